"""Drive the loopback server with the real `openai` and `anthropic` SDKs through the scripted
conversations of chat_scripts.json, streaming and not, as an agent would: append what the server
answered, send tool results back, and check each answer is the scripted one (the tiny chat model
memorized them; requests are greedy).

Usage: python loopback_sdk_client.py BASE_URL

Sessions are named `<protocol>-<stream|plain>-<conversation>`; after `weather`, the same session
goes on with `compacted` (the agent dropped its history), so the server must seal a segment there.
The first request of `think` is sent twice (an identical retry), which must be recorded once.
Prints one JSON line with what each session received.
"""

import json
import sys

import anthropic
import openai

BASE = sys.argv[1]
with open(__file__.replace("loopback_sdk_client.py", "chat_scripts.json")) as f:
    SCRIPT = json.load(f)
TOOLS = SCRIPT["tools"]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]


def check(got, want, where):
    if got != want:
        raise AssertionError(f"{where}: got {got!r}, want {want!r}")


def openai_turn(client, messages, tools, stream):
    kwargs = dict(model="tiny", messages=messages, temperature=0, max_tokens=120)
    if tools:
        kwargs["tools"] = TOOLS
    if not stream:
        r = client.chat.completions.create(**kwargs)
        check(r.object, "chat.completion", "object")
        m = r.choices[0].message
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in (m.tool_calls or [])]
        check(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens, "usage")
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        check(chunk.object, "chat.completion.chunk", "chunk object")
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert usage is not None and usage.completion_tokens > 0, "stream_options.include_usage sent no usage"
    calls = [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return (content or None), calls, finish


def run_openai(name, conv, stream, session):
    client = openai.OpenAI(base_url=f"{BASE}/s/{session}/v1", api_key="moult", max_retries=0)
    messages, received = [], []
    for i, msg in enumerate(conv["messages"]):
        if msg["role"] != "assistant":
            if msg["role"] == "tool":
                messages.append({"role": "tool", "tool_call_id": last_call_id, "content": msg["content"]})
            else:
                messages.append({"role": msg["role"], "content": msg["content"]})
            continue
        retries = 2 if (name == "think" and i == 2) else 1
        for _ in range(retries):
            content, calls, finish = openai_turn(client, messages, conv["tools"], stream)
        where = f"openai {session} turn {i}"
        if "tool_call" in msg:
            check([(n, a) for _, n, a in calls], [(msg["tool_call"]["name"], msg["tool_call"]["arguments"])], where)
            check(finish, "tool_calls", where)
            last_call_id = calls[0][0]
            assert last_call_id.startswith("call_"), last_call_id
            messages.append({
                "role": "assistant",
                "content": content,
                "tool_calls": [{"id": c[0], "type": "function", "function": {"name": c[1], "arguments": json.dumps(c[2])}} for c in calls],
            })
        else:
            check(content, msg["content"], where)
            check(calls, [], where)
            check(finish, "stop", where)
            messages.append({"role": "assistant", "content": content})
        received.append({"content": content, "tool_calls": [[n, a] for _, n, a in calls]})
    return received


def anthropic_turn(client, system, messages, tools, stream):
    # anthropic 2.x dropped the sampling arguments from `create`; the server still takes them.
    kwargs = dict(model="tiny", max_tokens=120, messages=messages, extra_body={"temperature": 0})
    if system is not None:
        kwargs["system"] = system
    if tools:
        kwargs["tools"] = ANTHROPIC_TOOLS
    if stream:
        with client.messages.stream(**kwargs) as s:
            text = "".join(s.text_stream)
            m = s.get_final_message()
        streamed_text = "".join(b.text for b in m.content if b.type == "text")
        check(text, streamed_text, "text_stream vs final message")
    else:
        m = client.messages.create(**kwargs)
    check(m.type, "message", "type")
    check(m.role, "assistant", "role")
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0, m.usage
    return m


def run_anthropic(name, conv, stream, session):
    client = anthropic.Anthropic(base_url=f"{BASE}/s/{session}", api_key="moult", max_retries=0)
    system, messages, received = None, [], []
    for i, msg in enumerate(conv["messages"]):
        if msg["role"] == "system":
            system = msg["content"]
            continue
        if msg["role"] == "user":
            messages.append({"role": "user", "content": msg["content"]})
            continue
        if msg["role"] == "tool":
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": last_call_id, "content": msg["content"]}]})
            continue
        retries = 2 if (name == "think" and i == 2) else 1
        for _ in range(retries):
            m = anthropic_turn(client, system, messages, conv["tools"], stream)
        where = f"anthropic {session} turn {i}"
        uses = [b for b in m.content if b.type == "tool_use"]
        text = "".join(b.text for b in m.content if b.type == "text")
        if "tool_call" in msg:
            check([(u.name, u.input) for u in uses], [(msg["tool_call"]["name"], msg["tool_call"]["arguments"])], where)
            check(m.stop_reason, "tool_use", where)
            last_call_id = uses[0].id
            assert last_call_id.startswith("toolu_"), last_call_id
        else:
            check(text, msg["content"], where)
            check(uses, [], where)
            check(m.stop_reason, "end_turn", where)
        # What agents do: send the content blocks back as they came.
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        received.append({"content": text, "tool_calls": [[u.name, u.input] for u in uses]})
    return received


def main():
    out = {}
    for proto, run in (("openai", run_openai), ("anthropic", run_anthropic)):
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            for name in ("weather", "think"):
                session = f"{proto}-{mode}-{name}"
                out[session] = run(name, SCRIPT["conversations"][name], stream, session)
                if name == "weather":
                    out[session] += run("compacted", SCRIPT["conversations"]["compacted"], stream, session)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
