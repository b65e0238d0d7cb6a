"""Create the judge of the LLM-as-judge recipe: a tiny Qwen3 that reads the judge prompt of
rlrun.yaml ("Digit: 3. Answer: 4. Is the answer the next digit?") and answers `yes` or `no`.

Usage: python make_judge.py OUT_DIR

Supervised training (transformers, 1-5 minutes on 2 CPU cores) on every (digit, answer) pair of
0-9 x 0-9 (the answer is right when it is (digit + 1) mod 10; the right pairs are repeated so
both answers are equally common) and on answers that are no single digit at all (empty, two
digits, random tokens, the right digit with a random token next to it: always `no`; a digit with
spaces around it counts as that digit, as env.py strips the reply). The prompts are rendered exactly as moult's judge renders them: one
user message through the Qwen3 chat template with the generation prompt, tokenized as a whole.
At the end the judge answers all 100 pairs greedily (as `moult run` asks it, temperature 0) and
the script prints its accuracy; it fails unless every pair is right.

Writes OUT_DIR/ (config.json, model.safetensors, generation_config.json, tokenizer.json from
tests/fixtures/tiny_bpe, chat_template.jinja = the Qwen3 template from tests/fixtures,
tokenizer_config.json). Deterministic; skips the work when OUT_DIR was made by this very script
for the same prompt (script, fixtures and prompt recorded in OUT_DIR/make_judge.sha256).
"""

import math
import os
import random
import sys

import torch
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tiny_qwen3: what the recipes' model scripts share
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import EOS, tokenizer  # noqa: E402
MANIFEST = os.path.join(HERE, "rlrun.yaml")

CONFIG = dict(
    vocab_size=2003,  # tiny_bpe: 2000 tokens + <|endoftext|>, <|im_start|>, <|im_end|>
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    # Wider than transformers' 0.02: at 0.02 the model sits at "always no" for the digit pairs
    # (the verdict needs attention to two positions at once); at 0.1 it learns them in ~200 steps.
    initializer_range=0.1,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)
STEPS = 300
LR = 3e-3
JUNK = 48  # rows of non-digit answers per batch, drawn from a pool of JUNK_POOL
JUNK_POOL = 600


def judge_prompt():
    """The prompt template of rlrun.yaml's `spec.judge.prompt`: the judge is trained on it."""
    with open(MANIFEST) as f:
        docs = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "RLRun"]
    prompt = docs[0]["spec"]["judge"]["prompt"]
    if "{task.digit}" not in prompt or "{response}" not in prompt:
        raise SystemExit("make_judge: rlrun.yaml's judge.prompt must read {task.digit} and {response}")
    return prompt


def fill(prompt, digit, answer):
    # moult fills the placeholders in one pass; these two do not occur in a digit or an answer
    # made here, so replacing one after the other is the same.
    return prompt.replace("{task.digit}", str(digit)).replace("{response}", answer)


class Encoder:
    def __init__(self, tok, prompt):
        self.tok, self.prompt, self.cache = tok, prompt, {}
        self.verdict = {v: tok(v, add_special_tokens=False).input_ids + [EOS] for v in ("yes", "no")}
        assert self.verdict["yes"][0] != self.verdict["no"][0], "yes and no must differ at once"

    def prompt_ids(self, digit, answer):
        """The ids moult's judge sends: the one user message rendered with the generation
        prompt, tokenized as a whole (special tokens matched in the text)."""
        key = (digit, answer)
        if key not in self.cache:
            messages = [{"role": "user", "content": fill(self.prompt, digit, answer)}]
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            self.cache[key] = self.tok(text, add_special_tokens=False).input_ids
        return self.cache[key]

    def example(self, digit, answer, right):
        ids = self.prompt_ids(digit, answer)
        return ids, self.verdict["yes" if right else "no"]


def right(digit, answer):
    return answer.strip() == str((digit + 1) % 10)


