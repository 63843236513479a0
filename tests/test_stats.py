"""reporting/stats.py and reporting/diagnostics.py on hand-made data: exact t quantiles against published table values,
t-intervals and paired differences against hand-computed numbers, the test-set bootstrap (deterministic, the
identity resample equals acc_bwt, paired differences cancel shared noise, coverage near 95% on a known
population), where the seed variance of a mean over tasks comes from (hand-computed covariances, the two limits of
the test-prompt part), and the collapse / empty / length-capped diagnostics on hand-made predictions."""
import math
import statistics

import numpy as np
import pytest

from reporting.diagnostics import COLLAPSE_RATE, OFF_FORMAT_WARN, answer_shape, diagnose, is_letter_answer, warnings
from data.metrics import acc_bwt, letter_accuracy
from reporting.stats import (bootstrap_acc_bwt, bootstrap_indices, excludes_zero, known_std_interval, mean_std, noise_sources,
                        paired_differences, percentile_interval, t_interval, t_quantile)

# two-sided 95% (= one-sided 0.975) Student-t quantiles, from any printed t table
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646, 8: 2.3060, 9: 2.2622,
        10: 2.2281, 15: 2.1314, 20: 2.0860, 30: 2.0423, 60: 2.0003, 120: 1.9799}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_the_table(df):
    assert t_quantile(df) == pytest.approx(T975[df], abs=6e-5)


def test_t_quantile_other_levels_and_bad_df():
    assert t_quantile(1, 0.5) == pytest.approx(1.0, abs=1e-9)  # Cauchy: P(|T| <= 1) = 1/2
    assert t_quantile(2, 0.90) == pytest.approx(2.9200, abs=1e-4)
    assert t_quantile(10, 0.99) == pytest.approx(3.1693, abs=1e-4)
    for bad in (0, 2.5, -1):
        with pytest.raises(ValueError, match="df must be a positive integer"):
            t_quantile(bad)


def test_mean_std_is_the_sample_std():
    assert mean_std([67, 71]) == {"mean": 69.0, "std": pytest.approx(2 * math.sqrt(2)), "n": 2}
    assert mean_std([1, 2, 3, 4, 5]) == {"mean": 3.0, "std": pytest.approx(math.sqrt(2.5)), "n": 5}
    assert mean_std([7.5]) == {"mean": 7.5, "std": None, "n": 1}


def test_t_interval_by_hand():
    # mean 3, sample std sqrt(2.5), half width t(0.975, 4) * sqrt(2.5) / sqrt(5) = 2.776445 * 0.707107 = 1.963243
    lo, hi = t_interval([1, 2, 3, 4, 5])
    assert lo == pytest.approx(3 - 1.963243, abs=1e-5) and hi == pytest.approx(3 + 1.963243, abs=1e-5)
    assert t_interval([4.0]) is None
    assert t_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)


def test_known_std_interval_by_hand():
    # one value -2.5, std 2.07 measured on 10 other seeds: -2.5 -/+ t(0.975, 9) * 2.07 = -2.5 -/+ 2.2622 * 2.07
    lo, hi = known_std_interval([-2.5], 2.07, 10)
    assert (lo, hi) == pytest.approx((-2.5 - 4.68275, -2.5 + 4.68275), abs=1e-4)
    # four values: the mean's interval, half as wide
    assert known_std_interval([1, 2, 3, 4], 2.0, 5) == pytest.approx((2.5 - 2.7764, 2.5 + 2.7764), abs=1e-4)
    assert known_std_interval([], 1.0, 10) is None


