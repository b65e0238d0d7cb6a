"""The built-in `math` environment: one question, one reply, reward 1 when the reply's final
answer is mathematically equivalent to the reference, else 0. Equivalence is decided by
math-verify (PyPI `math-verify`), so `0.5` matches `\\frac{1}{2}`, `1,234` matches `1234`,
`\\sqrt{4}` matches `2` and `(1, 3]` matches `(1,3]`; the rest of this package needs only the
standard library, and this module imports math-verify only when an episode starts.

A task is a JSON object, in the shape of GSM8K or of MATH:

    {"question": "A baker sells 48 muffins ...", "answer": "... 48 + 24 = <<48+24=72>>72 muffins.\\n#### 72"}
    {"problem": "What is $1/2 + 1/4$?", "solution": "... so the sum is $\\boxed{\\frac{3}{4}}$."}

The question is `question`, `problem` or `prompt`; the reference is `answer`, `solution` or
`ground_truth`: what follows the last `####` if there is one, else the last `\\boxed{...}` (or
`\\fbox{...}`, `\\boxed 5`), else the whole value (a `solution` must mark its answer). An optional
`instruction` replaces the sentence appended to the question (the default asks for a boxed answer).

The model's answer is the last `\\boxed{...}` of its reply, else what follows the last `####`
(a number, not a markdown heading), else what follows the last "answer is" / "Answer:"; `$`, a
trailing period, thousands separators and unit words after a number ("18 dollars") are dropped.
A reply with none of these scores 0.
`info`: `extracted` (the answer found, or null), `reference`, `correct`, `format_ok` (an answer
was found).

    moult agents --engine http://127.0.0.1:8000 --model MODEL_DIR \
        --agent moult.math --tasks gsm8k.jsonl --max-turns 1 --max-tokens 2048

(in a manifest: `agent: {form: Env, env: math}`; docs/agents.md, "The built-in `math`
environment", says what the agent's Python needs).
"""

import re
import threading

import moult

QUESTION_FIELDS = ("question", "problem", "prompt")
ANSWER_FIELDS = ("answer", "solution", "ground_truth")
INSTRUCTION = "Reason step by step, then give the final answer as \\boxed{...}."

# What to install when math-verify is missing: the version tests/python/requirements.txt pins, with
# the extra that pins the ANTLR runtime latex2sympy2_extended's generated parser was built with.
REQUIREMENT = "math-verify[antlr4-13-2]==0.9.0"

# math-verify bounds its parsing and each comparison with SIGALRM (whole seconds, main thread
# only; moult.runner calls step there). A reply such as \boxed{9^{9^{9^9}}} then costs at most
# PARSE_TIMEOUT + (comparisons, at most 4) * VERIFY_TIMEOUT seconds, not the episode's timeout.
PARSE_TIMEOUT = 3
VERIFY_TIMEOUT = 3
# An answer after `####` or "answer is" ends at the line's end, and within this many characters.
MAX_ANSWER_CHARS = 500

_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_HASHES = re.compile(r"####")
# "The answer is", "the final answer is:", "Answer:", "**Answer:**", "**Final Answer**:".
_ANSWER = re.compile(r"\banswer\b(?:\s*\*\*)?\s*(?:is\b\s*:?|:)(?:\s*\*\*)?", re.IGNORECASE)
# An answer ends with its sentence ("$42$. I hope it is correct.") or clause ("1,234, which").
_CLAUSE_END = re.compile(r"\.\s|,\s+(?=[A-Za-z]{2})")
# A word, not a LaTeX command.
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
# A number, an expression, LaTeX, an interval or set, or an equation such as `x = 5`: not a word.
_LOOKS_LIKE_ANSWER = re.compile(r"[-+.\d\\(\[{]|[A-Za-z]\s*=")
# A number, maybe with thousands separators and a percent sign, then maybe unit words ("18
# dollars"; not a single letter or pi, which may be part of the answer: "5 x", "2 pi").
_NUMBER_WITH_UNITS = re.compile(
    r"(?P<number>[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+)"
    r"(?P<percent>\s*\\?%)?(?:\s+(?!pi\b|sqrt\b)[A-Za-z]{2,}(?:\s+[A-Za-z]+)*)?"
)


def math_verify():
    """math-verify, or an error that says what to install and where."""
    try:
        import math_verify  # noqa: PLC0415 - imported when an episode starts, not with moult
    except ImportError as e:
        raise ImportError(
            "the math env needs math-verify in the Python that runs the agent: "
            f"pip install '{REQUIREMENT}' (locally: the python3 on PATH or --python; on a "
            "cluster: the agent image, docs/agents.md, \"The built-in `math` environment\")"
        ) from e
    return math_verify


def last_boxed(text):
    """The content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces balanced), or of
    `\\boxed 5` (up to a space or `$`); None if there is none or it is empty or unclosed."""
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    # Each brace's partner, in one pass: a reply of many unclosed boxes stays linear.
    closing, stack = {}, []
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            closing[stack.pop()] = i
    for m in reversed(boxes):
        start = m.end()
        if text.startswith("{", start):
            end = closing.get(start)
            content = text[start + 1:end].strip() if end is not None else ""  # unclosed: cut off
        else:
            content = re.match(r" +([^\s$]*)", text[start:start + MAX_ANSWER_CHARS])
            content = content.group(1) if content else ""
        if content:
            return content
    return None


