"""Create the geometry task's base policy: a tiny Qwen2.5-VL that has the skill the task needs
under another instruction, and answers the task itself at random. As in the successor recipe
(examples/successor/make_model.py), supervised training on two kinds of episodes, rendered
exactly as the env loop renders them (see env.py):

- the task's own episodes (its figures and questions), with the assistant's digits drawn at
  random from 3-6, independent of the figure: so under the task's questions the model answers
  every turn with one digit and `<|im_end|>`, and is right one time in four;
- the skill: other questions ("Count the corners of the shape." then "Count again.") about the
  same kind of figures, answered with the number of sides.

RL then has to find out, from the reward alone, that the task asks for what the model can do
under the other question. The vision tower learns to see the figures in this supervised phase;
RL moves the answer.

Usage: python make_model.py OUT_DIR

Writes OUT_DIR/ (config.json, model.safetensors, generation_config.json, preprocessor_config.json,
tokenizer.json: the tiny BPE tokenizer of tests/fixtures with the three vision tokens added,
chat_template.jinja: the Qwen2-VL template of tests/fixtures, tokenizer_config.json).
Deterministic; does nothing when OUT_DIR was made by this very script (same script, env.py and
fixtures, recorded in OUT_DIR/make_model.sha256). About two minutes on 2 CPU cores.
"""

import json
import os
import random
import shutil
import sys

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tiny_qwen3: what the recipes' model scripts share
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import EOS, EOS_TEXT  # noqa: E402

sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "runtime", "python")]  # env.py imports moult
from env import FIRST, NEXT, SIDES, draw  # noqa: E402

TEMPLATE = os.path.join(tiny_qwen3.FIXTURES, "qwen2_vl_chat_template.jinja")
# The tiny BPE tokenizer's 2003 tokens, then the vision tokens Qwen2-VL templates render.
VISION_START, VISION_END, IMAGE_PAD = 2003, 2004, 2005
VISION_TOKENS = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END, "<|image_pad|>": IMAGE_PAD}
TURNS = 2

SKILL_FIRST = "Count the corners of the shape."
SKILL_NEXT = "Count again."

CONFIG = dict(
    text_config=dict(
        vocab_size=2006,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=None,
        initializer_range=0.1,
    ),
    vision_config=dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
        out_hidden_size=64,
        in_channels=3,
        initializer_range=0.1,
    ),
    image_token_id=IMAGE_PAD,
    video_token_id=IMAGE_PAD,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    tie_word_embeddings=True,
)
STEPS = 800
BATCH = 32
LR = 1e-3


def tokenizer_json():
    """The tiny BPE tokenizer with the vision tokens added as special tokens."""
    with open(tiny_qwen3.TOKENIZER) as f:
        spec = json.load(f)
    for content, id_ in VISION_TOKENS.items():
        spec["added_tokens"].append(
            {"id": id_, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        )
    return spec


def tokenizer(path):
    tok = PreTrainedTokenizerFast(tokenizer_file=path, eos_token=EOS_TEXT, pad_token="<|endoftext|>")
    with open(TEMPLATE) as f:
        tok.chat_template = f.read()
    return tok


class Episodes:
    """Episodes of one pair of questions. `ids(figures, replies)` gives the token ids as the
    loopback server records them (each turn's rendering, only what it adds, with each image's
    placeholder expanded to its 16 tokens), the loss mask (1 on the replies) and the images."""

    def __init__(self, tok, processor, first, next_):
        self.tok, self.processor, self.first, self.next = tok, processor, first, next_
        self.digit = {d: tok(str(d), add_special_tokens=False).input_ids for d in SIDES}
        assert all(len(ids) == 1 for ids in self.digit.values()), "each digit must be one token"
        self.digit = {d: ids[0] for d, ids in self.digit.items()}
        self.pieces = self.render(["3"] * TURNS)

    def render(self, replies):
        """Per turn: the ids the turn's rendering adds (placeholders expanded)."""
        enc = lambda text: self.tok(text, add_special_tokens=False).input_ids  # noqa: E731
        tokens = self.processor_tokens()
        messages, text, pieces = [], "", []
        for turn, reply in enumerate(replies):
            question = self.first if turn == 0 else self.next
            messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
            rendered = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if not rendered.startswith(text):
                raise SystemExit(f"make_model: the template rewrote history: {rendered!r} after {text!r}")
            ids = []
            for id_ in enc(rendered[len(text) :]):
                ids += [IMAGE_PAD] * tokens if id_ == IMAGE_PAD else [id_]
            pieces.append(ids)
            text = rendered + reply + EOS_TEXT
            messages.append({"role": "assistant", "content": reply})
        return pieces

    def processor_tokens(self):
        grid = self.processor(images=[draw(3, 0)], return_tensors="pt")["image_grid_thw"][0]
        return int(grid.prod()) // 4

    def ids(self, replies):
        ids, mask = [], []
        for piece, reply in zip(self.pieces, replies):
            ids += piece + [self.digit[reply], EOS]
            mask += [0] * len(piece) + [1, 1]
        return ids, mask


def batch(task, skill, processor, rng):
    """Fresh episodes, half of each kind: ids (right-padded), the images in order, the positions
    whose next token is a reply token, with those tokens."""
    rows, images, positions, targets = [], [], [], []
    for row in range(BATCH):
        figures = [(rng.choice(SIDES), rng.randrange(10**6)) for _ in range(TURNS)]
        if row % 2:
            seq, mask = skill.ids([s for s, _ in figures])
        else:
            seq, mask = task.ids([rng.choice(SIDES) for _ in range(TURNS)])
        rows.append(seq)
        images += [draw(s, seed) for s, seed in figures]
        for t, m in enumerate(mask):
            if m:
                positions.append((row, t - 1))
                targets.append(seq[t])
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
    pixels = processor(images=images, return_tensors="pt")
    at = tuple(torch.tensor(x) for x in zip(*positions))
    return ids, pixels, at, torch.tensor(targets)


def train(task, skill, processor, rng):
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    for step in range(STEPS):
        ids, pixels, at, targets = batch(task, skill, processor, rng)
        hidden = model.model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]).last_hidden_state
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[at]), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 99:
            print(f"make_model: step {step + 1} loss {loss.item():.4f}", flush=True)
    model.eval()
    return model


