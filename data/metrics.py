"""Per-example TRACE metrics, each returning a score in [0, 100], plus the continual-learning aggregates.

Scoring follows TRACE's evaluation code (BeyonderXX/TRACE: metrics.py and evaluations/eval_*.py):
  letter_accuracy  C-STANCE, FOMC, ScienceQA  first character of the answer (after "Answer: " when present,
                                              as eval_ScienceQA.resolve does) must match the gold one
  number_accuracy  NumGLUE-cm, NumGLUE-ds     last number in the prediction equals the gold number
  code_fuzz        Py150                      rapidfuzz fuzz.ratio after eval_Py150.postprocess
  rouge_l          MeetingBank                ROUGE-L F1 (rouge_score, no stemmer)
  sari             20Minuten                  SARI (Xu et al., 2016) exactly as HF `evaluate`'s sari / EASSE
Like TRACE's `if prediction == "" ...: continue`, an empty (all-whitespace) prediction or gold scores 0.
"""

import math
import re
from collections import Counter
from functools import lru_cache

from rapidfuzz import fuzz

from data.tasks import get_task

# ---------------------------------------------------------------------------------------------------------------
# Classification: C-STANCE, FOMC, ScienceQA


def answer_letter(text: str) -> str:
    """The answer character: the first non-space character after "Answer:" when the text starts with it
    (TRACE's ScienceQA answers read "Answer: A\\nBecause ..."), else the first non-space character."""
    t = text.strip()
    if t.startswith("Answer:"):
        t = t[len("Answer:"):].strip()
    return t[:1]


def letter_accuracy(prediction: str, gold: str, prompt: str = "") -> float:
    p, g = answer_letter(prediction), answer_letter(gold)
    return 100.0 if p and g and p == g else 0.0


# ---------------------------------------------------------------------------------------------------------------
# NumGLUE: last number in the prediction vs the gold answer
#
# Numbers: optional minus sign (not when glued to a preceding word/digit, so "x-5" and "10-5" do not read as
# -5), digits with optional thousands separators ("1,234"), optional decimals. A trailing "." is not part of
# the number, so "The answer is 12." reads 12; "12." and "12" and "12.0" are the same number because we compare
# the parsed floats exactly (no tolerance: TRACE compares strings exactly, and e.g. gold "1.4300000000000002"
# stays distinct from "1.43"). Some NumGLUE-cm gold answers are words ("Wednesday", "May", "Cameron"): those
# score 100 when the prediction, stripped of trailing punctuation, equals the gold or ends with it as a word
# (case-insensitive).
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.-])-?\.\d+")


def parse_number(text: str):
    """float of a whole-string number ("1,234.5", "-12", "12.", ".5"), else None."""
    t = text.strip().replace(",", "")
    if t.endswith("."):
        t = t[:-1]
    if not re.fullmatch(r"-?(?:\d+(?:\.\d+)?|\.\d+)", t):
        return None
    return float(t)


def last_number(text: str):
    """The last number in free text as a float ("we get -1,234.5 apples." -> -1234.5), else None."""
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def number_accuracy(prediction: str, gold: str, prompt: str = "") -> float:
    if not prediction.strip() or not gold.strip():
        return 0.0
    g = parse_number(gold)
    if g is not None:
        p = last_number(prediction)
        return 100.0 if p is not None and p == g else 0.0
    # non-numeric gold: exact word match at the end of the prediction
    p = prediction.strip().rstrip(".!?;: ").lower()
    g = gold.strip().lower()
    return 100.0 if p == g or re.search(r"(?:^|\W)" + re.escape(g) + r"$", p) else 0.0


# ---------------------------------------------------------------------------------------------------------------
# Py150: follows evaluations/eval_Py150.py (postprocess) + metrics.caculate_fuzz (fuzz.ratio). TRACE does not
# cut the prediction at the first line or touch <EOL>; we only add a strip() of surrounding whitespace.


def py150_postprocess(code: str) -> str:
    """TRACE's literal un-masking: <NUM_LIT> -> "0", <STR_LIT>/<CHAR_LIT> -> "", <NUM_LIT:3> -> "3" etc."""
    code = code.replace("<NUM_LIT>", "0").replace("<STR_LIT>", "").replace("<CHAR_LIT>", "")
    return re.sub(r"<(?:STR|NUM|CHAR)_LIT:(.*?)>", lambda m: m.group(1), code, flags=re.S)


def code_fuzz(prediction: str, gold: str, prompt: str = "") -> float:
    p, g = py150_postprocess(prediction).strip(), py150_postprocess(gold).strip()
    if not p or not g:
        return 0.0
    return float(fuzz.ratio(p, g))


# ---------------------------------------------------------------------------------------------------------------
# MeetingBank: ROUGE-L F1. rouge_score's default tokenizer lowercases and keeps only [a-z0-9] runs, so non-ASCII
# letters split words (fine for English MeetingBank; identical texts still score 100).


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, gold: str, prompt: str = "") -> float:
    if not prediction.strip() or not gold.strip():
        return 0.0
    return 100.0 * _rouge_scorer().score(gold, prediction)["rougeL"].fmeasure


# ---------------------------------------------------------------------------------------------------------------
# 20Minuten: SARI. A line-by-line port of huggingface/evaluate metrics/sari/sari.py (itself the tensor2tensor
# port of Xu et al.'s SARI.py with 0/0 := 1 and the keep-recall fix), with EASSE's normalisation: lowercase then
# sacrebleu's 13a tokenizer, n-grams 1..4, averaged over n, then (keep F1 + delete precision + add F1) / 3.


