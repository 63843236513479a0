"""A preset's seed noise, measured once; run.py attaches it to results.json's meta ("seed_noise")
when the run is the one it was measured on, and the report reads it (reporting.numbers).

    noise = preset_seed_noise("tiny", run.PRESETS["tiny"], cfg, rhos, custom, numerics, engine, sha)
"""
from data import embedded, metrics


# The seed noise measured for a preset with its settings as they are: `python run.py --seeds 0,...,9
# --drift-limit 0` read by bench/seed_noise.py (BENCHMARKS.md, "The default over 10 seeds, under
# NUMERICS 15"): sample std over seeds of each method's ACC / BWT and of the per-seed paired
# difference against replay and sft. run.py puts it in results.json's meta when a run uses the
# preset unchanged (any method subset, any seeds, drift on or off), so that a one-seed report can
# say how far another seed would move its numbers (report.py). Re-measure it when the benchmark, the
# base, the kernels, the scoring rules or the preset change: `setting` says what it was measured on.
SEED_NOISE = {
    "tiny": dict(seeds=10, measured="BENCHMARKS.md, 'The default over 10 seeds, under NUMERICS "
                                    "15': seeds 0-9 of the preset",
                 setting=dict(
                     benchmark=5, code=15, rules=1, device="cpu", gpus=0, threads=1,
                     engine="native",
                     base="558861ddf2a7f0f0543a19eb8f929bee837d5c4acc9cf648a2ecbf93b4551105"),
                 std={"sft": dict(acc=4.54, bwt=4.97), "replay": dict(acc=0.83, bwt=1.10),
                      "opr-ru": dict(acc=1.47, bwt=1.66), "opr-sc": dict(acc=5.05, bwt=5.60)},
                 delta_std={"replay": {"sft": dict(acc=4.03, bwt=4.54),
                                       "opr-ru": dict(acc=1.84, bwt=1.83),
                                       "opr-sc": dict(acc=5.39, bwt=6.07)},
                            "sft": {"replay": dict(acc=4.03, bwt=4.54),
                                    "opr-ru": dict(acc=4.45, bwt=5.03),
                                    "opr-sc": dict(acc=5.84, bwt=6.76)}}),
}


def preset_seed_noise(preset: str, settings, cfg: dict, rhos: list, custom: bool, numerics: dict,
                      engine: str, base_sha: str | None):
    """SEED_NOISE[preset] when the run is the one it was measured on: the preset as it is (its
    benchmark version, task order and every setting that changes results; the methods and the drift
    probe may differ), on the CPU with the native engine and the pinned thread count, from the same
    base (base_sha: its weights' sha256; a CPU that builds another base has another testbed, whose
    noise was not measured). settings: the preset's (run.PRESETS[preset]). Else None."""
    noise = SEED_NOISE.get(preset)
    if noise is None or custom or rhos != [float(settings.rho)]:
        return None
    # code: the steps' kernels (kernels.NUMERICS); rules: the scoring rules (data.metrics.RULES;
    # scores feed the metrics and OPR-RU's buffers); base: the base's bytes. Not the CPU or
    # --portable: another CPU's rounding moves a seed's numbers as another seed does, and the spread
    # over seeds is what this says
    where = dict(benchmark=embedded.VERSION, code=numerics["code"], rules=metrics.RULES,
                 device=numerics["device"], gpus=numerics["gpus"], threads=numerics["threads"],
                 engine=engine, base=base_sha)
    if where != noise["setting"]:
        return None
    ignored = ("methods", "drift_limit", "rho")
    return noise if all(cfg[k] == getattr(settings, k)
                        for k in cfg if k not in ignored) else None
