"""Create the chat-tools task's base policy: a tiny Qwen3 that knows the *format* of a tool-using
chat but not which tool pays. It is trained (supervised, about three minutes on 2 CPU cores) on
conversations exactly as the loopback server records them for agent.py, in which the first reply
is drawn at random: an answer without a tool, or a call of `weather`, `forecast` or `history`, a
quarter each. After a tool's result the answer repeats the temperature the tool gave. So the base
calls the right tool one time in four and guesses right one time in ten without one (an expected
reward of about 0.2); RL has to learn to call a tool, and `weather` among them.

Usage: python make_model.py OUT_DIR

Writes OUT_DIR/ (config.json, model.safetensors, generation_config.json, tokenizer.json from
tests/fixtures/tiny_bpe, chat_template.jinja = the Qwen3 template from tests/fixtures,
tokenizer_config.json). Deterministic; skips the work when OUT_DIR was made by this very script
(same script, agent, tasks and fixtures, recorded in OUT_DIR/make_model.sha256).

Rendering. The loopback server renders each request with the chat template and tokenizes only
what the rendering adds after the previous rendering and the text of the sampled ids (docs/loopback.md). With the Qwen3 template and tools an episode is one segment:

    [system: # Tools ... <tools>...</tools> ...][user: question][assistant\n]   rendered whole
    <tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call><|im_end|>     sampled
    \n[user: <tool_response>\n{"temperature": N}\n</tool_response>][assistant\n]  rendered
    It is N<|im_end|>                                                              sampled

The server hands the template a call's arguments as an object (as vLLM does), though the SDK
sends them back as a compact JSON string; the template's `tojson` then writes them as the model
did, so the second rendering continues the first. The training sequences are built from these
per-turn pieces of transformers' `apply_chat_template`, and the script stops if a rendering does
not continue the previous one.

Training. Copying the tool's number into the answer is an attention pattern a tiny model finds
late, and later still behind the ~420 tokens of the tool list. So the model first trains on the
same conversations rendered without tools (short), then on the real ones; the `q_norm`/`k_norm`
gains start at 2 (not 1) so attention can be sharp over a long prompt; and the answer is
`It is N`: its digit follows a token found nowhere else in a reply, an easier cue than the
generation prompt. The tool list, the same in every conversation, runs once per batch.
"""

import functools
import json
import math
import os
import random
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tiny_qwen3: what the recipes' model scripts share
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import EOS, EOS_TEXT, tokenizer  # noqa: E402

sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "runtime", "python")]  # agent.py imports moult
from agent import ANSWER, DAY, TOOLS  # noqa: E402
from make_tasks import QUESTIONS  # noqa: E402
from make_tasks import task as random_task  # noqa: E402

CHOICES = [None] + list(DAY)  # None: answer without a tool

CONFIG = dict(
    vocab_size=2003,  # tiny_bpe: 2000 tokens + <|endoftext|>, <|im_start|>, <|im_end|>
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)
SHORT_STEPS = 300  # on conversations rendered without the tool list
STEPS = 300  # then on the real ones
BATCH = 32
LR = 1e-2
QK_NORM_GAIN = 2.0


def call_text(name):
    """A call as the model writes it: the template's own rendering of that call."""
    return '<tool_call>\n{"name": "%s", "arguments": {}}\n</tool_call>' % name


def tool_result(task, name):
    return json.dumps({"temperature": task[DAY[name]]})


