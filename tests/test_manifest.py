"""Task manifests (data/manifest.py): a user's own stream of tasks, metrics and record formats.

Unit tests: every record format gives the same examples, the system prompt and chat turns reach the chat template,
a task without a test split gets a seeded held-out one, each kind of bad input is one InputError naming the manifest,
task and field, the new metrics, label diagnostics, and a manifest of the embedded benchmark that reproduces the TRACE
table's examples and scores. End to end (one run.py run on a tiny random model, then an edited manifest): a made-up
three-task stream (a classification task with its own labels, a chat task scored by exact match, a task with its own
scorer and no test split) through sft, replay and opr-ru; the report shows the matrix, the diagnostics count the
declared labels, and an edit of one task's settings re-runs exactly the steps that depend on it.
"""
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data import manifest
from data.manifest import check_scorer, load_manifest, use_manifest
from data.conventions import score
from data.metrics import exact_match, label_accuracy, token_f1
from data.tasks import TASKS, get_task, parse_tasks, use_tasks
from data.trace import load_task, task_file
from common.errors import InputError
from reporting.diagnostics import diagnose, warnings
import forkserver

REPO = Path(__file__).resolve().parents[1]
LABELS = ["refund", "bug", "praise"]
SCORER = '''def length_match(prediction, gold, record):
    """100 when the prediction has as many words as the gold answer, else 0."""
    return 100.0 if len(prediction.split()) == len(gold.split()) else 0.0
'''


@pytest.fixture(autouse=True)
def trace_table():
    yield
    use_tasks(None)  # a test's manifest must not leak into the next test


def write(path: Path, records, jsonl=True):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records)
    path.write_text(text)


def make_stream(root: Path, n_train=8, n_test=4, scorer_module="stream_scorer") -> Path:
    """Three made-up tasks: Tickets (labels, prompt/answer JSON), Chat (chat messages with a system turn, exact
    match), Words (instruction/input/output, its own scorer, no test split). Returns the manifest path."""
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    tickets = [{"prompt": f"Ticket: my {w} order #{i} " + ["wants money back", "crashes", "is great"][i % 3],
                "answer": LABELS[i % 3]} for i, w in enumerate(words * 3)]
    chat = [{"messages": [{"role": "system", "content": "Answer with one word."},
                          {"role": "user", "content": f"Repeat: {w}"},
                          {"role": "assistant", "content": w}]} for w in words * 3]
    instr = [{"instruction": "Say the word twice.", "input": w, "output": f"{w} {w}"} for w in words * 3]
    write(root / "tickets" / "train.json", tickets[:n_train], jsonl=False)
    write(root / "tickets" / "test.json", tickets[n_train:n_train + n_test], jsonl=False)
    write(root / "chat" / "train.jsonl", chat[:n_train])
    write(root / "chat" / "test.jsonl", chat[n_train:n_train + n_test])
    write(root / "words" / "train.jsonl", instr[:n_train + n_test])
    (root / f"{scorer_module}.py").write_text(SCORER)
    spec = {"tasks": [
        {"name": "Tickets", "dir": "tickets", "metric": "label_accuracy", "labels": LABELS, "epochs": 1,
         "max_new_tokens": 3},
        {"name": "Chat", "dir": "chat", "metric": "exact_match", "epochs": 1, "temperature": 0},
        {"name": "Words", "dir": "words", "metric": f"{scorer_module}:length_match", "epochs": 1, "held_out": 0.25,
         "system": "You repeat words."},
    ]}
    (root / "tasks.json").write_text(json.dumps(spec, indent=1))
    return root / "tasks.json"


