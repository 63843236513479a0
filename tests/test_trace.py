"""data/trace.py: the TRACE loader on real files and on synthetic ones (records, JSON Lines and their error
messages, through data/jsonl.py), and the over-long filter. The embedded benchmark: tests/test_embedded.py."""

import json
import sys
from pathlib import Path

import pytest

from data.metrics import score
from data.trace import Example, filter_overlong, filter_report, load_task

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "trace"


# --- real TRACE files ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task,counts", [("FOMC", (5000, 496, 496)), ("NumGLUE-cm", (5000, 41, 81)),
                                         ("NumGLUE-ds", (5000, 164, 325))])
def test_real_trace_files(task, counts):
    if not (SHARED / task).is_dir():
        pytest.skip(f"{SHARED / task} not present")
    for split, n in zip(("train", "eval", "test"), counts):
        exs = load_task(SHARED, task, split)
        assert len(exs) == n
        assert [e.idx for e in exs] == list(range(n))
        assert all(e.task == task and e.prompt and e.answer for e in exs)
        # every gold answer scores 100 against itself under the task metric
        assert all(score(task, e.answer, e.answer, e.prompt) == 100 for e in exs)
    if task == "FOMC":
        assert {e.answer for e in exs} == {"A", "B", "C"}
        assert exs[0].prompt.startswith("What is the monetary policy stance")


def test_real_train_subsample_keeps_source_index():
    if not (SHARED / "FOMC").is_dir():
        pytest.skip("shared TRACE data not present")
    full = load_task(SHARED, "FOMC", "train")
    sub = load_task(SHARED, "FOMC", "train", max_train=100, seed=3)
    assert len(sub) == 100 and sub == load_task(SHARED, "FOMC", "train", max_train=100, seed=3)
    assert sub != load_task(SHARED, "FOMC", "train", max_train=100, seed=4)
    assert all(full[e.idx] == e for e in sub)
    assert [e.idx for e in sub] == sorted(e.idx for e in sub)


# --- loader on synthetic files ---------------------------------------------------------------------------------

def _write(root, task, split, text):
    d = root / task
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{split}.json").write_text(text, encoding="utf-8")
    return d / f"{split}.json"


def test_loader_json_list_jsonl_and_subsample(tmp_path):
    recs = [{"prompt": f"p{i}", "answer": f"a{i}", "extra": 1} for i in range(10)]
    _write(tmp_path, "FOMC", "train", json.dumps(recs))
    exs = load_task(tmp_path, "FOMC", "train")
    assert exs[3] == Example("FOMC", 3, "p3", "a3")
    sub = load_task(tmp_path, "FOMC", "train", max_train=4, seed=0)
    assert len(sub) == 4 and all(e.prompt == f"p{e.idx}" for e in sub)
    # JSON Lines (blank lines allowed), under .json or .jsonl
    _write(tmp_path, "FOMC", "eval", "\n".join(json.dumps(r) for r in recs[:3]) + "\n\n")
    assert [e.answer for e in load_task(tmp_path, "FOMC", "eval")] == ["a0", "a1", "a2"]
    (tmp_path / "FOMC" / "test.jsonl").write_text(json.dumps(recs[0]) + "\n", encoding="utf-8")
    assert load_task(tmp_path, "FOMC", "test")[0].prompt == "p0"
    # eval/test are never subsampled
    assert len(load_task(tmp_path, "FOMC", "eval", max_train=1)) == 3


def _err(tmp_path, text, split="train"):
    path = _write(tmp_path, "FOMC", split, text)
    with pytest.raises(ValueError) as e:
        load_task(tmp_path, "FOMC", split)
    msg = str(e.value)
    assert str(path) in msg, msg
    return msg


def test_read_records_field_types(tmp_path):
    from data.jsonl import read_records
    p = tmp_path / "predictions.jsonl"
    p.write_text('{"idx": 0, "score": 100.0}\n{"idx": 1, "score": 0}\n{"idx": 2, "score": "0"}\n')
    types = {"idx": int, "score": (int, float)}
    with pytest.raises(ValueError, match=r"record 2 \(line 3\): field 'score' must be int or float, got str"):
        read_records(p, required=("idx", "score"), types=types)
    p.write_text('{"idx": 0, "score": 100.0}\n{"idx": 1, "score": 0}\n')
    assert [r["score"] for r in read_records(p, required=("idx", "score"), types=types)] == [100.0, 0]


def test_loader_errors_name_file_record_field(tmp_path):
    good = {"prompt": "p", "answer": "A"}
    # malformed JSON in the third record of a list
    msg = _err(tmp_path, json.dumps([good, good])[:-1] + ', {"prompt": "p", "answer": }]')
    assert "malformed JSON in record 2" in msg and "line 1" in msg
    # missing field
    msg = _err(tmp_path, json.dumps([good, {"prompt": "p"}]))
    assert "record 1" in msg and "missing field 'answer'" in msg
    # non-string field
    msg = _err(tmp_path, json.dumps([{"prompt": "p", "answer": 3}]))
    assert "record 0" in msg and "field 'answer' must be a string, got int" in msg
    # not an object
    assert "record 1" in _err(tmp_path, json.dumps([good, ["p", "A"]]))
    # empty file / empty list
    assert "empty" in _err(tmp_path, "")
    assert "empty" in _err(tmp_path, "  \n")
    assert "no records" in _err(tmp_path, "[]")
    # JSON Lines: record number and line number
    msg = _err(tmp_path, json.dumps(good) + "\n\n" + '{"prompt": "p", "answer": "A"\n')
    assert "malformed JSON in record 1 (line 3, column" in msg
    msg = _err(tmp_path, json.dumps(good) + "\n" + json.dumps({"answer": "A"}) + "\n")
    assert "record 1 (line 2)" in msg and "missing field 'prompt'" in msg
    # trailing garbage after the list
    assert "after record 0" in _err(tmp_path, json.dumps([good]) + " x")


