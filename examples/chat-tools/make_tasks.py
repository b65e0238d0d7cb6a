"""Writes the chat-tools tasks: `python make_tasks.py > tasks.jsonl` (seeded, so the file is the
same every time). Each task is a question and three distinct temperatures (digits, degrees C)."""

import json
import random

TASKS = 256
QUESTIONS = ["How warm is it today?", "What is the temperature today?", "Is it cold today?"]



def task(rng):
    question = rng.choice(QUESTIONS)
    today, tomorrow, yesterday = rng.sample(range(10), 3)
    return {"question": question, "today": today, "tomorrow": tomorrow, "yesterday": yesterday}


if __name__ == "__main__":
    rng = random.Random(0)
    for _ in range(TASKS):
        print(json.dumps(task(rng)))