def test_paired_differences_and_their_interval_by_hand():
    a = {"0": 70.0, "1": 75.0, "2": 72.0}
    b = {"0": 68.0, "1": 70.0, "2": 71.0, "3": 99.0}  # seed 3 has no partner: left out
    d = paired_differences(a, b)
    assert d == {"0": 2.0, "1": 5.0, "2": 1.0}
    # mean 8/3, sample std sqrt(39/9) = 2.081666, half width 4.302653 * 2.081666 / sqrt(3) = 5.171145
    lo, hi = t_interval(d.values())
    assert lo == pytest.approx(8 / 3 - 5.171145, abs=1e-5) and hi == pytest.approx(8 / 3 + 5.171145, abs=1e-5)
    assert not excludes_zero((lo, hi)) and excludes_zero((0.1, 3)) and excludes_zero((-3, -0.1))
    assert not excludes_zero(None) and not excludes_zero((0.0, 1.0))


def runs_of(matrices_of_examples):
    return [[[list(map(float, ex)) for ex in row] for row in m] for m in matrices_of_examples]


def test_bootstrap_indices_are_deterministic():
    a = bootstrap_indices({"A": 5, "B": 3}, B=50, seed=7)
    b = bootstrap_indices({"A": 5, "B": 3}, B=50, seed=7)
    c = bootstrap_indices({"A": 5, "B": 3}, B=50, seed=8)
    assert a["A"].shape == (50, 5) and a["B"].shape == (50, 3)
    assert all(np.array_equal(a[t], b[t]) for t in a) and not np.array_equal(a["A"], c["A"])
    assert a["A"].min() >= 0 and a["A"].max() == 4 and a["B"].max() == 2


def test_identity_resample_equals_acc_bwt():
    tasks = ["A", "B", "C"]
    run = runs_of([[[[100, 0, 100, 0]],
                    [[0, 0, 100, 0], [50, 50, 100, 100]],
                    [[100, 100, 0, 0], [0, 0, 0, 40], [10, 20, 30, 40]]]])[0]
    identity = {t: np.arange(4)[None, :] for t in tasks}
    got = bootstrap_acc_bwt([run], tasks, identity)
    matrix = [[sum(ex) / len(ex) for ex in row] for row in run]
    acc, bwt = acc_bwt(matrix)
    assert got["acc"].shape == (1,) and got["acc"][0] == pytest.approx(acc) and got["bwt"][0] == pytest.approx(bwt)
    # two seeds: the mean of their ACC/BWT
    run2 = [[[v / 2 for v in ex] for ex in row] for row in run]
    got2 = bootstrap_acc_bwt([run, run2], tasks, identity)
    acc2, bwt2 = acc_bwt([[sum(ex) / len(ex) for ex in row] for row in run2])
    assert got2["acc"][0] == pytest.approx((acc + acc2) / 2) and got2["bwt"][0] == pytest.approx((bwt + bwt2) / 2)
    assert bootstrap_acc_bwt([run[:1]], tasks, identity)["bwt"] is None  # one stage: BWT undefined


def test_paired_bootstrap_cancels_the_noise_both_methods_share():
    """Method B scores exactly 10 points above method A on every test example: each method's ACC interval is wide
    (the examples differ a lot), but the paired difference is 10 in every resample."""
    rng = np.random.default_rng(0)
    tasks = ["A", "B"]
    base = rng.uniform(0, 80, size=(2, 2, 60))  # [stage, task, example]
    run_a = [[list(base[i, j]) for j in range(i + 1)] for i in range(2)]
    run_b = [[list(base[i, j] + 10) for j in range(i + 1)] for i in range(2)]
    idx = bootstrap_indices({"A": 60, "B": 60}, B=400, seed=0)
    a, b = bootstrap_acc_bwt([run_a], tasks, idx), bootstrap_acc_bwt([run_b], tasks, idx)
    lo, hi = percentile_interval(a["acc"])
    assert hi - lo > 5  # per-method: the spread of the test set
    assert np.allclose(b["acc"] - a["acc"], 10.0) and np.allclose(b["bwt"] - a["bwt"], 0.0)
    d = percentile_interval(b["acc"] - a["acc"])
    assert d == pytest.approx((10.0, 10.0)) and excludes_zero(d)


