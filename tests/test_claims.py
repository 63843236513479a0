"""The paper's claims on hand-built results.json files (reporting/claims.py): each verdict (holds, contradicted,
unresolved, not testable) where the numbers say so, the percent cut of |BWT| and both its intervals against naive
math, and a run without the methods a claim needs saying which."""
import math
import statistics

import numpy as np
import pytest

from reporting.claims import MATCH_PP, claims, claims_section, percent_cut
from reporting.stats import BOOTSTRAP_B, BOOTSTRAP_SEED, bootstrap_indices

TASKS = ["C-STANCE", "MeetingBank"]
T975_2 = 4.302652729911275  # Student's t, 0.975 quantile, 2 degrees of freedom (tables)


def run2(a00, a10, a11, drift=None, examples=None) -> dict:
    """A 2-stage run: BWT = a10 - a00, ACC = (a10 + a11) / 2."""
    r = {"matrix": [[a00], [a10, a11]]}
    if drift is not None:
        r["drift"] = [{"stage": 2, "tasks": {"C-STANCE": {"mean_seq_kl": drift}}, "all": {"n": 4, "mean_seq_kl": drift, "median_seq_kl": drift,
                                                         "kl_per_token": drift, "mean_tokens": 1}}]
    if examples is not None:
        r["example_scores"] = examples
    return r


def results(methods: dict, rho="0.5") -> dict:
    return {"tasks": TASKS, "methods": {m: {"seeds": dict(runs)} for m, runs in methods.items()},
            "meta": {"cfg": {"rho": rho}}}


def by_claim(rows, claim, where=None):
    hits = [r for r in rows if r["claim"] == claim and (where is None or r["where"] == where)]
    assert len(hits) == 1, hits
    return hits[0]


# replay forgets 10 +- 1, opr-ru 5 +- 1 (BWT), over 3 seeds
REPLAY = {"0": run2(90, 80, 90), "1": run2(90, 81, 90), "2": run2(90, 79, 90)}
OPR_RU = {"0": run2(90, 85, 90), "1": run2(90, 84, 90), "2": run2(90, 86, 90)}


def test_percent_cut_and_its_seed_interval_against_naive_math():
    a, b = {"0": -5.0, "1": -6.0, "2": -4.0}, {"0": -10.0, "1": -9.0, "2": -11.0}
    r = (5 + 6 + 4) / (10 + 9 + 11)
    resid = [5 - r * 10, 6 - r * 9, 4 - r * 11]
    half = T975_2 * statistics.stdev(resid) / (math.sqrt(3) * 10)
    value, ci = percent_cut(a, b)
    assert value == pytest.approx(100 * (1 - r))
    assert ci == pytest.approx((100 * (1 - r - half), 100 * (1 - r + half)))
    assert percent_cut({"0": -5.0}, {"0": -10.0}) == (50.0, None)  # one seed: no interval


def test_c1_holds_with_the_cut_and_its_test_prompt_interval_against_naive_math():
    # per-example scores (4 prompts per task) whose means are the matrix entries
    def ex(a00, a10, a11):
        col = lambda m: [m - 1, m + 1, m - 2, m + 2]  # noqa: E731 (mean m)
        return run2(a00, a10, a11, examples=[[col(a00)], [col(a10), col(a11)]])
    rep = {"0": ex(90, 80, 90), "1": ex(90, 81, 90), "2": ex(90, 79, 90)}
    opr = {"0": ex(90, 85, 90), "1": ex(90, 84, 90), "2": ex(90, 86, 90)}
    res = results({"replay": rep, "opr-ru": opr})
    res["test_idx"] = {t: [0, 1, 2, 3] for t in TASKS}
    row = by_claim(claims(res), "C1")
    assert row["where"] == "rho 0.5" and row["verdict"] == "holds"
    assert row["value"] == pytest.approx(100 * (1 - 15 / 30))
    # naive: every resample's BWT per seed (the same prompts for both methods), the cut of their seed means
    idx = bootstrap_indices({t: 4 for t in TASKS}, BOOTSTRAP_B, BOOTSTRAP_SEED)

    def bwt(run):
        s = run["example_scores"]
        return np.array(s[1][0])[idx["C-STANCE"]].mean(1) - np.array(s[0][0])[idx["C-STANCE"]].mean(1)
    cut = 100 * (1 - np.mean([np.abs(bwt(opr[k])) for k in opr], 0) / np.mean([np.abs(bwt(rep[k])) for k in rep], 0))
    assert row["test"] == pytest.approx(tuple(np.quantile(cut, [0.025, 0.975])))
    assert row["seeds"][0] > 0