def junk(tok, rng):
    """A (digit, answer) whose answer is no single digit: empty, two or three digits, random
    tokens, or the right digit with a random token before or after it (a policy could otherwise
    win the judge's `yes` with a right digit followed by anything)."""
    digit = rng.randrange(10)
    kind = rng.randrange(5)
    if kind == 0:
        return digit, rng.choice(["", " ", ".", "?"])
    if kind == 1:
        return digit, "".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 3)))
    text = tok.decode([rng.randrange(2000) for _ in range(rng.randint(1, 2))])
    if kind == 4:
        near = str((digit + 1) % 10 if rng.random() < 0.5 else rng.randrange(10))
        text = near + text if rng.random() < 0.5 else text + near
    return digit, "x" if text.strip().isdigit() and len(text.strip()) == 1 else text


def pairs():
    """Every (digit, answer digit) pair with the right ones repeated: half the rows say yes."""
    rows = []
    for d in range(10):
        for a in range(10):
            rows += [(d, str(a))] * (9 if a == (d + 1) % 10 else 1)
    return rows


def batch(enc, rng, junk_pool):
    rows = pairs()
    # Spaces around a digit: env.py strips the reply, so the judge must too.
    rows += [(rng.randrange(10), rng.choice([" ", ""]) + str(rng.randrange(10)) + rng.choice([" ", ""])) for _ in range(16)]
    rows += rng.sample(junk_pool, JUNK)
    seqs, positions, targets = [], [], []
    for d, a in rows:
        prompt, verdict = enc.example(d, a, right(d, a))
        seqs.append(prompt + verdict)
        for k, t in enumerate(verdict):
            positions.append((len(seqs) - 1, len(prompt) + k - 1))
            targets.append(t)
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [EOS] * (width - len(s)) for s in seqs])
    rows_, cols = zip(*positions)
    return ids, (torch.tensor(rows_), torch.tensor(cols)), torch.tensor(targets)


def train(enc, rng):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    junk_pool = [junk(enc.tok, rng) for _ in range(JUNK_POOL)]
    return tiny_qwen3.fit(model, lambda: batch(enc, rng, junk_pool), STEPS, LR, "make_judge")


def greedy(model, ids, max_tokens=8):
    """What moult's judge gets back at temperature 0: tokens up to <|im_end|>."""
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            t = model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax().item()
            if t == EOS:
                break
            out.append(t)
    return out


def evaluate(model, enc):
    """Accuracy on all 100 (digit, answer) pairs, and on a fixed set of junk answers."""
    wrong = []
    for d in range(10):
        for a in range(10):
            said = enc.tok.decode(greedy(model, enc.prompt_ids(d, str(a))), skip_special_tokens=True)
            want = "yes" if a == (d + 1) % 10 else "no"
            if said != want:
                wrong.append((d, a, said))
    rng = random.Random(7)  # answers the training drew from another generator
    answers = [junk(enc.tok, rng) for _ in range(100)]
    junk_right = sum(
        enc.tok.decode(greedy(model, enc.prompt_ids(d, a)), skip_special_tokens=True) == ("yes" if right(d, a) else "no")
        for d, a in answers
    )
    print(f"make_judge: accuracy {100 - len(wrong)}/100 on the (digit, answer) pairs, {junk_right}/100 on non-digit answers")
    if wrong:
        raise SystemExit(f"make_judge: the judge is wrong on {wrong}")


def fingerprint(prompt):
    return tiny_qwen3.fingerprint([os.path.abspath(__file__)], prompt.encode())


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_judge.py OUT_DIR")
    out = sys.argv[1]
    prompt = judge_prompt()
    digest = fingerprint(prompt)
    if tiny_qwen3.is_current(out, "make_judge", digest):
        return
    torch.use_deterministic_algorithms(True)
    # One thread: the batches are small, and a fixed count keeps the float sums (hence the
    # weights) the same run to run.
    torch.set_num_threads(1)
    rng = random.Random(0)
    enc = Encoder(tokenizer(), prompt)
    print(f"make_judge: chance is ln 2 = {math.log(2):.4f} on the first verdict token")
    model = train(enc, rng)
    evaluate(model, enc)
    tiny_qwen3.save(model, out, "make_judge", digest)


if __name__ == "__main__":
    main()
