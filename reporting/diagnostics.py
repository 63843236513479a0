"""Degenerate answers in one evaluation: label collapse, empty and length-capped responses.

A score alone cannot tell "forgot the task" from "answers the majority class to everything" or "runs
into the token cap". run.py computes these numbers from each evaluation's predictions.jsonl (fields
prediction, gold, finish_reason, num_tokens, score), stores them in results.json, and report.py
prints them next to the accuracy matrix with one warning line per flagged (method, stage, task).

    diagnose(task, records) -> {"n", "empty", "length_capped", "mean_tokens",   # every task
                                "labels", "gold_labels", "top_label", "top_rate",
                                "gold_majority_rate", "collapsed", "off_format", "off_format_hits",
                                "off_format_chance", "off_format_example"}      # classification
    warnings(diag) -> ["predictions collapsed to 'C' (95% of answers, 20% of the gold answers; gold
                        majority class 46%)", ...]

Rates are fractions in [0, 1] of all responses (examples x repeats). A label is
data.metrics.answer_letter of the response, the character the lenient metric compares ("" for an
empty response), whatever --scoring the evaluation used: the labels describe what the model
answered, not how it was scored (only off_format_hits, below, reads the record's score). A task's
predictions have COLLAPSED when one label, answered as a letter alone (below), is at least
COLLAPSE_RATE of all responses while that label is below COLLAPSE_RATE of the gold answers (a test
set that is itself 95% "A" may rightly be answered "A"; answering it "C" throughout is a collapse;
answering it "Anna sah ..." throughout is off-format, not a collapse to "A"). top_label / top_rate
are that most frequent letter answer and its share of all responses.

A task of a manifest that declares its labels (data/manifest.py) is a classification task
over those labels: a response's label is data.metrics.read_label's, and it is in format when
it is a label alone (answer_text, end punctuation dropped, equal to one regardless of case);
the rest is as for letters.

A first-character rule (the lenient and the paper conventions) reads any text as a label: a
model that forgot a letter task and answers it "Anna sah Bücher in Bern ." scores as if it had
answered "A". So each classification task also reports its OFF-FORMAT answers: non-empty
responses that are not a letter alone (answer_shape: after an optional "Answer:", an upper-case
letter A-Z followed, on its line, by nothing, by punctuation, or by a space and then no word:
"B", "B.", "B. against", "B (against)", "Answer: B\nBecause ..." are letters, right or wrong;
"Anna ...", "AC", "A5", "(A)", "A bill for ...", "I think ...", "x = 1" are not; where the
task's gold answers are a letter and a sentence, as the embedded ScienceQA's
"C because rain is wet", a gold letter and a sentence is a letter too, so there "A bill for ..."
reads as "A": its shape is the gold answers'), the share of all responses that are off-format
yet scored (the record's "score" > 0: accuracy only a first-character rule gives), the share of
all responses such hits would be if the off-format answers' first characters were unrelated to
their gold labels (off_format_chance: the sum over letters of the two letter counts among them,
over their number; hits near it are chance, as "Anna ..." read as "A"; hits above it mean the
first character carries some of the answer, as "Ccouncil ..." to a gold "C"), and the most
frequent off-format response (its first EXAMPLE_CHARS characters).
"""
import string
from collections import Counter

from data.metrics import answer_letter, answer_text, read_label
from data.tasks import get_task

# ---- thresholds of the warnings ------------------------------------------------------------------
LABELS = string.ascii_uppercase  # the letters a label can be (TRACE's and the
                                 # embedded tasks' are A-D)
COLLAPSE_RATE = 0.9    # one label takes >= 90% of the responses (and not >= 90%
                       # of the gold answers)
EMPTY_WARN = 0.2       # >= 20% of the responses are empty (all whitespace)
LENGTH_WARN = 0.2      # >= 20% of the responses stopped at the max-new-tokens cap
                       # (finish_reason "length")
OFF_FORMAT_WARN = 0.2  # >= 20% of the responses are non-empty and not a letter alone
                       # (classification tasks)
EXAMPLE_CHARS = 40     # the off-format example is cut to this many characters
# --------------------------------------------------------------------------------------------------
CLASSIFICATION_METRICS = ("letter_accuracy",)  # tasks whose answer is a label
                                               # (C-STANCE, FOMC, ScienceQA)


def is_classification(task: str) -> bool:
    t = get_task(task)
    return t.metric in CLASSIFICATION_METRICS or t.labels is not None


def _by_count(kc: tuple) -> tuple:
    return -kc[1], kc[0]  # most frequent first, ties by key


def _ranked(counter: Counter, n: int) -> dict:
    """{label: rate}, most frequent first (ties by label), so the JSON reads as a distribution."""
    return {k: c / n for k, c in sorted(counter.items(), key=_by_count)}


def _mode(counter: Counter) -> tuple:
    """(key, count) of the most frequent key (ties: the smallest); ("", 0) when the
    counter is empty."""
    return min(counter.items(), key=_by_count, default=("", 0))


