"""evaluate.py on an untrained tiny Llama and a tiny embedded benchmark: output files and fields, scores.json equals
the per-example metrics recomputed from predictions.jsonl, repeats, the over-long filter, and errors that write
nothing."""
import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

from data.embedded import write_benchmark
from data.conventions import score
from data.tasks import TASK_ORDER
from data.trace import load_task
from model.tokenizer import ChatTokenizer
import forkserver

REPO = Path(__file__).resolve().parents[1]
PRED_FIELDS = {"task", "idx", "repeat", "prompt", "prediction", "gold", "score", "finish_reason", "num_tokens"}
torch.set_num_threads(1)  # 2 shared cores: more threads only slow tiny ops down
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    # Py150's fuzzy-match metric gives partial credit to any text, so the score checks are not all 0 == 0
    root = tmp_path_factory.mktemp("trace")
    write_benchmark(root, n_train=4, n_eval=2, n_test=4, tasks="FOMC,NumGLUE-cm,Py150")
    return root


def read_predictions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def evaluate(*args) -> Path:
    import evaluate as ev
    return ev.main([str(a) for a in args] + ["--quiet"])


def test_evaluate_script_end_to_end(tiny_ckpt, data_root):
    """Subprocess, default tasks and output dir, 2 repeats at temperature 1: every number in scores.json is
    recomputed here from predictions.jsonl with data.conventions.score."""
    r = forkserver.run([sys.executable, "evaluate.py", "--ckpt", str(tiny_ckpt), "--data", str(data_root),
                        "--max-new-tokens", "8", "--repeats", "2", "--temperature", "1.0", "--engine", "native",
                        "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=ENV)
    assert r.returncode == 0, r.stderr
    out = tiny_ckpt / "eval"
    assert "FOMC/test: kept 4/4 (dropped 0 over 2048 tokens)" in r.stdout
    summary = json.loads((out / "scores.json").read_text())
    rows = read_predictions(out)
    tasks = ["FOMC", "Py150", "NumGLUE-cm"]  # every task under --data, in TRACE order
    assert [t for t in TASK_ORDER if t in tasks] == tasks

    assert set(summary) >= {"ckpt", "scores", "std_over_repeats", "n", "dropped_overlong", "scoring", "temperature",
                            "repeats"}
    assert summary["ckpt"] == str(tiny_ckpt) and summary["temperature"] == 1.0 and summary["repeats"] == 2
    for key in ("scores", "std_over_repeats", "n", "dropped_overlong"):
        assert list(summary[key]) == tasks, key
    assert summary["n"] == {t: 4 for t in tasks} and summary["dropped_overlong"] == {t: 0 for t in tasks}

    # one line per (example, repeat), in task, idx, repeat order, fields as documented
    assert [(x["task"], x["idx"], x["repeat"]) for x in rows] == \
        [(t, i, k) for t in tasks for i in range(4) for k in range(2)]
    test = {t: {ex.idx: ex for ex in load_task(data_root, t, "test")} for t in tasks}
    for x in rows:
        assert set(x) == PRED_FIELDS
        ex = test[x["task"]][x["idx"]]
        assert x["prompt"] == ex.prompt and x["gold"] == ex.answer
        assert x["score"] == score(x["task"], x["prediction"], x["gold"], x["prompt"])
        assert 1 <= x["num_tokens"] <= 8 and x["finish_reason"] in ("stop", "length")
        assert x["finish_reason"] == "stop" or x["num_tokens"] == 8

    for t in tasks:
        per_repeat = [statistics.mean(x["score"] for x in rows if x["task"] == t and x["repeat"] == k)
                      for k in range(2)]
        assert summary["scores"][t] == pytest.approx(statistics.mean(per_repeat), abs=1e-9)
        assert summary["std_over_repeats"][t] == pytest.approx(statistics.pstdev(per_repeat), abs=1e-9)
        assert 0 <= summary["scores"][t] <= 100
    assert summary["scores"]["Py150"] > 0  # partial credit: the equality checks above compared real numbers

    # at temperature 1 the two repeats of a prompt are independent draws, not copies
    pairs = {}
    for x in rows:
        pairs.setdefault((x["task"], x["idx"]), []).append(x["prediction"])
    assert sum(a != b for a, b in pairs.values()) >= len(pairs) // 2

    # the per-task table is printed
    for t in tasks:
        assert f"| {t} | 4 | 0 | {summary['scores'][t]:.2f} |" in r.stdout


def test_evaluate_is_reproducible(tiny_ckpt, data_root, tmp_path):
    """The same seed gives the same predictions; --scoring only changes how they are scored (and is recorded)."""
    for name, scoring in (("a", "lenient"), ("b", "trace")):
        evaluate("--ckpt", tiny_ckpt, "--data", data_root, "--tasks", "NumGLUE-cm,FOMC", "--max-new-tokens", "4",
                 "--temperature", "1.0", "--seed", "3", "--out", tmp_path / name, "--scoring", scoring)
    a, b = read_predictions(tmp_path / "a"), read_predictions(tmp_path / "b")
    assert [{k: v for k, v in x.items() if k != "score"} for x in a] == \
        [{k: v for k, v in x.items() if k != "score"} for x in b]
    for x, y in zip(a, b):
        assert x["score"] == score(x["task"], x["prediction"], x["gold"], x["prompt"], scoring="lenient")
        assert y["score"] == score(y["task"], y["prediction"], y["gold"], y["prompt"], scoring="trace")
    summary = json.loads((tmp_path / "a" / "scores.json").read_text())
    assert list(summary["scores"]) == ["NumGLUE-cm", "FOMC"]  # --tasks order is kept
    assert summary["repeats"] == 1 and summary["std_over_repeats"] == {"NumGLUE-cm": 0.0, "FOMC": 0.0}
    assert summary["scoring"] == "lenient" and json.loads((tmp_path / "b" / "scores.json").read_text())["scoring"] == \
        "trace"


def test_overlong_test_examples_are_dropped_and_counted(tiny_ckpt, data_root, tmp_path):
    """Same length rule as training: len(encode_sft(prompt, answer) ids) > --max-len is dropped."""
    tok = ChatTokenizer.from_dir(tiny_ckpt)
    length = {t: {ex.idx: len(tok.encode_sft(ex.prompt, ex.answer)[0]) for ex in load_task(data_root, t, "test")}
              for t in ("FOMC", "NumGLUE-cm")}
    max_len = max(length["FOMC"].values()) - 1
    want = {t: sorted(i for i, n in length[t].items() if n <= max_len) for t in length}
    assert 0 < len(want["FOMC"]) < 4  # the limit splits FOMC's test set

    out = evaluate("--ckpt", tiny_ckpt, "--data", data_root, "--tasks", "FOMC,NumGLUE-cm", "--max-new-tokens", "2",
                   "--max-len", max_len, "--out", tmp_path / "ev")
    summary = json.loads((out / "scores.json").read_text())
    rows = read_predictions(out)
    for t in want:
        assert sorted(x["idx"] for x in rows if x["task"] == t) == want[t]
        assert summary["n"][t] == len(want[t]) and summary["dropped_overlong"][t] == 4 - len(want[t])

    # a limit that drops a whole task is an error, not a silent empty score
    with pytest.raises(ValueError, match="FOMC.test.json: no example fits max length 5"):
        evaluate("--ckpt", tiny_ckpt, "--data", data_root, "--tasks", "FOMC", "--max-len", "5", "--out", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_unknown_task_fails_and_writes_nothing(tiny_ckpt, data_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # a flag error: argparse's exit 2 naming the flag
        evaluate("--ckpt", tiny_ckpt, "--data", data_root, "--tasks", "FOMC,NotATask", "--out", tmp_path / "ev")
    assert e.value.code == 2 and "argument --tasks: unknown task 'NotATask'" in capsys.readouterr().err
    # a known task without a test file under --data names the missing file
    with pytest.raises(ValueError, match="MeetingBank/test.json: file not found"):
        evaluate("--ckpt", tiny_ckpt, "--data", data_root, "--tasks", "FOMC,MeetingBank", "--out", tmp_path / "ev")
    assert not (tmp_path / "ev").exists()


def test_checkpoint_without_tokenizer_fails_naming_it(tiny_ckpt, data_root, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((tiny_ckpt / f).read_bytes())
    r = forkserver.run([sys.executable, "evaluate.py", "--ckpt", str(bare), "--data", str(data_root), "--quiet"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode != 0
    assert f"{bare}: tokenizer.json not found" in r.stderr
    assert not (bare / "eval").exists()
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        evaluate("--ckpt", tmp_path / "missing", "--data", data_root, "--out", tmp_path / "ev")
    assert not (tmp_path / "ev").exists()


def test_rollout_and_evaluate_read_chat_files_as_their_prompt_answer_files(tiny_ckpt, data_root, tmp_path):
    """A TRACE root whose files hold chat records ({"messages": [user, assistant]}, JSON Lines) gives rollout.py and
    evaluate.py the examples of the prompt/answer files they were written from: the same rollouts, predictions and
    scores, byte for byte (data.manifest.as_prompt_record, the manifest's own converter)."""
    import rollout
    tasks = ["FOMC", "NumGLUE-cm"]
    chat = tmp_path / "chat"
    for t in tasks:
        for split in ("train", "test"):
            records = [{"messages": [{"role": "user", "content": r["prompt"]},
                                     {"role": "assistant", "content": r["answer"]}]}
                       for r in json.loads((data_root / t / f"{split}.json").read_text())]
            (chat / t).mkdir(parents=True, exist_ok=True)
            (chat / t / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for root, name in ((data_root, "trace"), (chat, "chat")):
        common = ["--ckpt", tiny_ckpt, "--data", root, "--tasks", ",".join(tasks), "--max-new-tokens", "4", "--engine",
                  "native"]
        evaluate(*common, "--out", tmp_path / name / "eval")
        rollout.main([str(a) for a in common] + ["--out", str(tmp_path / name / "rollouts.jsonl"), "--check-logprobs",
                                                 "0", "--quiet"])
    for f in ("eval/predictions.jsonl", "rollouts.jsonl"):
        a, b = (tmp_path / "trace" / f).read_bytes(), (tmp_path / "chat" / f).read_bytes()
        assert a == b and len(a.splitlines()) == 8, f  # 4 test / 4 train records per task
    a, b = (json.loads((tmp_path / name / "eval" / "scores.json").read_text()) for name in ("trace", "chat"))
    assert a.pop("data") != b.pop("data") and a == b
