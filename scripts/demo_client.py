"""Talks to a running `moult engine` the way the router and trainer will: token ids in, token
ids with logprobs and weight versions out. Standard library only, plus `tokenizers` (installed
with transformers) to show the ids as text."""

import json
import sys
import time
import urllib.error
import urllib.request

base, model_dir = sys.argv[1], sys.argv[2]


def call(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
        return json.loads(raw) if raw.strip().startswith("{") else raw


for _ in range(300):
    try:
        call("GET", "/health")
        break
    except (urllib.error.URLError, ConnectionError):
        time.sleep(0.1)
else:
    sys.exit("the engine did not come up")

from tokenizers import Tokenizer  # noqa: E402

tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
prompt = tok.encode("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n").ids
print(f"prompt: {len(prompt)} token ids {prompt}")

t0 = time.time()
out = call("POST", "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"max_tokens": 24, "temperature": 0.8, "seed": 1, "ignore_eos": True}})
choice = out["choices"][0]
print(f"\ngenerated {len(choice['token_ids'])} tokens in {time.time() - t0:.2f}s (random weights, so the text is noise):")
print("  ids:      ", choice["token_ids"])
print("  logprobs: ", [round(c["logprob"], 3) for c in choice["logprobs"]["content"][:8]], "...")
print("  versions: ", choice["weight_versions"], " finish:", choice["finish_reason"])
print("  text:     ", repr(tok.decode(choice["token_ids"])))

req = urllib.request.Request(base + "/inference/v1/generate", data=json.dumps({"token_ids": prompt, "stream": True, "sampling_params": {"max_tokens": 6, "seed": 1, "ignore_eos": True}}).encode(), headers={"content-type": "application/json"})
print("\nstreaming (SSE):")
with urllib.request.urlopen(req) as resp:
    for line in resp:
        line = line.decode().strip()
        if line:
            print("  " + (line if len(line) < 150 else line[:147] + "..."))

print("\npause(keep) / resume:", call("POST", "/pause?mode=keep")["status"], "->", call("POST", "/resume")["status"])
metrics = call("GET", "/metrics")
print("\nmetrics:")
for line in metrics.splitlines():
    if line.startswith("vllm:") and ("generation_tokens" in line or "prompt_tokens" in line or "num_requests" in line):
        print("  " + line)
print("\nThe engine speaks vLLM's API: see docs/engine.md for every endpoint.")
