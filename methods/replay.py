"""replay — Vanilla Replay: after stage i, a seeded random draw of b gold training examples of tasks
1..i (b = rho * n_{i+1} split over them, data/replay.py) joins stage i+1's data for plain SFT."""
from methods.base import Method


class Replay(Method):
    name = "replay"
    uses_buffer = True

    def plan_buffer(self, steps, train_key, stage, seen, seed, next_task, rho):
        return steps.gold_buffer(stage, seen, seed, next_task, rho)


METHOD = Replay()
