"""What the recipes' model scripts share (successor/make_model.py, distill/make_teacher.py,
judge/make_judge.py, chat-tools/make_model.py, code/make_model.py): the tiny BPE tokenizer and
the Qwen3 chat template from tests/fixtures, their supervised training loop, the fingerprint that makes a script do nothing when its output is
current, and the model folder every script writes (a servable Hugging Face folder).

A script imports it with its parent folder on sys.path:
    sys.path.insert(0, os.path.join(HERE, ".."))
"""

import hashlib
import json
import os
import shutil

import torch
from transformers import PreTrainedTokenizerFast

FIXTURES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
TOKENIZER = os.path.join(FIXTURES, "tiny_bpe", "tiny_bpe_tokenizer.json")
TEMPLATE = os.path.join(FIXTURES, "qwen3_chat_template.jinja")
EOS_TEXT = "<|im_end|>"
EOS = 2002  # <|im_end|>


def tokenizer():
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER, eos_token=EOS_TEXT, pad_token="<|endoftext|>")
    with open(TEMPLATE) as f:
        tok.chat_template = f.read()
    return tok


def fit(model, next_batch, steps, lr, name, note=""):
    """Supervised training of `model` for `steps` batches of `next_batch()`: (ids, the positions
    that have a target, the targets), cross-entropy of the logits there (logits only where there
    is a target: the vocabulary projection dominates otherwise). Prints the loss every 50 steps,
    with `note`; returns the model, in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        ids, at, targets = next_batch()
        hidden = model.model(input_ids=ids).last_hidden_state[at]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 49:
            print(f"{name}: step {step + 1} loss {loss.item():.4f}{note}")
    model.eval()
    return model


def fingerprint(files, extra=b""):
    """A digest of what makes a model: the script's `files` (its own source first), this module,
    the tokenizer and template, `extra` bytes, and torch's version."""
    h = hashlib.sha256()
    for path in [*files, os.path.abspath(__file__), TOKENIZER, TEMPLATE]:
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(extra)
    h.update(torch.__version__.encode())
    return h.hexdigest()


def stamp_path(out, name):
    return os.path.join(out, f"{name}.sha256")


def is_current(out, name, digest):
    """Whether `out` was made by script `name` with this very `digest` (then say so)."""
    stamp = stamp_path(out, name)
    if os.path.exists(stamp) and open(stamp).read().strip() == digest:
        print(f"{name}: {out} is current")
        return True
    return False


def save(model, out, name, digest, tokenizer_spec=None, template=TEMPLATE):
    """Writes `model` as a servable folder: weights, config, the tokenizer (the tiny BPE one, or
    `tokenizer_spec`, a tokenizer.json as a dict) and `template`, and the stamp of `digest`."""
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_spec is None:
        shutil.copyfile(TOKENIZER, os.path.join(out, "tokenizer.json"))
    else:
        with open(os.path.join(out, "tokenizer.json"), "w") as f:
            json.dump(tokenizer_spec, f)
    shutil.copyfile(template, os.path.join(out, "chat_template.jinja"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS_TEXT, "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS, 2000]}, f)
    with open(stamp_path(out, name), "w") as f:
        f.write(digest + "\n")
    print(f"{name}: wrote {out}")
