"""Metrics on hand-checked cases, SARI against HF evaluate's documented value, ACC/BWT by hand (the other codebases'
scoring conventions: tests/test_conventions.py)."""

import math

import pytest

from data.metrics import (acc_bwt, bwt_over_all_tasks, cl_metrics, code_fuzz, forgetting, forward_transfer,
                          last_number, letter_accuracy, number_accuracy, overall_performance, py150_postprocess, rouge_l,
                          sari, sari_metric, simplification_source)
from data.conventions import score


# --- letter accuracy -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pred,gold,want", [
    ("A", "A", 100), ("  B\n", "B", 100), ("C. neutral, because the text is balanced", "C", 100),
    ("B", "A", 0), ("", "A", 0), ("   ", "A", 0), ("a", "A", 0),
    ("Answer: A\nBecause wax reduces friction", "Answer: A\nBecause experiments ...", 100),  # TRACE ScienceQA
    ("Answer: B\nBecause ...", "Answer: A\nBecause ...", 0),
    ("B because fire is hot", "B because sun is hot", 100),
])
def test_letter_accuracy(pred, gold, want):
    assert letter_accuracy(pred, gold) == want
    assert score("FOMC", pred, gold) == want and score("ScienceQA", pred, gold) == want


# --- number accuracy -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("12", 12.0), ("12.", 12.0), ("The answer is 12.", 12.0), ("-1,234.5", -1234.5), ("we get -7 now", -7.0),
    ("1,234,567.89 in total", 1234567.89), ("3 apples and 4 pears: 7", 7.0), ("x-5", 5.0), ("no number", None),
    ("0.5 or .25", 0.25),
])
def test_last_number(text, want):
    assert last_number(text) == want


@pytest.mark.parametrize("pred,gold,want", [
    ("12", "12", 100), ("12.", "12", 100), ("12", "12.0", 100), ("The answer is 12.", "12", 100),
    ("first 3 then 12", "12", 100), ("12 then 3", "12", 0), ("-1,234", "-1234", 100), ("1,234", "1234", 100),
    ("-5", "5", 0), ("4.17", "4.17", 100), ("4.170", "4.17", 100), ("4.2", "4.17", 0),
    ("1.43", "1.4300000000000002", 0), ("", "12", 0), ("twelve", "12", 0),
    ("Wednesday", "Wednesday", 100), ("It is wednesday.", "Wednesday", 100), ("Tuesday", "Wednesday", 0),
    ("Wednesday.", "Wednesday.", 100), ("It is Wednesday", "Wednesday.", 100), ("x?", "x?", 100),  # gold's end stop
    ("foo (bar)", ".", 0),  # a gold of only punctuation does not match every prediction
])
def test_number_accuracy(pred, gold, want):
    assert number_accuracy(pred, gold) == want
    assert score("NumGLUE-ds", pred, gold) == want


# --- Py150 -----------------------------------------------------------------------------------------------------

def test_py150_postprocess_and_fuzz():
    assert py150_postprocess("x = <NUM_LIT> + <NUM_LIT:3> ; s = '<STR_LIT>' + '<STR_LIT:ab>' + <CHAR_LIT>") == \
        "x = 0 + 3 ; s = '' + 'ab' + "
    gold = "return val + <NUM_LIT:8>"
    assert code_fuzz(gold, gold) == 100
    assert code_fuzz("return val + 8  ", gold) == 100  # literals unmasked, outer whitespace ignored
    # rapidfuzz ratio = 100 * (1 - InDel distance / total length): "return val - 8" vs "return val + 8" -> 2/28
    assert code_fuzz("return val - 8", gold) == pytest.approx(100 * (1 - 2 / 28))
    assert code_fuzz("", gold) == 0
    assert 0 < score("Py150", "return val", gold) < 100


# --- ROUGE-L ---------------------------------------------------------------------------------------------------

