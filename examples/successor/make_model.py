"""Create the successor task's base policy: a tiny Qwen3 that has the skill the task needs under
another instruction, and answers the task itself at random. Supervised training (about half a
minute on 2 CPU cores) on two kinds of episodes, rendered exactly as the env loop renders them
(see env.py):

- the task's own episodes (its observations), with the assistant's digits drawn at random,
  independent of the observation: so under the task's instruction the model answers every turn
  with one digit and `<|im_end|>`, and is right one time in ten;
- the skill: another instruction ("Count up by one from 3", then "Then from 8", ...) answered
  with the next digit.

RL then has to find out, from the reward alone, that the task asks for what the model can do
under the other instruction: the way RL on a language model mostly works (it brings out what the
base model can do). Measured with a plain GRPO loop in PyTorch (groups of 8, 8 per step,
learning rate 1e-3): this base goes from 0.1 to above 0.9 in about 20 steps. Knowing only the
format, a base stays at chance for 80 steps: a model this small does not find out from a reward
that is right 10% of the time that the answer depends on the digit shown. Taught only to repeat
the digit (so it reads it), it learns most successors in 150 steps, but one to three digits
collapse onto a wrong answer they never leave (a near-certain token's gradient vanishes), which
keeps the reward at 0.7-0.9.

Usage: python make_model.py OUT_DIR [--head-dim 32] [--family llama] [--both]

`--head-dim 32` makes the same model with two heads of 32 instead of four of 16 (one key/value
head instead of two): vLLM's CPU attention refuses head_dim 16, so the recipe's vLLM variant
(rlrun-vllm.yaml) serves this one. `--family llama` makes it a Llama 3-architecture model
(`LlamaForCausalLM`: no q/k norms, llama3 rope scaling) of the same shape, trained the same way:
the policy of rlrun-llama.yaml (docs/models.md).

`--both` makes the base of two LoRA runs that share it (an engine pool serves one base and each
run's adapter) while learning two different tasks: the successor task and its reverse, the
predecessor task (env.py's `"direction": "down"`, rlrun-pool-up.yaml and rlrun-pool-down.yaml).
Each task needs its skill hidden under another instruction, or its run has nothing to bring out
(see above), so the one base must hold both skills: it is trained on four kinds of episodes, a
quarter of each: both tasks' own episodes with random replies (the predecessor's first
instruction is env.py's FIRST_DOWN, later turns the same "Next: 8"), the count-up skill above,
and the count-down skill ("Count down by one from 3", "Then from 8", answered with the previous
digit). The later turns of both tasks, and of both skills, look the same, so the model must read
the first instruction to know which way to count. It is trained for STEPS_BOTH (400) steps
instead of 200 (the loss reaches its floor at about 150): about 45 s of CPU. Then each task is
at chance (P(right) 0.10, P(a digit) 0.998) and each skill at 0.995. Without `--both` the script
makes exactly the model it made before the option existed.

Writes OUT_DIR/ (config.json, model.safetensors, generation_config.json, tokenizer.json from
tests/fixtures/tiny_bpe, chat_template.jinja = the Qwen3 template from tests/fixtures,
tokenizer_config.json). Deterministic; does nothing when OUT_DIR was made by this very script
(same script, env.py and fixtures, recorded in OUT_DIR/make_model.sha256).

Rendering. The env loop sends the observations as user messages with no system prompt and no
`enable_thinking`, and its loopback server tokenizes only what each turn's rendering adds after
the previous rendering plus the sampled ids (docs/loopback.md). With the Qwen3 template that makes
one segment per episode: the generation prompt is a bare `<|im_start|>assistant\\n` (the empty
think block comes only with `enable_thinking` false), and an earlier assistant turn renders as
its content alone. The training sequences are built from those per-turn pieces, checked here
against transformers' `apply_chat_template`.
"""

import math
import os
import random
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tiny_qwen3: what the recipes' model scripts share
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import EOS, EOS_TEXT, tokenizer  # noqa: E402
TURNS = 3

sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "runtime", "python")]  # env.py imports moult
from env import FIRST, FIRST_DOWN, NEXT, predecessor, successor  # noqa: E402

# The skill, under an instruction the task never uses.
SKILL_FIRST = "Count up by one from {}"
SKILL_NEXT = "Then from {}"
# --both: the predecessor's skill, under its own instruction (later turns as the other skill's).
SKILL_DOWN_FIRST = "Count down by one from {}"

