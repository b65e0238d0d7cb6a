"""A ChatAgent that misbehaves on request (task `mode`): `crash` kills itself mid-stream, `hang`
stops reading its stream and sleeps past any timeout, `fail` raises, `ok` does one short turn."""

import os
import signal
import time

import openai

import moult


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        client = openai.OpenAI(max_retries=0)
        messages = [{"role": "user", "content": "Tell a long story."}]
        mode = task["mode"]
        if mode == "ok":
            client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4)
            return 1.0
        if mode == "fail":
            raise RuntimeError("the agent gave up")
        stream = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4000, stream=True)
        for i, _ in enumerate(stream):
            if i == 20:
                break
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # hang, holding the half-read stream open
        return 0.0
