"""score.py on hand-written rollout files (scores, bad input, nothing written on error), the buffer's loss bound and
the RU/SC rank correlation. The replay budget and selection: test_replay.py; the rollout.py -> score.py run:
test_rollout.py."""
import json
import math
from pathlib import Path

import pytest

import score
from reporting.stats import spearman

# --- score.py on hand-written files ---------------------------------------------------------------------------------

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "trace"


def write_trace(root: Path):
    recs = {"FOMC": [{"prompt": f"Stance of text {i}?", "answer": "ABC"[i % 3]} for i in range(6)],
            "NumGLUE-cm": [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)]}
    for task, rs in recs.items():
        (root / task).mkdir(parents=True)
        (root / task / "train.json").write_text(json.dumps(rs))
    return recs


def rollout(task, idx, prompt, response, logprobs):
    return {"task": task, "idx": idx, "prompt": prompt, "response": response, "token_ids": list(range(len(logprobs))),
            "logprobs": logprobs, "mean_logprob": sum(logprobs) / len(logprobs), "num_tokens": len(logprobs),
            "finish_reason": "stop"}


@pytest.fixture
def files(tmp_path):
    recs = write_trace(tmp_path / "trace")
    rows = []
    for i, r in enumerate(recs["FOMC"]):  # right on 0, 2, 4; wrong on 1, 3; empty on 5
        response = r["answer"] if i % 2 == 0 else ("   " if i == 5 else "C" if r["answer"] != "C" else "A")
        rows.append(rollout("FOMC", i, r["prompt"], response, [-0.1 * (i + 1)] * 3))
    for i, r in enumerate(recs["NumGLUE-cm"]):  # right on 0, 1; wrong on 2, 3, 4
        rows.append(rollout("NumGLUE-cm", i, r["prompt"], f"The answer is {2 * i if i < 2 else 99}.",
                            [-0.5 + 0.1 * i, -0.2]))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path, path


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_score_ru_picks_correct_rollouts(files, capsys):
    tmp, path = files
    out = score.main(["--rollouts", str(path), "--data", str(tmp / "trace"), "--scorer", "ru", "--budget", "5",
                      "--out", str(tmp / "buf.jsonl")])
    buf = read(out)
    assert [b["task"] for b in buf] == ["FOMC"] * 3 + ["NumGLUE-cm"] * 2
    assert sorted(b["idx"] for b in buf if b["task"] == "FOMC") == [0, 2, 4]
    assert sorted(b["idx"] for b in buf if b["task"] == "NumGLUE-cm") == [0, 1]
    assert all(b["score"] == 100.0 and b["scorer"] == "ru" and b["source"] == str(path) for b in buf)
    assert buf[0]["response"] == "A" and buf[0]["prompt"].startswith("Stance of text")
    table = capsys.readouterr().out
    assert "| FOMC | 6 | 0 | 3 | 0.000 | 50.000 | 100.000 | 3 | 1 |" in table
    assert "| NumGLUE-cm | 5 | 0 | 2 | 0.000 | 0.000 | 100.000 | 2 | 0 |" in table


def test_score_skips_rollouts_too_long_to_train_on(files, tmp_path, capsys):
    """With --max-len and --tokenizer, a rollout longer than train.py's --max-len (which would drop it from the next
    stage, leaving the buffer short) is no candidate: the next best takes its place, and it is counted."""
    from model.base import write_random_tiny
    from model.tokenizer import ChatTokenizer
    tmp, path = files
    rows = read(path)
    rows[0]["response"] = "A" + " and so on" * 60  # right (first letter), and long
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = tmp_path / "base"
    write_random_tiny(base)
    tok = ChatTokenizer.from_dir(base)
    assert tok.sft_length(rows[0]["prompt"], rows[0]["response"]) > 64 >= max(
        tok.sft_length(r["prompt"], r["response"]) for r in rows[1:])
    args = ["--rollouts", str(path), "--data", str(tmp / "trace"), "--scorer", "ru", "--budget", "5"]
    unchecked = read(score.main(args + ["--out", str(tmp / "a.jsonl")]))
    assert sorted(b["idx"] for b in unchecked if b["task"] == "FOMC") == [0, 2, 4]
    capsys.readouterr()
    out = score.main(args + ["--max-len", "64", "--tokenizer", str(base), "--out", str(tmp / "b.jsonl")])
    fomc = [b["idx"] for b in read(out) if b["task"] == "FOMC"]
    assert len(fomc) == 3 and 0 not in fomc and {2, 4} <= set(fomc)
    assert json.loads(score.stats_path(out).read_text())["tasks"]["FOMC"]["overlong"] == 1
    assert "| FOMC | 5 | 1 | 3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        score.main(args + ["--max-len", "64", "--out", str(tmp / "c.jsonl")])  # one without the other


