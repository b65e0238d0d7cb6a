"""Tests of the built-in `math` env (runtime/python/moult/math.py), on the real math-verify.

    PYTHONPATH=runtime/python python tests/python/test_math_env.py

`tests/fixtures/math_answers.jsonl` holds one case a line, `{"task", "reply", "reward", "why"}`:
GSM8K-shaped tasks (a worked `answer` ending in `#### 72`) and MATH-shaped ones (a `solution` with
`\\boxed{}`), with replies written by hand in the forms models answer in (chain of thought ending
in `\\boxed{}`, `#### 72`, "The answer is", Minerva's "Final Answer: ... I hope it is correct."),
not recorded from a model (tests/fixtures/SOURCES.md).
"""

import json
import os
import subprocess
import sys
import threading
import time
import unittest
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "runtime" / "python"))

import moult.math as math_env  # noqa: E402

CASES = [json.loads(line) for line in (ROOT / "tests/fixtures/math_answers.jsonl").read_text().splitlines() if line.strip()]


def run_episode(task, reply):
    env = math_env.AgentRunner()
    prompt = env.reset(task)
    return prompt, env.step(reply)


class RewardsTheFixtureReplies(unittest.TestCase):
    def test_the_fixture_covers_both_dataset_shapes_and_both_rewards(self):
        self.assertGreaterEqual(len(CASES), 40)
        self.assertTrue(any("####" in c["task"].get("answer", "") for c in CASES if isinstance(c["task"].get("answer"), str)))
        self.assertTrue(any("\\boxed" in c["task"].get("solution", "") for c in CASES))
        self.assertGreaterEqual(sum(c["reward"] == 1 for c in CASES), 15)
        self.assertGreaterEqual(sum(c["reward"] == 0 for c in CASES), 15)
        self.assertTrue(any(not c["reply"].strip() for c in CASES))

    def test_each_reply_gets_the_reward_the_fixture_states(self):
        for i, case in enumerate(CASES):
            with self.subTest(line=i + 1, why=case["why"]):
                _, step = run_episode(case["task"], case["reply"])
                self.assertEqual(step.reward, float(case["reward"]), step.info)
                self.assertTrue(step.terminated)
                self.assertEqual(step.info["correct"], case["reward"] == 1)
                self.assertEqual(step.info["format_ok"], step.info["extracted"] is not None)
                if step.reward:
                    self.assertTrue(step.info["format_ok"])
                json.dumps(step.info)  # what the runner sends must be JSON

    def test_a_reply_without_an_answer_is_not_format_ok(self):
        for reply in ["", "I cannot solve this.", "48 + 24 = 72", "So the answer is \\boxed{"]:
            with self.subTest(reply=reply):
                _, step = run_episode({"question": "q", "answer": "#### 72"}, reply)
                self.assertEqual((step.reward, step.info["extracted"], step.info["format_ok"]), (0.0, None, False))

    def test_the_reference_is_what_follows_the_last_hashes_or_the_last_box(self):
        cases = [
            ({"answer": "3 + 4 = 7\n#### 7 dollars, not #### 72"}, "72"),
            ({"answer": "It is 1,080.\n#### 1,080"}, "1080"),
            ({"solution": "First $\\boxed{2}$, finally $\\boxed{\\frac{1}{\\sqrt{3}}}$."}, "\\frac{1}{\\sqrt{3}}"),
            ({"solution": "So it is $\\fbox{8}$."}, "8"),
            ({"solution": "So it is \\boxed 9."}, "9"),
            ({"answer": "\\frac{2}{3}", "solution": "ignored \\boxed{1}"}, "\\frac{2}{3}"),
            ({"ground_truth": "-12"}, "-12"),
            ({"answer": 42}, "42"),
        ]
        for task, reference in cases:
            with self.subTest(task=task):
                self.assertEqual(math_env.reference_answer(task), reference)


class Prompts(unittest.TestCase):
    def test_the_prompt_is_the_question_and_an_instruction_to_box_the_answer(self):
        env = math_env.AgentRunner()
        prompt = env.reset({"question": "What is 6 times 7?", "answer": "#### 42"})
        self.assertTrue(prompt.startswith("What is 6 times 7?\n\n"))
        self.assertIn("\\boxed{", prompt)
        self.assertEqual(env.reset({"problem": "Compute $2+2$.", "solution": "$\\boxed{4}$"}).split("\n")[0], "Compute $2+2$.")
        self.assertEqual(env.reset({"prompt": "Add 1 and 1.", "ground_truth": "2", "instruction": "End with #### N."}), "Add 1 and 1.\n\nEnd with #### N.")
        self.assertEqual(env.reset({"prompt": "Add 1 and 1.", "ground_truth": "2", "instruction": ""}), "Add 1 and 1.")

    def test_each_reset_starts_a_new_episode(self):
        env = math_env.AgentRunner()
        env.reset({"question": "q1", "answer": "#### 1"})
        env.reset({"question": "q2", "answer": "#### 2"})
        self.assertEqual(env.step("\\boxed{2}").reward, 1.0)


