"""The code task: the policy writes a one-line Python expression in `x` for a function shown by
one example, the expression runs in a sandbox of its own (`moult.sandbox.run`) against hidden
tests, and the reward is the fraction of them it passes. One turn. A task is

    {"shown": [1, 5], "tests": [[0, 4], [3, 7], [8, 12], [25, 29]]}

the model sees only `f(1) == 5`; the tests (inputs and expected outputs) stay here, and the
sandboxed code gets the inputs alone, so it cannot print what is expected. Whatever the code
does (loop, fork, fill its disk, open sockets, read files) happens in its own jail with no
network and small limits, and ends with its call (docs/agents.md, "Running model-written code").

    moult agents --engine http://127.0.0.1:8000 --model examples/code/model \
        --agent examples/code/env.py --tasks examples/code/tasks.jsonl --max-tokens 6

Run as a program (`python env.py`, with the `moult` package importable), it serves the same env
over the JSON-lines protocol of `moult.runner`.
"""

import json

import moult

PROMPT = "Write f(x) as one Python expression in x, where f({}) == {}"

# Runs in the sandbox: the expression from `snippet.txt` on each input of `inputs.json`, one
# JSON line of results (the value's repr, or the exception's name) on stdout.
HARNESS = """
import json
snippet = open("snippet.txt").read()
try:
    code = compile(snippet, "snippet", "eval")
except SyntaxError as e:
    print(json.dumps({"error": "SyntaxError: " + str(e)}))
    raise SystemExit
results = []
for x in json.load(open("inputs.json")):
    try:
        results.append(repr(eval(code, {"__builtins__": __builtins__}, {"x": x})))
    except Exception as e:
        results.append(type(e).__name__)
print(json.dumps({"results": results}))
"""

LIMITS = {"cpuSeconds": 2, "memory": "512Mi", "processes": 16, "fileSize": "1Mi"}


def score(snippet, tests):
    """The fraction of `tests` ([input, expected] pairs) that `snippet` passes, and what happened."""
    ran = moult.sandbox.run(
        HARNESS,
        files={"snippet.txt": snippet, "inputs.json": json.dumps([x for x, _ in tests])},
        timeout=5,
        limits=LIMITS,
    )
    if not ran.ok:
        return 0.0, {"error": ran.limit or ("timed out" if ran.timed_out else ran.stderr[-300:])}
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    if "error" in report:
        return 0.0, {"error": report["error"]}
    passed = sum(got == repr(want) for got, (_, want) in zip(report["results"], tests))
    return passed / len(tests), {"passed": passed, "tests": len(tests)}


class AgentRunner(moult.Env):
    def reset(self, task):
        (x, y), self.tests = task["shown"], task["tests"]
        if not self.tests or any(len(t) != 2 for t in self.tests):
            raise ValueError(f"a task holds `shown` [x, f(x)] and `tests`, a list of [x, f(x)]: {task!r}")
        return PROMPT.format(x, y)

    def step(self, action):
        reward, info = score(action.strip(), self.tests)
        return moult.Step(observation="", reward=reward, terminated=True, info=info)


if __name__ == "__main__":
    from moult.runner import serve_env

    serve_env(AgentRunner())
