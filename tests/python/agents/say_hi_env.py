"""An Env in Python: the framework owns the LLM loop. Reward 1 per reply that greets."""

import moult


class AgentRunner(moult.Env):
    def reset(self, task):
        self.turn = 0
        print("resetting", task)  # user prints go to stderr, never into the protocol
        return task["prompt"]

    def step(self, action):
        self.turn += 1
        greeted = action.rstrip().endswith("!") and "Hi" in action
        return moult.Step(observation="Again.", reward=float(greeted), terminated=self.turn == 2, info={"turn": self.turn})
