"""Create the distillation recipe's teacher: a Qwen3 twice as wide as the successor student that
knows the task. It is trained (supervised, about a minute on 2 CPU cores) on successor episodes
rendered with the Qwen3 chat template exactly as the env loop sends them (the observations of
examples/successor/env.py as user messages, no system prompt), with the right answers.

Usage: python make_teacher.py OUT_DIR

Writes a Hugging Face folder (config.json, model.safetensors, tokenizer.json from
tests/fixtures/tiny_bpe, the Qwen3 chat template, tokenizer_config.json, generation_config.json).
Deterministic; skips the work when OUT_DIR was made by this very script (make_teacher.sha256).
"""

import os
import random
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tiny_qwen3: what the recipes' model scripts share
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import EOS, tokenizer  # noqa: E402
ENV = os.path.join(HERE, "..", "successor", "env.py")
TURNS = 3
STEPS = 300

sys.path[:0] = [os.path.dirname(ENV), os.path.join(HERE, "..", "..", "runtime", "python")]
from env import FIRST, NEXT, successor  # noqa: E402

CONFIG = dict(
    vocab_size=2003,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.1,  # as the student: the default 0.02 learns this task far slower
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)


def episode(tok, digits):
    """Token ids of a whole episode with the right answers, and the positions of the answers'
    tokens (each answer digit and its <|im_end|>): an answer starts where the rendering of the
    conversation so far, with the generation prompt, ends."""
    messages, targets = [], []
    for turn, d in enumerate(digits):
        messages.append({"role": "user", "content": (FIRST if turn == 0 else NEXT).format(d)})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        at = len(tok(prompt, add_special_tokens=False).input_ids)
        targets += [at, at + 1]
        messages.append({"role": "assistant", "content": str(successor(d))})
    text = tok.apply_chat_template(messages, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids, targets


def fingerprint():
    return tiny_qwen3.fingerprint([os.path.abspath(__file__), ENV])


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_teacher.py OUT_DIR")
    out = sys.argv[1]
    digest = fingerprint()
    if tiny_qwen3.is_current(out, "make_teacher", digest):
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = random.Random(0)
    tok = tokenizer()
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(STEPS):
        batch = [episode(tok, [rng.randrange(10) for _ in range(TURNS)]) for _ in range(32)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [EOS] * (width - len(ids)) for ids, _ in batch])
        rows = torch.tensor([r for r, (_, t) in enumerate(batch) for _ in t])
        cols = torch.tensor([c for _, t in batch for c in t])
        hidden = model.model(input_ids=ids).last_hidden_state[rows, cols - 1]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), ids[rows, cols])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 49:
            print(f"make_teacher: step {step + 1} loss {loss.item():.4f}")
    model.eval()
    right = 0
    with torch.no_grad():
        for d in range(10):
            ids, t = episode(tok, [d, (d + 3) % 10, (d + 7) % 10])
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            right += sum(int(logits[i - 1].argmax() == ids[i]) for i in t[::2])
    print(f"make_teacher: greedy answers right {right}/30")
    if right < 29:
        raise SystemExit("make_teacher: the teacher did not learn the task")
    tiny_qwen3.save(model, out, "make_teacher", digest)


if __name__ == "__main__":
    main()