def test_rouge_l():
    assert rouge_l("council approves fund of road", "council approves fund of road") == pytest.approx(100)
    # LCS "council of road" = 3 tokens, P = 3/5, R = 3/5 -> F = 60
    assert rouge_l("council rejects sale of road", "council approves fund of road") == pytest.approx(60)
    assert rouge_l("", "council approves") == 0
    assert rouge_l("totally different words", "council approves") == 0
    german = "Die Gemeinde genehmigt die Brücke über den Fluss in Zürich"
    assert rouge_l(german, german) == pytest.approx(100)
    assert 0 < score("MeetingBank", "Die Gemeinde lehnt die Brücke ab", german) < 100


# --- SARI ------------------------------------------------------------------------------------------------------

def test_sari_reproduces_hf_evaluate_example():
    s = sari("About 95 species are currently accepted .", "About 95 you now get in .",
             ["About 95 species are currently known .", "About 95 species are now accepted .",
              "95 species are now accepted ."])
    assert s == pytest.approx(26.953601953601954, abs=1e-6)


def test_sari_hand_computed():
    # source "a b c", output "a d", reference "a c":
    #   1-grams keep F1 = 2/3 (P 1, R 1/2), del P = 1/2 (b good, c bad), add F1 = 0 (d not in reference)
    #   2-grams keep 1 (0/0), del P = 1, add 0 ("a d" wrong, "a c" missed); 3-, 4-grams all 1
    #   SARI = (mean(2/3,1,1,1) + mean(1/2,1,1,1) + mean(0,0,1,1)) / 3 = (11/12 + 7/8 + 1/2) / 3 = 55/72
    assert sari("a b c", "a d", ["a c"]) == pytest.approx(100 * 55 / 72, abs=1e-9)
    # a perfect simplification scores 100
    assert sari("Anna erwarb gestern große Bücher in Zürich .", "Anna kaufte Bücher in Zürich .",
                ["Anna kaufte Bücher in Zürich ."]) == pytest.approx(100)


def test_sari_unicode_and_normalisation():
    src = "Reto verspeiste tatsächlich süße Äpfel in Zürich."
    gold = "Reto aß Äpfel in Zürich."
    # 13a tokenisation splits the final period; lowercasing makes case irrelevant
    assert sari(src, "RETO Aß ÄPFEL IN ZÜRICH .", [gold]) == pytest.approx(100)
    partial = sari(src, "Reto verspeiste Äpfel in Zürich.", [gold])
    assert 0 < partial < 100
    assert sari(src, src, [gold]) < partial  # copying the source is worse than a partial simplification


def test_sari_metric_takes_source_from_prompt():
    para = "Anna erwarb gestern große Bücher in Zürich ."
    head = "Provide a simplified version of the following paragraph in German.\n\n"
    prompt = f"{head}Paragraph:\n{para}\nSimplified version:"
    assert simplification_source(prompt) == para
    assert simplification_source(f"{head}Paragraph:\n{para}") == para
    assert simplification_source("Vereinfache: " + para) == "Vereinfache: " + para  # no marker -> whole prompt
    gold = "Anna kaufte Bücher in Zürich ."
    assert sari_metric(gold, gold, prompt) == pytest.approx(100)
    assert score("20Minuten", "Anna erwarb Bücher in Zürich .", gold, prompt) == \
        pytest.approx(sari(para, "Anna erwarb Bücher in Zürich .", [gold]))
    assert score("20Minuten", "", gold, prompt) == 0


