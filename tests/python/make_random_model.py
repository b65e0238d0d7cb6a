"""Create a checkpoint with random weights from a Hugging Face config.json (for benchmarks of
real model shapes without downloading weights).

Usage: python make_random_model.py CONFIG_JSON OUT_DIR
"""

import json
import sys

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


def main():
    config_path, out = sys.argv[1], sys.argv[2]
    with open(config_path) as f:
        raw = json.load(f)
    arch = raw["architectures"][0]
    raw["torch_dtype"] = "float32"
    raw.pop("dtype", None)
    torch.manual_seed(0)
    if arch == "Qwen3ForCausalLM":
        model = Qwen3ForCausalLM(Qwen3Config(**raw))
    elif arch == "Qwen3MoeForCausalLM":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**raw))
    elif arch == "LlamaForCausalLM":
        model = LlamaForCausalLM(LlamaConfig(**raw))
    elif arch == "Gemma3ForCausalLM":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**raw))
    else:
        sys.exit(f"unsupported architecture {arch}")
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main()
