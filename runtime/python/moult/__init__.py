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

import io
import os

__all__ = ["ChatAgent", "Context", "Env", "Image", "Result", "Step", "sandbox"]

_REQUIRED = object()


class _Record:
    """Named fields with defaults, given by position or keyword, with equality and a repr (what
    `dataclasses` would give, without its import: every episode's program starts Python anew, and
    that import is a fifth of its start; docs/benchmarks.md, "Episodes"). `_fields` lists
    (name, default); a `dict` default is a fresh dict per object."""

    _fields = ()
    __hash__ = None

    def __init__(self, *args, **kwargs):
        names = [name for name, _ in self._fields]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes at most {len(names)} positional arguments")
        unknown = sorted(set(kwargs) - set(names))
        twice = sorted(set(kwargs) & set(names[: len(args)]))
        if unknown or twice:
            what = f"no field {unknown[0]!r}" if unknown else f"two values for {twice[0]!r}"
            raise TypeError(f"{type(self).__name__}() got {what}")
        given = dict(zip(names, args), **kwargs)
        for name, default in self._fields:
            if name not in given and default is _REQUIRED:
                raise TypeError(f"{type(self).__name__}() is missing {name!r}")
            value = given.get(name, default)
            setattr(self, name, dict(value) if value is default and isinstance(default, dict) else value)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n, _ in self._fields)

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n, _ in self._fields)
        return f"{type(self).__name__}({fields})"


class Context(_Record):
    """Where an episode's agent talks to the model: `session_id`, `openai_base_url`,
    `anthropic_base_url`, `api_key`, `model`."""

    _fields = (("session_id", _REQUIRED), ("openai_base_url", _REQUIRED), ("anthropic_base_url", _REQUIRED),
               ("api_key", _REQUIRED), ("model", _REQUIRED))

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


class Result(_Record):
    """What a ChatAgent episode returns (a bare float is the reward): `reward`, `info` (a dict)."""

    _fields = (("reward", _REQUIRED), ("info", {}))


class Image(_Record):
    """An image in an observation, for a vision-language policy (docs/vision.md): PNG or JPEG
    bytes (`data`, `media_type`). An observation is a string, or a list of strings and images in
    the order the model sees them::

        return moult.Step(observation=["Here is the figure:", moult.Image.from_file("fig.png"), "What is x?"])
    """

    _fields = (("data", _REQUIRED), ("media_type", "image/png"))

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


class Step(_Record):
    """What `Env.step` returns (a dict with these keys works too): `observation` (a string, or a
    list of strings and `moult.Image`s), `reward` (0.0), `terminated` and `truncated` (False),
    `info` (a dict)."""

    _fields = (("observation", _REQUIRED), ("reward", 0.0), ("terminated", False), ("truncated", False),
               ("info", {}))


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
