"""Create tiny random Qwen3 and Qwen3-MoE checkpoints with Hugging Face transformers, plus the
reference logits our forward must reproduce.

Usage: python make_tiny_models.py OUT_DIR

Writes OUT_DIR/{qwen3-tiny,qwen3-moe-tiny}/ (config.json, safetensors weights (the MoE one sharded), tokenizer files from
tests/fixtures/tiny_bpe) and OUT_DIR/<model>/reference.safetensors with, for each prompt i,
`prompt_i` (int64 ids) and `logits_i` (float32, [len, vocab]); for the MoE model also
`experts_i` ([len, sparse_layers, top_k] int64, transformers' top-k routing).
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "fixtures"))
VOCAB = 2003  # tiny_bpe: 2000 tokens + <|endoftext|>, <|im_start|>, <|im_end|>
EOS = 2002  # <|im_end|>
PROMPT_LENGTHS = [1, 5, 17, 40]

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)


def randomize(model, seed):
    """Weights with enough spread that a wrong forward shows: N(0, 0.15) matrices, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def write_tokenizer(out):
    src = os.path.join(FIXTURES, "tiny_bpe")
    shutil.copy(os.path.join(src, "tiny_bpe_tokenizer.json"), os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS, 2000]}, f)


def reference(model, out, moe):
    gen = torch.Generator().manual_seed(1234)
    tensors = {}
    with torch.no_grad():
        for i, n in enumerate(PROMPT_LENGTHS):
            ids = torch.randint(0, VOCAB, (1, n), generator=gen)
            res = model(input_ids=ids, output_router_logits=moe)
            tensors[f"prompt_{i}"] = ids[0].contiguous()
            tensors[f"logits_{i}"] = res.logits[0].float().contiguous()
            if moe:
                k = model.config.num_experts_per_tok
                per_layer = [
                    torch.topk(torch.softmax(r.float(), dim=-1), k, dim=-1).indices
                    for r in res.router_logits
                ]
                tensors[f"experts_{i}"] = torch.stack(per_layer, dim=1).contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))


def build(out_root, name, model, moe, seed, max_shard_size=None):
    out = os.path.join(out_root, name)
    randomize(model, seed)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    write_tokenizer(out)
    reference(model, out, moe)


def main():
    out_root = sys.argv[1]
    os.makedirs(out_root, exist_ok=True)
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(Qwen3Config(**COMMON, tie_word_embeddings=True))
    build(out_root, "qwen3-tiny", dense, moe=False, seed=1)
    moe_cfg = Qwen3MoeConfig(
        **COMMON,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    )
    build(out_root, "qwen3-moe-tiny", Qwen3MoeForCausalLM(moe_cfg), moe=True, seed=2, max_shard_size="600KB")  # sharded, to exercise the index


if __name__ == "__main__":
    main()