def answer_shape(text: str) -> str:
    """The shape of a response to a letter task, after an optional "Answer:" (answer_text):
    "letter"   a label letter (LABELS) followed, on its line, by nothing, by punctuation, or by a
               space and then no word ("B", "B.", "B. against", "B (against)", "A 5",
               "Answer: B\nBecause ...");
    "sentence" a label letter followed on its line by a space and a word, a token that is one letter
               or starts with two ("A bill for ...", "I think ...", "C because rain is wet", "A B");
    "other"    anything else ("", "Bern", "BC", "B2", "(B)", "x = 1", "b", "Ä")."""
    t = answer_text(text)
    if not t or t[0] not in LABELS:
        return "other"
    line = t[1:].splitlines()[0] if t[1:] else ""  # what follows the letter on its line
    if line[:1].isalnum():                          # "Bern", "BC", "B2"
        return "other"
    words = line.split()
    return "sentence" if line[:1].isspace() and words and words[0][:2].isalpha() else "letter"


def is_letter_answer(text: str, sentences=frozenset()) -> bool:
    """Whether a response is in a letter task's format: a letter alone (answer_shape "letter"), or a
    letter and a sentence when that letter is in `sentences`, the letters whose gold answers on this
    task are themselves a letter and a sentence (the embedded ScienceQA's "C because rain is wet":
    there "A bill for ..." reads as "A", "I think ..." does not)."""
    shape = answer_shape(text)
    return shape == "letter" or (shape == "sentence" and answer_letter(text) in sentences)


def diagnose(task: str, records: list) -> dict:
    """Diagnostics of one task in one evaluation from its prediction records (dicts with
    prediction, gold, finish_reason, num_tokens, and score for classification tasks).
    Classification tasks add the predicted and gold label distributions, the collapse flag and the
    off-format answers (module docstring)."""
    n = len(records)
    if n == 0:
        raise ValueError(f"diagnose: no predictions for task {task!r}")
    out = {
        "n": n,
        "empty": sum(not r["prediction"].strip() for r in records) / n,
        "length_capped": sum(r["finish_reason"] == "length" for r in records) / n,
        "mean_tokens": sum(r["num_tokens"] for r in records) / n,
    }
    labels = get_task(task).labels
    if labels is not None:  # a manifest's own label set
        label_of = lambda text: read_label(text, labels)  # noqa: E731
        in_format = [answer_text(r["prediction"]).rstrip(".!?;: ").lower()
                     in {x.lower() for x in labels} for r in records]
    elif is_classification(task):
        label_of = answer_letter
        sentences = {answer_letter(r["gold"])
                     for r in records if answer_shape(r["gold"]) == "sentence"}
        in_format = [is_letter_answer(r["prediction"], sentences) for r in records]
    if is_classification(task):
        pred = Counter(label_of(r["prediction"]) for r in records)
        gold = Counter(label_of(r["gold"]) for r in records)
        top, top_n = _mode(Counter(label_of(r["prediction"])
                                   for r, ok in zip(records, in_format) if ok))
        gold_major = max(gold.values()) / n
        off = [r for r, ok in zip(records, in_format) if not ok and r["prediction"].strip()]
        example = _mode(Counter(r["prediction"].strip()[:EXAMPLE_CHARS] for r in off))[0]
        first, gold_off = (Counter(label_of(r[k]) for r in off) for k in ("prediction", "gold"))
        chance = sum(first[c] * gold_off[c] for c in first) / len(off) / n if off else 0.0
        out.update(labels=_ranked(pred, n), gold_labels=_ranked(gold, n), top_label=top,
                   top_rate=top_n / n, gold_majority_rate=gold_major,
                   collapsed=(bool(top) and top_n / n >= COLLAPSE_RATE
                              and gold[top] / n < COLLAPSE_RATE),
                   off_format=len(off) / n, off_format_hits=sum(r["score"] > 0 for r in off) / n,
                   off_format_chance=chance, off_format_example=example)
        if labels is not None:
            out["declared_labels"] = list(labels)
    return out


def _share(rate: float) -> str:
    # 1 of 300 reads 0.3%, not 0%
    return f"{rate:.0%}" if rate >= 0.01 or rate == 0 else f"{rate:.1%}"


def warnings(diag: dict) -> list:
    """The reasons (strings) to distrust one (stage, task) score; empty when nothing is flagged."""
    out = []
    if diag.get("collapsed"):
        gold = diag["gold_labels"].get(diag["top_label"], 0.0)
        out.append(f"predictions collapsed to {diag['top_label']!r} "
                   f"({diag['top_rate']:.0%} of answers, {gold:.0%} of the gold answers; "
                   f"gold majority class {diag['gold_majority_rate']:.0%})")
    if diag.get("off_format", 0.0) >= OFF_FORMAT_WARN:
        # .get: old results.json lack off_format_chance, and their reports still render
        hits, chance = diag["off_format_hits"], diag.get("off_format_chance")
        shape = "a declared label" if "declared_labels" in diag else "a letter"
        out.append(f"{diag['off_format']:.0%} of answers are not {shape} "
                   f"(most often {diag['off_format_example']!r})"
                   + (f", {_share(hits)} of answers score by their first character alone"
                      if hits else "")
                   + (f" (chance {_share(chance)})" if hits and chance is not None else ""))
    if diag["empty"] >= EMPTY_WARN:
        out.append(f"{diag['empty']:.0%} empty responses")
    if diag["length_capped"] >= LENGTH_WARN:
        out.append(f"{diag['length_capped']:.0%} of responses hit the max-new-tokens cap")
    return out
