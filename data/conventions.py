"""The scoring conventions of other codebases, reproduced exactly, per example, and the table
of all three by task.

data/metrics.py holds the project's own (lenient) scorers; this module holds ports of other code's
scorers, kept literal, quirks included, so that our numbers can be set beside the sources'
(`score(..., scoring=...)` at the end of this module picks one; evaluate.py, score.py and run.py:
--scoring). They are kept apart because they are reproductions, not rules of ours: each stays as its
source has it, whatever the lenient rules become.
  paper  the OPR paper's official code (Yancey2024/OnPolicyReplay tools/eval.py;
         tools/generate_opr_ru.py scores OPR-RU rollouts with the same rules): classification =
         first character of the raw response equals the gold's (a non-empty response); NumGLUE = the
         last string matching -?[0-9.,]+ (skipping "" and ".") equals the gold STRING
         ("12." != "12", "1,234" != "1234"); MeetingBank = rouge_score ROUGE-L F1; Py150 =
         fuzzywuzzy fuzz.ratio (an integer; equal strings 100, one empty 0) after TRACE's literal
         un-masking; 20Minuten = SARI with the source cut out of the prompt between "Paragraph:\\n"
         and "\\n\\nSimplification:".
  trace  TRACE's metrics.py + evaluations/eval_*.py: C-STANCE, FOMC and both NumGLUE =
         whole-string equality (caculate_accuracy); ScienceQA = first character equal
         (eval_ScienceQA.resolve takes datium[0]); MeetingBank = the `rouge` package's ROUGE-L F
         (Rouge(metrics=["rouge-l"]).get_scores(gold, prediction), TRACE's argument order);
         Py150 = fuzz.ratio after the un-masking, empty -> 0 (caculate_fuzz); 20Minuten = SARI
         with the WHOLE prompt as the source (TRACE passes its input sequences). Empty
         prediction or gold -> 0.
Where the sources would crash (TRACE's ScienceQA on an empty prediction, its `rouge` on a text of
only dots) we score 0; a 20Minuten prompt without "Paragraph:\\n" under `paper` is an error, as
in the official code.
"""

import re

from common.errors import InputError
from data.metrics import METRICS, _rouge_scorer, prompt_text, sari, task_metric
from data.tasks import TASKS, get_task


# --------------------------------------------------------------------------------------------------
# The official OPR code's rules ("paper") and TRACE's ("trace"), each a literal port of its source


def paper_letter(prediction: str, gold: str, prompt: str = "") -> float:
    """tools/eval.py eval_acc: `g[:1] == r[:1] and r != ""` on the raw strings (no strip)."""
    return 100.0 if prediction != "" and gold[:1] == prediction[:1] else 0.0


def paper_number(prediction: str, gold: str, prompt: str = "") -> float:
    """tools/eval.py eval_math: the last match of -?[0-9.,]+ that is not "" or "." (all invalid: the
    first match, as the source's loop leaves it) must equal the gold string exactly."""
    found = re.findall(r"(\-?[0-9\.\,]+)", prediction)
    final = None
    for final in reversed(found):
        if final not in ("", "."):
            break
    return 100.0 if final == gold else 0.0


def paper_rouge_l(prediction: str, gold: str, prompt: str = "") -> float:
    """tools/eval.py eval_rougel: rouge_score ROUGE-L F1 (no stemmer) x 100, no empty check."""
    return 100.0 * _rouge_scorer().score(gold, prediction)["rougeL"].fmeasure


def literal_py150_postprocess(code: str) -> str:
    """TRACE's eval_Py150.postprocess (copied verbatim into the official code): find every literal,
    then str.replace each one in turn."""
    code = code.replace("<NUM_LIT>", "0").replace("<STR_LIT>", "").replace("<CHAR_LIT>", "")
    for kind, value in re.findall(re.compile(r"<(STR|NUM|CHAR)_LIT:(.*?)>", re.S), code):
        code = code.replace(f"<{kind}_LIT:{value}>", value)
    return code


