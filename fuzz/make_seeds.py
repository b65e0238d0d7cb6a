"""Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/seed-*), one small valid
input of each shape a target reads, from the repository's fixtures and examples.

Usage: python fuzz/make_seeds.py   (the project's virtualenv: numpy, Pillow and pyarrow)

libFuzzer adds what it finds to a run's working corpus (scripts/fuzz.sh keeps that outside the
repository); inputs of fixed findings are copied into fuzz/corpus/<target>/ by hand, named
`finding-<what>`, so that CI replays them.
"""

import base64
import glob
import io
import json
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(CORPUS, target, f"seed-{name}"), "wb") as f:
        f.write(data)


def npy(ids):
    buf = io.BytesIO()
    np.save(buf, np.asarray(ids, dtype=np.uint8))
    return buf.getvalue()


def segment(length, sampled_from, experts=True):
    seg = {
        "token_ids": [(7 * i + 3) % 2003 for i in range(length)],
        "loss_mask": [1 if i >= sampled_from else 0 for i in range(length)],
        "logprobs": [-0.5 if i >= sampled_from else 0.0 for i in range(length)],
        "versions": [2 if i >= sampled_from else None for i in range(length)],
        "routed_experts": [],
        "turns": 1,
    }
    if experts:
        # The tiny Qwen3-MoE: 2 sparse layers, top-2 of 8 experts; one chunk per request.
        ids = [[[(t + l + k) % 8 for k in range(2)] for l in range(2)] for t in range(length - 1)]
        seg["routed_experts"] = [{"start": 0, "data": base64.b64encode(npy(ids)).decode()}]
    return seg


def episode(segments, reward=1.0, status="completed"):
    return json.dumps({
        "index": 0, "session": "s-1", "task": {"question": "2+2"}, "status": status,
        "reward": reward, "info": {}, "seconds": 0.5, "segments": segments,
    })


def episodes():
    write("episode_forward", "one-turn", episode([segment(12, 5)]))
    write("episode_forward", "two-segments", episode([segment(8, 3), segment(20, 10)], reward=0.0))
    write("episode_forward", "no-replay", episode([segment(6, 2, experts=False)]))
    write("episode_forward", "at-the-limit", episode([segment(40, 30)]))
    write("episode_forward", "failed", episode([], status="failed"))
    write("episode_json", "one-turn", episode([segment(12, 5, experts=False)]))
    write("episode_json", "replay", episode([segment(9, 4)]))


