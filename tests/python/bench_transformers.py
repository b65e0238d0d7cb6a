"""The transformers side of `cargo bench --bench engine`: decode throughput of
`model.generate` on the same model, batch and prompt length as our engine.

Usage: python bench_transformers.py MODEL_DIR BATCH PROMPT_LEN NEW_TOKENS [THREADS]
Prints one JSON line: {"tokens_per_s": ..., "seconds": ..., "first_token_seconds": ...,
"decode_tokens_per_s": ..., "threads": ...}: end-to-end throughput, the time of a
`max_new_tokens=1` run (prefill and one token), and the throughput of the remaining tokens.
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, batch, prompt_len, new_tokens = sys.argv[1], *map(int, sys.argv[2:5])
    if len(sys.argv) > 5:
        torch.set_num_threads(int(sys.argv[5]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 2000), (batch, prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **kwargs)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        seconds = time.perf_counter() - t0
    generated = (out.shape[1] - prompt_len) * batch
    print(json.dumps({
        "tokens_per_s": generated / seconds,
        "seconds": seconds,
        "first_token_seconds": first,
        "decode_tokens_per_s": batch * (new_tokens - 1) / max(seconds - first, 1e-9),
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