def fuzzywuzzy_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy.fuzz.ratio with python-Levenshtein installed (both sources' requirements): equal
    strings -> 100, an empty one -> 0, else int(round(100 * Levenshtein.ratio)) (Levenshtein.ratio =
    the normalised InDel similarity, which rapidfuzz computes)."""
    from rapidfuzz.distance import Indel
    if s1 == s2:
        return 100
    if not s1 or not s2:
        return 0
    return int(round(100 * Indel.normalized_similarity(s1, s2)))


def paper_code_fuzz(prediction: str, gold: str, prompt: str = "") -> float:
    """tools/eval.py eval_code: fuzz.ratio(postprocess(r), postprocess(g)), no empty check."""
    return float(fuzzywuzzy_ratio(literal_py150_postprocess(prediction),
                                  literal_py150_postprocess(gold)))


def paper_sari(prediction: str, gold: str, prompt: str = "") -> float:
    """tools/eval.py eval_sari: source =
    prompt.split('Paragraph:\\n')[1].split('\\n\\nSimplification:')[0]."""
    prompt = prompt_text(prompt)
    if "Paragraph:\n" not in prompt:
        # the data's fault, not a bug: an InputError, to which evaluate.py / score.py add the record
        raise InputError("--scoring paper: a 20Minuten prompt has no 'Paragraph:\\n' to cut the "
                         "source from (the official code fails here too; "
                         f"use --scoring lenient or trace): {prompt[:80]!r}")
    source = prompt.split("Paragraph:\n")[1].split("\n\nSimplification:")[0]
    return sari(source, prediction, [gold])


def trace_exact(prediction: str, gold: str, prompt: str = "") -> float:
    """TRACE metrics.caculate_accuracy: skip (0) when either is "", else whole-string equality."""
    return 100.0 if prediction != "" and gold != "" and prediction == gold else 0.0


def trace_first_char(prediction: str, gold: str, prompt: str = "") -> float:
    """TRACE eval_ScienceQA: resolve() keeps datium[0] of each, then caculate_accuracy (TRACE itself
    fails on an empty prediction; 0 here)."""
    return trace_exact(prediction[:1], gold[:1])


def _pltrdy_recon_lcs(x: list, y: list) -> set:
    """rouge 1.0.1 rouge_score._recon_lcs with exclusive=True: the words of one LCS of x and y (ties
    go to y's side, as in the source's `table[i-1, j] > table[i, j-1]`), as a set."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            table[i][j] = (table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1]
                           else max(table[i - 1][j], table[i][j - 1]))
    words, i, j = set(), n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def pltrdy_rouge_l_f(hyp: str, ref: str) -> float:
    """F of the `rouge` package (pltrdy, 1.0.1):
    Rouge(metrics=["rouge-l"]).get_scores(hyp, ref, avg=True)
    ["rouge-l"]["f"]: texts split into "sentences" on ".", words on " "; summary-level union LCS
    over SETS of words (exclusive=True); F = 2PR / (P + R + 1e-8). ValueError when either text has
    no sentence (the package's)."""
    hyp_s = [" ".join(s.split()) for s in hyp.split(".") if len(s) > 0]
    ref_s = [" ".join(s.split()) for s in ref.split(".") if len(s) > 0]
    if not hyp_s or not ref_s:
        raise ValueError("Collections must contain at least 1 sentence.")
    m = len({w for s in ref_s for w in s.split(" ")})
    n = len({w for s in hyp_s for w in s.split(" ")})
    union, llcs = set(), 0
    for r in ref_s:
        before = len(union)
        for h in hyp_s:
            union |= _pltrdy_recon_lcs(r.split(" "), h.split(" "))
        llcs += len(union) - before
    r_lcs, p_lcs = llcs / m, llcs / n
    return 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))


def trace_rouge_l(prediction: str, gold: str, prompt: str = "") -> float:
    """TRACE metrics.caculate_rouge: skip (0) when either is "", else
    score_rouge(target, prediction), i.e. the `rouge` package with the gold as hypothesis (x 100). A
    text of only dots, where the package raises, scores 0."""
    if prediction == "" or gold == "":
        return 0.0
    try:
        return 100.0 * pltrdy_rouge_l_f(gold, prediction)
    except ValueError:
        return 0.0


def trace_code_fuzz(prediction: str, gold: str, prompt: str = "") -> float:
    """TRACE eval_Py150 + metrics.caculate_fuzz: un-mask both, skip (0) when either is
    "", else fuzz.ratio."""
    p, g = literal_py150_postprocess(prediction), literal_py150_postprocess(gold)
    return 0.0 if p == "" or g == "" else float(fuzzywuzzy_ratio(p, g))


def trace_sari(prediction: str, gold: str, prompt: str = "") -> float:
    """TRACE eval_20Minuten + metrics.caculate_sari: HF SARI with the whole prompt (its input
    sequence) as source."""
    return sari(prompt_text(prompt), prediction, [gold])


# --------------------------------------------------------------------------------------------------
# The three conventions by task (score() below dispatches on this table)

# TRACE's own table (TASKS), not the active one: this module is first imported by score(), maybe
# after a manifest made its tasks the active ones, and score() uses these rows only for TRACE tasks
# with their TRACE metric
CONVENTIONS = {  # scoring -> task -> fn(prediction, gold, prompt) -> float in [0, 100]
    "lenient": {t: METRICS[TASKS[t].metric] for t in
                ("C-STANCE", "FOMC", "MeetingBank", "Py150", "ScienceQA", "NumGLUE-cm",
                 "NumGLUE-ds", "20Minuten")},
    "paper": {"C-STANCE": paper_letter, "FOMC": paper_letter, "MeetingBank": paper_rouge_l,
              "Py150": paper_code_fuzz, "ScienceQA": paper_letter, "NumGLUE-cm": paper_number,
              "NumGLUE-ds": paper_number, "20Minuten": paper_sari},
    "trace": {"C-STANCE": trace_exact, "FOMC": trace_exact, "MeetingBank": trace_rouge_l,
              "Py150": trace_code_fuzz, "ScienceQA": trace_first_char, "NumGLUE-cm": trace_exact,
              "NumGLUE-ds": trace_exact, "20Minuten": trace_sari},
}


# --------------------------------------------------------------------------------------------------
# Dispatch by convention and task (the conventions' table CONVENTIONS above)

SCORINGS = ("lenient", "paper", "trace")
SCORING = "lenient"  # the default everywhere: reads what a small model means;
                     # `paper` / `trace` reproduce sources


def score(task: str, prediction: str, gold: str, prompt: str = "", scoring: str = SCORING,
          record=None) -> float:
    """Per-example score in [0, 100] of `prediction` for a task under a scoring convention
    (lenient | paper | trace, see data/conventions.py). The prompt is only used by SARI, the
    record (the source record) only by a user's scorer. The conventions are TRACE's: a manifest's
    task follows them where it is a TRACE task with its TRACE metric, else its own metric scores
    it whatever the convention."""
    t = get_task(task)  # unknown task -> ValueError listing the valid ones
    if scoring not in CONVENTIONS:
        raise ValueError(f"unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    if task in TASKS and t.metric == TASKS[task].metric:
        return CONVENTIONS[scoring][task](prediction, gold, prompt)
    return task_metric(t)(prediction, gold, prompt, record)