def images():
    for name, (w, h), mode, fmt in [
        ("rgb-png", (40, 30), "RGB", "PNG"), ("grey-png", (60, 60), "L", "PNG"),
        ("rgba-png", (28, 90), "RGBA", "PNG"), ("rgb-jpeg", (64, 48), "RGB", "JPEG"),
    ]:
        im = Image.new(mode, (w, h))
        im.putdata([tuple((x * 5 + y * 3 + c * 40) % 256 for c in range(len(mode)))
                    if len(mode) > 1 else (x * 5 + y * 3) % 256
                    for y in range(h) for x in range(w)])
        buf = io.BytesIO()
        im.save(buf, fmt)
        write("image_preprocess", name, buf.getvalue())
        media = "image/png" if fmt == "PNG" else "image/jpeg"
        write("image_data_url", name, f"data:{media};base64,{base64.b64encode(buf.getvalue()).decode()}")
    write("image_data_url", "http", "https://example.com/cat.png")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat():
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "<think>ok</think>Sunny."},
        {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "image"}]},
    ]
    for pick in range(6):
        write("chat_template", f"tools-{pick}", bytes([pick]) + json.dumps({"messages": conversation, "tools": TOOLS}).encode())
    write("chat_template", "plain", bytes([0x80]) + json.dumps([{"role": "user", "content": "hi"}]).encode())
    outputs = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "hermes-text": 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"x": [1, 2]}}\n</tool_call>',
        "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "pythonic": '[get_weather(city="Paris"), f(x=1, y=[1, 2], z={"a": None})]',
        "text": "The answer is 4.",
    }
    for name, text in outputs.items():
        write("tool_calls", name, text)
    openai = {"model": "m", "messages": conversation[:4] + [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
        "tools": TOOLS, "tool_choice": "auto", "n": 2, "max_tokens": 16, "temperature": 0.7, "logprobs": True,
        "stop": ["\n\n"], "chat_template_kwargs": {"enable_thinking": False}, "stream": True,
        "stream_options": {"include_usage": True}}
    write("openai_request", "tools", json.dumps(openai))
    write("openai_request", "plain", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    anthropic = {"model": "m", "max_tokens": 32, "system": "Be terse.", "tools": [{"name": "get_weather",
        "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "auto"}, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}],
        "stop_sequences": ["END"], "temperature": 0.5, "stream": True}
    write("anthropic_request", "tools", json.dumps(anthropic))
    write("anthropic_request", "plain", json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
    write("generate_request", "sampling", json.dumps({"request_id": "r-1", "token_ids": [1, 2, 3], "stream": True,
        "sampling_params": {"max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "top_k": 5, "logprobs": 2,
                            "stop_token_ids": [2002], "seed": 7, "min_tokens": 1}}))
    write("generate_request", "image", json.dumps({"token_ids": [5, 6], "content_parts": [
        {"type": "image_url", "url": "data:image/png;base64,iVBORw0KGgo="}]}))
    for name in ["generate_stream.sse", "error_in_stream.sse"]:
        with open(os.path.join(FIXTURES, "vllm_cpu", name), "rb") as f:
            write("sse_stream", name.split(".")[0], bytes([37]) + f.read()[:3000])


def data():
    write("routed_experts_npy", "u8", npy([[[1, 2], [3, 4]], [[5, 6], [7, 0]]]))
    buf = io.BytesIO()
    np.save(buf, np.arange(24, dtype=np.uint16).reshape(2, 3, 4))
    write("routed_experts_npy", "u16", buf.getvalue())
    rows = [{"problem": "2+2", "solution": "4", "id": 1}, {"problem": "3*3", "solution": "9", "id": 2}]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows)
    write("tasks_dataset", "jsonl", b"\x00" + jsonl.encode())
    write("tasks_dataset", "jsonl-columns", b"\x02" + jsonl.encode())
    table = pa.table({"problem": ["2+2", "3*3"], "solution": ["4", "9"],
                      "meta": [{"level": 1, "tags": ["a"]}, {"level": 2, "tags": []}]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    write("tasks_dataset", "parquet", b"\x01" + buf.getvalue())
    write("tasks_dataset", "parquet-columns", b"\x03" + buf.getvalue())


def manifests():
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True)):
        with open(path, "rb") as f:
            text = f.read()
        if b"kind: RLRun" in text:
            name = os.path.relpath(path, os.path.join(ROOT, "examples")).replace("/", "-")
            write("rlrun_manifest", name, text)


def weights():
    info = {"names": ["a", "b", "c"], "dtype_names": ["float32", "bfloat16", "float16"], "shapes": [[2, 3], [4], []]}
    payload = np.arange(6, dtype=np.float32).tobytes() + b"\x80\x3f" * 4 + b"\x00\x3c"
    # A byte 0: the trainer sends these tensors' bytes as a tagged bucket.
    write("weight_stream", "three", json.dumps(info).encode() + b"\n\x00" + payload)
    # A byte 1: bytes injected as they are: a well-framed bucket with a made-up tag, and a cut one.
    header = b"MOULTWT2" + struct.pack("<Q", len(payload))
    write("weight_stream", "forged", json.dumps(info).encode() + b"\n\x01" + header + payload + b"\x00" * 32)
    write("weight_stream", "short", json.dumps({"names": ["b"], "dtype_names": ["float32"], "shapes": [[4]]}).encode() + b"\n\x01MOULTWT2" + struct.pack("<Q", 16) + b"\x00" * 8)


def sandbox():
    write("sandbox_answers", "ended", '{"pid":42}\n{"exit":{"code":0}}\n')
    write("sandbox_answers", "signal", '{"pid":42}\n{"exit":{"signal":9}}\n')
    write("sandbox_answers", "failed", '{"error":"no such program"}\n')


if __name__ == "__main__":
    episodes(); images(); chat(); data(); manifests(); weights(); sandbox()
    for target in sorted(os.listdir(CORPUS)):
        print(f"{target}: {len(os.listdir(os.path.join(CORPUS, target)))} seeds")