def test_bootstrap_interval_width_and_coverage_on_a_known_population():
    """Test sets of n = 100 prompts scored 0/100 with success probability 0.3 (true ACC 30), one task, one stage:
    the percentile interval's half width is near 1.96 * 100 * sqrt(0.3 * 0.7 / 100) = 8.98, and over 200 fresh test
    sets it contains 30 about 95% of the time."""
    rng = np.random.default_rng(123)
    idx = bootstrap_indices({"A": 100}, B=500, seed=1)
    covered, widths = 0, []
    for _ in range(200):
        scores = (rng.random(100) < 0.3) * 100.0
        lo, hi = percentile_interval(bootstrap_acc_bwt([[[list(scores)]]], ["A"], idx)["acc"])
        covered += lo <= 30 <= hi
        widths.append((hi - lo) / 2)
    assert 0.90 <= covered / 200 <= 0.99, covered
    assert np.median(widths) == pytest.approx(8.98, rel=0.1)


def test_percentile_interval_by_hand():
    assert percentile_interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))  # numpy's linear rule
    assert percentile_interval([3.0] * 10) == (3.0, 3.0)


# ---------------------------------------------------------------------------------------------------------------
# diagnostics


def rec(prediction, gold, finish="stop", tokens=3):
    """A prediction record as evaluate.py writes it, scored by the lenient first-character rule."""
    return {"prediction": prediction, "gold": gold, "finish_reason": finish, "num_tokens": tokens,
            "score": letter_accuracy(prediction, gold)}


def test_noise_sources_by_hand():
    # 3 seeds x 2 tasks. Row means 1.5, 2.5, 6.5 -> var ((-2)^2 + (-1)^2 + 3^2) / 2 = 7. Task variances 4 and 12,
    # covariance ((1-3)(2-4) + 0 + (5-3)(8-4)) / 2 = 6: shares (4 + 6) / 4 / 7 = 5/14 and (12 + 6) / 4 / 7 = 9/14.
    ns = noise_sources([[1, 2], [3, 2], [5, 8]])
    assert ns["n"] == 3 and ns["std"] == pytest.approx(math.sqrt(7))
    assert ns["task_std"] == pytest.approx([2.0, math.sqrt(12)])
    assert ns["share"] == pytest.approx([5 / 14, 9 / 14])
    assert ns["prompt"] is None and ns["floor"] is None
    # with per-example scores: task 0's prompts (1, 3) and (2, 3) over the 2 seeds vary by 2 and 0.5; task 1 not at
    # all: prompt part (2 + 0.5) / 2^2 / 2^2 = 0.15625 of var ((1.75 - 2.5)^2 * 2 / 1 / 4 =) 0.28125
    ns = noise_sources([[1.5, 2], [3, 2]], [[[1, 2], [2, 2]], [[3, 3], [2, 2]]])
    assert ns["std"] == pytest.approx(math.sqrt(0.28125)) and ns["share"] == pytest.approx([1.0, 0.0])
    assert ns["prompt"] == pytest.approx(0.15625) and ns["floor"] == pytest.approx(math.sqrt(0.125))
    assert noise_sources([[1, 2]]) is None  # one seed: no spread


def test_noise_sources_std_and_shares_on_random_data():
    v = np.random.default_rng(0).normal(50, 5, size=(7, 5))
    ns = noise_sources(v)
    assert ns["std"] == pytest.approx(statistics.stdev(v.mean(axis=1)))
    assert sum(ns["share"]) == pytest.approx(1.0)
    assert ns["task_std"] == pytest.approx(v.std(axis=0, ddof=1))