class Renderer:
    """An episode's token ids and loss mask as the loopback server records them."""

    def __init__(self, tok, tools=TOOLS):
        self.tok = tok
        self.tools = tools

    @functools.lru_cache(maxsize=None)
    def enc(self, text):
        return tuple(self.tok(text, add_special_tokens=False).input_ids)

    def render(self, messages):
        return self.tok.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True, tokenize=False)

    @functools.lru_cache(maxsize=None)
    def first(self, question):
        """The first request's rendering."""
        return self.render([{"role": "user", "content": question}])

    @functools.lru_cache(maxsize=None)
    def after_call(self, question, name, result):
        """What the second request's rendering adds after the first rendering and the call."""
        messages = [
            {"role": "user", "content": question},
            # As the server hands it to the template: arguments as an object, no content.
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": name, "arguments": {}}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": result},
        ]
        before = self.first(question) + call_text(name) + EOS_TEXT
        rendered = self.render(messages)
        if not rendered.startswith(before):
            raise SystemExit(f"make_model: the template rewrote history: {rendered!r} after {before!r}")
        return rendered[len(before) :]

    def episode(self, task, choice, answer):
        """Ids and loss mask (1 on sampled tokens) of an episode whose first reply is a call of
        `choice` (or, for None, the answer itself) and whose final answer is `answer`."""
        q = task["question"]
        ids, mask = [], []

        def rendered(text):
            piece = self.enc(text)
            ids.extend(piece)
            mask.extend([0] * len(piece))

        def sampled(text):
            piece = self.enc(text) + (EOS,)
            ids.extend(piece)
            mask.extend([1] * len(piece))

        rendered(self.first(q))
        if choice is not None:
            sampled(call_text(choice))
            rendered(self.after_call(q, choice, tool_result(task, choice)))
        sampled(ANSWER.format(answer))
        return ids, mask


def draw(rng):
    """A training episode: a random task and first reply; after a tool, its temperature."""
    task = random_task(rng)
    choice = rng.choice(CHOICES)
    answer = rng.randrange(10) if choice is None else task[DAY[choice]]
    return task, choice, answer


def shared_prefix(renderer):
    """The tokens every episode starts with (the system prompt with the tools): training runs them
    once per batch and shares their keys and values."""
    firsts = [renderer.enc(renderer.first(question)) for question in QUESTIONS]
    n = 0
    while all(len(f) > n + 1 and f[n] == firsts[0][n] for f in firsts):
        n += 1
    return list(firsts[0][:n])


def batch(renderer, rng, skip):
    """Ids after the first `skip` (right-padded with <|im_end|>), and the positions (in them)
    whose next token is sampled, with those tokens."""
    episodes = [renderer.episode(*draw(rng)) for _ in range(BATCH)]
    width = max(len(ids) for ids, _ in episodes) - skip
    rows, cols, targets, padded = [], [], [], []
    for row, (ids, mask) in enumerate(episodes):
        padded.append(ids[skip:] + [EOS] * (width - len(ids) + skip))
        for t, m in enumerate(mask):
            if m:
                rows.append(row)
                cols.append(t - 1 - skip)
                targets.append(ids[t])
    return torch.tensor(padded), (torch.tensor(rows), torch.tensor(cols)), torch.tensor(targets)


def forward(model, prefix, ids):
    """Hidden states of `prefix + ids[i]` for each row, at the positions of `ids`; the prefix
    is run once (with gradient) and its cache repeated for the rows (the same numbers as a
    forward of the whole rows, at a fraction of the cost)."""
    cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).cache
    cache.batch_repeat_interleave(ids.shape[0])
    positions = torch.arange(len(prefix), len(prefix) + ids.shape[1]).expand(ids.shape[0], -1)
    return model.model(input_ids=ids, cache=cache, position_ids=positions).last_hidden_state


