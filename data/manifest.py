"""A task manifest: the user's own stream of tasks, in place of TRACE's eight.

    ROOT/tasks.json (or any file given as --task-spec FILE; directories are relative to the
    file's own):
    {"tasks": [
      {"name": "Tickets", "dir": "tickets", "metric": "label_accuracy", "labels": ["refund", "bug"],
       "epochs": 3, "max_new_tokens": 4},
      {"name": "Chat", "metric": "exact_match", "epochs": 2, "system": "Answer in one word.",
       "temperature": 0},
      {"name": "SQL", "metric": "my_scorer:sql_match", "epochs": 2, "held_out": 0.2}
    ]}

Fields: name (letters, digits, . _ + -; a letter or digit first), metric (required); epochs
(default: run.py's --epochs, which then must be given; given, --epochs overrides it); dir (default:
the name), max_new_tokens and temperature (default: the run's), system (a system prompt before every
prompt), labels (the allowed answers: label_accuracy needs them, every gold answer must be one, and
the collapse diagnostics count them), held_out (the share of train held out, seeded, as the test
split of a task without one; default 0.1).
Metrics: data.metrics.METRICS by name, label_accuracy, or `module:function`, a scorer (prediction,
gold, record) -> number in [0, 100] imported from the manifest's directory or the Python path.
A split is `<dir>/<split>.json` (a JSON list), `.jsonl` or `.parquet` (with pyarrow); a record is
{"prompt", "answer" | "response" | "completion"}, chat {"messages": [...]} (the turns before the
last assistant turn are the prompt, that turn the answer) or {"instruction", "input", "output"} (the
prompt is the instruction, a blank line and the input). train.py's --data and a TRACE root read all
three formats too (as_prompt_record).

use_manifest(root, spec) makes the manifest's tasks the ones every script sees
(data.tasks.use_tasks); without one the TRACE table stays, untouched. Every problem is one
InputError naming the manifest, the task and the field. A script takes the manifest as --task-spec
(add_task_spec) and loads it before its parser checks --tasks (use_manifest_from_argv).
"""
import importlib.util
import json
import math
import random
import re
import sys
from pathlib import Path

from common.cli import Parser
from common.errors import InputError
from common.jsonl import check_answer, loads_strict, read_records, read_text
from data.metrics import METRICS, import_scorer
from data.tasks import Task, active_tasks, use_tasks

MANIFEST = "tasks.json"
FORMATS = (".json", ".jsonl", ".parquet")
FIELDS = {"name": str, "dir": str, "metric": str, "epochs": int, "max_new_tokens": int,
          "temperature": (int, float), "system": str, "labels": list, "held_out": (int, float)}
HELD_OUT_SEED = 0  # the held-out test split is a function of the train file alone


def manifest_path(root, spec=None) -> Path | None:
    """--task-spec when given, else ROOT/tasks.json when it exists, else None (TRACE's table)."""
    if spec:
        return Path(spec).resolve()
    path = Path(root) / MANIFEST if root else None
    if path and path.is_symlink() and not path.exists():  # there, but leading nowhere:
                                                          # not "no manifest"
        raise InputError(f"{path}: a symlink to nothing (a loop, or its target is gone): "
                         f"fix or remove it")
    return path.resolve() if path and path.is_file() else None


def use_manifest(root, spec=None) -> Path | None:
    """Load and check the manifest of `root` (or `spec`) and make its tasks the active ones; None
    and TRACE's table when there is none. Returns the manifest's path."""
    path = manifest_path(root, spec)
    use_tasks(load_manifest(path) if path else None)
    return path


# ---- a script's task manifest flags --------------------------------------------------------------
def add_task_spec(p):
    """The scripts' --task-spec flag."""
    p.add_argument("--task-spec", default=None,
                   help="task manifest (default: <data>/tasks.json when present, else the TRACE "
                        "task table; README, 'Your own tasks')")


def use_manifest_from_argv(argv=None):
    """use_manifest for a script's --data and --task-spec, before its parser checks --tasks
    against the names."""
    pre = Parser(add_help=False)  # a flag without its value: one error line, as the
                                  # script's own parser gives
    pre.add_argument("--data")
    pre.add_argument("--task-spec")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return use_manifest(known.data, known.task_spec)


def data_root(args) -> Path:
    """A script's data root: --data, else the directory of --task-spec, else the
    embedded benchmark."""
    if args.data is not None:
        return Path(args.data)
    if args.task_spec:
        return Path(args.task_spec).parent
    from data.embedded import ensure_embedded
    return ensure_embedded()