CONFIG = dict(
    vocab_size=2003,  # tiny_bpe: 2000 tokens + <|endoftext|>, <|im_start|>, <|im_end|>
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    # At transformers' 0.02 attention stays near uniform for hundreds of steps before the model
    # finds the digit; at 0.1 it has the skill after ~100.
    initializer_range=0.1,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)
STEPS = 200
STEPS_BOTH = 400  # --both: two skills, and two instructions to tell apart
BATCH = 64
LR = 3e-3


def render_turns(tok, observations, replies):
    """An episode as the loopback server records it, turn by turn: (the ids the turn's rendering
    adds, the reply's ids). Each rendering (transformers' template) must extend the previous one
    plus the reply, and only the new text is tokenized."""
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    messages, turns, text = [], [], ""
    for obs, reply in zip(observations, replies):
        messages.append({"role": "user", "content": obs})
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not rendered.startswith(text):
            raise SystemExit(f"make_model: the template rewrote history: {rendered!r} after {text!r}")
        turns.append((enc(rendered[len(text) :]), enc(reply) + [EOS]))
        text = rendered + reply + EOS_TEXT
        messages.append({"role": "assistant", "content": reply})
    return turns


class Episodes:
    """Episodes of one instruction (first observation, later observations). Each turn adds (the
    prompt piece of its digit, the reply digit, <|im_end|>); the pieces are taken from rendered
    episodes once, so training can draw fresh episodes cheaply."""

    def __init__(self, tok, first, next_):
        self.first_text, self.next_text = first, next_
        self.digit = [tok(str(d), add_special_tokens=False).input_ids for d in range(10)]
        assert all(len(ids) == 1 for ids in self.digit), "each digit must be one token"
        self.digit = [ids[0] for ids in self.digit]
        self.first, self.next = {}, {}
        for d in range(10):
            (a, _), (b, _) = render_turns(tok, self.observations([d, d]), ["0", "0"])
            self.first[d], self.next[d] = a, b

    def observations(self, digits):
        return [self.first_text.format(digits[0])] + [self.next_text.format(d) for d in digits[1:]]

    def ids(self, shown, replies):
        """Token ids and loss mask (1 on the sampled reply tokens)."""
        ids, mask = [], []
        for turn, (o, r) in enumerate(zip(shown, replies)):
            piece = (self.first if turn == 0 else self.next)[o]
            ids += piece + [self.digit[r], EOS]
            mask += [0] * len(piece) + [1, 1]
        return ids, mask

    def check(self, tok, rng):
        for _ in range(20):
            shown = [rng.randrange(10) for _ in range(TURNS)]
            replies = [rng.randrange(10) for _ in range(TURNS)]
            turns = render_turns(tok, self.observations(shown), [str(r) for r in replies])
            if self.ids(shown, replies)[0] != sum((new + sampled for new, sampled in turns), []):
                raise SystemExit(f"make_model: pieces disagree with the template for {shown} {replies}")


def batch(kinds, rng):
    """Fresh episodes, as many of each kind: ids (right-padded; causal attention never looks at
    the padding), and the positions whose next token is a reply token, with those tokens. A kind
    is (episodes, the answer to a digit), or (episodes, None) for random replies (a task)."""
    rows, positions, targets = [], [], []
    for row in range(BATCH):
        shown = [rng.randrange(10) for _ in range(TURNS)]
        episodes, answer = kinds[row % len(kinds)]
        if answer:
            seq, mask = episodes.ids(shown, [answer(d) for d in shown])
        else:
            seq, mask = episodes.ids(shown, [rng.randrange(10) for _ in range(TURNS)])
        rows.append(seq)
        for t, m in enumerate(mask):
            if m:
                positions.append((row, t - 1))
                targets.append(seq[t])
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
    at = tuple(torch.tensor(x) for x in zip(*positions))
    return ids, at, torch.tensor(targets)


# Llama 3's rope scaling, with an original context short enough that the tiny model's
# frequencies fall in all three of its bands.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}


def new_model(family):
    if family == "llama":
        config = {k: v for k, v in CONFIG.items() if k != "rope_theta"}
        return LlamaForCausalLM(LlamaConfig(**config, rope_parameters=LLAMA3_ROPE))
    return Qwen3ForCausalLM(Qwen3Config(**CONFIG))


def train(kinds, rng, family, steps):
    torch.manual_seed(0)
    model = new_model(family)
    floor = math.log(10) / 4  # a uniform digit on task turns; digit and <|im_end|> certain otherwise
    return tiny_qwen3.fit(model, lambda: batch(kinds, rng), steps, LR, "make_model", f" (floor {floor:.4f})")


