"""Per-example TRACE metrics, each returning a score in [0, 100], plus the
continual-learning aggregates.

Scoring follows TRACE's evaluation code (BeyonderXX/TRACE: metrics.py and evaluations/eval_*.py):
  letter_accuracy  C-STANCE, FOMC, ScienceQA  first character of the answer (after "Answer: "
                                              when present, as eval_ScienceQA.resolve does)
                                              must match the gold one
  number_accuracy  NumGLUE-cm, NumGLUE-ds     last number in the prediction equals the gold number
  code_fuzz        Py150                      rapidfuzz fuzz.ratio after eval_Py150.postprocess
  rouge_l          MeetingBank                ROUGE-L F1 (rouge_score, no stemmer)
  sari             20Minuten                  SARI (Xu et al., 2016) exactly as HF `evaluate`'s
                                              sari / EASSE
Like TRACE's `if prediction == "" ...: continue`, an empty (all-whitespace)
prediction or gold scores 0.

These are the LENIENT rules (the default, `scoring="lenient"`): they read the answer a small model
means ("Answer: B" -> B, " A" -> A, "12.0" = 12). Two more conventions reproduce other code exactly,
per example (means over examples are taken by the caller, as both sources do); choose one with
data.conventions.score(..., scoring=...) (evaluate.py, score.py and run.py: --scoring):
  paper  the OPR paper's official code (Yancey2024/OnPolicyReplay tools/eval.py)
  trace  TRACE's metrics.py + evaluations/eval_*.py
Their scorers, and CONVENTIONS, the table of all three by task, are in data/conventions.py,
which gives their rules.
"""

import math
import numbers
import re
import sys
from collections import Counter
from functools import lru_cache

from rapidfuzz import fuzz

from data.tasks import TASKS, get_task
from common.errors import InputError

# Bumped whenever a change here changes a score that existing data can produce: run.py puts it in
# the keys of the steps that score (evaluations, OPR buffers) and so of everything downstream, so a
# resumed run re-scores instead of mixing rules. What each version changed: BENCHMARKS.md,
# "Numerics versions".
RULES = 1

# --------------------------------------------------------------------------------------------------
# Classification: C-STANCE, FOMC, ScienceQA


def answer_text(text: str) -> str:
    """The response stripped, and without a leading "Answer:" (TRACE's ScienceQA answers read
    "Answer: A\\nBecause ...")."""
    t = text.strip()
    return t[len("Answer:"):].strip() if t.startswith("Answer:") else t


def answer_letter(text: str) -> str:
    """The answer character: the first non-space character of answer_text (after "Answer:" when the
    text starts with it)."""
    return answer_text(text)[:1]


def letter_accuracy(prediction: str, gold: str, prompt: str = "") -> float:
    p, g = answer_letter(prediction), answer_letter(gold)
    return 100.0 if p and g and p == g else 0.0


# --------------------------------------------------------------------------------------------------
# NumGLUE: last number in the prediction vs the gold answer
#
# Numbers: optional minus sign (not when glued to a preceding word/digit, so "x-5" and "10-5" do not
# read as -5), digits with optional thousands separators ("1,234"), optional decimals. A trailing
# "." is not part of the number, so "The answer is 12." reads 12; "12." and "12" and "12.0" are the
# same number because we compare the parsed floats exactly (no tolerance: TRACE compares strings
# exactly, and e.g. gold "1.4300000000000002" stays distinct from "1.43"). Some NumGLUE-cm gold
# answers are words ("Wednesday", "May", "Cameron"): those score 100 when the prediction, stripped
# of trailing punctuation, equals the gold or ends with it as a word (case-insensitive).
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
    # (a gold of only punctuation stays itself)
    g = gold.strip().rstrip(".!?;: ").lower() or gold.strip().lower()
    return 100.0 if p == g or re.search(r"(?:^|\W)" + re.escape(g) + r"$", p) else 0.0


# --------------------------------------------------------------------------------------------------
# Py150: follows evaluations/eval_Py150.py (postprocess) + metrics.caculate_fuzz (fuzz.ratio).
# TRACE does not cut the prediction at the first line or touch <EOL>; we only add a strip() of
# surrounding whitespace.


def py150_postprocess(code: str) -> str:
    """TRACE's literal un-masking: <NUM_LIT> -> "0", <STR_LIT>/<CHAR_LIT> -> "",
    <NUM_LIT:3> -> "3" etc."""
    code = code.replace("<NUM_LIT>", "0").replace("<STR_LIT>", "").replace("<CHAR_LIT>", "")
    return re.sub(r"<(?:STR|NUM|CHAR)_LIT:(.*?)>", lambda m: m.group(1), code, flags=re.S)


def code_fuzz(prediction: str, gold: str, prompt: str = "") -> float:
    p, g = py150_postprocess(prediction).strip(), py150_postprocess(gold).strip()
    if not p or not g:
        return 0.0
    return float(fuzz.ratio(p, g))