def test_manifest_tasks_formats_and_held_out_split(tmp_path):
    path = make_stream(tmp_path, scorer_module="scorer_a")
    assert use_manifest(tmp_path) == path
    assert parse_tasks(None) == ["Tickets", "Chat", "Words"] and parse_tasks("words,tickets") == ["Words", "Tickets"]
    tickets = load_task(tmp_path, "Tickets", "train")
    assert tickets[0].prompt.startswith("Ticket:") and tickets[0].answer == "refund"
    chat = load_task(tmp_path, "Chat", "test")
    assert chat[0].prompt == [{"role": "system", "content": "Answer with one word."},
                              {"role": "user", "content": "Repeat: gamma"}] and chat[0].answer == "gamma"
    train, test = load_task(tmp_path, "Words", "train"), load_task(tmp_path, "Words", "test")
    assert (len(train), len(test)) == (9, 3)  # 12 records, 0.25 held out
    assert sorted(e.idx for e in train + test) == list(range(12))  # idx: the position in train.jsonl
    assert test == load_task(tmp_path, "Words", "test")  # seeded
    assert train[0].prompt[0] == {"role": "system", "content": "You repeat words."}
    word = train[0].answer.split()[0]
    assert train[0].prompt[1]["content"] == f"Say the word twice.\n\n{word}" and train[0].answer == f"{word} {word}"
    assert task_file(tmp_path, "Words", "test") == tmp_path / "words" / "train.jsonl"
    assert manifest.held_out(get_task("Words")) == {"from": "train", "n_test": 3, "n_train": 9, "fraction": 0.25,
                                                    "seed": 0}
    assert score("Words", "a b", "x y", record=test[0].record) == 100.0
    assert score("Tickets", "Refund.", "refund") == 100.0 and score("Chat", "The Gamma!", "gamma") == 100.0
    use_manifest(tmp_path / "elsewhere")  # no manifest: TRACE's table again
    assert parse_tasks(None) == list(TASKS)


def test_record_formats_give_the_same_examples(tmp_path):
    rows = [("What is 1+1?", "2"), ("Name a colour.", "red")]
    formats = {"a": [{"prompt": p, "answer": a} for p, a in rows],
               "b": [{"prompt": p, "response": a} for p, a in rows],
               "c": [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}
                     for p, a in rows],
               "d": [{"instruction": p, "output": a} for p, a in rows]}
    for name, records in formats.items():
        write(tmp_path / name / "train.jsonl", records)
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": [{"name": n, "metric": "exact_match", "epochs": 1}
                                                               for n in formats]}))
    use_manifest(tmp_path)
    got = {n: [(e.prompt, e.answer) for e in load_task(tmp_path, n, "train")] for n in formats}
    assert all(v == got["a"] for v in got.values())


