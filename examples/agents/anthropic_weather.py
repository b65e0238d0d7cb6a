"""The same agent written against the `anthropic` SDK: ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
point at the episode's session. Tool results go back as `tool_result` blocks.

    moult agents --engine http://127.0.0.1:8000 --model MODEL_DIR \
        --agent examples/agents/anthropic_weather.py --tasks examples/agents/weather_tasks.jsonl
"""

import anthropic

import moult

TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
WEATHER = {"Paris": "sunny, 21 C"}


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        client = anthropic.Anthropic(max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        for _ in range(task.get("max_turns", 4)):
            # anthropic 2.x no longer takes sampling arguments in `create`; the server does.
            m = client.messages.create(
                model=ctx.model, max_tokens=120, messages=messages, tools=TOOLS,
                extra_body={"temperature": task.get("temperature", 0)},
            )
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
            uses = [b for b in m.content if b.type == "tool_use"]
            if not uses:
                text = "".join(b.text for b in m.content if b.type == "text")
                return moult.Result(reward=float("sunny" in text), info={"answer": text})
            messages.append({
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": WEATHER.get(u.input.get("city", ""), "unknown")}
                    for u in uses
                ],
            })
        return moult.Result(reward=0.0, info={"answer": None})
