"""Writes the code tasks: `python make_tasks.py > tasks.jsonl` (seeded, so the file is the same
every time), and with `--eval`, the held-out tasks of `spec.eval`: `python make_tasks.py --eval >
eval.jsonl`, functions shown by examples that no training task shows.

Each task is f(x) = x + K for a digit K, shown by one example f(X) == Y (X is 0 or 1, Y a digit),
and checked on four hidden inputs (0 to 99) that the prompt never shows."""

import json
import random
import sys

TASKS = 256
# Every example a task can show: f(X) == Y, X 0 or 1, Y a digit, X <= Y.
PAIRS = [(x, y) for x in range(2) for y in range(x, 10)]
# Shown only by held-out tasks, each by two (with other hidden inputs).
HELD_OUT = [(0, 4), (1, 2), (1, 7)]


def task(rng, x, y):
    tests = [[n, n + y - x] for n in rng.sample(range(100), 4)]
    return {"shown": [x, y], "tests": tests}


def training():
    rng = random.Random(0)
    pairs = [p for p in PAIRS if p not in HELD_OUT]
    return [task(rng, *rng.choice(pairs)) for _ in range(TASKS)]


def held_out():
    rng = random.Random(1)
    return [task(rng, x, y) for x, y in HELD_OUT * 2]


if __name__ == "__main__":
    for t in held_out() if "--eval" in sys.argv[1:] else training():
        print(json.dumps(t))
