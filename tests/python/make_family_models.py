"""Create tiny random checkpoints of the families besides Qwen3 (Llama 3, Qwen2, Mistral, Gemma 3)
with Hugging Face transformers, plus the reference logits our forward must reproduce, in the
layout of make_tiny_models.py.

Usage: python make_family_models.py OUT_DIR

Writes OUT_DIR/<name>/ for each model of MODELS: config.json, safetensors weights, tokenizer
files from tests/fixtures/tiny_bpe, and reference.safetensors (`prompt_i`, `logits_i`). Each
model exercises what sets its family apart from Qwen3: no q/k norms; Llama's `llama3` rope
scaling with tied embeddings, and its attention and MLP biases with an explicit head_dim that is
not hidden/heads; Qwen2's q/k/v biases; Mistral's explicit head_dim, and its sliding window;
Gemma 3's sandwich norms, embedding scale, GeGLU and query_pre_attn_scalar, with local
(sliding-window) and global layers on their own rope bases, tied and untied, with linear rope
scaling, attention biases and final-logit soft-capping. Windows are shorter than the longest
prompt (40 tokens), so they slide.
"""

import os
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
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import COMMON, build  # noqa: E402

# The shapes every family shares with the Qwen3 tiny model; head_dim is set per model.
SHAPES = {k: v for k, v in COMMON.items() if k != "head_dim"}

# A rope scaling whose three bands (kept, interpolated, slowed) all hold frequencies of a 16-wide
# head at theta 1e4: wavelengths 6.3 ... 19869 against 16 and 64.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

# Gemma 3's default ropes (1e6 global, 1e4 local) in the form transformers 5 writes.
GEMMA_ROPES = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}

MODELS = [
    (
        "llama-tiny",
        lambda: LlamaForCausalLM(
            LlamaConfig(**SHAPES, head_dim=16, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
        ),
    ),
    (
        "llama-tiny-bias",
        lambda: LlamaForCausalLM(
            LlamaConfig(**SHAPES, head_dim=24, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
        ),
    ),
    ("qwen2-tiny", lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPES, tie_word_embeddings=False))),
    (
        "mistral-tiny",
        lambda: MistralForCausalLM(
            MistralConfig(**SHAPES, head_dim=24, tie_word_embeddings=False, sliding_window=None)
        ),
    ),
    (
        "mistral-tiny-window",
        lambda: MistralForCausalLM(MistralConfig(**SHAPES, head_dim=16, tie_word_embeddings=True, sliding_window=8)),
    ),
    (
        "gemma3-tiny",
        lambda: Gemma3ForCausalLM(
            Gemma3TextConfig(
                **SHAPES,
                head_dim=16,
                query_pre_attn_scalar=16,
                tie_word_embeddings=True,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters=GEMMA_ROPES,
            )
        ),
    ),
    (
        "gemma3-tiny-linear",
        lambda: Gemma3ForCausalLM(
            Gemma3TextConfig(
                **SHAPES,
                head_dim=24,
                query_pre_attn_scalar=20,
                tie_word_embeddings=False,
                attention_bias=True,
                final_logit_softcapping=3.0,
                sliding_window=5,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            )
        ),
    ),
]


def main():
    out_root = sys.argv[1]
    os.makedirs(out_root, exist_ok=True)
    torch.manual_seed(0)
    for seed, (name, make) in enumerate(MODELS, start=10):
        build(out_root, name, make(), moe=False, seed=seed)


if __name__ == "__main__":
    main()