def test_score_ru_scoring_conventions(files, capsys):
    """--scoring reaches the RU metric: "The answer is 0." is right when read leniently, wrong under the official
    code's rule (its last number string is "0.", not the gold "0") and under TRACE's (whole string != "0")."""
    tmp, path = files
    for scoring, numglue_passed in (("lenient", 2), ("paper", 0), ("trace", 0)):
        buf = read(score.main(["--rollouts", str(path), "--data", str(tmp / "trace"), "--scorer", "ru", "--budget",
                               "11", "--scoring", scoring, "--out", str(tmp / f"{scoring}.jsonl")]))
        assert {b["scoring"] for b in buf} == {scoring}
        numglue = {b["idx"]: b["score"] for b in buf if b["task"] == "NumGLUE-cm"}
        assert numglue == {0: 100.0 * (numglue_passed > 0), 1: 100.0 * (numglue_passed > 0), 2: 0.0, 3: 0.0, 4: 0.0}
        fomc = {b["idx"]: b["score"] for b in buf if b["task"] == "FOMC"}  # bare letters: the same in all three
        assert fomc == {0: 100.0, 1: 0.0, 2: 100.0, 3: 0.0, 4: 100.0, 5: 0.0}
        out = capsys.readouterr().out
        best = "100.000" if numglue_passed else "0.000"
        assert f"scoring={scoring}" in out
        assert f"| NumGLUE-cm | 5 | 0 | 5 | 0.000 | 0.000 | {best} | {numglue_passed} | 0 |" in out


def test_score_task_budgets_each_task_its_own_count(files):
    tmp, path = files
    buf = read(score.main(["--rollouts", str(path), "--data", str(tmp / "trace"), "--scorer", "ru",
                           "--task-budgets", "FOMC=2,NumGLUE-cm=9", "--out", str(tmp / "b.jsonl")]))
    # FOMC: 2 of its three right answers; NumGLUE-cm: capped at its 5 rollouts, nothing moves to FOMC
    assert [b["task"] for b in buf] == ["FOMC"] * 2 + ["NumGLUE-cm"] * 5
    assert {b["idx"] for b in buf if b["task"] == "FOMC"} <= {0, 2, 4}
    with pytest.raises(ValueError, match="names FOMC but .* holds rollouts of FOMC, NumGLUE-cm"):
        score.main(["--rollouts", str(path), "--scorer", "sc", "--task-budgets", "FOMC=2", "--out",
                    str(tmp / "c.jsonl")])
    with pytest.raises(SystemExit):
        score.main(["--rollouts", str(path), "--scorer", "sc", "--task-budgets", "FOMC=2", "--budget", "3"])
    with pytest.raises(SystemExit):
        score.main(["--rollouts", str(path), "--scorer", "sc", "--task-budgets", "FOMC=x"])
    assert not (tmp / "c.jsonl").exists()


def test_score_sc_mean_logprob_and_empty_is_lowest(files):
    tmp, path = files
    out = score.main(["--rollouts", str(path), "--scorer", "sc", "--budget", "11", "--select", "low",
                      "--out", str(tmp / "buf.jsonl")])
    buf = read(out)
    fomc = [b for b in buf if b["task"] == "FOMC"]
    assert len(fomc) == 6 and fomc[0]["idx"] == 5 and fomc[0]["score"] is None  # empty response -> -inf -> first
    assert [b["idx"] for b in fomc[1:]] == [4, 3, 2, 1, 0]
    assert fomc[1]["score"] == pytest.approx(-0.5)
    numglue = [b for b in buf if b["task"] == "NumGLUE-cm"]
    assert [b["idx"] for b in numglue] == [0, 1, 2, 3, 4]
    assert numglue[0]["score"] == pytest.approx((-0.5 - 0.2) / 2)


def test_score_default_budget_rho_n_and_task_order(files):
    tmp, path = files
    # default b = 0.01 * 5000 = 50 > 11 rollouts: everything, tasks in --tasks order
    buf = read(score.main(["--rollouts", str(path), "--scorer", "sc", "--tasks", "NumGLUE-cm,FOMC",
                           "--out", str(tmp / "b.jsonl")]))
    assert [b["task"] for b in buf] == ["NumGLUE-cm"] * 5 + ["FOMC"] * 6
    # 3 over two tasks: the remainder goes to the earliest (NumGLUE-cm here)
    buf = read(score.main(["--rollouts", str(path), "--scorer", "sc", "--tasks", "NumGLUE-cm,FOMC",
                           "--rho", "0.01", "--n", "300", "--out", str(tmp / "b.jsonl")]))
    assert [b["task"] for b in buf] == ["NumGLUE-cm"] * 2 + ["FOMC"]
    a = read(score.main(["--rollouts", str(path), "--scorer", "sc", "--budget", "4", "--select", "random",
                         "--seed", "5", "--out", str(tmp / "r1.jsonl")]))
    b = read(score.main(["--rollouts", str(path), "--scorer", "sc", "--budget", "4", "--select", "random",
                         "--seed", "5", "--out", str(tmp / "r2.jsonl")]))
    assert a == b and len(a) == 4


