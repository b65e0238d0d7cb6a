"""The chat-tools task: a ChatAgent, written against the `openai` SDK as it would be against any
OpenAI-compatible server, that answers "How warm is it today?" with the help of tools.

The model is offered three tools: `weather` (today's temperature), `forecast` (tomorrow's) and
`history` (yesterday's). It may call one, or answer at once. The agent runs the call it asked
for, sends the result back as a `tool` message, and takes the next reply as the answer, "It is N"
(N degrees C, a digit). The reward is 1 when N is today's temperature, else 0. So the right tool
call is what pays: `forecast` and `history` give real but wrong numbers, and an answer without a
tool is a guess (right one time in ten).

A task is `{"question", "today", "tomorrow", "yesterday"}` (the three temperatures are distinct
digits, so only `weather` gives the answer). Run on its own against an engine:

    moult agents --engine http://127.0.0.1:8000 --model examples/chat-tools/model \
        --agent examples/chat-tools/agent.py --tasks examples/chat-tools/tasks.jsonl
"""

import json

import openai

import moult


def tool(name, description):
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object", "properties": {}}},
    }


TOOLS = [
    tool("weather", "Today's temperature here, in degrees C."),
    tool("forecast", "Tomorrow's temperature here, in degrees C."),
    tool("history", "Yesterday's temperature here, in degrees C."),
]
# The task field each tool reads.
DAY = {"weather": "today", "forecast": "tomorrow", "history": "yesterday"}
# A tool call and the answer fit in this (a call is 33 tokens of the tiny tokenizer).
MAX_TOKENS = 48
# The answer's form; its number is the temperature.
ANSWER = "It is {}"
# The same as the manifest's spec.rollout.temperature, which the trainer's loss assumes.
TEMPERATURE = 1.0
# Requests per episode: a tool call, then the answer; one more in case the model calls again.
MAX_REQUESTS = 3


def run_tool(task, name):
    """What a tool answers: `{"temperature": N}`, or an error the model reads as text."""
    if name not in DAY:
        return f"error: no tool named {name}"
    return json.dumps({"temperature": task[DAY[name]]})


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        client = openai.OpenAI(max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        calls = []
        for _ in range(MAX_REQUESTS):
            r = client.chat.completions.create(
                model=ctx.model, messages=messages, tools=TOOLS, temperature=TEMPERATURE, max_tokens=MAX_TOKENS
            )
            m = r.choices[0].message
            if not m.tool_calls:
                right = (m.content or "").strip() == ANSWER.format(task["today"])
                return moult.Result(reward=float(right), info={"calls": calls, "answer": m.content})
            messages.append(m.model_dump(exclude_none=True))
            for call in m.tool_calls:
                calls.append(call.function.name)
                result = run_tool(task, call.function.name)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return moult.Result(reward=0.0, info={"calls": calls, "answer": None})
