"""On-Policy Replay: after stage i the new checkpoint answers every training prompt of tasks 1..i
once (rollout.py: T 0.1, log-probs kept), a scorer ranks the answers and b of them join stage i+1's
data for plain SFT (score.py). Four buffers, one class:

    opr-ru      the top b by the task's own metric (OPR-RU)
    opr-sc      the top b by the mean log-prob of the sampled tokens (OPR-SC, self-confidence)
    opr-low     the lowest b by the task's metric (the paper's low-score ablation)
    opr-random  a random b of the rollouts (a selection ablation)
"""
from methods.base import Method


class OPR(Method):
    uses_buffer = True

    def __init__(self, name: str, scorer: str, select: str):
        self.name, self.scorer, self.select = name, scorer, select  # scorer ru | sc;
                                                                    # select top | low | random

    def plan_buffer(self, steps, train_key, stage, seen, seed, next_task, rho):
        rollouts = steps.rollout(train_key, stage, seen, seed)
        return steps.score(rollouts, stage, seen, self.scorer, self.select, seed, next_task, rho)


METHODS = (OPR("opr-ru", "ru", "top"), OPR("opr-sc", "sc", "top"), OPR("opr-low", "ru", "low"),
           OPR("opr-random", "ru", "random"))