def test_parquet_split(tmp_path):
    """A .parquet split reads as the same records in .jsonl do (the manifest's held-out share taken alike)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    records = [{"prompt": f"p{i}", "answer": f"a{i}"} for i in range(6)]
    for name in ("P", "J"):  # a task's files are in the folder of its name
        (tmp_path / name).mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "P" / "train.parquet")
    (tmp_path / "J" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": [{"name": n, "metric": "exact_match", "epochs": 1}
                                                               for n in ("P", "J")]}))
    use_manifest(tmp_path)
    got = [[(e.prompt, e.answer) for e in load_task(tmp_path, n, "train")] for n in ("P", "J")]
    assert got[0] == got[1] and got[0]


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["tasks"][1].update(metric="bleu"), "task 'Chat', field 'metric': unknown metric 'bleu'"),
    (lambda s: s["tasks"][2].update(metric="no_such_module:f"), "task 'Words', field 'metric': cannot import"),
    (lambda s: s["tasks"][1].update(name="Tickets"), "task 'Tickets', field 'name': declared twice"),
    (lambda s: s["tasks"][0].update(dir="nowhere"), "task 'Tickets', field 'dir':"),
    (lambda s: s["tasks"][0].pop("labels"), "task 'Tickets', field 'labels': metric label_accuracy needs"),
    (lambda s: s["tasks"][0].update(epochs=0), "task 'Tickets', field 'epochs': must be >= 1"),
    (lambda s: s["tasks"][0].update(epoch=2), "task 'Tickets', field 'epoch': unknown field"),
    # a key meant for every task, or misspelt, beside "tasks": would be ignored
    (lambda s: s.update(epochs=2), "unknown top-level key 'epochs': a manifest holds only \"tasks\""),
    (lambda s: s["tasks"][0].update(name="a,b"), "field 'name': start with a letter or digit, then use letters"),
    # a leading '-' would make the name a flag in the steps' command lines
    (lambda s: s["tasks"][0].update(name="-x"), "task '-x', field 'name': start with a letter or digit"),
    (lambda s: s["tasks"][0].update(name="--help"), "task '--help', field 'name': start with a letter or digit"),
])
def test_bad_manifest_is_one_line_naming_task_and_field(tmp_path, edit, message):
    path = make_stream(tmp_path, scorer_module="scorer_b")
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))
    with pytest.raises(InputError, match=r"tasks\.json: ") as e:
        load_manifest(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gold_outside_labels_and_bad_scorer_are_caught(tmp_path):
    path = make_stream(tmp_path, scorer_module="scorer_c")
    spec = json.loads(path.read_text())
    spec["tasks"][0]["labels"] = ["refund", "bug"]
    path.write_text(json.dumps(spec))
    use_manifest(tmp_path)
    with pytest.raises(InputError, match=r"task 'Tickets', field 'labels': .*train.json: record 2 has the gold "
                                         r"answer 'praise', not one of refund, bug"):
        load_task(tmp_path, "Tickets", "train")
    (tmp_path / "scorer_d.py").write_text("def f(prediction, gold, record):\n    return 'yes'\n")
    spec["tasks"][0]["labels"] = LABELS
    spec["tasks"][2]["metric"] = "scorer_d:f"
    path.write_text(json.dumps(spec))
    use_manifest(tmp_path)
    with pytest.raises(InputError, match=r"task 'Words', field 'metric': scorer_d:f returned 'yes'"):
        check_scorer(get_task("Words"), load_task(tmp_path, "Words", "train")[0])


@pytest.mark.parametrize("expr, value", [
    ("numpy.int64(100)", 100.0), ("numpy.int32(0)", 0.0), ("numpy.float32(50.5)", 50.5), ("numpy.float64(7)", 7.0),
    ("fractions.Fraction(1, 2)", 0.5), ("3", 3.0), ("100.0", 100.0),
    ("float('nan')", None), ("numpy.float64('nan')", None), ("float('inf')", None), ("numpy.float32('-inf')", None),
    ("True", None), ("numpy.bool_(True)", None), ("'50'", None), ("None", None), ("numpy.int64(101)", None),
])
def test_a_scorer_may_return_any_real_number_but_not_nan_or_a_bool(tmp_path, expr, value):
    """A user scorer's result is a number when it is a numbers.Real (numpy's scalars included), not a bool, finite and
    in [0, 100]; the step sees it as a float. Anything else is refused naming the task and the returned value."""
    path = make_stream(tmp_path, scorer_module="scorer_real")
    module = f"scorer_real_{abs(hash(expr))}"
    (tmp_path / f"{module}.py").write_text(f"import fractions\nimport numpy\n\n\ndef f(prediction, gold, record):\n"
                                           f"    return {expr}\n")
    spec = json.loads(path.read_text())
    spec["tasks"][2]["metric"] = f"{module}:f"
    path.write_text(json.dumps(spec))
    use_manifest(tmp_path)
    task, example = get_task("Words"), load_task(tmp_path, "Words", "train")[0]
    if value is None:
        with pytest.raises(InputError, match=rf"task 'Words', field 'metric': {module}:f returned "):
            check_scorer(task, example)
    else:
        check_scorer(task, example)
        got = score("Words", "x", example.answer, example.prompt, record=example.record)
        assert type(got) is float and got == value


@pytest.mark.parametrize("record, field", [
    ({"prompt": "p", "answer": ""}, "answer"),
    ({"prompt": "p", "completion": " \t\n"}, "completion"),
    ({"instruction": "i", "input": "x", "output": ""}, "output"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}, "messages[1].content"),
])
def test_a_blank_gold_answer_is_refused_naming_file_record_and_field(tmp_path, record, field):
    """An empty gold answer trains nothing and scores as an empty prediction does (TRACE's SARI gave it 91.7): each
    record format's answer field is checked where the split is read."""
    good = {"prompt": "p", "answer": "a"}
    write(tmp_path / "t" / "train.jsonl", [good, good, record, good])
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": [{"name": "T", "dir": "t", "metric": "exact_match",
                                                                "epochs": 1}]}))
    use_manifest(tmp_path)
    with pytest.raises(InputError, match=rf"train\.jsonl: record 2 \(line 3\): field '{re.escape(field)}' is "
                                         rf"(empty|only whitespace): a gold answer needs text"):
        load_task(tmp_path, "T", "train")


