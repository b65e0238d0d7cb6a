"""A ChatAgent that does what untrusted agent code might: looks for credentials in its environment,
starts a process meant to outlive its episode, and calls the loopback server under a session
that is not its own. It reports what it found in `info` (the test checks it)."""

import json
import os
import subprocess
import urllib.error
import urllib.request

import openai

import moult


def status_of(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        # One real turn, so the episode has a segment.
        openai.OpenAI(max_retries=0).chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        leftover = subprocess.Popen(["sleep", "600"])
        forged = ctx.openai_base_url.replace(ctx.session_id, "forged-session")
        return moult.Result(
            reward=1.0,
            info={
                "env": sorted(os.environ),
                "values": sorted(os.environ.values()),
                "leftover_pid": leftover.pid,
                "forged_status": status_of(
                    forged + "/chat/completions",
                    {"model": ctx.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                ),
                "task_in_env": "MOULT_TASK" in os.environ,
                "task_len": len(task["padding"]),
            },
        )