def test_noise_sources_test_prompt_part_at_its_two_limits():
    rng = np.random.default_rng(1)
    # one task whose prompts all move with the seed (a seed that learned the task better): each prompt varies as
    # much as the task mean, so the prompt part is var / P exactly and the floor sqrt(var (1 - 1/P))
    base, shift = rng.normal(60, 10, size=(1, 1, 8)), rng.normal(0, 3, size=(6, 1, 1))
    ex = base + shift
    ns = noise_sources(ex.mean(axis=2), ex)
    var = ns["std"] ** 2
    assert ns["prompt"] == pytest.approx(var / 8)
    assert ns["floor"] == pytest.approx(math.sqrt(var * (1 - 1 / 8)))
    # every seed gets the same scores on other prompts (a permutation): the task means never move, all of the
    # prompts' variation averages out, and the floor is 0 (not the square root of a negative number)
    perm = np.stack([rng.permutation(base[0, 0]) for _ in range(6)])[:, None, :]
    ns = noise_sources(perm.mean(axis=2), perm)
    assert ns["std"] == pytest.approx(0, abs=1e-9) and ns["prompt"] > 1 and ns["floor"] == 0.0
    assert ns["share"] is None


def test_noise_sources_rejects_mismatched_examples():
    with pytest.raises(ValueError, match="average to its values"):
        noise_sources([[1, 2], [3, 4]], [[[1], [2]], [[3], [5]]])
    with pytest.raises(ValueError, match="like values"):
        noise_sources([[1, 2], [3, 4]], [[[1], [2]]])
    with pytest.raises(ValueError, match=r"\[seeds\]\[tasks\]"):
        noise_sources([1, 2, 3])


def test_collapsed_classification_task_is_flagged():
    # FOMC: 19 of 20 answers "C" (one "Answer: C" counts as C too), gold is 50% A, 30% B, 20% C
    golds = ["A"] * 10 + ["B"] * 6 + ["C"] * 4
    preds = ["C"] * 18 + ["Answer: C"] + ["B"]
    d = diagnose("FOMC", [rec(p, g) for p, g in zip(preds, golds)])
    assert d["n"] == 20 and d["top_label"] == "C" and d["top_rate"] == 0.95 and d["gold_majority_rate"] == 0.5
    assert d["labels"] == {"C": 0.95, "B": 0.05} and d["gold_labels"] == {"A": 0.5, "B": 0.3, "C": 0.2}
    assert d["collapsed"] is True
    assert warnings(d) == ["predictions collapsed to 'C' (95% of answers, 20% of the gold answers; gold majority "
                           "class 50%)"]


def test_collapse_needs_a_balanced_gold_and_a_real_label():
    # answering the majority class of a test set that is itself 95% "A" is not flagged
    d = diagnose("C-STANCE", [rec("A", "A")] * 19 + [rec("A", "B")])
    assert d["top_rate"] == 1.0 and d["gold_majority_rate"] == 0.95 and d["collapsed"] is False
    # ... but answering that test set (or a one-label one) with another label throughout is
    wrong = diagnose("C-STANCE", [rec("C", "A")] * 19 + [rec("C", "B")])
    assert wrong["top_label"] == "C" and wrong["gold_majority_rate"] == 0.95 and wrong["collapsed"] is True
    assert diagnose("FOMC", [rec("B", "A")] * 20)["collapsed"] is True
    # exactly at the threshold counts; just below does not
    n = 10
    at = diagnose("ScienceQA", [rec("B", "A" if k % 2 else "B") for k in range(n - 1)] + [rec("A", "A")])
    assert at["top_rate"] == COLLAPSE_RATE and at["collapsed"] is True
    below = diagnose("ScienceQA", [rec("B", "A" if k % 2 else "B") for k in range(n - 2)] + [rec("A", "A")] * 2)
    assert below["top_rate"] == 0.8 and below["collapsed"] is False
    # all empty: the empty label "" is not a collapse, the empty rate says it
    e = diagnose("FOMC", [rec("  ", g) for g in "ABCA"])
    assert e["labels"] == {"": 1.0} and e["top_label"] == "" and e["collapsed"] is False and e["empty"] == 1.0
    assert warnings(e) == ["100% empty responses"]