@pytest.mark.parametrize("formats", [(".json", ".jsonl"), (".jsonl", ".parquet"), (".json", ".jsonl", ".parquet")])
def test_one_split_in_two_files_is_refused_naming_both(tmp_path, formats):
    """train.json beside train.jsonl: reading either would ignore the other without a word."""
    for ext in formats:
        (tmp_path / "t").mkdir(exist_ok=True)
        (tmp_path / "t" / f"train{ext}").write_text('[{"prompt": "p", "answer": "a"}]')
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": [{"name": "T", "dir": "t", "metric": "exact_match",
                                                                "epochs": 1}]}))
    with pytest.raises(InputError) as e:
        load_manifest(tmp_path / "tasks.json")
    named = " and ".join(str(tmp_path / "t" / f"train{ext}") for ext in formats)
    assert str(e.value).startswith(f"{named}: {len(formats)} files hold the train split; keep one"), str(e.value)


def test_a_trace_split_in_two_files_is_refused_naming_both(tmp_path):
    for ext in (".json", ".jsonl"):
        write(tmp_path / "FOMC" / f"test{ext}", [{"prompt": "p", "answer": "A"}], jsonl=ext == ".jsonl")
    with pytest.raises(InputError, match=re.escape(f"{tmp_path / 'FOMC' / 'test.json'} and "
                                                   f"{tmp_path / 'FOMC' / 'test.jsonl'}: 2 files hold the test split")):
        task_file(tmp_path, "FOMC", "test")


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
# every numeric field a task may have, from the manifest's own table: a field added later is covered
NUMERIC = [f for f, t in manifest.FIELDS.items() if set(t if isinstance(t, tuple) else (t,)) <= {int, float}]


def one_task(root: Path, **fields) -> Path:
    write(root / "t" / "train.jsonl", [{"prompt": f"p{i}", "answer": "a"} for i in range(4)])
    (root / "tasks.json").write_text(json.dumps({"tasks": [{"name": "T", "dir": "t", "metric": "exact_match",
                                                            "epochs": 1, **fields}]}))
    return root / "tasks.json"


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("const", NON_FINITE)
def test_a_non_finite_number_in_any_numeric_field_is_refused(tmp_path, field, const):
    """Python's JSON reader takes NaN, Infinity and 1e999 (an infinity), and a NaN passes a range check written as
    `x < lo`: the manifest refuses them when parsed (naming file, field and constant), and its checks refuse them in a
    library caller's dict (naming task and field)."""
    assert {"epochs", "max_new_tokens", "temperature", "held_out"} <= set(NUMERIC)
    path = one_task(tmp_path, **{field: 123456789})
    path.write_text(path.read_text().replace("123456789", const))
    with pytest.raises(InputError) as e:
        load_manifest(path)
    assert f"{path}: field 'tasks[0].{field}': {const} is " in str(e.value) and "\n" not in str(e.value), str(e.value)
    entry = {"name": "T", "dir": "t", "metric": "exact_match", "epochs": 1, field: float(const)}
    with pytest.raises(InputError, match=rf"task 'T', field '{field}': "):
        manifest.check_entry(path, 0, entry)