@pytest.mark.parametrize("case, parts", [
    ("malformed", ["rollouts.jsonl: ", "line 3", "malformed JSON"]),
    ("unknown_task", ["rollouts.jsonl: ", "line 2", "unknown task 'NotATask'"]),
    ("missing_field", ["rollouts.jsonl: ", "line 4", "missing field 'logprobs'"]),
    ("bad_idx", ["rollouts.jsonl: ", "line 1", "idx 77 is not a record of", "FOMC/train.json"]),
    ("other_prompt", ["rollouts.jsonl: ", "line 1", "prompt differs from", "FOMC/train.json record 0"]),
])
def test_score_bad_input_names_file_and_line_and_writes_nothing(files, case, parts):
    tmp, path = files
    lines = path.read_text().splitlines()
    if case == "malformed":
        lines[2] = lines[2][:-5]
    elif case == "unknown_task":
        lines[1] = lines[1].replace('"FOMC"', '"NotATask"')
    elif case == "missing_field":
        r = json.loads(lines[3])
        del r["logprobs"]
        lines[3] = json.dumps(r)
    elif case == "bad_idx":
        lines[0] = lines[0].replace('"idx": 0', '"idx": 77')
    else:
        lines[0] = lines[0].replace("Stance of text 0?", "Something else")
    path.write_text("\n".join(lines) + "\n")
    out = tmp / "buffer.jsonl"
    with pytest.raises(ValueError) as err:
        score.main(["--rollouts", str(path), "--data", str(tmp / "trace"), "--scorer", "ru", "--budget", "5",
                    "--out", str(out)])
    for part in parts:
        assert part in str(err.value)
    assert not out.exists() and not list(tmp.glob(".buffer.jsonl*"))


def test_score_tasks_flag_without_rollouts_fails(files):
    tmp, path = files
    with pytest.raises(ValueError, match="no rollouts for task.*C-STANCE"):
        score.main(["--rollouts", str(path), "--scorer", "sc", "--tasks", "C-STANCE,FOMC", "--out",
                    str(tmp / "b.jsonl")])
    assert not (tmp / "b.jsonl").exists()


@pytest.mark.skipif(not SHARED_TRACE.is_dir(), reason="real TRACE files not available")
def test_score_ru_against_real_trace_gold(tmp_path):
    """Gold looked up by idx in the real (5,000-record) files: a rollout that copies the gold answer scores 100."""
    from data.trace import load_task
    rows = []
    for task in ("FOMC", "NumGLUE-ds"):
        exs = load_task(SHARED_TRACE, task, "train")[:8]  # one rollout per prompt: 4 copy the gold, 4 are empty
        for i, ex in enumerate(exs):
            rows.append(rollout(task, ex.idx, ex.prompt, ex.answer if i < 4 else "", [-0.1]))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    buf = read(score.main(["--rollouts", str(path), "--data", str(SHARED_TRACE), "--scorer", "ru", "--budget", "8",
                           "--out", str(tmp_path / "b.jsonl")]))
    assert len(buf) == 8 and all(b["score"] == 100.0 and b["response"] for b in buf)


# --- the buffer's loss bound (Eq. 3) and the RU/SC rank correlation ------------------------------------------------

def test_spearman_exact_values_and_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, -math.inf]) == pytest.approx(-1.0)
    assert spearman([5, 5, 5], [1, 2, 3]) is None and spearman([1], [2]) is None
    # ties get average ranks: x ranks [1.5, 1.5, 3, 4], y ranks [1, 2, 3, 4] -> 4.5 / sqrt(4.5 * 5)
    assert spearman([0, 0, 1, 2], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    scipy_stats = pytest.importorskip("scipy.stats")
    xs, ys = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]
    assert spearman(xs, ys) == pytest.approx(scipy_stats.spearmanr(xs, ys).statistic)