def test_letter_alone():
    for text in ["B", " B ", "B.", "B. against", "B)", "B\n", "Answer: B", "Answer: B\nBecause it is.", "C,", "D"]:
        assert is_letter_answer(text), text
    for text in ["B (against)", "B - against", "A 5", "C\nright", "C\r\nright", "A\u2028bill"]:  # no word after a space
        assert is_letter_answer(text), text
    for text in ["Bern", "Anna sah Bücher", "BC", "B2", "Acouncil BIRD", "AAAA", "(B)", "5", ".", "", "Answer:",
                 "A bill for an ordinance", "I think it is B", "B against", "x = 1", "b", "Answer: A council", "Ä",
                 "A B", "C I think"]:
        assert not is_letter_answer(text), text
    assert [answer_shape(t) for t in ["B. against", "A bill", "Bern", ""]] == ["letter", "sentence", "other", "other"]
    # a task whose gold answers are a letter and a sentence ("C because rain is wet") accepts that shape for its
    # gold letters
    for text in ["C because rain is wet", "A bill for an ordinance", "B. against"]:
        assert is_letter_answer(text, sentences="ABC"), text
    for text in ["Bern", "(B)", "x = 1", "A5 because", "I think it is hot", "D because"]:
        assert not is_letter_answer(text, sentences="ABC"), text


