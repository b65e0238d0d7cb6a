"""Writes the successor tasks: `python make_tasks.py > tasks.jsonl` (seeded, so the file is the
same every time), and with `--eval`, the held-out tasks of `spec.eval`: `python make_tasks.py
--eval > eval.jsonl`, digit triples that are not among the training tasks."""

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


for numbers in held_out() if "--eval" in sys.argv[1:] else training():
    print(json.dumps({"numbers": numbers}))
