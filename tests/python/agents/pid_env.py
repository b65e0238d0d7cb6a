"""An Env that says which process served each episode (`info["pid"]`), so tests can see the agent
pool reuse env processes. One turn per episode. Task `mode`: `ok`; `fail` raises in `step`;
`exit` completes, then the process exits instead of starting another episode, as a program
written to serve one episode would."""

import os

import moult


class AgentRunner(moult.Env):
    def reset(self, task):
        if getattr(self, "mode", None) == "exit":
            os._exit(0)
        self.mode = task["mode"]
        return "Say hi."

    def step(self, action):
        if self.mode == "fail":
            raise RuntimeError("the env gave up")
        return moult.Step(observation="", terminated=True, info={"pid": os.getpid()})
