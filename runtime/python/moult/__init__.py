"""moult agents in Python: write one module that exports `AgentRunner`, in either form, and run it
with the agent pool (`moult agents --agent my_agent.py ...`). Standard library only (the built-in
`math` env, `moult.math`, imports PyPI's math-verify when it runs).

ChatAgent: your own program owns the LLM loop and talks to the loopback server with the `openai`
or `anthropic` SDK. `OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL` and their API keys are already set
for the episode's session, so an unmodified client works::

    import moult, openai

    class AgentRunner(moult.ChatAgent):
        def run(self, task, ctx):
            client = openai.OpenAI()               # base URL and key come from the environment
            r = client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": task["question"]}])
            return 1.0 if task["answer"] in r.choices[0].message.content else 0.0

Env: Gymnasium-shaped; the framework owns the LLM loop and calls `reset` once, then `step` with
each model reply until `terminated` or `truncated`::

    class AgentRunner(moult.Env):
        def reset(self, task):
            self.target = task["word"]
            return f"Say {self.target}."
        def step(self, action):
            won = self.target in action
            return moult.Step(observation="Again." if not won else "", reward=float(won), terminated=won)
"""

import dataclasses
import io
import os

__all__ = ["ChatAgent", "Context", "Env", "Image", "Result", "Step", "sandbox"]


@dataclasses.dataclass
class Context:
    """Where an episode's agent talks to the model."""

    session_id: str
    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str

    @classmethod
    def from_environ(cls):
        e = os.environ
        return cls(
            session_id=e["MOULT_SESSION_ID"],
            openai_base_url=e["MOULT_OPENAI_BASE_URL"],
            anthropic_base_url=e["MOULT_ANTHROPIC_BASE_URL"],
            api_key=e.get("OPENAI_API_KEY", "moult"),
            model=e.get("MOULT_MODEL", "policy"),
        )


@dataclasses.dataclass
class Result:
    """What a ChatAgent episode returns (a bare float is the reward)."""

    reward: float
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Image:
    """An image in an observation, for a vision-language policy (docs/vision.md): PNG or JPEG
    bytes. An observation is a string, or a list of strings and images in the order the model
    sees them::

        return moult.Step(observation=["Here is the figure:", moult.Image.from_file("fig.png"), "What is x?"])
    """

    data: bytes
    media_type: str = "image/png"

    @classmethod
    def from_file(cls, path):
        with open(path, "rb") as f:
            data = f.read()
        media_type = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
        return cls(data=data, media_type=media_type)

    @classmethod
    def from_pil(cls, image):
        """A PIL image, saved as PNG (lossless: the model sees exactly these pixels)."""
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return cls(data=buf.getvalue(), media_type="image/png")

    def to_json(self):
        import base64  # here, not at the top: it costs every episode's Python start

        return {"type": "image", "media_type": self.media_type, "data": base64.b64encode(self.data).decode("ascii")}


def observation_json(observation):
    """An observation as the Env protocol sends it: a string, or a list of text and image parts."""
    if isinstance(observation, (list, tuple)):
        parts = []
        for item in observation:
            if isinstance(item, Image):
                parts.append(item.to_json())
            elif isinstance(item, str):
                parts.append({"type": "text", "text": item})
            else:
                raise TypeError(f"an observation part is a str or moult.Image, got {item!r}")
        return parts
    if isinstance(observation, Image):
        return [observation.to_json()]
    return str(observation)


@dataclasses.dataclass
class Step:
    """What `Env.step` returns (a dict with these keys works too). `observation` is a string, or a
    list of strings and `moult.Image`s."""

    observation: object
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class ChatAgent:
    """Runs one episode per process: `run(task, ctx)` returns a reward or a `Result`."""

    form = "chat"

    def run(self, task, ctx):  # pragma: no cover - the user's code
        raise NotImplementedError("a ChatAgent implements run(task, ctx)")


class Env:
    """Gymnasium-shaped environment: `reset(task) -> observation`, `step(action) -> Step`."""

    form = "env"

    def reset(self, task):  # pragma: no cover - the user's code
        raise NotImplementedError("an Env implements reset(task)")

    def step(self, action):  # pragma: no cover - the user's code
        raise NotImplementedError("an Env implements step(action)")


def __getattr__(name):
    # `moult.sandbox.run`: model-written code in a fresh sandbox of its own (docs/agents.md).
    # Imported when first used: every episode's program starts Python anew, and most never run
    # code (docs/benchmarks.md, "Episodes").
    if name == "sandbox":
        import importlib

        return importlib.import_module(".sandbox", __name__)
    raise AttributeError(f"module 'moult' has no attribute {name!r}")
