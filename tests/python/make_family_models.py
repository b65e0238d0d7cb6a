"""Create tiny random checkpoints of the families besides Qwen3 (Llama 3, Qwen2, Mistral) with
Hugging Face transformers, plus the reference logits our forward must reproduce, in the layout
of make_tiny_models.py.

Usage: python make_family_models.py OUT_DIR

Writes OUT_DIR/<name>/ for each model of MODELS: config.json, safetensors weights, tokenizer
files from tests/fixtures/tiny_bpe, and reference.safetensors (`prompt_i`, `logits_i`). Each
model exercises what sets its family apart from Qwen3: no q/k norms; Llama's `llama3` rope
scaling with tied embeddings, and its attention and MLP biases with an explicit head_dim that is
not hidden/heads; Qwen2's q/k/v biases; Mistral's explicit head_dim.
"""

import os
import sys

import torch
from transformers import (
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
]


def main():
    out_root = sys.argv[1]
    os.makedirs(out_root, exist_ok=True)
    torch.manual_seed(0)
    for seed, (name, make) in enumerate(MODELS, start=10):
        build(out_root, name, make(), moe=False, seed=seed)


if __name__ == "__main__":
    main()