def train(renderer, short, rng):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(QK_NORM_GAIN)
            layer.self_attn.k_norm.weight.fill_(QK_NORM_GAIN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    prefix = shared_prefix(renderer)
    model.train()
    for step in range(SHORT_STEPS + STEPS):
        if step < SHORT_STEPS:
            ids, at, targets = batch(short, rng, 0)
            hidden = model.model(input_ids=ids).last_hidden_state[at]
        else:
            # The full conversations, at a learning rate falling linearly to a tenth.
            for group in opt.param_groups:
                group["lr"] = LR * (1 - 0.9 * (step - SHORT_STEPS) / STEPS)
            ids, at, targets = batch(renderer, rng, len(prefix))
            hidden = forward(model, prefix, ids)[at]
        # Logits only where there is a target: the vocabulary projection dominates otherwise.
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            print(f"make_model: step {step + 1} loss {loss.item():.4f}", flush=True)
    model.eval()
    return model


def evaluate(model, renderer):
    """Under teacher forcing, on fresh episodes that call a random tool: how the first reply
    splits between a call and an answer, how it picks the tool, how often the rest of the call
    comes out exactly, and how often the answer after the tool's result is exactly `It is N`
    with the tool's N."""
    rng = random.Random(1)
    call_start = renderer.enc("<tool_call>")[0]
    answer_start = renderer.enc(ANSWER.format(0))[0]
    name_index = len(renderer.enc('<tool_call>\n{"name": "'))
    names = {name: renderer.enc(call_text(name))[name_index] for name in DAY}
    first, pick, exact, copy = [], {n: [] for n in DAY}, [], []
    with torch.no_grad():
        for _ in range(60):
            task, _, _ = draw(rng)
            name = rng.choice(list(DAY))
            ids, mask = renderer.episode(task, name, task[DAY[name]])
            logp = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
            sampled = [t for t, m in enumerate(mask) if m]
            call_len = len(renderer.enc(call_text(name))) + 1  # and <|im_end|>
            p = lambda ts: math.exp(sum(logp[t - 1, ids[t]].item() for t in ts))  # noqa: E731
            first.append((logp[sampled[0] - 1, call_start].exp().item(), logp[sampled[0] - 1, answer_start].exp().item()))
            for n, t in names.items():
                pick[n].append(logp[sampled[name_index] - 1, t].exp().item())
            exact.append(p([t for t in sampled[1:call_len] if t != sampled[name_index]]))
            copy.append(p(sampled[call_len:]))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    p_call, p_answer = mean([a for a, _ in first]), mean([b for _, b in first])
    p_pick = {n: mean(v) for n, v in pick.items()}
    p_exact, p_copy = mean(exact), mean(copy)
    expected = p_answer * 0.1 + p_call * p_pick["weather"] * p_exact * p_copy
    print(
        f"make_model: first reply: P(call) {p_call:.3f} P(answer) {p_answer:.3f}; "
        f"tool: {', '.join(f'{n} {p:.3f}' for n, p in p_pick.items())}; "
        f"P(rest of the call exact) {p_exact:.3f}; P(answer = the tool's temperature) {p_copy:.3f}; "
        f"expected reward {expected:.3f}",
        flush=True,
    )
    return p_call, p_pick, p_exact, p_copy


def check(model, renderer):
    """The base must write calls and answers well (the copy is learnt last: most of it, not all)
    and choose at chance."""
    p_call, p_pick, p_exact, p_copy = evaluate(model, renderer)
    at_chance = abs(p_call - 0.75) < 0.1 and all(abs(p - 1 / 3) < 0.1 for p in p_pick.values())
    if p_exact < 0.9 or p_copy < 0.8 or not at_chance:
        raise SystemExit("make_model: the base model did not learn the format at chance level")


def fingerprint():
    return tiny_qwen3.fingerprint([os.path.abspath(__file__), os.path.join(HERE, "agent.py"), os.path.join(HERE, "make_tasks.py")])


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_model.py OUT_DIR")
    out = sys.argv[1]
    digest = fingerprint()
    if tiny_qwen3.is_current(out, "make_model", digest):
        return
    torch.use_deterministic_algorithms(True)
    # One thread: a fixed count keeps the float sums, hence the weights, the same run to run.
    torch.set_num_threads(1)
    tok = tokenizer()
    renderer = Renderer(tok)
    model = train(renderer, Renderer(tok, tools=None), random.Random(0))
    check(model, renderer)
    tiny_qwen3.save(model, out, "make_model", digest)


if __name__ == "__main__":
    main()
