"""mtl — multi-task training, the upper bound: row i of its matrix is the base trained jointly on
tasks 1..i (at the mean of their epochs), a separate run per row, so only its ACC is meaningful."""
from methods.base import Method


class MTL(Method):
    name = "mtl"
    acc_only = True

    def plan_train(self, steps, prev, stage, tasks, buffer_key, seed):
        seen, epochs = tasks[:stage], steps.inputs.epochs
        n_ep = round(sum(epochs[t] for t in seen) / len(seen))
        return steps.train(None, stage, seen, None, seed, self.train_flags(steps.cfg),
                           n_epochs=n_ep)


METHOD = MTL()
