"""The successor task: each turn the env shows a digit and the model must answer with the next
one, (n + 1) mod 10, as a single digit. Three turns, reward 1/3 per exact answer, so an episode's
reward is the fraction of turns it got right (0, 1/3, 2/3 or 1). A task is `{"numbers": [3, 7, 1]}`.

A task with `"direction": "down"` (`{"numbers": [3, 7, 1], "direction": "down"}`; the default is
"up") is the reverse, predecessor task: the first instruction is `FIRST_DOWN` ("Reply with the
previous digit (zero wraps to nine): 3"), later turns the same "Next: 7", and the answer is
(n - 1) mod 10. tasks-down.jsonl and eval-down.jsonl hold the same digits as tasks.jsonl and
eval.jsonl in this direction (make_tasks.py --down): the second task of the two LoRA runs that
share one base (make_model.py --both) and one engine pool (rlrun-pool-up.yaml,
rlrun-pool-down.yaml; README.md).

    moult agents --engine http://127.0.0.1:8000 --model examples/successor/model \
        --agent examples/successor/env.py --tasks examples/successor/tasks.jsonl \
        --max-turns 3 --max-tokens 4

Run as a program (`python env.py`, with the `moult` package importable), it serves the same env
over the JSON-lines protocol of `moult.runner`.
"""

import moult

FIRST = "Reply with the next digit (nine wraps to zero): {}"
NEXT = "Next: {}"
FIRST_DOWN = "Reply with the previous digit (zero wraps to nine): {}"


def successor(n):
    return (n + 1) % 10


def predecessor(n):
    return (n - 1) % 10


# direction -> (first instruction, the answer to a digit)
DIRECTIONS = {"up": (FIRST, successor), "down": (FIRST_DOWN, predecessor)}


class AgentRunner(moult.Env):
    def reset(self, task):
        self.numbers = [int(n) for n in task["numbers"]]
        if not self.numbers or any(not 0 <= n <= 9 for n in self.numbers):
            raise ValueError(f"a task holds 1 or more digits 0-9 in `numbers`: {task!r}")
        direction = task.get("direction", "up")
        if direction not in DIRECTIONS:
            raise ValueError(f"a task's `direction` is \"up\" (the default) or \"down\": {task!r}")
        first, self.answer = DIRECTIONS[direction]
        self.turn = 0
        self.correct = 0
        return first.format(self.numbers[0])

    def step(self, action):
        right = action.strip() == str(self.answer(self.numbers[self.turn]))
        self.correct += right
        self.turn += 1
        done = self.turn == len(self.numbers)
        return moult.Step(
            observation="" if done else NEXT.format(self.numbers[self.turn]),
            reward=float(right) / len(self.numbers),
            terminated=done,
            info={"correct": self.correct, "turns": self.turn},
        )


if __name__ == "__main__":
    from moult.runner import serve_env

    serve_env(AgentRunner())
