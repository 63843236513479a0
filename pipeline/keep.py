"""Which stage checkpoints a run keeps on disk (run.py --keep-checkpoints), and what that
costs at most (the plan).

    all    every stage's checkpoint stays in steps/ (the default)
    last   per method and seed, the newest committed stage's, plus every checkpoint that a step not
           yet committed reads (the next stage, its evaluation, rollouts, drift and buffer probes):
           pruned as the run goes, which runs the steps that read a checkpoint before the next
           training (Pipeline.readers_first)
    final  every one while the run runs; once every step is committed, each method and seed's
           final stage's only

A pruned checkpoint loses its weights; its step stays done for the steps that read it, and runs
again before a new step that reads it (Pipeline.prune, Pipeline.committed). Only train steps of the
run's own chains are pruned: a checkpoint of a step this run does not plan (another command's
method) is left as it is.

    kept("last", chains, deps, done)  -> {train key}
                                      chains: [[train key of stage 1, 2, ...]] per method and seed
    prune(pipe, "last", chains, done) -> [pruned keys]
    simulate("last", chains, deps)    -> (most checkpoints at once, checkpoints at the end)
"""
POLICIES = ("all", "last", "final")


def kept(policy: str, chains: list, deps: dict, done: set) -> set:
    """The train steps whose checkpoints stay, given the committed steps `done` (deps:
    {step: [steps it reads]}). A checkpoint that a step not in `done` reads is always kept."""
    trains = {k for chain in chains for k in chain}
    pending = [k for k in deps if k not in done]
    if policy == "all" or policy == "final" and pending:
        return trains
    needed = {d for k in pending for d in deps[k] if d in trains}
    newest = set()
    for chain in chains:
        committed = [k for k in chain if k in done]
        if committed:
            newest.add(committed[-1])
    return needed | newest


def prune(pipe, policy: str, chains: list, done: set) -> list:
    """Prune every committed checkpoint of `chains` that kept() lets go and that is still on
    disk; the keys pruned."""
    if policy == "all":
        return []
    keep = kept(policy, chains, {k: s["deps"] for k, s in pipe.steps.items()}, done)
    trains = dict.fromkeys(k for chain in chains for k in chain)  # (ordered, for the messages)
    return [k for k in trains if k in done and k not in keep and pipe.prune(k)]


def simulate(policy: str, chains: list, deps: dict) -> tuple[int, int]:
    """(the most checkpoints on disk at once, the checkpoints left at the end) of a run from
    scratch that runs one step at a time in the pipeline's order (the first step whose inputs
    are done; under last, a training only when no other step is ready: Pipeline.readers_first);
    a training stage's checkpoint counts from its start. Each further step run in parallel can
    add one to the peak."""
    trains = {k for chain in chains for k in chain}
    done, todo, peak = set(), list(deps), 0
    while todo:
        ready = [k for k in todo if all(d in done for d in deps[k])]
        # (min: the first of the lowest)
        key = min(ready, key=lambda k: policy == "last" and k in trains)
        todo.remove(key)
        peak = max(peak, len(kept(policy, chains, deps, done) & done) + (key in trains))
        done.add(key)
    return peak, len(kept(policy, chains, deps, done) & done)
