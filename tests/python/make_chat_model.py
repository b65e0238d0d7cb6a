"""Create `qwen3-tiny-chat`: a tiny Qwen3 trained with transformers until greedy decoding says
exactly the assistant turns of chat_scripts.json, so the loopback-server tests can drive real
multi-turn conversations (tool calls, Qwen3 thinking) through the real SDKs and the built-in
engine and know what must come back.

Usage: python make_chat_model.py OUT_DIR [--head-dim 32]

`--head-dim 32` makes the model with two attention heads of 32 (one key/value head) instead of
four of 16: vLLM's CPU attention refuses 16, so the tests that drive the SDKs through vLLM use it.

Writes OUT_DIR/qwen3-tiny-chat/ (config.json, model.safetensors, tokenizer.json from
tests/fixtures/tiny_bpe, chat_template.jinja = the Qwen3 template from tests/fixtures,
tokenizer_config.json, generation_config.json) and OUT_DIR/qwen3-tiny-chat/expected.json: for
each conversation, the segments the loopback server must record, rendered with transformers'
`apply_chat_template` and tokenized with transformers' tokenizer (docs/loopback.md accounting: a turn
continues the segment when its rendering starts with the previous rendering plus the sampled
text; only the new text is tokenized).
"""

import json
import os
import shutil
import sys

import torch
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "fixtures"))
EOS = 2002  # <|im_end|>
EOS_TEXT = "<|im_end|>"

sys.path.insert(0, HERE)
from make_tiny_models import COMMON  # noqa: E402


def tokenizer():
    tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(FIXTURES, "tiny_bpe", "tiny_bpe_tokenizer.json"),
        eos_token=EOS_TEXT,
        pad_token="<|endoftext|>",
    )
    with open(os.path.join(FIXTURES, "qwen3_chat_template.jinja")) as f:
        tok.chat_template = f.read()
    return tok


def assistant_text(msg):
    if "tool_call" in msg:
        call = msg["tool_call"]
        return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"
    return msg["content"]


def template_message(msg, i):
    """A script message as the server hands it to the template (tool-call arguments as objects)."""
    if msg["role"] == "assistant" and "tool_call" in msg:
        call = msg["tool_call"]
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}],
        }
    if msg["role"] == "tool":
        return {"role": "tool", "content": msg["content"], "tool_call_id": f"call_{i - 1}"}
    return {"role": msg["role"], "content": msg["content"]}


def conversation_samples(tok, script, conv):
    """(prompt ids, target ids) per assistant turn, and the segments the server must record."""
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    tools = script["tools"] if conv["tools"] else None
    history, samples, segments = [], [], []
    acc_ids, acc_mask, acc_text = [], [], ""
    for i, msg in enumerate(conv["messages"]):
        if msg["role"] == "assistant":
            rendered = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
            if acc_text and rendered.startswith(acc_text):
                new = enc(rendered[len(acc_text):])
            else:
                if acc_ids:
                    segments.append({"token_ids": acc_ids, "loss_mask": acc_mask})
                acc_ids, acc_mask, acc_text, new = [], [], "", enc(rendered)
            prompt = acc_ids + new
            text = assistant_text(msg)
            target = enc(text) + [EOS]
            samples.append((prompt, target))
            acc_ids = prompt + target
            acc_mask = acc_mask + [0] * len(new) + [1] * len(target)
            acc_text = rendered + text + EOS_TEXT
        history.append(template_message(msg, i))
    segments.append({"token_ids": acc_ids, "loss_mask": acc_mask})
    return samples, segments


def greedy_ok(model, samples):
    with torch.no_grad():
        for prompt, target in samples:
            ids = torch.tensor([prompt + target[:-1]])
            pred = model(input_ids=ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
            if pred != target:
                return False
    return True


def train(samples, config, seed=7):
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config, tie_word_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    width = max(len(p) + len(t) for p, t in samples)
    ids = torch.full((len(samples), width), 0, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for row, (p, t) in enumerate(samples):
        seq = p + t
        ids[row, : len(seq)] = torch.tensor(seq)
        attn[row, : len(seq)] = 1
        labels[row, len(p) : len(seq)] = torch.tensor(t)
    for step in range(3000):
        model.train()
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 49:
            model.eval()
            if loss.item() < 0.05 and greedy_ok(model, samples):
                print(f"make_chat_model: memorized after {step + 1} steps (loss {loss.item():.4f})")
                return model
    raise SystemExit("make_chat_model: the tiny model did not memorize the scripts")


def main():
    args = sys.argv[1:]
    config = dict(COMMON)
    if args[1:] == ["--head-dim", "32"]:
        config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    elif len(args) != 1:
        raise SystemExit("usage: python make_chat_model.py OUT_DIR [--head-dim 32]")
    out = os.path.join(args[0], "qwen3-tiny-chat")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(HERE, "chat_scripts.json")) as f:
        script = json.load(f)
    tok = tokenizer()
    samples, expected = [], {}
    for name, conv in script["conversations"].items():
        s, segments = conversation_samples(tok, script, conv)
        samples += s
        expected[name] = segments
    model = train(samples, config)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(os.path.join(FIXTURES, "tiny_bpe", "tiny_bpe_tokenizer.json"), os.path.join(out, "tokenizer.json"))
    shutil.copy(os.path.join(FIXTURES, "qwen3_chat_template.jinja"), os.path.join(out, "chat_template.jinja"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS_TEXT, "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS, 2000]}, f)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main()