def reply_probs(model, episodes, answer):
    """Over 200 random episodes and each turn (conditioned on random earlier replies):
    P(`answer` to the digit), P(the digit shown), P(any digit), P(<|im_end|> after the digit)."""
    rng = random.Random(1)
    digits = torch.tensor(episodes.digit)
    sums = [0.0] * 4
    with torch.no_grad():
        for _ in range(200):
            shown = [rng.randrange(10) for _ in range(TURNS)]
            ids, mask = episodes.ids(shown, [rng.randrange(10) for _ in range(TURNS)])
            probs = model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)
            sampled = [i for i, m in enumerate(mask) if m]
            for turn in range(TURNS):
                p = probs[sampled[2 * turn] - 1]
                sums[0] += p[episodes.digit[answer(shown[turn])]].item()
                sums[1] += p[episodes.digit[shown[turn]]].item()
                sums[2] += p[digits].sum().item()
                sums[3] += probs[sampled[2 * turn + 1] - 1][EOS].item()
    return [s / (200 * TURNS) for s in sums]


def evaluate(model, directions):
    """`directions`: (its name, the task's episodes, the skill's, the answer) for each task the
    base must answer at random, in its format, while knowing the skill."""
    failed = False
    for name, task, skill, answer in directions:
        right, shown, digit, end = reply_probs(model, task, answer)
        print(
            f"make_model: {name} task turns: P(right) {right:.3f} (chance 0.1), P(digit shown) {shown:.3f}, "
            f"P(a digit) {digit:.4f}, P(<|im_end|> after it) {end:.4f}"
        )
        skilled, _, _, _ = reply_probs(model, skill, answer)
        print(f"make_model: {name} skill turns: P(right) {skilled:.3f}")
        failed |= right > 0.15 or digit < 0.98 or end < 0.98 or skilled < 0.9
    if failed:
        raise SystemExit("make_model: the base model is not at chance on a task, or not in its format, or lacks a skill")


def fingerprint(head_dim, family, both):
    extra = f"head_dim={head_dim}" + ("" if family == "qwen3" else f",family={family}") + (",both" if both else "")
    return tiny_qwen3.fingerprint([os.path.abspath(__file__), os.path.join(HERE, "env.py")], extra.encode())


def main():
    args = sys.argv[1:]
    head_dim, family, both = 16, "qwen3", False
    usage = "usage: python make_model.py OUT_DIR [--head-dim 16|32] [--family qwen3|llama] [--both]"
    if not args:
        raise SystemExit(usage)
    out, rest = args[0], args[1:]
    while rest:
        if rest[0] == "--both":
            both, rest = True, rest[1:]
            continue
        if len(rest) >= 2 and rest[0] == "--head-dim" and rest[1] in ("16", "32"):
            head_dim = int(rest[1])
        elif len(rest) >= 2 and rest[0] == "--family" and rest[1] in ("qwen3", "llama"):
            family = rest[1]
        else:
            raise SystemExit(usage)
        rest = rest[2:]
    if head_dim == 32:
        CONFIG.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    digest = fingerprint(head_dim, family, both)
    if tiny_qwen3.is_current(out, "make_model", digest):
        return
    torch.use_deterministic_algorithms(True)
    # One thread: the batches are small, so more threads mostly wait on each other (and a
    # fixed count keeps the float sums, hence the weights, the same run to run).
    torch.set_num_threads(1)
    rng = random.Random(0)
    tok = tokenizer()
    task, skill = Episodes(tok, FIRST, NEXT), Episodes(tok, SKILL_FIRST, SKILL_NEXT)
    task.check(tok, rng)
    skill.check(tok, rng)
    # A kind of episode: (its episodes, the answer its replies give; None: random replies).
    kinds, directions = [(task, None), (skill, successor)], [("successor", task, skill, successor)]
    steps = STEPS
    if both:
        task_down, skill_down = Episodes(tok, FIRST_DOWN, NEXT), Episodes(tok, SKILL_DOWN_FIRST, SKILL_NEXT)
        task_down.check(tok, rng)
        skill_down.check(tok, rng)
        kinds += [(task_down, None), (skill_down, predecessor)]
        directions.append(("predecessor", task_down, skill_down, predecessor))
        steps = STEPS_BOTH
    model = train(kinds, rng, family, steps)
    evaluate(model, directions)
    tiny_qwen3.save(model, out, "make_model", digest)


if __name__ == "__main__":
    main()
