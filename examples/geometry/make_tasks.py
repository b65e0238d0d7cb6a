"""Writes the geometry tasks: `python make_tasks.py > tasks.jsonl` (seeded, so the file is the
same every time), and with `--eval`, the held-out tasks of `spec.eval`: `python make_tasks.py
--eval > eval.jsonl`, figures drawn from seeds the training tasks never use."""

import json
import random
import sys

TASKS = 256
EVAL_TASKS = 16
TURNS = 2
SIDES = (3, 4, 5, 6)


def tasks(count, seed, seeds):
    rng = random.Random(seed)
    return [[[rng.choice(SIDES), rng.randrange(*seeds)] for _ in range(TURNS)] for _ in range(count)]


held_out = "--eval" in sys.argv[1:]
for figures in tasks(EVAL_TASKS, 1, (10**6, 2 * 10**6)) if held_out else tasks(TASKS, 0, (0, 10**6)):
    print(json.dumps({"figures": figures}))