def test_score_records_nll_bound_and_rank_correlation(files, capsys):
    """Hand-checked: FOMC rollout i has l = 0.1 (i + 1) and is right on 0, 2, 4 (5 is empty); NumGLUE-cm rollout i
    has logprobs [-0.5 + 0.1 i, -0.2], so l = 0.35 - 0.05 i, right on 0, 1."""
    tmp, path = files
    out = score.main(["--rollouts", str(path), "--data", str(tmp / "trace"), "--scorer", "ru", "--budget", "5",
                      "--out", str(tmp / "buf.jsonl")])
    stats = json.loads((tmp / "buf_stats.json").read_text())
    assert score.stats_path(out) == tmp / "buf_stats.json"
    assert stats["scorer"] == "ru" and stats["select"] == "top" and stats["budget"] == 5
    fomc, ng = stats["tasks"]["FOMC"], stats["tasks"]["NumGLUE-cm"]
    assert fomc["n"] == 6 and fomc["selected"]["n"] == 3 and fomc["rejected"]["n"] == 3
    assert fomc["selected"]["nll_mean"] == pytest.approx(0.3) and fomc["selected"]["nll_max"] == pytest.approx(0.5)
    assert fomc["selected"]["token_nll_max"] == pytest.approx(0.5)
    assert fomc["rejected"]["nll_mean"] == pytest.approx(0.4) and fomc["rejected"]["nll_max"] == pytest.approx(0.6)
    assert ng["selected"]["nll_mean"] == pytest.approx(0.325) and ng["selected"]["nll_max"] == pytest.approx(0.35)
    assert ng["selected"]["token_nll_max"] == pytest.approx(0.5)
    assert ng["rejected"]["nll_mean"] == pytest.approx(0.2) and ng["rejected"]["nll_max"] == pytest.approx(0.25)
    assert ng["rejected"]["token_nll_max"] == pytest.approx(0.3)
    # FOMC: RU ranks [4,1,4,1,4,1], SC ranks [5,4,3,2,1,0] (the empty one is -inf) -> 4.5 / sqrt(13.5 * 17.5)
    assert fomc["spearman_ru_sc"] == pytest.approx(4.5 / math.sqrt(13.5 * 17.5))
    # NumGLUE-cm: RU ranks [3.5,3.5,1,1,1], SC ranks [0,1,2,3,4] -> -7.5 / sqrt(7.5 * 10)
    assert ng["spearman_ru_sc"] == pytest.approx(-7.5 / math.sqrt(75))
    scipy_stats = pytest.importorskip("scipy.stats")
    ru = [100, 0, 100, 0, 100, 0, 100, 100, 0, 0, 0]
    sc = [max(score.sc_score(r), -1e9) for r in read(path)]  # the file's own floats: -0.3 may tie or not
    assert stats["spearman_ru_sc"] == pytest.approx(scipy_stats.spearmanr(ru, sc).statistic)
    assert stats["all"]["selected"]["n"] == 5 and stats["all"]["rejected"]["n"] == 6
    assert stats["all"]["selected"]["nll_max"] == pytest.approx(0.5)
    assert stats["all"]["rejected"]["nll_mean"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.25 + 0.2 + 0.15) / 6)
    assert "| FOMC | 6 | 0 | 3 | 0.000 | 50.000 | 100.000 | 3 | 1 | 0.300 | 0.500 | 0.400 | 0.293 |" in \
        capsys.readouterr().out


def test_score_low_selection_breaks_the_bound_and_sc_without_gold_has_no_correlation(files):
    tmp, path = files
    score.main(["--rollouts", str(path), "--scorer", "sc", "--budget", "4", "--select", "low",
                "--out", str(tmp / "low.jsonl")])
    stats = json.loads((tmp / "low_stats.json").read_text())
    assert stats["spearman_ru_sc"] is None and stats["tasks"]["FOMC"]["spearman_ru_sc"] is None  # no --data
    # lowest SC = highest l: FOMC keeps 5 (empty, l 0.6) and 4 (l 0.5); NumGLUE-cm keeps 0 and 1
    assert stats["tasks"]["FOMC"]["selected"]["nll_mean"] == pytest.approx(0.55)
    assert stats["tasks"]["FOMC"]["selected"]["nll_max"] == pytest.approx(0.6)
    assert stats["tasks"]["FOMC"]["rejected"]["nll_max"] == pytest.approx(0.4)
    assert stats["all"]["selected"]["nll_mean"] > stats["all"]["rejected"]["nll_mean"]
    # sc with --data: the gold answers are read, so the correlation is there
    score.main(["--rollouts", str(path), "--scorer", "sc", "--data", str(tmp / "trace"), "--budget", "4",
                "--out", str(tmp / "top.jsonl")])
    assert json.loads((tmp / "top_stats.json").read_text())["tasks"]["NumGLUE-cm"]["spearman_ru_sc"] == \
        pytest.approx(-7.5 / math.sqrt(75))