class RefusesMalformedTasks(unittest.TestCase):
    def test_a_task_without_a_question_names_the_accepted_fields(self):
        with self.assertRaises(ValueError) as e:
            math_env.AgentRunner().reset({"answer": "#### 3"})
        self.assertIn("question, problem, prompt", str(e.exception))

    def test_a_task_without_an_answer_names_the_accepted_fields(self):
        with self.assertRaises(ValueError) as e:
            math_env.AgentRunner().reset({"question": "What is 1 + 2?"})
        self.assertIn("answer, solution, ground_truth", str(e.exception))

    def test_a_solution_that_marks_no_answer_is_refused(self):
        with self.assertRaises(ValueError) as e:
            math_env.AgentRunner().reset({"problem": "p", "solution": "It is three."})
        self.assertIn("\\boxed{} or ####", str(e.exception))

    def test_a_task_that_is_not_an_object_is_refused(self):
        with self.assertRaises(ValueError):
            math_env.AgentRunner().reset("What is 1 + 2?")


class MathVerify(unittest.TestCase):
    def test_without_math_verify_the_error_says_what_to_install_and_where(self):
        with mock.patch.dict(sys.modules, {"math_verify": None}):
            with self.assertRaises(ImportError) as e:
                math_env.AgentRunner().reset({"question": "q", "answer": "#### 1"})
        message = str(e.exception)
        self.assertIn("pip install 'math-verify[antlr4-13-2]==", message)
        self.assertIn("agent image", message)
        self.assertIn("docs/agents.md", message)

    def test_the_requirement_named_in_the_error_is_the_one_the_project_pins(self):
        pins = (ROOT / "tests/python/requirements.txt").read_text().splitlines()
        self.assertIn(math_env.REQUIREMENT, pins)
        import math_verify  # noqa: F401 - the tests run on the pinned version
        from importlib.metadata import version

        self.assertEqual(version("math-verify"), math_env.REQUIREMENT.split("==")[1])

    def test_a_pathological_answer_costs_seconds_not_the_episode(self):
        start = time.monotonic()
        _, step = run_episode({"question": "q", "answer": "#### 5"}, "\\boxed{9^{9^{9^{9}}}}")
        self.assertEqual(step.reward, 0.0)
        self.assertLess(time.monotonic() - start, 4 * math_env.VERIFY_TIMEOUT + math_env.PARSE_TIMEOUT + 5)

    def test_an_env_stepped_outside_the_main_thread_still_verifies(self):
        # math-verify's SIGALRM timeouts work in the main thread only; elsewhere they are off.
        out = []
        t = threading.Thread(target=lambda: out.append(run_episode({"question": "q", "answer": "#### 0.5"}, "\\boxed{\\frac{1}{2}}")[1]))
        t.start()
        t.join()
        self.assertEqual(out[0].reward, 1.0)


class OverTheRunnerProtocol(unittest.TestCase):
    """`python -m moult.runner run moult.math`, as the agent pool starts it, over JSON lines."""

    def runner(self, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "runtime/python"), os.environ.get("PYTHONPATH", "")]))
        return subprocess.Popen(
            [sys.executable, "-m", "moult.runner", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def test_describe_says_env(self):
        p = self.runner("describe", "moult.math")
        out, err = p.communicate(timeout=60)
        self.assertEqual((p.returncode, out.strip()), (0, "env"), err)

    def test_reset_and_step_over_json_lines(self):
        p = self.runner("run", "moult.math")
        requests = [
            {"method": "reset", "task": {"question": "A rope of 7 m is cut in half. How long is each piece?", "answer": "7 / 2 = 3.5\n#### 3.5"}},
            {"method": "step", "action": "Each piece is 7/2 m.\n\nThe answer is $\\boxed{\\frac{7}{2}}$."},
            {"method": "reset", "task": {"answer": "#### 1"}},
            {"method": "close"},
        ]
        out, err = p.communicate("".join(json.dumps(r) + "\n" for r in requests), timeout=120)
        self.assertEqual(p.returncode, 0, err)
        answers = [json.loads(line) for line in out.splitlines()]
        self.assertEqual(len(answers), 3, out)
        self.assertTrue(answers[0]["observation"].startswith("A rope of 7 m"))
        self.assertIn("\\boxed{", answers[0]["observation"])
        self.assertEqual(
            answers[1],
            {
                "observation": "",
                "reward": 1.0,
                "terminated": True,
                "truncated": False,
                "info": {"extracted": "\\frac{7}{2}", "reference": "3.5", "correct": True, "format_ok": True},
            },
        )
        self.assertIn("question, problem, prompt", answers[2]["error"])


if __name__ == "__main__":
    unittest.main()
