"""A ChatAgent with tool calls, written against the openai SDK as any agent would be: the pool sets
OPENAI_BASE_URL and OPENAI_API_KEY for the episode's session. Reward 1 when the final answer
reports the weather the tool returned."""

import json
import os

import openai

import moult

with open(os.path.join(os.path.dirname(__file__), "..", "chat_scripts.json")) as f:
    TOOLS = json.load(f)["tools"]


def get_weather(city):
    return "sunny, 21 C" if city == "Paris" else "unknown"


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        client = openai.OpenAI(max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        for _ in range(4):
            r = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=120)
            m = r.choices[0].message
            messages.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                return moult.Result(reward=1.0 if "sunny" in (m.content or "") else 0.0, info={"answer": m.content})
            for call in m.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(args["city"])})
        return 0.0
