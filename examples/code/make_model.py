"""Create the code task's base policy: a tiny Qwen3 that writes expressions in the task's format
(`x+K` and `<|im_end|>`) but picks K at random, and has the skill the task needs under another
instruction. Supervised training (about half a minute on 2 CPU cores) on two kinds of episodes,
rendered as the env loop renders them (one user turn, see env.py):

- the task's own prompts (`Write f(x) as one Python expression in x, where f(3) == 7`), answered
  `x+K` with K drawn at random: so under the task's instruction the model writes a well-formed
  expression and passes the hidden tests one time in ten;
- the skill: the same instruction for a `g` (`... where g(3) == 7`) answered with the right
  `x+4`.

RL has to find out, from the tests' verdicts alone, that the task asks for what the model can do
under the other instruction (examples/successor/make_model.py says why a model this small needs
the skill first).

Usage: python make_model.py OUT_DIR

Writes OUT_DIR/ as the other recipes' scripts do (examples/tiny_qwen3.py). Deterministic; does
nothing when OUT_DIR was made by this very script (recorded in OUT_DIR/make_model.sha256).
"""

import os
import random
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import EOS, tokenizer  # noqa: E402

sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "runtime", "python")]  # env.py imports moult
from env import PROMPT  # noqa: E402
from make_tasks import PAIRS  # noqa: E402

# The task's own words for another function name: RL has to make `f` what `g` is.
SKILL = PROMPT.replace("f(", "g(")
# The successor recipe's model (examples/successor/make_model.py says why these values).
CONFIG = dict(vocab_size=2003, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.1,
              eos_token_id=EOS, bos_token_id=None, pad_token_id=None)
STEPS = 600
BATCH = 64
LR = 3e-3


def prompt_ids(tok, text):
    """A one-turn episode's prompt as the loopback server renders it (no system prompt)."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False).input_ids


def reply_ids(tok, k):
    ids = tok(f"x+{k}", add_special_tokens=False).input_ids
    assert len(ids) == 3, f"x+{k} must be three tokens"
    return ids + [EOS]


def batch(task, skill, replies, rng):
    """Half task prompts answered at random, half skill prompts answered right: ids (right-padded),
    and the positions whose next token is a reply token, with those tokens."""
    rows, positions, targets = [], [], []
    for row in range(BATCH):
        x, y = rng.choice(PAIRS)
        prompt, k = (skill[x, y], y - x) if row % 2 else (task[x, y], rng.randrange(10))
        rows.append(prompt + replies[k])
        for t in range(len(prompt), len(rows[-1])):
            positions.append((row, t - 1))
            targets.append(rows[-1][t])
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
    return ids, tuple(torch.tensor(p) for p in zip(*positions)), torch.tensor(targets)


def train(task, skill, replies, rng):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    return tiny_qwen3.fit(model, lambda: batch(task, skill, replies, rng), STEPS, LR, "make_model")


def p_right(model, prompts, replies):
    """Mean over the pairs of P(the right K) after `x+`, and P(the whole `x+`, any digit, EOS)."""
    right = formed = 0.0
    digits = [r[2] for r in replies]
    with torch.no_grad():
        for (x, y), prompt in prompts.items():
            k = y - x
            ids = torch.tensor([prompt + replies[k]])
            probs = model(input_ids=ids).logits[0].softmax(-1)
            n = len(prompt)
            right += probs[n + 1][replies[k][2]].item()
            formed += (probs[n - 1][replies[k][0]] * probs[n][replies[k][1]] * probs[n + 1][digits].sum()
                       * probs[n + 2][EOS]).item()
    return right / len(prompts), formed / len(prompts)


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_model.py OUT_DIR")
    out = sys.argv[1]
    sources = [os.path.abspath(__file__), os.path.join(HERE, "env.py"), os.path.join(HERE, "make_tasks.py")]
    digest = tiny_qwen3.fingerprint(sources)
    if tiny_qwen3.is_current(out, "make_model", digest):
        return
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # small batches; and the same float sums, so the same weights, every run
    tok = tokenizer()
    task = {(x, y): prompt_ids(tok, PROMPT.format(x, y)) for x, y in PAIRS}
    skill = {(x, y): prompt_ids(tok, SKILL.format(x, y)) for x, y in PAIRS}
    replies = [reply_ids(tok, k) for k in range(10)]
    model = train(task, skill, replies, random.Random(0))
    right, formed = p_right(model, task, replies)
    skilled, _ = p_right(model, skill, replies)
    print(f"make_model: task prompts: P(right K) {right:.3f} (chance 0.1), P(well-formed) {formed:.3f}; "
          f"skill prompts: P(right K) {skilled:.3f}")
    if right > 0.15 or formed < 0.95 or skilled < 0.9:
        raise SystemExit("make_model: the base model is not at chance on the task, or not in its format")
    tiny_qwen3.save(model, out, "make_model", digest)


if __name__ == "__main__":
    main()
