"""ssr — Self-Synthesized Rehearsal (Huang et al. 2024, ACL): the closest relative of OPR, the
model writes its own rehearsal data, but from a few stored demonstrations instead of every
stored training prompt:

    once per task (synthesize.py): the BASE model writes synthetic inputs by in-context learning
        from --ssr-demos stored demonstrations of the task, embedded by its own pooled hidden states
    after stage i (ssr_buffer.py): per prior task, K-means over its synthetic inputs' embeddings,
        b_j of them kept (each cluster its share, the members closest to the centroid), the latest
        checkpoint answers them greedily, and they join stage i+1's data for plain SFT (b: replay's
        budget rule, an equal-budget comparison)

Defaults: the official code's (DeepLearnXMU/SSR 38d2a06: 20 demonstrations, 2 shots, 3 samples per
prompt at T 0.9, 20 clusters, proportional quotas of the closest points). Where ours differs, and
why: the official code labels a task's instances once, with the checkpoint right after that task;
here the latest checkpoint answers them at every stage, as OPR's rollouts are (the comparison this
project makes); top-p 0.6 and the repetition penalty are not applied; the embeddings are the base
model's, not SimCSE's. The peers' faults this avoids: synthesizing the current task instead of the
prior ones and a selection that never runs at its defaults (EasyCL).
"""
import torch

from methods.base import Method

CLUSTERS = 20       # official kmeans_self.py


class Ssr(Method):
    name = "ssr"
    uses_buffer = True

    def plan_buffer(self, steps, train_key, stage, seen, seed, next_task, rho):
        synth = [steps.synthesize(task, seed) for task in seen]
        return steps.ssr_buffer(train_key, synth, stage, seen, seed, next_task, rho)


def kmeans(x: torch.Tensor, k: int, seed: int, iters: int = 100):
    """Lloyd's K-means of the rows of x [N, D] (fp64 inside) from a seeded k-means++ start
    -> (labels [N], centroids [k, D]). Deterministic in (x, k, seed); stops when no
    assignment changes."""
    x = x.double()
    g = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    k = min(k, n)
    centers = [x[int(torch.randint(n, (1,), generator=g))]]
    for _ in range(1, k):  # k-means++: the next center drawn with probability proportional to D^2
        d2 = torch.cdist(x, torch.stack(centers)).min(1).values ** 2
        if float(d2.sum()) == 0:
            centers.append(x[int(torch.randint(n, (1,), generator=g))])
            continue
        centers.append(x[int(torch.multinomial(d2 / d2.sum(), 1, generator=g))])
    c = torch.stack(centers)
    labels = None
    for _ in range(iters):
        new = torch.cdist(x, c).argmin(1)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        c = torch.stack([x[labels == j].mean(0) if (labels == j).any() else c[j] for j in range(k)])
    return labels, c


def cluster_select(emb: torch.Tensor, b: int, k: int, seed: int) -> list[int]:
    """SSR's selection: K-means of the L2-normalised embeddings; cluster c gets round(b * n_c / N)
    (the official quota), filled with its members closest to the centroid; the total is then trimmed
    or topped up to min(b, N) by distance to the own centroid, so the buffer holds exactly its
    budget. -> sorted row indices."""
    n = emb.shape[0]
    if b >= n:
        return list(range(n))  # (no inputs, or fewer than the budget: all of them)
    if b == 0:
        return []
    x = torch.nn.functional.normalize(emb.double(), dim=1)
    labels, c = kmeans(x, k, seed)
    dist = (x - c[labels]).norm(dim=1)
    picked, rest = [], []
    for j in range(c.shape[0]):
        members = sorted((int(i) for i in (labels == j).nonzero().flatten()),
                         key=lambda i: (float(dist[i]), i))
        q = round(b * len(members) / n)
        picked += members[:q]
        rest += members[q:]
    by_dist = lambda i: (float(dist[i]), i)  # noqa: E731
    if len(picked) > b:
        picked = sorted(picked, key=by_dist)[:b]
    else:
        picked += sorted(rest, key=by_dist)[:b - len(picked)]
    return sorted(picked)


METHOD = Ssr()