def _sari_ngram(sgrams, cgrams, rgramslist, numref):
    rgramcounter = Counter(g for rgrams in rgramslist for g in rgrams)
    sgramcounter_rep = Counter({g: c * numref for g, c in Counter(sgrams).items()})
    cgramcounter = Counter(cgrams)
    cgramcounter_rep = Counter({g: c * numref for g, c in cgramcounter.items()})

    # keep: F1 of n-grams kept from the source that the references also keep
    keep_rep = sgramcounter_rep & cgramcounter_rep
    keep_good = keep_rep & rgramcounter
    keep_all = sgramcounter_rep & rgramcounter
    keep_p = sum(keep_good[g] / keep_rep[g] for g in keep_good) / len(keep_rep) if keep_rep else 1.0
    keep_r = sum(keep_good.values()) / sum(keep_all.values()) if keep_all else 1.0
    keep = 2 * keep_p * keep_r / (keep_p + keep_r) if keep_p > 0 or keep_r > 0 else 0.0

    # delete: precision only
    del_rep = sgramcounter_rep - cgramcounter_rep
    del_good = del_rep - rgramcounter
    del_p = sum(del_good[g] / del_rep[g] for g in del_good) / len(del_rep) if del_rep else 1.0

    # add: F1 over n-gram types added w.r.t. the source
    add = set(cgramcounter) - set(sgrams)
    add_good = add & set(rgramcounter)
    add_all = set(rgramcounter) - set(sgrams)
    add_p = len(add_good) / len(add) if add else 1.0
    add_r = len(add_good) / len(add_all) if add_all else 1.0
    add_f = 2 * add_p * add_r / (add_p + add_r) if add_p > 0 or add_r > 0 else 0.0
    return keep, del_p, add_f


def _ngrams(tokens, n):
    return [" ".join(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def _sari_sent(ssent: str, csent: str, rsents: list[str]) -> float:
    # split(" ") (not split()) as in the reference: an empty string is one empty token
    s1, c1 = ssent.split(" "), csent.split(" ")
    r1s = [r.split(" ") for r in rsents]
    keep = dele = add = 0.0
    for n in range(1, 5):
        k, d, a = _sari_ngram(_ngrams(s1, n), _ngrams(c1, n), [_ngrams(r, n) for r in r1s], len(rsents))
        keep, dele, add = keep + k, dele + d, add + a
    return (keep / 4 + dele / 4 + add / 4) / 3


@lru_cache(maxsize=1)
def _tok13a():
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    return Tokenizer13a()


def sari_normalize(sentence: str) -> str:
    return _tok13a()(sentence.lower())


def sari(source: str, prediction: str, references: list[str]) -> float:
    """SARI in [0, 100] of one prediction against its source and one or more references (HF evaluate's value)."""
    if not references:
        raise ValueError("sari needs at least one reference")
    return 100.0 * _sari_sent(sari_normalize(source), sari_normalize(prediction),
                              [sari_normalize(r) for r in references])


_PARAGRAPH = re.compile(r"Paragraph:\s*\n(.*)", re.S)


def simplification_source(prompt: str) -> str:
    """The paragraph to simplify inside a 20Minuten prompt.

    TRACE's prompts read "Provide a simplified version of the following paragraph in German.\\n\\nParagraph:\\n
    <text>" optionally followed by a short cue line such as "Simplified version:". We take the text after
    "Paragraph:" and drop a final short line ending in ':'; without the marker the whole prompt is the source.
    """
    m = _PARAGRAPH.search(prompt)
    if not m:
        return prompt.strip()
    lines = m.group(1).strip().split("\n")
    if len(lines) > 1 and lines[-1].rstrip().endswith(":") and len(lines[-1].split()) <= 4:
        lines = lines[:-1]
    return "\n".join(lines).strip()


def sari_metric(prediction: str, gold: str, prompt: str = "") -> float:
    if not prediction.strip() or not gold.strip():
        return 0.0
    return sari(simplification_source(prompt), prediction, [gold])


# ---------------------------------------------------------------------------------------------------------------
# Dispatch

METRICS = {  # metric name (data.tasks.Task.metric) -> fn(prediction, gold, prompt) -> float in [0, 100]
    "letter_accuracy": letter_accuracy,
    "number_accuracy": number_accuracy,
    "code_fuzz": code_fuzz,
    "rouge_l": rouge_l,
    "sari": sari_metric,
}


def score(task: str, prediction: str, gold: str, prompt: str = "") -> float:
    """Per-example score in [0, 100] of `prediction` for a TRACE task (the prompt is only used by SARI)."""
    return METRICS[get_task(task).metric](prediction, gold, prompt)


# ---------------------------------------------------------------------------------------------------------------
# Continual-learning aggregates


def acc_bwt(matrix):
    """(ACC, BWT) from a score matrix, matrix[i][j] = score on task j after training stage i (i >= j filled).

    Rows may be ragged (row i holds i+1 entries) or full N x N (entries above the diagonal ignored).
    ACC = mean of the last row; BWT = 1/(N-1) * sum_{j<N-1} (a[N-1][j] - a[j][j]).
    For N == 1 BWT is undefined and returned as None.
    """
    n = len(matrix)
    if n == 0:
        raise ValueError("acc_bwt: empty matrix")
    for i, row in enumerate(matrix):
        if len(row) < i + 1:
            raise ValueError(f"acc_bwt: row {i} has {len(row)} entries, needs at least {i + 1}")
        for j in range(i + 1):
            v = row[j]
            if v is None or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"acc_bwt: entry [{i}][{j}] is {v!r}, expected a number")
    last = matrix[-1]
    acc = sum(last[j] for j in range(n)) / n
    if n == 1:
        return acc, None
    bwt = sum(last[j] - matrix[j][j] for j in range(n - 1)) / (n - 1)
    return acc, bwt