def test_c1_contradicted_unresolved_and_not_testable():
    half = {"0": run2(90, 85, 90), "1": run2(90, 84, 90), "2": run2(90, 86, 90)}  # BWT -5, -6, -4
    double = {"0": run2(90, 80, 90), "1": run2(90, 78, 90), "2": run2(90, 82, 90)}  # opr-ru forgets twice as much
    row = by_claim(claims(results({"replay": half, "opr-ru": double})), "C1")
    assert row["verdict"] == "contradicted" and row["value"] == pytest.approx(-100.0)
    noisy = {"0": run2(90, 80, 90), "1": run2(90, 95, 90), "2": run2(90, 70, 90)}  # cut spans 0 over seeds
    assert by_claim(claims(results({"replay": REPLAY, "opr-ru": noisy})), "C1")["verdict"] == "unresolved"
    gain = {s: run2(80, 82, 90) for s in "012"}  # replay does not forget: nothing to cut
    row = by_claim(claims(results({"replay": gain, "opr-ru": OPR_RU})), "C1")
    assert row["verdict"] == "not testable" and "replay does not forget here (BWT +2.00)" in row["why"]
    row = by_claim(claims(results({"replay": REPLAY, "sft": REPLAY})), "C1")
    assert row["verdict"] == "not testable" and row["why"] == "needs opr-ru and replay"


def test_c2_needs_two_budgets_and_compares_the_ranges():
    row = by_claim(claims(results({"replay": REPLAY, "opr-ru": OPR_RU})), "C2")
    assert row["verdict"] == "not testable" and "2 budgets or more" in row["why"]
    # replay's ACC moves by 5 between the budgets, opr-ru's by 0.5: per seed, range(opr) - range(replay) = -4.5
    flat = {s: run2(90, 85, 90) for s in "012"}
    flat2 = {s: run2(90, 86, 90) for s in "012"}
    swing = {s: run2(90, 80 + int(s), 90) for s in "012"}
    swing2 = {s: run2(90, 90 + int(s), 90) for s in "012"}
    res = results({"replay@0.01": swing, "replay@0.1": swing2, "opr-ru@0.01": flat, "opr-ru@0.1": flat2},
                  rho="0.01,0.1")
    row = by_claim(claims(res), "C2")
    assert row["where"] == "rho 0.01, 0.1" and row["value"] == pytest.approx(0.5 - 5.0)
    assert row["verdict"] == "holds"


def test_c3_holds_and_is_contradicted():
    low = {s: run2(90, 70 + int(s), 90) for s in "012"}  # forgets 20: more than both
    row = by_claim(claims(results({"replay": REPLAY, "opr-ru": OPR_RU, "opr-low": low})), "C3")
    assert row["verdict"] == "holds"
    assert row["value"] == pytest.approx([-19 - (-5), -19 - (-10)])  # opr-low - opr-ru, opr-low - replay
    kind = {s: run2(90, 89 + int(s) * 0.1, 90) for s in "012"}  # forgets ~1: less than both
    row = by_claim(claims(results({"replay": REPLAY, "opr-ru": OPR_RU, "opr-low": kind})), "C3")
    assert row["verdict"] == "contradicted"
    row = by_claim(claims(results({"replay": REPLAY, "opr-ru": OPR_RU})), "C3")
    assert row["verdict"] == "not testable" and row["why"] == "needs opr-low, opr-ru and replay at one budget"