# --------------------------------------------------------------------------------------------------
# MeetingBank: ROUGE-L F1. rouge_score's default tokenizer lowercases and keeps only [a-z0-9] runs,
# so non-ASCII letters split words (fine for English MeetingBank; identical texts still score 100).


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, gold: str, prompt: str = "") -> float:
    if not prediction.strip() or not gold.strip():
        return 0.0
    return 100.0 * _rouge_scorer().score(gold, prediction)["rougeL"].fmeasure


# --------------------------------------------------------------------------------------------------
# 20Minuten: SARI. A line-by-line port of huggingface/evaluate metrics/sari/sari.py (itself the
# tensor2tensor port of Xu et al.'s SARI.py with 0/0 := 1 and the keep-recall fix), with EASSE's
# normalisation: lowercase then sacrebleu's 13a tokenizer, n-grams 1..4, averaged over n, then
# (keep F1 + delete precision + add F1) / 3.


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
        k, d, a = _sari_ngram(_ngrams(s1, n), _ngrams(c1, n), [_ngrams(r, n) for r in r1s],
                              len(rsents))
        keep, dele, add = keep + k, dele + d, add + a
    return (keep / 4 + dele / 4 + add / 4) / 3


@lru_cache(maxsize=1)
def _tok13a():
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    return Tokenizer13a()


def sari_normalize(sentence: str) -> str:
    return _tok13a()(sentence.lower())


def sari(source: str, prediction: str, references: list[str]) -> float:
    """SARI in [0, 100] of one prediction against its source and one or more references (HF
    evaluate's value)."""
    if not references:
        raise ValueError("sari needs at least one reference")
    return 100.0 * _sari_sent(sari_normalize(source), sari_normalize(prediction),
                              [sari_normalize(r) for r in references])


_PARAGRAPH = re.compile(r"Paragraph:\s*\n(.*)", re.S)


def prompt_text(prompt) -> str:
    """The text of a prompt: a manifest's chat prompt (a list of turns: a system prompt, earlier
    turns) is its user turns' text, which SARI reads its source from (a list failed there as a
    TypeError traceback)."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(m["content"] for m in prompt if m["role"] == "user")


def simplification_source(prompt: str) -> str:
    """The paragraph to simplify inside a 20Minuten prompt.

    TRACE's prompts read
    "Provide a simplified version of the following paragraph in German.\\n\\nParagraph:\\n
    <text>" optionally followed by a short cue line such as "Simplified version:". We take the text
    after "Paragraph:" and drop a final short line ending in ':'; without the marker the whole
    prompt is the source.
    """
    m = _PARAGRAPH.search(prompt := prompt_text(prompt))
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


# --------------------------------------------------------------------------------------------------
# A user's own tasks (data/manifest.py): exact match and token F1 as SQuAD's evaluate-v1.1
# normalises, accuracy over a declared label set, and the user's own scorer


def squad_normalize(text: str) -> str:
    """SQuAD's normalize_answer: lower case, no punctuation, no articles (a, an, the),
    single spaces."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def exact_match(prediction: str, gold: str, prompt: str = "") -> float:
    p, g = squad_normalize(prediction), squad_normalize(gold)
    return 100.0 if prediction.strip() and p == g else 0.0


