"""A ChatAgent written against the `openai` SDK, unchanged from how it would run against any
OpenAI-compatible server: the agent pool sets OPENAI_BASE_URL and OPENAI_API_KEY to the episode's
session on the loopback server. It calls a tool, sends the result back, and is rewarded when the
final answer reports the weather.

    moult agents --engine http://127.0.0.1:8000 --model MODEL_DIR \
        --agent examples/agents/openai_weather.py --tasks examples/agents/weather_tasks.jsonl
"""

import json

import openai

import moult

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
WEATHER = {"Paris": "sunny, 21 C"}


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        client = openai.OpenAI(max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        for _ in range(task.get("max_turns", 4)):
            r = client.chat.completions.create(
                model=ctx.model, messages=messages, tools=TOOLS, temperature=task.get("temperature", 0), max_tokens=120
            )
            m = r.choices[0].message
            messages.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                return moult.Result(reward=float("sunny" in (m.content or "")), info={"answer": m.content})
            for call in m.tool_calls:
                city = json.loads(call.function.arguments).get("city", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER.get(city, "unknown")})
        return moult.Result(reward=0.0, info={"answer": None})
