"""The three scoring conventions (lenient / paper = the official OPR code's tools/eval.py / trace = TRACE's metrics.py)
on cases that separate them, and the ports of the `rouge` and fuzzywuzzy packages against the packages themselves when
installed."""

import subprocess
import sys
from pathlib import Path

import pytest

from data.conventions import fuzzywuzzy_ratio, literal_py150_postprocess, pltrdy_rouge_l_f
from data.conventions import SCORINGS, score
from data.metrics import sari


# --- scoring conventions: lenient (default) / paper (official OPR code) / trace (TRACE) -------------------------

@pytest.mark.parametrize("task,pred,gold,want", [
    # classification. paper: raw first characters equal; trace: whole strings equal (ScienceQA: first characters)
    ("FOMC", "B", "B", (100, 100, 100)),
    ("FOMC", " B", "B", (100, 0, 0)),                                  # a leading space: only lenient strips it
    ("FOMC", "B. The stance is hawkish", "B", (100, 100, 0)),          # trace wants the bare label
    ("FOMC", "Answer: B", "A", (0, 100, 0)),                           # paper compares "A"nswer with "A"
    ("C-STANCE", "", "A", (0, 0, 0)),
    ("ScienceQA", "B\nBecause ice floats", "B\nBecause water expands", (100, 100, 100)),
    ("ScienceQA", "Answer: B\nBecause ...", "B\nBecause ...", (100, 0, 0)),
    ("ScienceQA", "Bbecause", "B\nBecause", (100, 100, 100)),
    # NumGLUE. paper: the last -?[0-9.,]+ string equals the gold string; trace: whole strings equal
    ("NumGLUE-cm", "12", "12", (100, 100, 100)),
    ("NumGLUE-cm", "The answer is 12.", "12", (100, 0, 0)),            # paper reads "12."
    ("NumGLUE-cm", "12.0", "12", (100, 0, 0)),
    ("NumGLUE-cm", "1,234", "1234", (100, 0, 0)),
    ("NumGLUE-cm", "so 3 apples, total 12", "12", (100, 100, 0)),      # matches "3", ",", "12"
    ("NumGLUE-ds", "12, I think", "12", (100, 0, 0)),                  # paper reads "12,"
    ("NumGLUE-ds", "x-5", "-5", (0, 100, 0)),                          # lenient does not read x-5 as -5
    ("NumGLUE-ds", "it is . then", ".", (0, 100, 0)),                  # all matches invalid -> the first one
    ("NumGLUE-cm", "It is wednesday.", "Wednesday", (100, 0, 0)),      # word answers: lenient only
    ("NumGLUE-cm", "Wednesday", "Wednesday", (100, 0, 100)),
    # Py150. paper/trace: fuzzywuzzy's integer ratio on the raw un-masked strings; trace: empty -> 0
    ("Py150", "abc", "abd", (100 * 4 / 6, 67, 67)),
    ("Py150", " x=1", "x=1", (100, 86, 86)),                           # InDel 1 over 7 characters -> 85.7 -> 86
    ("Py150", "", "<STR_LIT>", (0, 100, 0)),                           # both un-mask to "": fuzz.ratio("", "") = 100
    ("Py150", "x = <NUM_LIT:3>", "x = 3", (100, 100, 100)),
    # MeetingBank. lenient = paper = rouge_score (lower-cased [a-z0-9] tokens); trace = the `rouge` package: words
    # split on spaces, case-sensitive, sets of words. gold (its hypothesis) {the, council, approved, budget}: n = 4;
    # prediction {The, council, approved, the, budget}: m = 5; union LCS {council, approved, the, budget} = 4;
    # R = 4/5, P = 4/4 -> F = 2 * 0.8 / 1.8
    ("MeetingBank", "The council approved the budget", "the council approved the budget.", (100, 100, 800 / 9)),
    ("MeetingBank", "...", "the council approved", (0, 0, 0)),         # no sentence: the package raises; 0
])
def test_scoring_conventions_separate(task, pred, gold, want):
    got = tuple(score(task, pred, gold, "", scoring=s) for s in SCORINGS)
    assert got == pytest.approx(want), dict(zip(SCORINGS, got))


