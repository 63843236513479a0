"""TRACE loader (real files + error messages), over-long filter, and the embedded synthetic benchmark."""

import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data import embedded
from data.metrics import score
from data.tasks import TASK_ORDER
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


# --- embedded benchmark ----------------------------------------------------------------------------------------

def _hashes(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*.json"))}


def test_embedded_deterministic(tmp_path):
    kw = dict(n_train=64, n_eval=16, n_test=32)
    embedded.write_benchmark(tmp_path / "a", seed=0, **kw)
    embedded.write_benchmark(tmp_path / "b", seed=0, **kw)
    embedded.write_benchmark(tmp_path / "c", seed=1, **kw)
    ha, hb, hc = _hashes(tmp_path / "a"), _hashes(tmp_path / "b"), _hashes(tmp_path / "c")
    assert len(ha) == 24 and ha == hb
    assert all(ha[k] != hc[k] for k in ha)


def test_embedded_cli(tmp_path):
    out = tmp_path / "emb"
    r = subprocess.run([sys.executable, "-m", "data.embedded", "--out", str(out), "--n-train", "8", "--n-test", "4",
                        "--n-eval", "2", "--seed", "0", "--tasks", "FOMC,20Minuten"],
                       cwd=REPO, capture_output=True, text=True, check=True)
    assert "FOMC: train 8 eval 2 test 4" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["20Minuten", "FOMC"]
    assert len(load_task(out, "20Minuten", "test")) == 4


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    embedded.write_benchmark(root, n_train=128, n_eval=32, n_test=32, seed=0)
    return root, {t: {s: load_task(root, t, s) for s in ("train", "eval", "test")} for t in TASK_ORDER}


def test_embedded_gold_scores_100_and_sizes(bench):
    _, data = bench
    for task in TASK_ORDER:
        splits = data[task]
        assert [len(splits[s]) for s in ("train", "eval", "test")] == [128, 32, 32]
        prompts = [e.prompt for s in splits.values() for e in s]
        assert len(set(prompts)) == len(prompts), f"{task}: repeated prompt across splits"
        for e in (e for s in splits.values() for e in s):
            assert score(task, e.answer, e.answer, e.prompt) == pytest.approx(100), (task, e)
            assert len(e.prompt.split()) <= 40 and len(e.answer.split()) <= 12, (task, e)


def test_embedded_tiny_vocabulary(bench):
    _, data = bench
    for task in TASK_ORDER:
        words = {w for s in data[task].values() for e in s for w in (e.prompt + " " + e.answer).split()}
        assert len(words) <= 100, (task, len(words))


def _text_line(prompt):
    return prompt.split("Text:\n")[1].split("\n")[0]


def test_embedded_answer_is_a_function_of_the_prompt(bench):
    # solve() re-derives every gold answer from the prompt text alone (an independent parse of each rule)
    _, data = bench
    for task in TASK_ORDER:
        for e in (e for s in data[task].values() for e in s):
            assert embedded.solve(task, e.prompt) == e.answer, (task, e)


def test_embedded_large_test_splits_have_distinct_prompts():
    # the noise lever: hundreds of test prompts per task, none of them a training prompt
    for task in TASK_ORDER:
        exs = embedded.generate_task(task, 800, seed=0)
        assert len({e["prompt"] for e in exs}) == 800, task


def test_embedded_sizes_beyond_its_prompts_are_refused_and_leave_nothing(tmp_path, monkeypatch):
    """A size the templates cannot fill (run.py --n-train 5000) is one InputError naming the flags, checked in memory
    before anything is built; ensure_embedded's own failure leaves no hidden half-written folder in the cache."""
    from data.errors import InputError
    monkeypatch.setenv("OPR_CACHE", str(tmp_path))
    with pytest.raises(InputError, match=r"^--n-train 2000, --n-test 32: 2000 train \+ 32 eval \+ 32 test examples "
                                         r"per task, but the embedded task \S+ has only \d+ distinct prompts"):
        embedded.check_sizes(2000, 32, flags="--n-train 2000, --n-test 32")
    embedded.check_sizes(128, 32)  # the default sizes fit
    with pytest.raises(InputError, match="distinct prompts"):
        embedded.ensure_embedded(n_train=2000)
    assert list(tmp_path.iterdir()) == []


def test_embedded_stance_tasks_share_inputs_not_rules(bench):
    _, data = bench
    # the two verb tables are disjoint: no text has a letter in both tasks, so no rule is flipped between them
    verbs = {t: {v for vs in embedded.STANCE_VERBS[t].values() for v in vs} for t in ("C-STANCE", "FOMC")}
    assert verbs["C-STANCE"] and verbs["FOMC"] and not verbs["C-STANCE"] & verbs["FOMC"]
    frames = {}
    for task, other in (("C-STANCE", "FOMC"), ("FOMC", "C-STANCE")):
        frames[task] = set()
        for e in data[task]["train"] + data[task]["test"]:
            text = _text_line(e.prompt)
            assert e.answer == embedded.stance_label(task, text)
            with pytest.raises(ValueError, match="no .* verb"):
                embedded.stance_label(other, text)
            words = text.split()
            assert words[-2] in verbs[task] and words[-1] == "."  # the verb ends the text, next to the answer
            frames[task].add(" ".join(words[:-2]))  # the text with its verb taken out
    # ...while subjects, objects and the frame are shared: the same verb-less texts occur in both tasks
    assert len(frames["C-STANCE"] & frames["FOMC"]) >= 20
    # all three letters occur in all three letter tasks (ScienceQA answers with the same letters)
    for task in ("C-STANCE", "FOMC", "ScienceQA"):
        assert {e.answer[0] for e in data[task]["train"]} == {"A", "B", "C"}


def test_embedded_scienceqa_item_ends_the_prompt(bench):
    # the options are the three properties in one fixed order; the item that decides the letter ends the prompt
    _, data = bench
    rx = r"\nChoices:\nA\. hot\nB\. cold\nC\. wet\nQuestion:\nWhich one describes the (\w+) \?\nAnswer:$"
    for e in data["ScienceQA"]["train"] + data["ScienceQA"]["test"]:
        item = re.search(rx, e.prompt).group(1)
        prop = embedded.SCIENCE_PROPS["ABC".index(e.answer[0])]
        assert item in embedded.SCIENCE_ITEMS[prop] and e.answer == f"{e.answer[0]} because {item} is {prop}"


def test_embedded_arithmetic_tasks_share_inputs(bench):
    _, data = bench
    # the number ends the question, right before the answer; the words before it decide the operation
    pat = {"NumGLUE-cm": r"\n(\w+) buys one more (\w+) \. How many (\w+) now \? Had (\d+) \.\nAnswer:$",
           "NumGLUE-ds": r"\n(\w+) has a pair of bags of (\w+) \. How many (\w+) in all \? Each bag (\w+) \.\nAnswer:$"}
    seen, names = {}, {}
    for task, rx in pat.items():
        seen[task], names[task] = {}, set()
        for e in data[task]["train"]:
            m = re.search(rx, e.prompt)
            assert m and m.group(2) == m.group(3), e.prompt
            a = int(m.group(4)) if task == "NumGLUE-cm" else embedded.NUMBER_WORDS.index(m.group(4))
            assert e.answer == str(a + 1 if task == "NumGLUE-cm" else 2 * a)
            seen[task][a] = e.answer
            names[task].add(m.group(1))
        assert data[task]["train"][0].prompt.startswith("Solve the math problem.\nQuestion:\n")
    # the same names and numbers (digits in one, words in the other) in both tasks, different answers
    assert names["NumGLUE-cm"] == names["NumGLUE-ds"]
    both = set(seen["NumGLUE-cm"]) & set(seen["NumGLUE-ds"])
    assert sum(seen["NumGLUE-cm"][k] != seen["NumGLUE-ds"][k] for k in both) >= 5


def test_embedded_generative_tasks_are_graded(bench):
    _, data = bench
    # a half-right answer gets partial credit
    for task in ("MeetingBank", "Py150", "20Minuten"):
        e = data[task]["test"][0]
        words = e.answer.split()
        half = " ".join(words[: max(1, len(words) // 2)])
        assert 0 < score(task, half, e.answer, e.prompt) < 100, (task, half, e.answer)
    # ScienceQA: the letter decides, the reason does not
    e = data["ScienceQA"]["test"][0]
    assert score("ScienceQA", e.answer[0] + " because", e.answer, e.prompt) == 100


def test_general_mixture_and_corpus():
    mix = embedded.general_mixture(200, seed=0)
    assert mix == embedded.general_mixture(200, seed=0) and mix != embedded.general_mixture(200, seed=1)
    assert all(set(m) == {"prompt", "answer"} and m["prompt"] and m["answer"] for m in mix)
    assert len({m["prompt"].split("\n")[0].split(" after ")[0].split("?")[0] for m in mix}) == 10  # 8 kinds, "Which word" x 3 classes
    for m in mix:  # the letter kinds: the letter names the class of the word / the option of the asked class
        if m["prompt"].startswith("Is the word"):
            word = m["prompt"].split("Word:\n")[1].split("\n")[0]
            assert word in embedded.MIX_CLASSES[["color", "animal", "thing"]["ABC".index(m["answer"])]]
        if m["prompt"].startswith("Which word is"):
            cls = m["prompt"].split("?")[0].split()[-1]
            option = m["prompt"].split(f"{m['answer']}. ")[1].split(",")[0].rstrip(".")
            assert option in embedded.MIX_CLASSES[cls]
    task_heads = {embedded.MAKERS[t](random.Random(0))["prompt"].split("\n")[0] for t in TASK_ORDER}
    assert not any(m["prompt"].split("\n")[0] in task_heads for m in mix)
    corpus = embedded.corpus_texts(seed=0, n_per_task=20)
    text = "\n".join(corpus)
    for w in ["Zürich", "veräußerte", "<NUM_LIT:7>", "hawkish", "Wednesday", "STAR", "council"]:
        assert w in text
