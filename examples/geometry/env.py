"""The geometry task: geo3k in miniature, for a vision-language policy. Each turn the env shows a
figure, a regular polygon drawn at a random size, position and colour, and asks how many sides it
has; the model must answer with one digit. Two turns (two figures), reward 1/2 per exact answer,
so an episode's reward is the fraction it got right. The answer needs the picture: the text is
the same for every figure. A task is `{"figures": [[5, 1234], [3, 99]]}`: each figure's number
of sides and the seed that draws it.

Needs Pillow (`pip install pillow`) beside the `moult` package. Run as a program (`python env.py`)
it serves the env over the JSON-lines protocol of `moult.runner`.
"""

import math
import random

import moult

FIRST = "How many sides does this polygon have? Answer with one digit."
NEXT = "And this one?"
SIZE = 112  # pixels: an 8x8 patch grid, 16 placeholder tokens for Qwen2.5-VL
SIDES = (3, 4, 5, 6)
COLOURS = ("black", "navy", "darkgreen", "maroon")


def draw(sides, seed):
    """The figure of `sides` drawn from `seed` (a PIL image)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (SIZE, SIZE), "white")
    radius = SIZE * rng.uniform(0.32, 0.45)
    cx, cy = SIZE / 2 + rng.uniform(-4, 4), SIZE / 2 + rng.uniform(-4, 4)
    # A corner at the top, give or take a few degrees: the figure's shape, not its angle, is
    # what the model has to read.
    start = -math.pi / 2 + rng.uniform(-0.15, 0.15)
    corners = [
        (cx + radius * math.cos(start + 2 * math.pi * k / sides), cy + radius * math.sin(start + 2 * math.pi * k / sides))
        for k in range(sides)
    ]
    ImageDraw.Draw(image).polygon(corners, fill=rng.choice(COLOURS))
    return image


class AgentRunner(moult.Env):
    def reset(self, task):
        self.figures = [(int(s), int(seed)) for s, seed in task["figures"]]
        if not self.figures or any(s not in SIDES for s, _ in self.figures):
            raise ValueError(f"a task holds figures [sides, seed] with sides in {SIDES}: {task!r}")
        self.turn = 0
        self.correct = 0
        return self.show(FIRST)

    def show(self, question):
        sides, seed = self.figures[self.turn]
        return [moult.Image.from_pil(draw(sides, seed)), question]

    def step(self, action):
        right = action.strip() == str(self.figures[self.turn][0])
        self.correct += right
        self.turn += 1
        done = self.turn == len(self.figures)
        return moult.Step(
            observation="" if done else self.show(NEXT),
            reward=float(right) / len(self.figures),
            terminated=done,
            info={"correct": self.correct, "turns": self.turn},
        )


if __name__ == "__main__":
    from moult.runner import serve_env

    serve_env(AgentRunner())
