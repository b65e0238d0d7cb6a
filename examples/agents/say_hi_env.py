"""An Env in Python: the framework owns the LLM loop, calling `reset` once and `step` with each
model reply. Reward 1 per reply that greets.

    moult agents --engine http://127.0.0.1:8000 --model MODEL_DIR \
        --agent examples/agents/say_hi_env.py --tasks examples/agents/say_hi_tasks.jsonl \
        --system-prompt "You are terse." --temperature 0
"""

import moult


class AgentRunner(moult.Env):
    def reset(self, task):
        self.turn = 0
        return task["prompt"]

    def step(self, action):
        self.turn += 1
        greeted = action.rstrip().endswith("!") and "Hi" in action
        return moult.Step(observation="Again.", reward=float(greeted), terminated=self.turn == 2, info={"turn": self.turn})