def sampler_stub(monkeypatch):
    """The scripts' generation for prompts of several tasks (data.manifest.sampling_settings, then
    engine.sampling.generate_per_prompt) up to the engines: loading weights or sampling (where the
    KV cache is allocated) is recorded instead of done."""
    from engine import sampling
    calls = []
    monkeypatch.setattr(sampling, "load_native", lambda *a, **kw: calls.append("load"))
    monkeypatch.setattr(sampling, "generate", lambda ckpt, prompts, **kw: calls.append(kw["max_new_tokens"]) or [
        {"token_ids": [], "logprobs": [], "finish_reason": "length"} for _ in prompts])

    def generate_tasks(ckpt, prompts, tasks, *, temperature, max_new_tokens, evaluation, **kw):
        temps, caps = manifest.sampling_settings(tasks, temperature, max_new_tokens, evaluation)
        return sampling.generate_per_prompt(ckpt, prompts, temps, caps, **kw)
    return generate_tasks, calls


def tiny_config(path: Path, context=512) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "max_position_embeddings": context}))
    return path


def test_a_length_cap_past_the_model_context_is_refused_at_once(tmp_path, monkeypatch, capsys):
    """--max-new-tokens 10**9 would size the KV cache for 10**9 columns (~1 TB): refused in one line naming the flag
    and max_position_embeddings, before any weight loads or the sampler runs; a cap within the context runs, with one
    warning line when prompts plus it overrun the context."""
    generate_tasks, calls = sampler_stub(monkeypatch)
    ckpt = tiny_config(tmp_path / "ckpt")
    prompts, tasks = [[1] * 40, [1] * 10], ["FOMC", "NumGLUE-cm"]
    for cap in (10**9, 513):
        with pytest.raises(InputError) as e:
            generate_tasks(ckpt, prompts, tasks, temperature=0.1, max_new_tokens=cap,
                           evaluation=True, engine="native")
        assert calls == []
        assert str(e.value) == (f"--max-new-tokens: {cap} new tokens is more than the model's context "
                                f"(max_position_embeddings 512 in {ckpt / 'config.json'}); use at most 512")
    generate_tasks(ckpt, prompts, tasks, temperature=0.1, max_new_tokens=472, evaluation=True,
                   engine="native")
    assert calls == [[472, 472]] and capsys.readouterr().err == ""
    generate_tasks(ckpt, prompts, tasks, temperature=0.1, max_new_tokens=500, evaluation=True,
                   engine="native")
    assert calls[-1] == [500, 500]
    assert capsys.readouterr().err == (f"warning: 1 of 2 prompts plus --max-new-tokens 500 overrun the model's context "
                                       f"(max_position_embeddings 512 in {ckpt / 'config.json'}; the longest prompt "
                                       f"has 40 tokens)\n")


def test_a_manifest_length_cap_past_the_model_context_names_the_manifest_field(tmp_path, monkeypatch):
    generate_tasks, calls = sampler_stub(monkeypatch)
    ckpt = tiny_config(tmp_path / "ckpt")
    path = one_task(tmp_path, max_new_tokens=10**9)
    use_manifest(tmp_path)
    with pytest.raises(InputError) as e:
        generate_tasks(ckpt, [[1] * 12], ["T"], temperature=0.1, max_new_tokens=8, evaluation=False,
                       engine="native")
    assert str(e.value).startswith(f"{path}: task 'T', field 'max_new_tokens': 1000000000 new tokens is more than "
                                   f"the model's context (max_position_embeddings 512 in ")
    assert calls == []


