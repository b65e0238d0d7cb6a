"""Tiny random Qwen3 and Qwen3-MoE folders that both vLLM's CPU build and moult's built-in engine
serve (head_dim 32: vLLM's CPU attention refuses 16), plus a second dense folder with other
weights and the same config, for weight updates from a folder, and one folder of each other
family moult implements (docs/models.md): Llama 3 with llama3 rope scaling and biases, Qwen2,
Mistral with a head_dim that is not hidden/heads, and with a sliding window, Gemma 3 with local
(sliding-window) and global layers. Windows (8) are shorter than the sampled sequences.

    python make_vllm_models.py OUT_DIR

writes OUT_DIR/{qwen3-tiny, qwen3-tiny-v2, qwen3-moe-tiny, llama-tiny, qwen2-tiny,
mistral-tiny, mistral-tiny-window, gemma3-tiny}, each with the tiny BPE tokenizer of
tests/fixtures/tiny_bpe and the Qwen3 chat template. Does nothing when OUT_DIR/.stamp holds this
script's digest.
"""
import hashlib
import json
import os
import shutil
import sys

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures")
TOKENIZER = os.path.join(FIXTURES, "tiny_bpe", "tiny_bpe_tokenizer.json")
TEMPLATE = os.path.join(FIXTURES, "qwen3_chat_template.jinja")
VOCAB, EOS = 2003, 2002
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
              eos_token_id=EOS, bos_token_id=None, pad_token_id=None)


def randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)


def save(model, out):
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(TOKENIZER, os.path.join(out, "tokenizer.json"))
    shutil.copy(TEMPLATE, os.path.join(out, "chat_template.jinja"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS, 2000]}, f)


def main(root):
    digest = hashlib.sha256()
    for path in (__file__, TOKENIZER, TEMPLATE):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(torch.__version__.encode())
    stamp = os.path.join(root, ".stamp")
    if os.path.exists(stamp) and open(stamp).read() == digest.hexdigest():
        return
    for name, seed in [("qwen3-tiny", 1), ("qwen3-tiny-v2", 7)]:
        m = Qwen3ForCausalLM(Qwen3Config(**COMMON, tie_word_embeddings=True))
        randomize(m, seed)
        save(m, os.path.join(root, name))
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]))
    randomize(moe, 2)
    save(moe, os.path.join(root, "qwen3-moe-tiny"))
    # The other families, with what sets each apart (docs/models.md).
    shapes = {k: v for k, v in COMMON.items() if k != "head_dim"}
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    families = [
        ("llama-tiny", LlamaForCausalLM(LlamaConfig(
            **shapes, head_dim=32, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
            rope_scaling=llama3_rope))),
        ("qwen2-tiny", Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=False))),
        ("mistral-tiny", MistralForCausalLM(MistralConfig(
            **{**shapes, "num_attention_heads": 4, "num_key_value_heads": 2}, head_dim=32,
            tie_word_embeddings=False, sliding_window=None))),
        ("mistral-tiny-window", MistralForCausalLM(MistralConfig(
            **shapes, head_dim=32, tie_word_embeddings=True, sliding_window=8))),
        ("gemma3-tiny", Gemma3ForCausalLM(Gemma3TextConfig(
            **{k: v for k, v in shapes.items() if k != "rope_theta"}, head_dim=32,
            query_pre_attn_scalar=24, tie_word_embeddings=True, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))),
    ]
    for seed, (name, model) in enumerate(families, start=20):
        randomize(model, seed)
        save(model, os.path.join(root, name))
    with open(stamp, "w") as f:
        f.write(digest.hexdigest())


if __name__ == "__main__":
    main(sys.argv[1])