def test_scores_in_range_and_identity():
    cases = {"C-STANCE": "B", "FOMC": "C", "MeetingBank": "the council approves the plan", "Py150": "return x",
             "ScienceQA": "A because ice is cold", "NumGLUE-cm": "1,500", "NumGLUE-ds": "-3.5",
             "20Minuten": "Lea sah Blumen in Bern ."}
    prompt = "Paragraph:\nLea erblickte gestern schöne Blumen in Bern .\nSimplified version:"
    for task, gold in cases.items():
        assert score(task, gold, gold, prompt) == pytest.approx(100), task
        for pred in ["", "zzz", "A", "12", gold[: len(gold) // 2]]:
            assert 0 <= score(task, pred, gold, prompt) <= 100
    with pytest.raises(ValueError, match="valid tasks"):
        score("Nope", "a", "a")


# --- ACC / BWT -------------------------------------------------------------------------------------------------

def test_acc_bwt_small_by_hand():
    m = [[50.0], [40.0, 60.0], [30.0, 50.0, 70.0]]
    acc, bwt = acc_bwt(m)
    assert acc == pytest.approx((30 + 50 + 70) / 3)          # 50
    assert bwt == pytest.approx(((30 - 50) + (50 - 60)) / 2)  # -15
    # full square matrix with junk above the diagonal gives the same
    full = [[50.0, None, None], [40.0, 60.0, float("nan")], [30.0, 50.0, 70.0]]
    assert acc_bwt(full) == (acc, bwt)


def test_acc_bwt_8x8():
    # a[i][j] = 80 - 5 (i - j): every task loses 5 points per later stage
    m = [[80.0 - 5 * (i - j) for j in range(i + 1)] for i in range(8)]
    acc, bwt = acc_bwt(m)
    assert acc == pytest.approx(80 - 5 * 3.5)  # mean of 45..80 = 62.5
    assert bwt == pytest.approx(-5 * 4)        # mean over j<7 of -5 (7 - j) = -20
    # positive transfer: later stages improve old tasks
    up = [[50.0 + (i - j) for j in range(i + 1)] for i in range(8)]
    assert acc_bwt(up)[1] == pytest.approx(4.0)


def test_acc_bwt_edge_cases():
    assert acc_bwt([[42.0]]) == (42.0, None)  # BWT undefined for a single task
    with pytest.raises(ValueError, match=r"row 1"):
        acc_bwt([[1.0], []])
    with pytest.raises(ValueError, match=r"\[1\]\[0\]"):
        acc_bwt([[1.0], [float("nan"), 2.0]])
    assert not math.isnan(acc_bwt([[1.0], [2.0, 3.0]])[1])


# --- row 0, FWT, forgetting, TRACE's OP and BWT ------------------------------------------------------------------

def test_cl_metrics_by_hand():
    # 4 stages; task 1 peaks after stage 2, task 2 after stage 3, task 3 improves after its own stage
    m = [[50.0],
         [70.0, 60.0],
         [40.0, 80.0, 30.0],
         [45.0, 50.0, 35.0, 90.0]]
    row0 = [10.0, 20.0, 30.0, 40.0]   # the base model on tasks 1..4
    next_task = [25.0, 35.0, 60.0]     # a(1,2), a(2,3), a(3,4): the next task before training on it
    got = cl_metrics(m, row0, next_task)
    assert got["acc"] == got["op"] == pytest.approx((45 + 50 + 35 + 90) / 4)             # 55
    assert got["bwt"] == pytest.approx(((45 - 50) + (50 - 60) + (35 - 30)) / 3)       # -10/3
    assert got["bwt_trace"] == pytest.approx(((45 - 50) + (50 - 60) + (35 - 30) + 0) / 4)  # -2.5: TRACE's 1/N
    assert got["fwt"] == pytest.approx(((25 - 20) + (35 - 30) + (60 - 40)) / 3)        # 10
    # best earlier score (not the score right after the task's own stage) minus the final one
    assert got["forgetting"] == pytest.approx([70 - 45, 80 - 50, 30 - 35])             # [25, 30, -5]
    assert got["forgetting_mean"] == pytest.approx(50 / 3)
    assert forgetting(m) == got["forgetting"] and overall_performance(m) == got["acc"]
    assert forward_transfer(row0, next_task) == got["fwt"]
    assert bwt_over_all_tasks(m) == got["bwt_trace"]


def test_cl_metrics_edge_cases():
    one = cl_metrics([[42.0]], [10.0], [])
    assert one == {"acc": 42.0, "bwt": None, "bwt_trace": None, "op": 42.0, "fwt": None, "forgetting": [],
                   "forgetting_mean": None}
    assert cl_metrics([[1.0], [2.0, 3.0]])["fwt"] is None  # no row 0: no FWT
    with pytest.raises(ValueError, match="next_task: 1 entries, expected 2"):
        forward_transfer([1.0, 2.0, 3.0], [1.0])
    with pytest.raises(ValueError, match=r"row0: entry \[1\]"):
        forward_transfer([1.0, float("nan")], [1.0])
