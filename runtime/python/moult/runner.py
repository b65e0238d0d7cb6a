"""Runs a user's agent module for the moult agent pool.

    python -m moult.runner describe PATH   # prints `chat` or `env`
    python -m moult.runner run PATH        # one episode (environment set by the pool)

PATH is a Python file or an importable module name exporting `AgentRunner` (a class or an
instance of `moult.ChatAgent` or `moult.Env`).

A ChatAgent episode reads its task from MOULT_TASK (JSON) and writes `{"reward", "info"}` as JSON
to MOULT_RESULT_FILE. An Env speaks JSON lines on stdin/stdout: requests `{"method": "reset",
"task"}`, `{"method": "step", "action"}`, `{"method": "close"}`; answers `{"observation"}`, a step
object, or `{"error"}`. The user's own prints go to stderr so they never corrupt the protocol.
"""

import importlib
import importlib.util
import json
import os
import sys

import moult


def load(path):
    if path.endswith(".py") or os.sep in path:
        spec = importlib.util.spec_from_file_location("moult_user_agent", path)
        if spec is None:
            raise SystemExit(f"moult: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise SystemExit(f"moult: {path} exports no AgentRunner")
    agent = runner() if isinstance(runner, type) else runner
    if not isinstance(agent, (moult.ChatAgent, moult.Env)):
        raise SystemExit(f"moult: {path}: AgentRunner must be a moult.ChatAgent or a moult.Env")
    return agent


def run_chat(agent):
    task_file = os.environ.get("MOULT_TASK_FILE")
    if task_file:
        with open(task_file) as f:
            task = json.load(f)
    else:
        task = json.loads(os.environ.get("MOULT_TASK", "null"))
    result = agent.run(task, moult.Context.from_environ())
    if isinstance(result, (int, float)):
        result = moult.Result(reward=float(result))
    elif isinstance(result, tuple):
        result = moult.Result(reward=float(result[0]), info=dict(result[1]))
    elif isinstance(result, dict):
        result = moult.Result(reward=float(result["reward"]), info=dict(result.get("info", {})))
    if not isinstance(result, moult.Result):
        raise SystemExit(f"moult: run() returned {result!r}: return a reward, (reward, info) or moult.Result")
    with open(os.environ["MOULT_RESULT_FILE"], "w") as f:
        json.dump({"reward": result.reward, "info": result.info}, f)


def step_json(step):
    if isinstance(step, moult.Step):
        # Field by field: images stay moult.Image until observation_json.
        step = dict(step.__dict__)
    if not isinstance(step, dict) or "observation" not in step:
        raise TypeError(f"step() returned {step!r}: return moult.Step or a dict with `observation`")
    return {
        "observation": moult.observation_json(step["observation"]),
        "reward": float(step.get("reward", 0.0)),
        "terminated": bool(step.get("terminated", False)),
        "truncated": bool(step.get("truncated", False)),
        "info": dict(step.get("info", {})),
    }


def serve_env(agent):
    out = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            method = req.get("method")
            if method == "reset":
                answer = {"observation": moult.observation_json(agent.reset(req.get("task")))}
            elif method == "step":
                answer = step_json(agent.step(req["action"]))
            elif method == "close":
                break
            else:
                answer = {"error": f"unknown method {method!r}"}
        except Exception:  # noqa: BLE001 - reported to the pool as the episode's failure
            import traceback  # here: every episode's Python start pays for what is imported at the top

            answer = {"error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("describe", "run"):
        raise SystemExit("usage: python -m moult.runner describe|run PATH")
    agent = load(sys.argv[2])
    if sys.argv[1] == "describe":
        print(agent.form)
    elif isinstance(agent, moult.ChatAgent):
        run_chat(agent)
    else:
        serve_env(agent)


if __name__ == "__main__":
    main()
