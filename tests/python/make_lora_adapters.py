"""LoRA adapters in PEFT's layout for the tiny models of make_tiny_models.py, with the logits
PEFT (PyPI `peft`) computes with each: the reference moult's LoRA forward must reproduce.

Usage: python make_lora_adapters.py OUT_DIR TINY_MODELS_DIR
       python make_lora_adapters.py --score MODEL_DIR ADAPTER_DIR OUT_FILE

The first form writes OUT_DIR/<name>/ (adapter_config.json, adapter_model.safetensors,
reference.safetensors with `prompt_i` and `logits_i` as make_tiny_models.py writes them):
- `dense`: qwen3-tiny with an adapter that PEFT made (get_peft_model) on some of the seven
  projections (q, v, o, up, down: k and gate are left out, so stacks are only partly adapted);
- `moe-2d`: qwen3-moe-tiny with an adapter written here in the per-expert layout
  (`mlp.experts.E.gate_proj.lora_A.weight`), the one moult writes, which PEFT converts on load
  (PEFT itself makes only its fused-expert layout on transformers 5, which moult does not read).
Every adapter has B != 0 (PEFT starts B at zero, which would hide a wrong forward).

The second form loads an adapter moult wrote onto MODEL_DIR with PEFT and saves the logits of the
prompts of MODEL_DIR/reference.safetensors to OUT_FILE (`logits_i`).
"""

import json
import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

PRE = "base_model.model.model.layers"


def prompts(model_dir):
    ref = load_file(os.path.join(model_dir, "reference.safetensors"))
    return [ref[f"prompt_{i}"] for i in range(len([k for k in ref if k.startswith("prompt_")]))]


def logits(model, ids_list):
    with torch.no_grad():
        return {f"logits_{i}": model(input_ids=ids[None]).logits[0].float().contiguous() for i, ids in enumerate(ids_list)}


def randomize_lora(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def save(out, model_dir, peft_model, ids_list):
    peft_model.save_pretrained(out)
    tensors = {f"prompt_{i}": ids for i, ids in enumerate(ids_list)}
    tensors.update(logits(peft_model, ids_list))
    save_file(tensors, os.path.join(out, "reference.safetensors"))


def dense(out_root, tiny):
    model_dir = os.path.join(tiny, "qwen3-tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg)
    randomize_lora(peft_model, 11)
    peft_model.eval()
    save(os.path.join(out_root, "dense"), model_dir, peft_model, prompts(model_dir))


def moe_2d(out_root, tiny):
    """The per-expert layout, written by hand (PEFT on transformers 5 makes only the fused one)."""
    model_dir = os.path.join(tiny, "qwen3-moe-tiny")
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    h, i_moe = cfg["hidden_size"], cfg["moe_intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    r = 4
    gen = torch.Generator().manual_seed(13)
    mods = {}
    for layer in range(cfg["num_hidden_layers"]):
        mods[f"{layer}.self_attn.q_proj"] = (h, q)
        mods[f"{layer}.self_attn.o_proj"] = (q, h)
        # PEFT 0.21.2, converting per-expert adapters to its fused layout, drops the adapters
        # of the dense MLPs of a model that also has some (`mlp_only_layers`): left out here.
        if layer not in cfg["mlp_only_layers"]:
            for e in range(cfg.get("num_experts", cfg.get("num_local_experts"))):
                mods[f"{layer}.mlp.experts.{e}.gate_proj"] = (h, i_moe)
                mods[f"{layer}.mlp.experts.{e}.up_proj"] = (h, i_moe)
                mods[f"{layer}.mlp.experts.{e}.down_proj"] = (i_moe, h)
    tensors = {}
    for mod, (fan_in, fan_out) in mods.items():
        tensors[f"{PRE}.{mod}.lora_A.weight"] = 0.3 * torch.randn(r, fan_in, generator=gen) / fan_in**0.5
        tensors[f"{PRE}.{mod}.lora_B.weight"] = 0.3 * torch.randn(fan_out, r, generator=gen) / r**0.5
    out = os.path.join(out_root, "moe-2d")
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": r,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "target_modules": ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out)
    peft_model.eval()
    ids_list = prompts(model_dir)
    ref = {f"prompt_{i}": ids for i, ids in enumerate(ids_list)}
    ref.update(logits(peft_model, ids_list))
    save_file(ref, os.path.join(out, "reference.safetensors"))


def score(model_dir, adapter_dir, out_file):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    peft_model.eval()
    save_file(logits(peft_model, prompts(model_dir)), out_file)


def main():
    if sys.argv[1] == "--score":
        score(*sys.argv[2:5])
        return
    out_root, tiny = sys.argv[1], sys.argv[2]
    os.makedirs(out_root, exist_ok=True)
    torch.manual_seed(0)
    dense(out_root, tiny)
    moe_2d(out_root, tiny)


if __name__ == "__main__":
    main()