def test_loader_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(ValueError, match=r"MeetingBank[/\\]test\.json: file not found"):
        load_task(tmp_path, "MeetingBank", "test")
    with pytest.raises(ValueError, match=r"unknown task 'FOMX'; valid tasks: C-STANCE, FOMC, MeetingBank"):
        load_task(tmp_path, "FOMX", "train")
    with pytest.raises(ValueError, match=r"unknown split 'dev'"):
        load_task(tmp_path, "FOMC", "dev")


# every character str.splitlines() ends a line at (computed, so that one a later Python adds is covered), and "\r\n"
LINE_BREAKS = [c for c in map(chr, range(sys.maxunicode + 1)) if len(f"a{c}b".splitlines()) > 1] + ["\r\n"]


def test_jsonl_round_trips_every_line_break_in_any_string_field(tmp_path):
    """write_jsonl -> read_records keeps every record whole, whichever line-ending character a string holds, in
    whichever field (a key, a nested string included); the file has one line per record for str.splitlines too."""
    from data.jsonl import read_records
    from data.outputs import write_jsonl
    assert {"\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"} <= set(LINE_BREAKS)
    for i, c in enumerate(LINE_BREAKS):
        records = [{"prompt": f"p{c}q", "answer": "A"}, {"prompt": "p", "answer": c},
                   {"prompt": [{"role": "user", "content": f"{c}u"}], "answer": f"a{c}", f"k{c}": [f"x{c}y", {c: c}]}]
        path = write_jsonl(tmp_path / f"r{i}.jsonl", records)
        assert read_records(path, required=("prompt", "answer"), types={"prompt": (str, list)}) == records, repr(c)
        assert len(path.read_text(encoding="utf-8").splitlines()) == len(records), repr(c)


def test_jsonl_with_raw_line_separators_inside_strings_is_read(tmp_path):
    """A hand-written file (another tool's, or ours before U+2028/U+2029/U+0085 were escaped) holds them raw: valid
    JSON Lines, read whole; a "\r\n" line end is accepted, and line numbers count '\n' only."""
    text = ('{"prompt": "a\u2028b", "answer": "A"}\n'
            '{"prompt": "c\u2029d\u0085e", "answer": "B"}\r\n'
            '\n'
            '{"prompt": "f", "answer": "C"}\n')
    path = _write(tmp_path, "FOMC", "train", text)
    assert [(e.prompt, e.answer) for e in load_task(tmp_path, "FOMC", "train")] == \
        [("a\u2028b", "A"), ("c\u2029d\u0085e", "B"), ("f", "C")]
    path.write_text(text + '{"prompt": "g\u2028", "answer": }\n', encoding="utf-8")
    assert "malformed JSON in record 3 (line 5, column" in _err(tmp_path, path.read_text(encoding="utf-8"))


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]


@pytest.mark.parametrize("const", NON_FINITE)
def test_records_refuse_non_finite_numbers_naming_file_record_and_constant(tmp_path, const):
    """Python's JSON reader takes NaN, Infinity and 1e999 (an infinity); the record readers refuse them, in a JSON
    Lines file (record and line) and in a JSON list (record), with the field that holds them."""
    good = '{"prompt": "p", "answer": "A"}'
    bad = f'{{"prompt": "p", "answer": "A", "score": {const}}}'
    msg = _err(tmp_path, f"{good}\n{bad}\n")
    assert f"record 1 (line 2): field 'score': {const} is " in msg and "\n" not in msg, msg
    msg = _err(tmp_path, f"[{good},\n {bad}]")
    assert f"record 1 (line 2): field 'score': {const} is " in msg and "\n" not in msg, msg


@pytest.mark.parametrize("const", NON_FINITE)
def test_checkpoint_json_refuses_non_finite_numbers(tmp_path, const):
    """config.json, the safetensors index and the tokenizer's JSON files: a NaN or infinity anywhere in them is
    refused when parsed, naming the file and the constant."""
    from model.checkpoint import load_config, weight_files
    from model.tokenizer import _read_json
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_config(tmp_path).rms_norm_eps == 1e-5
    files = {"config.json": lambda: load_config(tmp_path),
             "model.safetensors.index.json": lambda: weight_files(tmp_path),
             "tokenizer_config.json": lambda: _read_json(tmp_path / "tokenizer_config.json")}
    for name, read in files.items():
        (tmp_path / name).write_text(json.dumps({**config, "weight_map": {}}).replace("1e-05", const))
        with pytest.raises(ValueError) as e:
            read()
        assert f"{tmp_path / name}: field 'rms_norm_eps': {const} is " in str(e.value), str(e.value)


def test_jsonl_integers_too_long_for_python_are_one_error(tmp_path):
    msg = _err(tmp_path, '{"prompt": "p", "answer": "A", "n": ' + "9" * 5000 + "}\n")
    assert "record 0 (line 1): an integer of 5000 digits is too large" in msg


def test_filter_overlong():
    exs = [Example("FOMC", i, "w " * i, "A") for i in range(10)]
    kept, dropped = filter_overlong(exs, lambda p, a: len(p.split()) + len(a.split()), max_len=5)
    assert [e.idx for e in kept] == [0, 1, 2, 3, 4] and dropped == 5
    assert filter_report("FOMC", "train", 10, dropped, max_len=5) == \
        "FOMC/train: kept 5/10 (dropped 5 over 5 tokens)"