def token_f1(prediction: str, gold: str, prompt: str = "") -> float:
    p, g = squad_normalize(prediction).split(), squad_normalize(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if not prediction.strip() or common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 100.0 * 2 * precision * recall / (precision + recall)


def read_label(text: str, labels) -> str:
    """The declared label a response gives: the label the answer text (answer_text, end punctuation
    dropped) equals, else the longest label it starts with as a whole word; matched
    case-insensitively, returned as declared; "" when it gives none."""
    t = answer_text(text).rstrip(".!?;: ").lower()
    by_lower = {label.lower(): label for label in labels}
    if t in by_lower:
        return by_lower[t]
    for low in sorted(by_lower, key=len, reverse=True):
        if t.startswith(low) and not t[len(low):len(low) + 1].isalnum():
            return by_lower[low]
    return ""


def label_accuracy(prediction: str, gold: str, labels) -> float:
    p = read_label(prediction, labels)
    return 100.0 if p and p == read_label(gold, labels) else 0.0


def import_scorer(spec: str):
    """The function `module:function` names (the data root is on the path:
    data.manifest puts it there)."""
    import importlib
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise AttributeError(f"module {module!r} has no function {name!r}")
    return fn


@lru_cache(maxsize=None)
def task_metric(task):
    """fn(prediction, gold, prompt, record) -> float in [0, 100] of a data.tasks.Task's metric: a
    METRICS name, label_accuracy over its labels, or a user scorer `module:function` called as
    (prediction, gold, record), whose result must be a number in [0, 100] (InputError naming the
    manifest and task otherwise)."""
    if task.metric == "label_accuracy":
        return (lambda prediction, gold, prompt, record:
                label_accuracy(prediction, gold, task.labels))
    if ":" not in task.metric:
        fn = METRICS[task.metric]
        return lambda prediction, gold, prompt, record: fn(prediction, gold, prompt)
    user = import_scorer(task.metric)
    source = (getattr(sys.modules.get(task.metric.partition(":")[0]), "__file__", None)
              or task.metric)

    def checked(prediction, gold, prompt, record):
        try:
            v = user(prediction, gold, record)
        except Exception as e:
            # the user's code failing on some predictions is bad input, not our bug: one line
            # naming the scorer (the caller adds the record), not a traceback through our frames
            raise InputError(f"{task.manifest}: task {task.name!r}, field 'metric': {task.metric} "
                             f"({source}) raised {type(e).__name__}: {e} "
                             f"on prediction {prediction[:40]!r}") from None
        # any real number (numpy's int64 and float32 too, which are not int or float) but a bool,
        # a number only by accident; the range check refuses NaN (every comparison with it is
        # false) and infinities
        x = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
        if not 0 <= x <= 100:
            raise InputError(f"{task.manifest}: task {task.name!r}, field 'metric': {task.metric} "
                             f"returned {v!r} for prediction {prediction[:40]!r}; "
                             f"a scorer returns a number in [0, 100]")
        return x
    return checked


# --------------------------------------------------------------------------------------------------
# Dispatch

METRICS = {  # metric name (data.tasks.Task.metric) -> fn(prediction, gold, prompt)
             # -> float in [0, 100]
    "letter_accuracy": letter_accuracy,
    "number_accuracy": number_accuracy,
    "code_fuzz": code_fuzz,
    "rouge_l": rouge_l,
    "sari": sari_metric,
    "exact_match": exact_match,
    "token_f1": token_f1,
}


# --------------------------------------------------------------------------------------------------
# Continual-learning aggregates


def acc_bwt(matrix):
    """(ACC, BWT) from a score matrix, matrix[i][j] = score on task j after training
    stage i (i >= j filled).

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


def _checked_numbers(name: str, values, n: int) -> list:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} entries, expected {n}")
    for j, v in enumerate(values):
        if v is None or not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError(f"{name}: entry [{j}] is {v!r}, expected a number")
    return values


def forward_transfer(row0, next_task):
    """FWT (Lopez-Paz & Ranzato 2017, with the base model as the reference b_i) = mean over
    i = 2..N of a(i-1, i) - a(0, i): how much training on tasks 1..i-1 already helps task i,
    relative to the base.

    row0[j]      = a(0, j+1), the base model on task j+1 (N entries)
    next_task[k] = a(k+1, k+2), task k+2 after stage k+1, before training on it (N-1 entries)
    None when N == 1.
    """
    n = len(row0)
    row0 = _checked_numbers("forward_transfer: row0", row0, n)
    next_task = _checked_numbers("forward_transfer: next_task", next_task, max(n - 1, 0))
    if n < 2:
        return None
    return sum(next_task[k] - row0[k + 1] for k in range(n - 1)) / (n - 1)


def forgetting(matrix) -> list:
    """Per-task forgetting (Chaudhry et al. 2018): for each task j < N, the best score it had at any
    earlier stage (stages j..N-1, 1-based) minus its final score. Positive = forgotten. N-1 entries
    (the last task has none)."""
    acc_bwt(matrix)  # validates the lower triangle
    n = len(matrix)
    return [max(matrix[i][j] for i in range(j, n - 1)) - matrix[-1][j] for j in range(n - 1)]


def overall_performance(matrix) -> float:
    """TRACE's OP (Wang et al. 2023, eq. 1): OP_t = 1/t sum_{i<=t} R_{t,i} after the last stage
    t = N, i.e. the mean of the final row; numerically our ACC (also the official OPR code's
    "overall accuracy")."""
    return acc_bwt(matrix)[0]


def bwt_over_all_tasks(matrix):
    """BWT normalised as TRACE's eq. 2 and the official OPR code's tools/show_result.py:
    1/N sum_{i<=N} (a(N, i) - a(i, i)), the last task's zero term included, i.e. (N-1)/N times our
    BWT. None for N == 1."""
    n = len(matrix)
    bwt = acc_bwt(matrix)[1]
    return None if bwt is None else bwt * (n - 1) / n


def cl_metrics(matrix, row0=None, next_task=None) -> dict:
    """Every continual-learning number of one run: acc, bwt (mean over i < N), bwt_trace (TRACE's /
    the official code's 1/N normalisation), op (TRACE), fwt (None without row 0 and the next-task
    scores), forgetting (per task j < N) and forgetting_mean (None for N == 1)."""
    acc, bwt = acc_bwt(matrix)
    forg = forgetting(matrix)
    fwt = forward_transfer(row0, next_task) if row0 is not None and next_task is not None else None
    return {"acc": acc, "bwt": bwt, "bwt_trace": bwt_over_all_tasks(matrix),
            "op": overall_performance(matrix), "fwt": fwt, "forgetting": forg,
            "forgetting_mean": sum(forg) / len(forg) if forg else None}