def test_a_task_s_own_temperature_and_cap_reach_the_engine_per_prompt(tmp_path, monkeypatch):
    """A manifest task's own length cap and (in evaluations) temperature reach the engine as numbers
    per prompt (data.manifest.sampling_settings; the engine reads no task table): one generate call
    per temperature, the checkpoint loaded once for all; a rollout's prompts in one call."""
    generate_tasks, calls = sampler_stub(monkeypatch)
    ckpt = tiny_config(tmp_path / "ckpt")
    path = one_task(tmp_path, max_new_tokens=4, temperature=0)
    write(tmp_path / "u" / "train.jsonl", [{"prompt": f"q{i}", "answer": "b"} for i in range(4)])
    spec = json.loads(path.read_text())
    spec["tasks"].append({"name": "U", "dir": "u", "metric": "exact_match", "epochs": 1})
    path.write_text(json.dumps(spec))
    use_manifest(tmp_path)
    tasks = ["U", "T", "U", "T"]
    field = (4, f"{path}: task 'T', field 'max_new_tokens'")
    assert manifest.sampling_settings(tasks, 0.7, 8, evaluation=True) == (
        [0.7, 0, 0.7, 0], [(8, "--max-new-tokens"), field, (8, "--max-new-tokens"), field])
    generate_tasks(ckpt, [[1] * 3] * 4, tasks, temperature=0.7, max_new_tokens=8, evaluation=True,
                   engine="native")
    assert calls == ["load", [8, 8], [4, 4]]
    calls.clear()
    generate_tasks(ckpt, [[1] * 3] * 4, tasks, temperature=0.7, max_new_tokens=8, evaluation=False,
                   engine="native")
    assert calls == [[8, 4, 8, 4]]


def test_new_metrics():
    assert exact_match("  The answer: Paris. ", "answer paris") == 100.0 and exact_match("", "") == 0.0
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(100 * 2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert label_accuracy("Answer: bug, clearly", "bug", LABELS) == 100.0
    assert label_accuracy("bugs", "bug", LABELS) == 0.0


def test_diagnostics_use_the_declared_labels(tmp_path):
    make_stream(tmp_path, scorer_module="scorer_e")
    use_manifest(tmp_path)
    records = [{"prediction": "praise", "gold": g, "finish_reason": "stop", "num_tokens": 1, "score": 0.0}
               for g in ["refund", "bug", "refund", "bug"] * 5]
    d = diagnose("Tickets", records)
    assert d["declared_labels"] == LABELS and d["labels"] == {"praise": 1.0} and d["collapsed"]
    assert d["top_label"] == "praise" and warnings(d)[0].startswith("predictions collapsed to 'praise'")
    off = [dict(r, prediction="I think so") for r in records]
    assert diagnose("Tickets", off)["off_format"] == 1.0
    assert "not a declared label" in warnings(diagnose("Tickets", off))[0]


def test_a_manifest_of_the_embedded_benchmark_reproduces_the_trace_table(tmp_path):
    """The README's example: the embedded benchmark described by a manifest gives the same examples and scores."""
    from data.embedded import write_benchmark
    write_benchmark(tmp_path, n_train=6, n_eval=2, n_test=3)
    trace = {t: (load_task(tmp_path, t, "train"), load_task(tmp_path, t, "test")) for t in TASKS}
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": [
        {"name": t.name, "metric": t.metric, "epochs": t.epochs} for t in TASKS.values()]}))
    use_manifest(tmp_path)
    for t in TASKS:
        train, test = load_task(tmp_path, t, "train"), load_task(tmp_path, t, "test")
        assert (train, test) == trace[t] and get_task(t).epochs == TASKS[t].epochs
        for scoring in ("lenient", "paper", "trace"):
            assert [score(t, e.answer[:3], e.answer, e.prompt, scoring) for e in test] == \
                   [score(t, e.answer[:3], e.answer, e.prompt, scoring) for e in trace[t][1]]


# ---- end to end ----------------------------------------------------------------------------------------------------
def run(base: Path, data: Path, out: Path, env: dict, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "run.py"), "--model", str(base), "--data", str(data), "--methods",
           "sft,replay,opr-ru", "--global-batch", "4", "--lr", "1e-4", "--max-new-tokens", "6", "--rho", "0.5",
           "--eval-repeats", "1", "--drift-limit", "0", "--jobs", "2", "--quiet", "--out", str(out), *extra]
    return forkserver.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("stream")
    write_random_tiny(root / "base")
    make_stream(root / "data", scorer_module="e2e_scorer")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"))
    r = run(root / "base", root / "data", root / "run", env)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(root=root, env=env, out=root / "run", stdout=r.stdout)