def load_manifest(path: Path) -> dict:
    """{name: data.tasks.Task} in the manifest's order, every field checked (module docstring)."""
    if not path.is_file():
        raise InputError(f"{path}: task manifest not found")
    try:
        doc = loads_strict(read_text(path), path)  # NaN, Infinity: refused, naming the constant
    except json.JSONDecodeError as e:
        raise InputError(
            f"{path}: malformed JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    entries = doc.get("tasks") if isinstance(doc, dict) else doc
    unknown = sorted(set(doc) - {"tasks"}) if isinstance(doc, dict) else []
    if unknown:  # a misspelt or misplaced key
                 # ("task", a field meant for every task) would be ignored
        raise InputError(f"{path}: unknown top-level key {unknown[0]!r}: a manifest holds only "
                         f"\"tasks\", a list of tasks each with its own fields")
    if not isinstance(entries, list) or not entries:
        raise InputError(
            f'{path}: expected {{"tasks": [{{"name", "metric", "epochs", ...}}, ...]}} '
            f"with one task or more")
    if str(path.parent) not in sys.path:  # user scorers live next to their data
        sys.path.append(str(path.parent))
    tasks = {}
    for i, entry in enumerate(entries):
        t = check_entry(path, i, entry)
        if t.name.lower() in (n.lower() for n in tasks):
            raise InputError(f"{path}: task {t.name!r}, field 'name': declared twice")
        tasks[t.name] = t
    return tasks


def check_entry(path: Path, i: int, entry) -> Task:
    if not isinstance(entry, dict):
        raise InputError(f"{path}: task {i}: "
                         f"expected an object with name, metric and optional epochs, ...")
    where = f"{path}: task {entry.get('name', i)!r}"
    for field in ("name", "metric"):
        if field not in entry:
            raise InputError(f"{where}, field {field!r}: missing")
    for field, value in entry.items():
        want = FIELDS.get(field)
        if want is None:
            raise InputError(f"{where}, field {field!r}: unknown field "
                             f"(known: {', '.join(FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, want):
            raise InputError(f"{where}, field {field!r}: expected "
                             f"{getattr(want, '__name__', 'a number')}, got {value!r}")
    name = entry["name"]
    # a letter or digit first: a name starting with '-' would read as a flag in the
    # steps' command lines
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name) or name.lower() == "all":
        raise InputError(f"{where}, field 'name': start with a letter or digit, "
                         f"then use letters, digits and . _ + - (it names files and --tasks items)")
    for field, lo in (("epochs", 1), ("max_new_tokens", 1), ("temperature", 0)):
        # written so that a NaN or an infinity (a library caller's dict; files refuse them
        # when parsed) fails too
        if field in entry and not lo <= entry[field] < math.inf:
            raise InputError(f"{where}, field {field!r}: must be >= {lo}, got {entry[field]}")
    if not 0 < entry.get("held_out", 0.1) < 1:  # False for a NaN, so refused
        raise InputError(f"{where}, field 'held_out': must be in (0, 1), got {entry['held_out']}")
    labels = entry.get("labels")
    if labels is not None and (
            not labels or not all(isinstance(x, str) and x.strip() == x and x for x in labels)
            or len({x.lower() for x in labels}) != len(labels)):
        raise InputError(f"{where}, field 'labels': "
                         f"expected distinct non-empty strings without surrounding spaces")
    metric = entry["metric"]
    if ":" in metric:
        try:
            import_scorer(metric)
        except Exception as e:  # any import-time failure of the user's module is theirs to fix
            raise InputError(f"{where}, field 'metric': cannot import scorer {metric!r} from "
                             f"{path.parent} or the Python path: {type(e).__name__}: {e}") from None
    elif metric == "label_accuracy":
        if labels is None:
            raise InputError(f"{where}, field 'labels': metric label_accuracy needs the label set")
    elif metric not in METRICS:
        raise InputError(f"{where}, field 'metric': unknown metric {metric!r} "
                         f"(known: {', '.join(METRICS)}, label_accuracy, or module:function)")
    task_dir = (path.parent / entry.get("dir", name)).resolve()
    if find_split(task_dir, "train") is None:
        raise InputError(f"{where}, field 'dir': {task_dir} has no train split "
                         f"(train.json, train.jsonl or train.parquet)")
    return Task(name, metric, entry.get("epochs"), dir=str(task_dir),
                max_new_tokens=entry.get("max_new_tokens"), temperature=entry.get("temperature"),
                system=entry.get("system"), labels=tuple(labels) if labels else None,
                held_out=entry.get("held_out", 0.1), manifest=str(path))


# ---- the data of a manifest's task ---------------------------------------------------------------
def find_split(task_dir: Path, split: str, formats=FORMATS) -> Path | None:
    """The file of a split in one of `formats`, None when there is none; two of them (test.json and
    test.jsonl) are refused, since reading either would silently ignore the other."""
    found = [p for p in (Path(task_dir) / f"{split}{ext}" for ext in formats) if p.is_file()]
    if len(found) > 1:
        raise InputError(
            f"{' and '.join(map(str, found))}: {len(found)} files hold the {split} split; "
            f"keep one (move or rename the others)")
    return found[0] if found else None


def split_file(task: Task, split: str) -> Path:
    """The file a split is read from: the train file for a held-out test split; the .json path when
    none exists (its error then names it)."""
    found = find_split(task.dir, split)
    if found is None and split == "test":
        return find_split(task.dir, "train")
    return found or Path(task.dir) / f"{split}.json"


def held_out(task: Task, n: int | None = None) -> dict | None:
    """How a task without a test split gets one: {"from", "n_test", "n_train", "fraction", "seed"};
    None when it has a test split. n: the train file's record count, when the caller has read it
    already."""
    if find_split(task.dir, "test") is not None:
        return None
    if n is None:
        n = len(read_file(split_file(task, "train")))
    if n < 2:
        raise InputError(f"{task.manifest}: task {task.name!r}, field 'dir': "
                         f"no test split and {n} train record(s): nothing to hold out")
    n_test = min(n - 1, max(1, round(task.held_out * n)))
    return {"from": "train", "n_test": n_test, "n_train": n - n_test, "fraction": task.held_out,
            "seed": HELD_OUT_SEED}


def read_split(task: Task, split: str) -> list[tuple]:
    """[(idx, prompt, answer, record)] of one split: idx is the record's position in its file (a
    held-out test record keeps its train file position), the prompt a string or, with a system
    prompt or earlier turns, a message list."""
    path = split_file(task, split)
    rows = [(i, *to_example(task, where, r), r) for i, (where, r) in enumerate(read_file(path))]
    # without a test split, `path` is the train file for both splits: its count is
    # the one held_out needs
    info = held_out(task, len(rows)) if split in ("train", "test") else None
    if info:
        test = set(random.Random(info["seed"]).sample(range(len(rows)), info["n_test"]))
        rows = [row for row in rows if (row[0] in test) == (split == "test")]
    return rows


def read_file(path: Path) -> list[tuple[str, dict]]:
    """(where, record) pairs of a JSON list, JSON Lines or Parquet file."""
    return read_records(path, required=(), locate=True)


def to_example(task: Task, where: str, r: dict) -> tuple:
    """(prompt, answer) of one record in any of the formats (module docstring), with the
    task's system prompt."""
    prompt, answer, answer_field = prompt_answer(where, r)
    check_answer(where, answer_field, answer)
    if task.labels is not None and answer.strip() not in task.labels:
        raise InputError(f"{task.manifest}: task {task.name!r}, field 'labels': {where} has the "
                         f"gold answer {answer[:40]!r}, not one of {', '.join(task.labels)}")
    if task.system is not None:
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if turns[0]["role"] != "system":
            prompt = [{"role": "system", "content": task.system}] + turns
    return prompt, answer


# the fields a record of another format holds its prompt and answer in (as_prompt_record drops them)
CONVERTED = ("messages", "instruction", "input", "output", "completion")


def as_prompt_record(where: str, r):
    """A record of any of the formats (module docstring) as the pipeline's own {"prompt", "answer"}
    record, its other fields kept, for the readers of train.py, rollout.py and evaluate.py
    (common.jsonl.read_records' convert): a chat or instruction record, or a prompt/completion one,
    converted as a manifest's task reads it; a prompt record with an answer or a response (and
    anything that is no record) returned as it is, for the reader's own checks."""
    if not isinstance(r, dict) or not ("messages" in r or "instruction" in r or (
            "prompt" in r and "completion" in r and "answer" not in r and "response" not in r)):
        return r
    prompt, answer, answer_field = prompt_answer(where, r)
    check_answer(where, answer_field, answer)
    return {**{k: v for k, v in r.items() if k not in CONVERTED}, "prompt": prompt,
            "answer": answer}


def prompt_answer(where: str, r: dict) -> tuple:
    """(prompt, answer, the answer's field) of one record in any of the formats (module docstring):
    the one place a chat or instruction record becomes a prompt and an answer."""
    def text(field, record=r, at=where):
        if not isinstance(record.get(field), str):
            raise InputError(f"{at}: field {field!r} must be a string")
        return record[field]
    if "messages" in r:
        msgs = r["messages"]
        if (not isinstance(msgs, list) or len(msgs) < 2
                or not all(isinstance(m, dict) for m in msgs)):
            raise InputError(f"{where}: field 'messages' must be a list of two or more "
                             f"{{role, content}} objects")
        for j, m in enumerate(msgs):
            text("role", m, f"{where}: message {j}"), text("content", m, f"{where}: message {j}")
        if msgs[-1]["role"] != "assistant":
            raise InputError(f"{where}: field 'messages': "
                             f"the last message must be the assistant's answer")
        prompt = [{"role": m["role"], "content": m["content"]} for m in msgs[:-1]]
        if len(prompt) == 1 and prompt[0]["role"] == "user":
            prompt = prompt[0]["content"]  # one user turn: the same prompt as a
                                           # {"prompt", "answer"} record
        return prompt, msgs[-1]["content"], f"messages[{len(msgs) - 1}].content"
    if "instruction" in r:
        extra = r.get("input") or ""
        if not isinstance(extra, str):
            raise InputError(f"{where}: field 'input' must be a string")
        return text("instruction") + (f"\n\n{extra}" if extra else ""), text("output"), "output"
    if "prompt" in r:
        field = next((f for f in ("answer", "response", "completion") if f in r), "answer")
        return text("prompt"), text(field), field
    raise InputError(f"{where}: no 'prompt', 'messages' or 'instruction' field (formats: "
                     f"prompt/answer, prompt/response, prompt/completion, chat messages, "
                     f"instruction/input/output)")


# ---- what run.py keys and passes on --------------------------------------------------------------
STEP_FIELDS = {  # step kind -> the task fields its output depends on
                 # (the files' contents are keyed by digest)
    "data": ("system", "held_out"),
    "rollout": ("system", "held_out", "max_new_tokens"),
    "eval": ("system", "held_out", "metric", "labels", "max_new_tokens", "temperature"),
    "score": ("system", "held_out", "metric", "labels"),
}


def step_fields(tasks, kind: str) -> dict:
    """{task: {field: value}} of the tasks' settings (a manifest's, or TRACE's own) that a step of
    `kind` depends on."""
    table = active_tasks()
    fields = STEP_FIELDS[kind]
    return {t: {f: list(v) if isinstance(v := getattr(table[t], f), tuple) else v for f in fields}
            for t in tasks}


def scorer_files(task: Task) -> list[Path]:
    """The source files of a task's own scorer: its module and every module it imports, directly or
    through another, from the user's tree (the scorer's directory and below); part of the keys of
    the steps that score with it, so editing a helper module re-scores too. Imports of the standard
    library and installed packages are not."""
    if ":" not in task.metric:
        return []
    spec = importlib.util.find_spec(task.metric.partition(":")[0])
    if not (spec and spec.origin and Path(spec.origin).is_file()):
        return []
    root, todo, found = Path(spec.origin).resolve().parent, [Path(spec.origin).resolve()], []
    while todo:
        f = todo.pop()
        if f in found:
            continue
        found.append(f)
        for name in _imported(f):
            try:
                sub = importlib.util.find_spec(name)
            except (ImportError, ValueError):  # a relative or missing name:
                                               # the scorer's own import says so
                continue
            origin = (Path(sub.origin).resolve()
                      if sub and sub.origin and Path(sub.origin).is_file() else None)
            if origin and origin.is_relative_to(root):
                todo.append(origin)
    return sorted(found)


def _imported(path: Path) -> list[str]:
    """Absolute module names a source file imports, with their parents (`import a.b`: a and a.b)."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else [])
        for m in mods:
            parts = m.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names)


def check_scorer(task: Task, example):
    """A user's scorer run once on a gold answer against itself, so that one that fails or returns a
    non-number stops the run before any step."""
    if ":" not in task.metric:
        return
    from data.conventions import score
    try:
        score(task.name, example.answer, example.answer, example.prompt, record=example.record)
    except InputError as e:  # a scorer that raised or returned a non-number:
                             # data.metrics names no record
        raise InputError(f"{e} (record {example.idx} of its train split, its gold answer "
                         f"against itself)") from None
    except Exception as e:
        raise InputError(f"{task.manifest}: task {task.name!r}, field 'metric': {task.metric} "
                         f"failed on record {example.idx} of its train split: "
                         f"{type(e).__name__}: {e}") from None


def length_cap(name: str, max_new_tokens: int) -> tuple[int, str]:
    """A task's generation length cap and what set it, for error lines: its manifest field, else the
    run's --max-new-tokens."""
    t = active_tasks()[name]
    if t.max_new_tokens:
        return t.max_new_tokens, f"{t.manifest}: task {t.name!r}, field 'max_new_tokens'"
    return max_new_tokens, "--max-new-tokens"


def sampling_settings(task_of: list, temperature: float, max_new_tokens: int,
                      evaluation: bool) -> tuple[list[float], list[tuple[int, str]]]:
    """Each job's sampling settings (task_of[i]: job i's task), as generate_per_prompt takes them
    (engine/sampling.py): (temperatures, caps), each job's temperature (in evaluations its task's
    own when the manifest gives one, else `temperature`) and its length cap with what set it
    (length_cap). One temperature and one cap for TRACE's tasks."""
    table, temps, caps = active_tasks(), [], []
    for name in task_of:
        t = table[name]
        temps.append(t.temperature if evaluation and t.temperature is not None else temperature)
        caps.append(length_cap(name, max_new_tokens))
    return temps, caps