def test_off_format_answers_and_their_first_character_hits():
    # a forgotten letter task answered in German (the shape the tiny default's sft gives after 20Minuten): 10 gold
    # A, 6 B, 4 C; 8 answers "Anna sah ..." (4 of them on gold-A prompts: scored 100 by the first character), 2
    # "Bern" (gold C: 0), 1 "A5" on a gold A (scored), 6 bare letters (3 right), 3 empty
    golds = ["A"] * 10 + ["B"] * 6 + ["C"] * 4
    preds = (["Anna sah Bücher in Bern ."] * 4 + ["A5", "A", "B", "", "", ""]
             + ["Anna sah Bücher in Bern ."] * 4 + ["B.", "C"]
             + ["Bern", "Bern", "C", "A"])
    d = diagnose("C-STANCE", [rec(p, g) for p, g in zip(preds, golds)])
    assert d["off_format"] == 11 / 20 and d["off_format_hits"] == 5 / 20
    assert d["off_format_example"] == "Anna sah Bücher in Bern ."
    assert sum(r["score"] for r in map(rec, preds, golds)) / 20 == 40.0  # 8 hits: 5 of them off-format
    # chance: first letters of the 11 off-format answers A 9, B 2; their gold letters A 5, B 4, C 2: (9*5 + 2*4) / 11
    # hits expected if the two were unrelated, 4.8 of 20 answers: the German answers' hits are chance
    assert d["off_format_chance"] == pytest.approx(53 / 11 / 20)
    assert warnings(d) == ["55% of answers are not a letter (most often 'Anna sah Bücher in Bern .'), 25% "
                           "of answers score by their first character alone (chance 24%)"]
    # the right letter glued to other text ("Ccouncil" to a gold C, "council" to the others): hits above chance
    cc = diagnose("FOMC", [rec("Ccouncil of school" if g == "C" else "council rejects", g) for g in "ABC" * 4])
    assert cc["off_format"] == 1.0 and cc["off_format_hits"] == 4 / 12
    assert cc["off_format_chance"] == pytest.approx(4 * 4 / 12 / 12)  # first C 4, c 8; gold A 4, B 4, C 4
    assert warnings(cc) == ["100% of answers are not a letter (most often 'council rejects'), 33% of answers score "
                            "by their first character alone (chance 11%)"]
    # off-format answers that never score (TRACE's whole-string rule, or wrong first characters): no hits clause
    below = [rec(p, g) for p, g in zip(["Bern"] * 4 + ["A"] * 16, ["A"] * 20)]
    assert diagnose("FOMC", below)["off_format"] == 0.2 == OFF_FORMAT_WARN
    assert warnings(diagnose("FOMC", below)) == ["20% of answers are not a letter (most often 'Bern')"]
    assert warnings(diagnose("FOMC", below[1:] + [rec("A", "A")])) == []  # 15%: below the threshold
    # a share of hits that rounds to 0% still reads as a share: 1 of 300 answers
    few = diagnose("FOMC", [rec("Bern", "B")] + [rec("Bern", "A")] * 99 + [rec("A", "A")] * 200)
    assert few["off_format_hits"] == 1 / 300 and warnings(few) == [
        "33% of answers are not a letter (most often 'Bern'), 0.3% of answers score by their first character alone "
        "(chance 0.3%)"]
    # a letter is in format, right or wrong: "D" to every prompt is a collapse, not off-format
    dd = diagnose("ScienceQA", [rec("D", g) for g in "ABCABC"])
    assert dd["off_format"] == 0.0 and dd["off_format_example"] == "" and dd["collapsed"] is True
    assert warnings(dd) == ["predictions collapsed to 'D' (100% of answers, 0% of the gold answers; gold "
                            "majority class 33%)"]
    # German answers throughout read 'A' or 'B' by their first character: off-format, not a collapse to 'A'
    g = diagnose("FOMC", [rec("Anna sah Bücher", "A")] * 19 + [rec("B", "B")])
    assert g["labels"] == {"A": 0.95, "B": 0.05} and g["top_label"] == "B" and g["top_rate"] == 0.05
    assert g["collapsed"] is False and g["off_format"] == 0.95 and g["off_format_hits"] == 0.95
    # nor is an English sentence that opens with a one-letter word ('A bill ...', the shape of MeetingBank's answers)
    bill = diagnose("C-STANCE", [rec("A bill for an ordinance", "A")] * 10 + [rec("I think so", "B")] * 10)
    assert bill["off_format"] == 1.0 and bill["top_label"] == "" and bill["collapsed"] is False
    # the gold answers' shape decides whether a letter and a sentence is in format: the embedded ScienceQA's gold
    # answers read "C because rain is wet", so "B because snow is cold" is a letter there (and "A bill ..." reads as
    # an 'A'); FOMC's are letters alone, so an FOMC answer in ScienceQA's shape is off-format (scored by its 'A')
    sq = diagnose("ScienceQA", [rec("B because snow is cold", "B because snow is cold"),
                                rec("A bill for an ordinance", "C because rain is wet"), rec("Bern", "A because x"),
                                rec("I think so", "A because x")])  # 'I' is no gold letter: off-format
    assert sq["off_format"] == 2 / 4 and sq["off_format_example"] == "Bern" and sq["labels"] == {
        "B": 2 / 4, "A": 1 / 4, "I": 1 / 4} and sq["top_label"] == "A" and sq["top_rate"] == 1 / 4
    fomc = diagnose("FOMC", [rec("A because rain is wet", "A")] * 3 + [rec("B", "B")])
    assert fomc["off_format"] == 0.75 == fomc["off_format_hits"] == fomc["off_format_chance"]
    assert fomc["top_label"] == "B"
    # not a classification task: no off-format numbers
    assert "off_format" not in diagnose("NumGLUE-cm", [rec("Anna 12", "12")])


def test_empty_and_length_capped_rates_on_every_task():
    records = [rec("", "12", "stop", 0), rec("12", "12", "length", 40), rec("1", "12", "length", 40),
               rec("x", "12", "stop", 1)]
    d = diagnose("NumGLUE-cm", records)
    assert d == {"n": 4, "empty": 0.25, "length_capped": 0.5, "mean_tokens": 20.25}  # no labels: not classification
    assert warnings(d) == ["25% empty responses", "50% of responses hit the max-new-tokens cap"]
    assert warnings(diagnose("Py150", [rec("a", "b")] * 9 + [rec("", "b")])) == []  # 10% empty: below EMPTY_WARN
    with pytest.raises(ValueError, match="no predictions for task 'FOMC'"):
        diagnose("FOMC", [])