def _rest_of_line(text, start):
    end = text.find("\n", start, start + MAX_ANSWER_CHARS)
    return text[start:end if end >= 0 else start + MAX_ANSWER_CHARS]


def clean(answer):
    """An answer as math-verify should read it: no `$` (math delimiter or currency), no markdown
    bold, no trailing period; a bare number loses its thousands separators and unit words."""
    a = answer.replace("\\$", "").replace("$", "").replace("**", "").strip().rstrip(" .")
    for prefix, suffix in (("\\(", "\\)"), ("\\[", "\\]")):
        if a.startswith(prefix) and a.endswith(suffix):
            a = a[len(prefix):-len(suffix)].strip().rstrip(" .")
    m = _NUMBER_WITH_UNITS.fullmatch(a)
    if m:
        a = m.group("number").replace(",", "") + ("\\%" if m.group("percent") else "")
    return a


def extract_answer(reply):
    """The final answer of a model's reply, cleaned, or None when it states none."""
    boxed = last_boxed(reply)
    if boxed is not None:
        return clean(boxed) or None
    # The last `####` line or "answer is" sentence that looks like an answer, so that a markdown
    # heading (`#### 2. Step two`) or "Let me check the answer is right." after "The answer is
    # 42." does not hide 42. A `####` line (GSM8K's form: a number) holds no word either.
    for m in reversed(list(_HASHES.finditer(reply))):
        answer = clean(_rest_of_line(reply, m.end()))
        if _looks_like_answer(answer) and not _WORD.search(answer):
            return answer
    for m in reversed(list(_ANSWER.finditer(reply))):
        answer = clean(_CLAUSE_END.split(_rest_of_line(reply, m.end()), 1)[0])
        if _looks_like_answer(answer):
            return answer
    return None


def _looks_like_answer(answer):
    return _LOOKS_LIKE_ANSWER.match(answer) is not None and not _BOX.search(answer)  # unclosed box


def reference_answer(task):
    """The task's reference answer as a string; ValueError naming the accepted fields."""
    field = next((f for f in ANSWER_FIELDS if task.get(f) is not None), None)
    if field is None:
        raise ValueError(f"a math task needs its reference answer in one of {', '.join(ANSWER_FIELDS)}: {task!r}")
    value = str(task[field])
    if "####" in value:  # GSM8K: a worked solution ending in `#### 72`
        ref = value.rsplit("####", 1)[1].strip()
    else:
        ref = last_boxed(value)  # MATH: the solution's last \boxed{}
        if ref is None:
            if field == "solution":
                raise ValueError(f"a math task's `solution` must mark its answer with \\boxed{{}} or ####: {value!r}")
            ref = value
    ref = clean(ref)
    if not ref:
        raise ValueError(f"a math task's `{field}` holds no answer: {value!r}")
    return ref


def _timeout(seconds):
    # SIGALRM works in the main thread only; elsewhere (an env driven from a thread) math-verify
    # runs without its timeout rather than failing.
    return seconds if threading.current_thread() is threading.main_thread() else None


def parse(answer):
    """math-verify's parse of an extracted answer: as LaTeX inside \\boxed{} (its normalisation
    removes \\text units, \\left, \\dfrac, ...), else as a plain expression such as 3/4."""
    mv = math_verify()
    configs = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return mv.parse("\\boxed{" + answer + "}", extraction_config=configs, parsing_timeout=_timeout(PARSE_TIMEOUT))


def equivalent(gold, answer):
    """Whether `answer` (a string) is equivalent to `gold` (parsed by `parse`)."""
    pred = parse(answer)
    return bool(pred) and math_verify().verify(gold, pred, timeout_seconds=_timeout(VERIFY_TIMEOUT))


class AgentRunner(moult.Env):
    def reset(self, task):
        if not isinstance(task, dict):
            raise ValueError(f"a math task is a JSON object with a question and an answer: {task!r}")
        field = next((f for f in QUESTION_FIELDS if task.get(f) is not None), None)
        if field is None:
            raise ValueError(f"a math task needs its question in one of {', '.join(QUESTION_FIELDS)}: {task!r}")
        self.reference = reference_answer(task)
        self.gold = parse(self.reference)  # also fails here, not mid-episode, without math-verify
        instruction = task.get("instruction", INSTRUCTION)
        question = str(task[field]).strip()
        return f"{question}\n\n{instruction}" if instruction else question

    def step(self, action):
        extracted = extract_answer(action)
        correct = extracted is not None and equivalent(self.gold, extracted)
        return moult.Step(
            observation="",
            reward=float(correct),
            terminated=True,
            info={
                "extracted": extracted,
                "reference": self.reference,
                "correct": correct,
                "format_ok": extracted is not None,
            },
        )