def test_c4_match_is_within_the_margin():
    same = {"0": run2(90, 85.1, 90), "1": run2(90, 84.1, 90), "2": run2(90, 86.1, 90)}  # opr-ru + 0.1
    row = by_claim(claims(results({"opr-ru": OPR_RU, "opr-sc": same})), "C4")
    assert row["verdict"] == "holds"
    far = {s: run2(90, 60 + int(s), 60) for s in "012"}  # ACC 15+ below, BWT 25 below
    assert by_claim(claims(results({"opr-ru": OPR_RU, "opr-sc": far})), "C4")["verdict"] == "contradicted"
    near = {"0": run2(90, 85, 90), "1": run2(90, 85 + 3 * MATCH_PP, 90), "2": run2(90, 85 - 3 * MATCH_PP, 90)}
    assert by_claim(claims(results({"opr-ru": OPR_RU, "opr-sc": near})), "C4")["verdict"] == "unresolved"


def test_c5_concentration_on_the_large_shift_task():
    # sdft loses 30 on MeetingBank (task 2, a11) and 0 on C-STANCE against replay; opr-ru matches replay there
    sdft = {s: run2(90, 80 + [0, 1, -1][int(s)], 60 + int(s)) for s in "012"}
    opr = {s: run2(90, 80 + [0, 1, -1][int(s)], 90 + 0.1 * int(s)) for s in "012"}
    row = by_claim(claims(results({"replay": REPLAY, "sdft": sdft, "opr-ru": opr})), "C5")
    assert row["verdict"] == "holds" and row["value"] == pytest.approx(-29.0)
    other = results({"replay": REPLAY, "sdft": sdft})
    other["tasks"] = ["C-STANCE", "FOMC"]
    row = by_claim(claims(other), "C5")
    assert row["verdict"] == "not testable" and "MeetingBank" in row["why"]


def test_c6_kl_lower_and_forgetting_growing_with_it():
    rep = {s: run2(90, 80 - int(s), 90, drift=2.0 + 0.1 * int(s)) for s in "012"}
    opr = {s: run2(90, 88 - int(s), 90, drift=0.5 + 0.1 * int(s)) for s in "012"}
    row = by_claim(claims(results({"replay": rep, "opr-ru": opr})), "C6")
    assert row["value"] == pytest.approx(-1.5) and row["verdict"] == "holds"
    row = by_claim(claims(results({"replay": REPLAY, "opr-ru": OPR_RU})), "C6")
    assert row["verdict"] == "not testable" and "drift" in row["why"]


def test_the_report_section_escapes_the_bars_of_abs_bwt():
    lines = claims_section(claims(results({"replay": REPLAY, "opr-ru": OPR_RU})))
    table = [l for l in lines if l.startswith("| C")]
    assert len(table) == 6 and all(l.replace("\\|", "").count("|") == 6 for l in table)


def test_a_resample_where_replay_forgets_nothing_leaves_the_cut_without_a_test_interval():
    """Replay forgets on one prompt of four only: some resamples of the test prompts hold none of it, and the cut
    (|BWT| over replay's |BWT|) is undefined there. The claim keeps its seed interval, and nothing non-finite
    reaches results.json (run.py writes it strictly)."""
    def ex(drop):
        before, after = [100, 100, 100, 100], [100 - drop, 100, 100, 100]
        return run2(100, 100 - drop / 4, 100, examples=[[before], [after, [100] * 4]])
    res = results({"replay": {s: ex(40 + int(s)) for s in "012"}, "opr-ru": {s: ex(20 + int(s)) for s in "012"}})
    res["test_idx"] = {t: [0, 1, 2, 3] for t in TASKS}
    row = by_claim(claims(res), "C1")
    assert row["test"] is None and row["seeds"] is not None and row["verdict"] == "holds"
    import json
    json.dumps(claims(res), allow_nan=False)
