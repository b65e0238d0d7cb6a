"""Create a tiny random Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) with Hugging Face
transformers, plus the reference logits moult's forward must reproduce with images.

Usage: python make_vl_model.py OUT_DIR

Writes OUT_DIR/qwen2.5-vl-tiny/, a complete model folder: config.json (as transformers 5 writes
it: the text settings under `text_config`), model.safetensors (float32, checkpoint names
`model.layers.*`, `visual.*`), the Qwen3 tokenizer of tests/fixtures (it has the vision tokens:
<|vision_start|> 151652, <|vision_end|> 151653, <|image_pad|> 151655) and
preprocessor_config.json, both saved by the processor's `save_pretrained`, and
generation_config.json. Then

- images/a.png (112x168 pixels: an 8x12 patch grid, 24 placeholder tokens) and images/b.png
  (84x140: 6x10, 15 tokens), drawn deterministically;
- reference.safetensors, for each prompt i: `prompt_i` (int64 ids: the processor's, with each
  image's placeholders expanded, then FORCED text tokens), `prompt_len_i` (the processor's part),
  `logits_i` (float32 [len, vocab], transformers' forward), and for prompts with images
  `grid_i` (int64 [images, 3]) and `pixel_values_i` (float32, the processor's);
- manifest.json: per prompt, its image files in prompt order.

and OUT_DIR/qwen2.5-vl-tiny-hd32/, the same architecture with text heads of 32 (two heads, one
key/value head: vLLM's CPU attention refuses a head of 16) and the Qwen2-VL chat template, for
the vLLM parity test (runtime/tests/vllm_engine.rs); a model folder alone.

The vision tower has 4 blocks, full attention on blocks 1 and 3 and window attention (a window
of 56 pixels: 2x2 merged tokens) on 0 and 2, so both images are cut into several windows, b's
into partial ones (its 3x5 merged grid is not a multiple of 2). The text model has 2 layers and
M-RoPE sections [2, 3, 3] over a 16-wide head.
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)
from transformers.processing_utils import ProcessorMixin

# The processor's video half needs torchvision, which the test environment does not install; it
# is only checked for its class, and images never reach it.
_check = ProcessorMixin.check_argument_for_proper_class
ProcessorMixin.check_argument_for_proper_class = (
    lambda self, name, arg: None if arg is None else _check(self, name, arg)
)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "fixtures"))
NAME = "qwen2.5-vl-tiny"
EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>

CONFIG = dict(
    text_config=dict(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=EOS[0],
    ),
    vision_config=dict(
        depth=4,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1, 3],
        out_hidden_size=64,
        in_channels=3,
    ),
    tie_word_embeddings=True,
)

IMAGES = {"a": (112, 168), "b": (84, 140)}  # name: (height, width)

USER = "<|im_start|>user\n"
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [
    (USER + "Hello there, how are you today?" + ASSISTANT, []),
    (USER + IMAGE + "What is in the image?" + ASSISTANT, ["a"]),
    (USER + "Compare " + IMAGE + " with" + IMAGE + " please." + ASSISTANT, ["a", "b"]),
]
# Appended to every prompt: the tokens a KV-cache test decodes one by one.
FORCED = " It is a small cat."


def randomize(model, seed):
    """Weights with enough spread that a wrong forward shows: N(0, 0.15) matrices, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def draw(rng, height, width):
    """Gradients, hard edges and noise, so every patch differs."""
    yy, xx = np.mgrid[0:height, 0:width]
    planes = []
    for c in range(3):
        gradient = (xx * (3 + c) + yy * (5 - c)) % 256
        edges = np.where(((xx // (7 + c)) + (yy // (5 + c))) % 2 == 0, 30, 220)
        noise = rng.integers(0, 256, size=(height, width))
        mix = np.where(rng.random((height, width)) < 0.5, gradient, edges)
        planes.append(np.where(rng.random((height, width)) < 0.2, noise, mix))
    return Image.fromarray(np.stack(planes, axis=-1).astype(np.uint8))


def main():
    out = os.path.join(sys.argv[1], NAME)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as src:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(FIXTURES, "qwen3_0.6b_tokenizer", name), os.path.join(src, name))
        shutil.copy(os.path.join(FIXTURES, "qwen3_tokenizer_config.json"), os.path.join(src, "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(src)
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)
    processor.image_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)

    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**CONFIG)).eval()
    randomize(model, 7)
    model.save_pretrained(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS}, f)

    rng = np.random.default_rng(5)
    for name, (h, w) in IMAGES.items():
        draw(rng, h, w).save(os.path.join(out, "images", f"{name}.png"))

    forced = tokenizer.encode(FORCED, add_special_tokens=False)
    tensors, manifest = {}, []
    with torch.no_grad():
        for i, (text, names) in enumerate(PROMPTS):
            images = [Image.open(os.path.join(out, "images", f"{n}.png")) for n in names]
            inputs = processor(text=[text], images=images or None, return_tensors="pt")
            ids = inputs["input_ids"]
            n = ids.shape[1]
            full = torch.cat([ids, torch.tensor([forced])], dim=1)
            kwargs = {}
            if images:
                mm = inputs["mm_token_type_ids"]
                kwargs = dict(
                    pixel_values=inputs["pixel_values"],
                    image_grid_thw=inputs["image_grid_thw"],
                    mm_token_type_ids=torch.cat([mm, torch.zeros(1, len(forced), dtype=mm.dtype)], dim=1),
                )
                tensors[f"grid_{i}"] = inputs["image_grid_thw"].to(torch.int64).contiguous()
                tensors[f"pixel_values_{i}"] = inputs["pixel_values"].float().contiguous()
            logits = model(input_ids=full, **kwargs).logits
            tensors[f"prompt_{i}"] = full[0].contiguous()
            tensors[f"prompt_len_{i}"] = torch.tensor([n], dtype=torch.int64)
            tensors[f"logits_{i}"] = logits[0].float().contiguous()
            manifest.append({"images": [f"images/{n}.png" for n in names]})
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)

    # The same shape with text heads of 32 (vLLM's CPU attention refuses 16): a model folder
    # alone (vLLM loads every .safetensors beside config.json), for the vLLM parity test.
    hd32 = os.path.join(sys.argv[1], NAME + "-hd32")
    os.makedirs(hd32, exist_ok=True)
    config = json.loads(json.dumps(CONFIG))
    config["text_config"].update(num_attention_heads=2, num_key_value_heads=1)
    config["text_config"]["rope_parameters"]["mrope_section"] = [4, 6, 6]
    wide = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).eval()
    randomize(wide, 8)
    wide.save_pretrained(hd32)
    processor.image_processor.save_pretrained(hd32)
    tokenizer.save_pretrained(hd32)
    shutil.copy(os.path.join(FIXTURES, "qwen2_vl_chat_template.jinja"), os.path.join(hd32, "chat_template.jinja"))
    with open(os.path.join(hd32, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS}, f)


if __name__ == "__main__":
    main()