def test_run_on_a_manifest_stream(e2e):
    out = e2e["out"]
    results = json.loads((out / "results.json").read_text())
    assert results["tasks"] == ["Tickets", "Chat", "Words"]
    assert results["meta"]["held_out"] == {"Words": {"from": "train", "n_test": 3, "n_train": 9, "fraction": 0.25,
                                                     "seed": 0}}
    assert "Words has no test split: 3 of its train records held out" in e2e["stdout"]
    for m in ("sft", "replay", "opr-ru"):
        run0 = results["methods"][m]["seeds"]["0"]
        assert [len(row) for row in run0["matrix"]] == [1, 2, 3]
        assert all(d["Tickets"]["declared_labels"] == LABELS for d in run0["diagnostics"])
        assert "declared_labels" not in run0["diagnostics"][-1]["Chat"]
    report = (out / "report.md").read_text()
    assert "Tickets" in report and "Words" in report and "opr-ru" in report
    # the chat task's prompts reached the model as chat turns, system prompt included
    preds = [json.loads(x) for x in next((out / "steps").glob("s0-eval*")).joinpath(
        "eval", "predictions.jsonl").read_text().splitlines()]
    chat = [p for p in preds if p["task"] == "Chat"]
    assert chat and chat[0]["prompt"][0] == {"role": "system", "content": "Answer with one word."}
    tickets = [p for p in preds if p["task"] == "Tickets"]
    assert all(p["num_tokens"] <= 3 for p in tickets)  # the task's own max_new_tokens


def test_an_edited_manifest_reruns_exactly_the_steps_it_affects(e2e):
    data, out = e2e["root"] / "data", e2e["out"]
    spec = json.loads((data / "tasks.json").read_text())
    before = set(json.loads((out / "manifest.json").read_text()))
    spec["tasks"][1]["max_new_tokens"] = 4  # Chat: changes its evaluations and the rollouts that answer it
    (data / "tasks.json").write_text(json.dumps(spec))
    try:
        r = run(e2e["root"] / "base", data, out, e2e["env"])
    finally:
        spec["tasks"][1].pop("max_new_tokens")
        (data / "tasks.json").write_text(json.dumps(spec))
    assert r.returncode == 0, r.stderr[-3000:]
    new = Counter(k.rsplit("-", 1)[0] for k in set(json.loads((out / "manifest.json").read_text())) - before)
    # every evaluation reads Chat (row 1 too: a(1, 2) for FWT); the rollout after stage 2 answers it, and its buffer
    # trains opr-ru's stage 3; training before, gold replay and the stage-1 rollout stay as they were
    assert new == Counter({"s0-eval": 1, "s1-eval": 1, "s2-eval": 3, "s3-eval": 3, "s2-rollout": 1, "s2-ru-top": 1,
                           "s3-train-Words": 1}), new


def test_bad_manifest_stops_run_py_before_anything_is_created(e2e, tmp_path):
    data = tmp_path / "data"
    path = make_stream(data, scorer_module="e2e_scorer_bad")
    spec = json.loads(path.read_text())
    spec["tasks"][2]["metric"] = "e2e_scorer_bad:no_such_function"
    path.write_text(json.dumps(spec))
    r = run(e2e["root"] / "base", data, tmp_path / "out", e2e["env"])
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert r.stderr.strip().splitlines() == [f"run.py: error: {path}: task 'Words', field 'metric': cannot import "
                                             f"scorer 'e2e_scorer_bad:no_such_function' from {data} or the Python "
                                             f"path: AttributeError: module 'e2e_scorer_bad' has no function "
                                             f"'no_such_function'"]


def test_dry_run_prices_a_manifest_stream(e2e, tmp_path):
    r = run(e2e["root"] / "base", e2e["root"] / "data", tmp_path / "plan", e2e["env"], "--dry-run", "--tasks",
            "Words,Tickets")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tasks Words,Tickets" in r.stdout and "s1-train-Words" in r.stdout and not (tmp_path / "plan").exists()