def reply_probs(model, episodes, processor):
    """Over 64 random episodes and each turn: P(the right number of sides), P(any of 3-6),
    P(<|im_end|> after the digit)."""
    rng = random.Random(1)
    digits = torch.tensor(list(episodes.digit.values()))
    sums, count = [0.0] * 3, 0
    with torch.no_grad():
        for _ in range(64):
            figures = [(rng.choice(SIDES), rng.randrange(10**6, 2 * 10**6)) for _ in range(TURNS)]
            ids, mask = episodes.ids([rng.choice(SIDES) for _ in range(TURNS)])
            pixels = processor(images=[draw(s, seed) for s, seed in figures], return_tensors="pt")
            logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]).logits[0]
            probs = logits.softmax(-1)
            sampled = [i for i, m in enumerate(mask) if m]
            for turn in range(TURNS):
                p = probs[sampled[2 * turn] - 1]
                sums[0] += p[episodes.digit[figures[turn][0]]].item()
                sums[1] += p[digits].sum().item()
                sums[2] += probs[sampled[2 * turn + 1] - 1][EOS].item()
                count += 1
    return [s / count for s in sums]


def evaluate(model, task, skill, processor):
    right, digit, end = reply_probs(model, task, processor)
    print(f"make_model: task turns: P(right) {right:.3f} (chance 0.25), P(3-6) {digit:.4f}, P(<|im_end|> after it) {end:.4f}")
    skilled, _, _ = reply_probs(model, skill, processor)
    print(f"make_model: skill turns: P(right) {skilled:.3f}")
    if right > 0.35 or digit < 0.98 or end < 0.98 or skilled < 0.8:
        raise SystemExit("make_model: the base model is not at chance on the task, or not in its format, or lacks the skill")


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_model.py OUT_DIR")
    out = sys.argv[1]
    digest = tiny_qwen3.fingerprint([os.path.abspath(__file__), os.path.join(HERE, "env.py"), TEMPLATE])
    if tiny_qwen3.is_current(out, "make_model", digest):
        return
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    rng = random.Random(0)
    staging = out + ".staging"
    os.makedirs(staging, exist_ok=True)
    path = os.path.join(staging, "tokenizer.json")
    with open(path, "w") as f:
        json.dump(tokenizer_json(), f)
    tok = tokenizer(path)
    processor = Qwen2VLImageProcessorPil()
    task = Episodes(tok, processor, FIRST, NEXT)
    skill = Episodes(tok, processor, SKILL_FIRST, SKILL_NEXT)
    model = train(task, skill, processor, rng)
    evaluate(model, task, skill, processor)
    processor.save_pretrained(out)  # preprocessor_config.json, before the stamp
    tiny_qwen3.save(model, out, "make_model", digest, tokenizer_json(), TEMPLATE)
    shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    main()
