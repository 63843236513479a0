"""The seed noise of a multi-seed run: each method's ACC and BWT over seeds (mean, sample std and
the std's 95 % chi-square interval), the paired differences against replay and sft (mean, the t
interval over seeds, the std of the per-seed difference), and the SEED_NOISE entry
(reporting/noise.py) that run.py attaches to one-seed reports of the same preset.

    python run.py --seeds 0,1,...,9 --drift-limit 0 --out DIR --quiet
    python bench/seed_noise.py DIR
"""
import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def per_seed(results: dict) -> dict:
    """{method: {seed: {"acc", "bwt"}}} from results.json (cl_metrics recomputed from
    each matrix)."""
    from data.metrics import cl_metrics
    out = {}
    for m, entry in results["methods"].items():
        out[m] = {}
        for seed, run in entry["seeds"].items():
            cl = cl_metrics(run["matrix"])
            out[m][seed] = {"acc": cl["acc"], "bwt": cl["bwt"]}
    return out


def chi2_quantile(p: float, k: int) -> float:
    """The chi-square quantile by Wilson and Hilferty's cube-root normal approximation
    (within 1 % at k >= 5)."""
    z = statistics.NormalDist().inv_cdf(p)
    return k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


def std_interval(s: float, n: int) -> tuple[float, float]:
    """95 % interval of a normal sample's std s over n draws (chi-square)."""
    lo, hi = chi2_quantile(0.975, n - 1), chi2_quantile(0.025, n - 1)
    return s * ((n - 1) / lo) ** 0.5, s * ((n - 1) / hi) ** 0.5


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    args = ap.parse_args()
    results = json.loads((args.run_dir / "results.json").read_text())
    data = per_seed(results)
    seeds = sorted(set.intersection(*(set(v) for v in data.values())), key=int)
    n = len(seeds)
    print(f"{args.run_dir}: {n} seeds ({', '.join(seeds)}), methods {', '.join(data)}\n")
    print("| method | ACC | BWT | ACC std 95 % | BWT std 95 % |\n|---|---:|---:|---:|---:|")
    std = {}
    for m, by in data.items():
        cells, std[m] = [], {}
        for k in ("acc", "bwt"):
            xs = [by[s][k] for s in seeds]
            std[m][k] = round(statistics.stdev(xs), 2)
            cells.append(f"{statistics.mean(xs):.2f} ± **{std[m][k]:.2f}**")
        ivs = [std_interval(std[m][k], n) for k in ("acc", "bwt")]
        print(f"| {m} | {cells[0]} | {cells[1]} | [{ivs[0][0]:.2f}, {ivs[0][1]:.2f}] | "
              f"[{ivs[1][0]:.2f}, {ivs[1][1]:.2f}] |")
    from reporting.stats import t_quantile
    t = t_quantile(n - 1, 0.95)
    delta_std = {}
    for ref in ("replay", "sft"):
        if ref not in data:
            continue
        delta_std[ref] = {}
        print(f"\n| vs {ref}, {n} seeds | ΔACC | 95 % CI | ΔBWT | 95 % CI |\n"
              f"|---|---:|---:|---:|---:|")
        for m in data:
            if m == ref:
                continue
            row, delta_std[ref][m] = [], {}
            for k in ("acc", "bwt"):
                d = [data[m][s][k] - data[ref][s][k] for s in seeds]
                mean, sd = statistics.mean(d), statistics.stdev(d)
                delta_std[ref][m][k] = round(sd, 2)
                half = t * sd / n ** 0.5
                row += [f"{mean:+.2f}", f"[{mean - half:+.2f}, {mean + half:+.2f}]"]
            print(f"| {m} | " + " | ".join(row) + " |")
    meta = results.get("meta", {})
    weights = Path(meta.get("base", "")) / "model.safetensors"
    sha = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
    print(f"\nSEED_NOISE entry (reporting/noise.py), "
          f"numerics {meta.get('numerics', {}).get('code')}, base {sha}:")
    print(json.dumps({"seeds": n, "std": std, "delta_std": delta_std}))


if __name__ == "__main__":
    main()