def test_evaluate_reads_a_task_spec_outside_the_data_root(e2e, tmp_path):
    """--task-spec FILE: the directories are the file's; each task keeps its own cap and scorer."""
    spec = json.loads((e2e["root"] / "data" / "tasks.json").read_text())
    for t in spec["tasks"]:
        t["dir"] = str(e2e["root"] / "data" / t["dir"])
    spec["tasks"][2]["metric"] = "exact_match"
    (tmp_path / "stream.json").write_text(json.dumps(spec))
    out = tmp_path / "eval"
    r = forkserver.run([sys.executable, str(REPO / "evaluate.py"), "--ckpt", str(e2e["root"] / "base"), "--task-spec",
                        str(tmp_path / "stream.json"), "--tasks", "Words,Tickets", "--limit", "2",
                        "--max-new-tokens", "5", "--out", str(out), "--quiet"],
                       cwd=REPO, env=e2e["env"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["task"] for p in preds] == ["Words", "Words", "Tickets", "Tickets"]
    assert all(p["num_tokens"] <= (3 if p["task"] == "Tickets" else 5) for p in preds)
    assert all(p["score"] == exact_match(p["prediction"], p["gold"]) for p in preds if p["task"] == "Words")


def test_a_scorers_helper_modules_are_part_of_its_files(tmp_path, monkeypatch):
    """scorer_files: the scorer's module and what it imports from its own tree, through other modules too (so editing
    a helper re-scores: the files are read into the scoring steps' keys); the standard library and installed
    packages are not the user's."""
    from types import SimpleNamespace
    (tmp_path / "helpers").mkdir()
    (tmp_path / "sc_main.py").write_text("import json\nimport numpy\nfrom sc_helper import norm\n"
                                         "def f(prediction, gold, record):\n    return 100.0 * (norm(prediction) == norm(gold))\n")
    (tmp_path / "sc_helper.py").write_text("import re\nimport helpers.words as w\ndef norm(s):\n    return w.clean(s)\n")
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "words.py").write_text("def clean(s):\n    return s.strip().lower()\n")
    (tmp_path / "unused.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    files = manifest.scorer_files(SimpleNamespace(metric="sc_main:f"))
    assert [f.relative_to(tmp_path.resolve()).as_posix() for f in files] == [
        "helpers/__init__.py", "helpers/words.py", "sc_helper.py", "sc_main.py"]
    assert manifest.scorer_files(SimpleNamespace(metric="exact_match")) == []


def test_a_task_without_epochs_takes_run_pys_epochs(tmp_path):
    """`epochs` may be left out when run.py gets --epochs: the plan (every step key) is the one of the manifest that
    names those epochs; without --epochs it is one line naming the manifest, the task and the field."""
    from model.base import write_random_tiny
    write_random_tiny(tmp_path / "base")
    path = make_stream(tmp_path / "data", scorer_module="epochs_scorer")
    spec = json.loads(path.read_text())
    assert {t["epochs"] for t in spec["tasks"]} == {1}
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(tmp_path / "cache"))
    import plan

    def keys(*extra):
        r = run(tmp_path / "base", tmp_path / "data", tmp_path / "plan", env, "--dry-run", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        return plan.parse_plan(r.stdout)
    named = keys()
    del spec["tasks"][2]["epochs"]
    path.write_text(json.dumps(spec))
    assert load_manifest(path)["Words"].epochs is None and load_manifest(path)["Chat"].epochs == 1
    assert keys("--epochs", "1") == named
    assert keys("--epochs", "2") != named  # (--epochs changes the plan: the equality above is no accident)
    r = run(tmp_path / "base", tmp_path / "data", tmp_path / "plan", env, "--dry-run")
    assert r.returncode == 2 and not (tmp_path / "plan").exists()
    assert r.stderr.strip().splitlines() == [f"run.py: error: {path}: task 'Words', field 'epochs': missing, and no "
                                             f"--epochs to fall back on; give the task its epochs or pass run.py "
                                             f"--epochs N"]
