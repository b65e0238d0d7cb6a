"""Writes the successor tasks: `python make_tasks.py > tasks.jsonl` (seeded, so the file is the
same every time), and with `--eval`, the held-out tasks of `spec.eval`: `python make_tasks.py
--eval > eval.jsonl`, digit triples that are not among the training tasks. With `--down`, the
same digits as tasks of the predecessor task (`"direction": "down"`, env.py):
`python make_tasks.py --down > tasks-down.jsonl`, `python make_tasks.py --eval --down >
eval-down.jsonl`."""

import json
import random
import sys

TASKS = 256
EVAL_TASKS = 16
TURNS = 3


def training():
    rng = random.Random(0)
    return [[rng.randrange(10) for _ in range(TURNS)] for _ in range(TASKS)]


def held_out():
    seen = {tuple(t) for t in training()}
    rng = random.Random(1)
    tasks = []
    while len(tasks) < EVAL_TASKS:
        t = [rng.randrange(10) for _ in range(TURNS)]
        if tuple(t) not in seen:
            seen.add(tuple(t))
            tasks.append(t)
    return tasks


args = sys.argv[1:]
if any(a not in ("--eval", "--down") for a in args):
    raise SystemExit("usage: python make_tasks.py [--eval] [--down]")
for numbers in held_out() if "--eval" in args else training():
    print(json.dumps({"numbers": numbers, "direction": "down"} if "--down" in args else {"numbers": numbers}))