def test_scoring_conventions_sari_source():
    # the three conventions differ only in where SARI's source comes from
    para = "Anna erwarb gestern große Bücher in Zürich ."
    gold, pred = "Anna kaufte Bücher in Zürich .", "Anna erwarb Bücher in Zürich ."
    embedded = f"Provide a simplified version.\n\nParagraph:\n{para}\nSimplified version:"
    official = f"Provide a simplified version.\n\nParagraph:\n{para}\n\nSimplification:"
    assert score("20Minuten", pred, gold, embedded, scoring="lenient") == pytest.approx(sari(para, pred, [gold]))
    # paper: between "Paragraph:\n" and "\n\nSimplification:" (the embedded cue line stays in the source)
    assert score("20Minuten", pred, gold, official, scoring="paper") == pytest.approx(sari(para, pred, [gold]))
    assert score("20Minuten", pred, gold, embedded, scoring="paper") == \
        pytest.approx(sari(f"{para}\nSimplified version:", pred, [gold]))
    # trace: the whole prompt
    assert score("20Minuten", pred, gold, official, scoring="trace") == pytest.approx(sari(official, pred, [gold]))
    # a prediction that keeps the prompt's own words tells the three sources apart
    keeps = "Anna erwarb Bücher in Zürich . Simplified version"
    got = [score("20Minuten", keeps, gold, embedded, scoring=s) for s in SCORINGS]
    assert got == pytest.approx([sari(para, keeps, [gold]), sari(f"{para}\nSimplified version:", keeps, [gold]),
                                 sari(embedded, keeps, [gold])])
    assert len({round(g, 6) for g in got}) == 3
    # an empty prediction is not skipped by either source (lenient scores it 0)
    assert score("20Minuten", "", gold, official, scoring="trace") == pytest.approx(sari(official, "", [gold]))
    with pytest.raises(ValueError, match="Paragraph"):
        score("20Minuten", pred, gold, "Vereinfache: " + para, scoring="paper")
    with pytest.raises(ValueError, match="unknown scoring 'strict'.*lenient, paper, trace"):
        score("FOMC", "A", "A", scoring="strict")


def test_literal_py150_postprocess_replaces_in_turn():
    assert literal_py150_postprocess("x = <NUM_LIT> + <NUM_LIT:3> ; s = '<STR_LIT>' + '<STR_LIT:ab>'") == \
        "x = 0 + 3 ; s = '' + 'ab'"
    # each literal found is str.replace'd everywhere in turn, like TRACE's loop: the same result as one re.sub here
    assert literal_py150_postprocess("<STR_LIT:a> <STR_LIT:a>") == "a a"


_WORDS = ["the", "The", "council", "budget", "approved", "a", "road", "of", ".", "..", " ", "  ", "Zürich", "x=1"]


def _random_texts(n, seed):
    import random
    rng = random.Random(seed)
    return [("".join(rng.choice(_WORDS) + rng.choice(["", " ", ". "]) for _ in range(rng.randint(0, 12))),
             "".join(rng.choice(_WORDS) + rng.choice(["", " ", ". "]) for _ in range(rng.randint(0, 12))))
            for _ in range(n)]


def test_pltrdy_rouge_port_matches_the_rouge_package():
    rouge = pytest.importorskip("rouge", reason="reference: pip install rouge==1.0.1 (TRACE's ROUGE-L)")
    ref = rouge.Rouge(metrics=["rouge-l"])
    for hyp, r in _random_texts(400, 0):
        try:
            want = ref.get_scores(hyp, r, avg=True)["rouge-l"]["f"]
        except ValueError:
            with pytest.raises(ValueError):
                pltrdy_rouge_l_f(hyp, r)
            continue
        assert pltrdy_rouge_l_f(hyp, r) == pytest.approx(want, abs=1e-12), (hyp, r)


def test_fuzzywuzzy_port_matches_fuzzywuzzy():
    pytest.importorskip("Levenshtein", reason="fuzzywuzzy uses python-Levenshtein when installed (both sources do)")
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz", reason="reference: pip install fuzzywuzzy python-Levenshtein")
    for a, b in _random_texts(400, 1) + [("", ""), ("", "a"), ("abc", "abd"), ("return x", "return  x")]:
        assert fuzzywuzzy_ratio(a, b) == fuzz.ratio(a, b), (a, b)


def test_conventions_first_imported_under_a_manifest():
    """score() imports data.conventions on first use, maybe after a manifest made its tasks the active ones: its
    lenient row comes from TRACE's own table, so a manifest without the TRACE tasks still scores."""
    code = ("from data.tasks import Task, use_tasks; use_tasks({'qa': Task('qa', 'exact_match', 1)}); "
            "from data.conventions import score; print(score('qa', 'Paris', 'paris'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "100.0", out.stderr[-2000:]
