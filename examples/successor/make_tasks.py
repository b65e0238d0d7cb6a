"""Writes the successor tasks: `python make_tasks.py > tasks.jsonl` (seeded, so the file is the
same every time)."""

import json
import random

TASKS = 256
TURNS = 3

rng = random.Random(0)
for _ in range(TASKS):
    print(json.dumps({"numbers": [rng.randrange(10) for _ in range(TURNS)]}))
