"""A ChatAgent that does what untrusted agent code might: looks for credentials in its environment,
starts a process meant to outlive its episode, double-forks a process out of its process group
(an orphan that exits soon), calls the loopback server under a session that is not its own, and
runs "model-written" code with `moult.sandbox.run` that tries to reach the loopback server.
It reports what it found in `info` (the test checks it)."""

import json
import os
import subprocess
import time
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


def stat_of(pid):
    """(state, parent pid) of a process, or None when it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return fields[0], int(fields[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def escape():
    """Double-forks a process into a session of its own (so the episode's process-group kill
    misses it) that exits after a moment: an orphan for whoever reaps orphans."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(0.3)
            os._exit(0)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    grandchild = int(os.read(r, 32))
    os.close(r)
    return grandchild


class AgentRunner(moult.ChatAgent):
    def run(self, task, ctx):
        # One real turn, so the episode has a segment.
        openai.OpenAI(max_retries=0).chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        leftover = subprocess.Popen(["sleep", "600"])
        escaped = escape()
        adopted_by = stat_of(escaped)
        time.sleep(1.0)
        after = stat_of(escaped)
        forged = ctx.openai_base_url.replace(ctx.session_id, "forged-session")
        # Code the model wrote, run as a tool would: in a sandbox of its own (inside the
        # episode's jail, where there is one), it reaches neither the loopback server nor the
        # episode's variables.
        code = (
            "import os, urllib.request\n"
            "try:\n"
            f"    urllib.request.urlopen({ctx.openai_base_url + '/models'!r}, timeout=2)\n"
            "    reached = 'reached'\n"
            "except OSError:\n"
            "    reached = 'unreachable'\n"
            "print(reached, os.environ.get('MOULT_SESSION_ID'))\n"
        )
        sandboxed = moult.sandbox.run(code, timeout=60)
        return moult.Result(
            reward=1.0,
            info={
                "env": sorted(os.environ),
                "values": sorted(os.environ.values()),
                "leftover_pid": leftover.pid,
                "parent_pid": os.getppid(),
                "escaped_parent": adopted_by[1] if adopted_by else None,
                "escaped_state": after[0] if after else "reaped",
                "forged_status": status_of(
                    forged + "/chat/completions",
                    {"model": ctx.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                ),
                "task_in_env": "MOULT_TASK" in os.environ,
                "sandboxed": [sandboxed.ok, sandboxed.stdout.strip(), sandboxed.stderr[-500:]],
                "task_len": len(task["padding"]),
            },
        )
