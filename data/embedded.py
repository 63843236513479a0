"""A small synthetic stand-in for TRACE: eight seeded tasks with the TRACE task names,
metrics and on-disk layout.

Written as `<out>/<Task>/{train,eval,test}.json` (JSON lists of {"prompt", "answer"}), so the
loader, the task table and the metrics apply unchanged. Built for a tiny model trained on CPU in
minutes: prompts are short and templated over a few dozen words per task, answers are at most ~10
words, and every answer is a deterministic function of its prompt (`solve(task, prompt)` recomputes
it from the prompt text alone).

The tasks interfere through shared formats and shared inputs, never through a flipped rule: no piece
of text that decides an answer in one task decides a different answer in another, so a model can
hold all eight tasks at once and a replay buffer of any size only helps (a benchmark whose tasks
contradict each other is bistable: which rule wins depends on a few replayed examples, and
seed-to-seed noise swamps the method differences).

  C-STANCE     "<When> , about the <obj> , <subj> <verb> ." -> A/B/C by the verb
               (favor/against/neutral verbs)
  FOMC         the same frame, subjects, objects and letters, its own verbs -> A/B/C
               (dovish/hawkish/neutral); the two verb sets are disjoint, so the tasks compete for
               the letters, not for the texts
  MeetingBank  3-sentence meeting -> "council approves|rejects <action> of <item> in district <d>"
               (ROUGE-L)
  Py150        two code lines with <EOL>/<NUM_LIT:k> -> the next line, copied from variables
               in the prompt (fuzz)
  ScienceQA    "Which one describes the <item> ?" with the options hot / cold / wet
               -> "<letter> because <item> is <prop>" (the stance letters again)
  NumGLUE-cm   "<name> buys one more <obj> . How many <obj> now ? Had <a> ." -> a + 1
  NumGLUE-ds   "<name> has a pair of bags of <obj> . ... Each bag <a in words> ." -> 2 * a: the
               same frame, names and objects as NumGLUE-cm, another operation, its own number
               tokens ("three", not "3")
  20Minuten    German sentence -> drop time/adverb/adjective words, swap a rare verb
               for a plain one (SARI)

In every classification and arithmetic task the words that decide the answer end the prompt, at the
same distance from the answer on every prompt, so the tiny model need not find them by content:
when it must, whether it finds them within a stage is a coin flip per seed, a bistable plateau that
makes the default's seed noise larger than the method effects
(git show 72fe6d4:BENCHMARKS.md, "Testbed history").

Each task has at least ~1,000 distinct prompts, so large test splits (hundreds of prompts per
task, the lever that makes seed-to-seed noise small) never repeat a training prompt. Same seed
-> byte-identical files. `general_mixture` gives task-disjoint instruction data for briefly
instruction-tuning the tiny base model; `corpus_texts` covers the whole vocabulary for
training its tokenizer.

    python -m data.embedded --out DIR --n-train 256 --n-test 256 --seed 0
"""

import argparse
import json
import os
import re
import shutil
import tempfile
import random
from pathlib import Path

from common.outputs import fsync_dir, fsync_tree
from data.tasks import TASK_ORDER, parse_tasks
from common.errors import InputError

VERSION = 5  # bumped whenever the generated data changes: part of the cache directory names

# --------------------------------------------------------------------------------------------------
# Vocabulary

NAMES = ["Anna", "Ben", "Mia", "Tom", "Lea", "Max", "Eva", "Noah", "Sara", "Luca", "Ida", "Finn"]
STANCE_SUBJECTS = NAMES[:6] + ["the board", "the mayor"]
STANCE_OBJECTS = ["plan", "rate", "budget", "tax", "loan", "report", "fee", "deal"]
STANCE_WHEN = ["today", "again", "now", "at last", "this week"]
# letter -> verbs; the two tables share no verb, so a text's letter is decided by
# one task's rule only
STANCE_VERBS = {
    "C-STANCE": {"A": ["backs", "praises", "supports"],     # favor
                 "B": ["attacks", "blames", "rejects"],     # against
                 "C": ["mentions", "notes", "studies"]},    # neutral
    "FOMC": {"A": ["cuts", "eases", "lowers"],              # dovish
             "B": ["raises", "hikes", "tightens"],          # hawkish
             "C": ["holds", "keeps", "reviews"]},           # neutral
}

MEET_SPEAKERS = ["Anna", "Ben", "Mia", "the mayor", "the clerk"]
MEET_ACTIONS = ["repair", "close", "fund", "build", "sell", "clean"]
MEET_ITEMS = ["park", "library", "bridge", "school", "road", "pool"]
MEET_REACTIONS = ["agrees", "objects", "asks a question", "says nothing"]

CODE_FUNCS = ["add", "scale", "step", "move", "clip", "mix"]
CODE_ARGS = ["x", "y", "n", "m", "w", "h"]
CODE_VARS = ["res", "val", "out", "acc"]
CODE_OPS = ["+", "-", "*"]

SCIENCE_ITEMS = {  # property -> things that have it
    "hot": ["fire", "sun", "oven"],
    "cold": ["ice", "snow", "frost"],
    "wet": ["rain", "river", "sea"],
    "hard": ["rock", "iron", "stone"],
}
SCIENCE_PROPS = ["hot", "cold", "wet"]  # the three options, always in this order
                                        # ("hard" things are no answer)

MATH_OBJECTS = ["apples", "pens", "cards", "coins", "books", "eggs", "cups", "toys", "shells",
                "stamps"]
MATH_NUMBERS = range(1, 10)  # the one number of a problem;
                             # NumGLUE-cm answers a + 1, NumGLUE-ds 2 * a
# NumGLUE-cm writes the number in digits, NumGLUE-ds in words: like the two verb tables of the
# stance tasks, the token that decides an answer belongs to one task only, so the tasks share frame,
# names and objects, not a rule
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

DE_NAMES = ["Anna", "Reto", "Lea", "Jonas", "Nina"]
DE_VERBS = {"erwarb": "kaufte", "erblickte": "sah", "verspeiste": "aß", "veräußerte": "verkaufte",
            "bewunderte": "mochte"}
DE_TIMES = ["gestern", "heute", "morgens"]
DE_ADVERBS = ["wirklich", "tatsächlich", "sehr gern"]
DE_ADJECTIVES = ["große", "grüne", "alte", "schöne", "süße"]
DE_NOUNS = ["Bücher", "Äpfel", "Blumen", "Stühle", "Brötchen"]
DE_CITIES = ["Zürich", "Bern", "Basel", "Genf", "Luzern"]

MIX_WORDS = ["red", "blue", "green", "cat", "dog", "sun", "tree", "car", "milk", "bird", "fish",
             "star"]
MIX_SEQUENCES = [
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"],
    ["January", "February", "March", "April", "May", "June", "July", "August"],
    ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"],
]

# --------------------------------------------------------------------------------------------------
# One example per call: rng -> {"prompt", "answer"}


def stance_text(rng: random.Random, task: str) -> tuple[str, str]:
    """(text, object) of a C-STANCE or FOMC prompt: shared subjects/objects/frame, the
    task's own verbs."""
    letter = rng.choice("ABC")
    obj = rng.choice(STANCE_OBJECTS)
    subj, verb, when = (rng.choice(STANCE_SUBJECTS), rng.choice(STANCE_VERBS[task][letter]),
                        rng.choice(STANCE_WHEN))
    return f"{when[0].upper()}{when[1:]} , about the {obj} , {subj} {verb} .", obj


def stance_label(task: str, text: str) -> str:
    """Gold letter of a C-STANCE or FOMC text: the letter of the task's verb in it."""
    for letter, verbs in STANCE_VERBS[task].items():
        if any(f" {v} " in f" {text} " for v in verbs):
            return letter
    raise ValueError(f"no {task} verb in {text!r}")


def make_cstance(rng):
    text, obj = stance_text(rng, "C-STANCE")
    prompt = (f"Stance of the text toward the target? A. favor, B. against, C. neutral.\n"
              f"Target:\n{obj}\nText:\n{text}\nStance:")
    return {"prompt": prompt, "answer": stance_label("C-STANCE", text)}


def make_fomc(rng):
    text, _ = stance_text(rng, "FOMC")
    prompt = (f"Monetary policy stance of the text? A. dovish, B. hawkish, C. neutral.\n"
              f"Text:\n{text}\nStance:")
    return {"prompt": prompt, "answer": stance_label("FOMC", text)}


def make_meetingbank(rng):
    spk, spk2 = rng.sample(MEET_SPEAKERS, 2)
    action, item, d = rng.choice(MEET_ACTIONS), rng.choice(MEET_ITEMS), rng.randint(1, 9)
    passes = rng.random() < 0.5
    transcript = (f"{spk.capitalize()} asks to {action} the {item} in district {d}. "
                  f"{spk2.capitalize()} {rng.choice(MEET_REACTIONS)}. "
                  f"The motion {'passes' if passes else 'fails'}.")
    prompt = f"Summarize the meeting.\nMeeting transcripts:\n{transcript}\nSummary:"
    answer = f"council {'approves' if passes else 'rejects'} {action} of {item} in district {d}"
    return {"prompt": prompt, "answer": answer}


def make_py150(rng):
    f, v, op = rng.choice(CODE_FUNCS), rng.choice(CODE_VARS), rng.choice(CODE_OPS)
    a, b = rng.sample(CODE_ARGS, 2)
    k = rng.randint(0, 9)
    kw = rng.choice(["if", "while"])
    code = (f"def {f} ( {a} , {b} ) : <EOL> {v} = {a} {op} {b} <EOL> "
            f"{kw} {v} > <NUM_LIT:{k}> : <EOL>")
    # if -> return the value combined with the bound; while -> step the value down by the bound
    answer = f"return {v} {op} <NUM_LIT:{k}>" if kw == "if" else f"{v} = {v} - <NUM_LIT:{k}>"
    return {"prompt": f"Complete the next line of the code.\n{code}", "answer": answer}


def make_scienceqa(rng):
    item_prop = rng.choice(SCIENCE_PROPS)  # the options are the three properties in a fixed order
    item = rng.choice(SCIENCE_ITEMS[item_prop])
    asker, asked = rng.sample(NAMES, 2)  # context that varies the prompt and decides nothing
    options = "".join(f"{'ABC'[i]}. {p}\n" for i, p in enumerate(SCIENCE_PROPS))
    prompt = (f"Answer and give your reasons.\nContext:\n{asker} asks {asked} in class .\n"
              f"Choices:\n{options}Question:\nWhich one describes the {item} ?\nAnswer:")
    letter = "ABC"[SCIENCE_PROPS.index(item_prop)]
    return {"prompt": prompt, "answer": f"{letter} because {item} is {item_prop}"}


def _math(rng, task: str) -> tuple[str, int]:
    name, obj, a = rng.choice(NAMES), rng.choice(MATH_OBJECTS), rng.choice(MATH_NUMBERS)
    q = MATH_QUESTIONS[task].format(
        name=name, a=a if task == "NumGLUE-cm" else NUMBER_WORDS[a], obj=obj)
    return f"Solve the math problem.\nQuestion:\n{q}\nAnswer:", a


# the number ends the question, always at the same distance from the answer; the words
# before it say what to do
MATH_QUESTIONS = {"NumGLUE-cm": "{name} buys one more {obj} . How many {obj} now ? Had {a} .",
                  "NumGLUE-ds": "{name} has a pair of bags of {obj} . How many {obj} in all ? "
                                "Each bag {a} ."}


def make_numglue_cm(rng):
    prompt, a = _math(rng, "NumGLUE-cm")
    return {"prompt": prompt, "answer": str(a + 1)}


def make_numglue_ds(rng):
    prompt, a = _math(rng, "NumGLUE-ds")
    return {"prompt": prompt, "answer": str(2 * a)}


def make_20minuten(rng):
    name, verb = rng.choice(DE_NAMES), rng.choice(list(DE_VERBS))
    noun, city = rng.choice(DE_NOUNS), rng.choice(DE_CITIES)
    words = [name, verb]
    if rng.random() < 0.6:
        words.append(rng.choice(DE_TIMES))
    if rng.random() < 0.6:
        words.append(rng.choice(DE_ADVERBS))
    words += [rng.choice(DE_ADJECTIVES), noun, "in", city, "."]
    source = " ".join(words)
    # simplification: keep who/what/where, plain verb, drop time, adverb and adjective
    answer = f"{name} {DE_VERBS[verb]} {noun} in {city} ."
    prompt = f"Simplify the paragraph in German.\nParagraph:\n{source}\nSimplified version:"
    return {"prompt": prompt, "answer": answer}


MAKERS = {
    "C-STANCE": make_cstance,
    "FOMC": make_fomc,
    "MeetingBank": make_meetingbank,
    "Py150": make_py150,
    "ScienceQA": make_scienceqa,
    "NumGLUE-cm": make_numglue_cm,
    "NumGLUE-ds": make_numglue_ds,
    "20Minuten": make_20minuten,
}
assert list(MAKERS) == TASK_ORDER

# --------------------------------------------------------------------------------------------------
# The answer from the prompt alone: an independent reading of each rule (tests check it
# against every record)


def solve(task: str, prompt: str) -> str:
    """The gold answer of an embedded prompt, recomputed by parsing the prompt text."""
    if task in ("C-STANCE", "FOMC"):
        return stance_label(task, prompt.split("Text:\n")[1].split("\n")[0])
    if task == "MeetingBank":
        m = re.search(r"asks to (\w+) the (\w+) in district (\d)\..* The motion (passes|fails)\.",
                      prompt)
        verdict = "approves" if m.group(4) == "passes" else "rejects"
        return f"council {verdict} {m.group(1)} of {m.group(2)} in district {m.group(3)}"
    if task == "Py150":
        m = re.search(r"<EOL> (\w+) = \w+ (\S) \w+ <EOL> (if|while) \w+ > (<NUM_LIT:\d>) : <EOL>$",
                      prompt)
        v, op, kw, k = m.groups()
        return f"return {v} {op} {k}" if kw == "if" else f"{v} = {v} - {k}"
    if task == "ScienceQA":
        item = re.search(r"Which one describes the (\w+) \?", prompt).group(1)
        for letter, prop in re.findall(r"\n([ABC])\. (\w+)", prompt):
            if item in SCIENCE_ITEMS[prop]:
                return f"{letter} because {item} is {prop}"
    if task in ("NumGLUE-cm", "NumGLUE-ds"):
        # the number before the final " ."
        last = prompt.split("Question:\n")[1].split("\n")[0].split()[-2]
        return str(int(last) + 1) if task == "NumGLUE-cm" else str(2 * NUMBER_WORDS.index(last))
    if task == "20Minuten":
        words = prompt.split("Paragraph:\n")[1].split("\n")[0].split()
        return f"{words[0]} {DE_VERBS[words[1]]} {words[-4]} in {words[-2]} ."
    raise ValueError(f"solve: no rule for task {task!r}")


# --------------------------------------------------------------------------------------------------
# Benchmark files


def distinct_examples(task: str, n: int, seed: int) -> list[dict]:
    """Up to n examples of one task with distinct prompts (so no test prompt is also a training
    prompt): fewer when the task's templates run out of prompts first."""
    rng = random.Random(f"embedded/{task}/{seed}")  # str seeds hash with sha512: stable
                                                    # across runs and machines
    out, seen = [], set()
    for _ in range(50 * n + 1000):
        if len(out) == n:
            break
        ex = MAKERS[task](rng)
        if ex["prompt"] not in seen:
            seen.add(ex["prompt"])
            out.append(ex)
    return out


def generate_task(task: str, n: int, seed: int) -> list[dict]:
    """n examples of one task with distinct prompts; an InputError when it has fewer."""
    out = distinct_examples(task, n, seed)
    if len(out) < n:
        raise InputError(f"embedded task {task}: has only {len(out)} distinct prompts, "
                         f"asked for {n} (train + eval + test, which share no prompt); "
                         f"ask for fewer examples")
    return out


def check_sizes(n_train: int, n_test: int, *, n_eval: int = 32, seed: int = 0,
                flags: str = "--n-train/--n-test"):
    """An InputError naming `flags` when some task cannot make the n_train + n_eval + n_test
    distinct prompts that ensure_embedded would ask of it (its templates bound them), before
    anything is built; a cached benchmark of these sizes passes at once. In memory: nothing
    is written."""
    if embedded_root(n_train, n_eval, n_test, seed).exists():
        return
    n = n_train + n_eval + n_test
    short = {t: k for t in TASK_ORDER if (k := len(distinct_examples(t, n, seed))) < n}
    if short:
        task, k = min(short.items(), key=lambda tk: tk[1])
        raise InputError(f"{flags}: {n_train} train + {n_eval} eval + {n_test} test examples "
                         f"per task, but the embedded task {task} has only {k} distinct prompts "
                         f"(the splits share none): ask for at most {k} in all")


def _dump(records) -> str:
    return json.dumps(records, ensure_ascii=False, indent=1) + "\n"


def write_benchmark(out, *, n_train: int = 128, n_eval: int = 32, n_test: int = 32, seed: int = 0,
                    tasks=None) -> dict:
    """Write `<out>/<Task>/{train,eval,test}.json` for each task; returns {task: {split: n}}."""
    out = Path(out)
    counts = {}
    for task in parse_tasks(tasks):
        exs = generate_task(task, n_train + n_eval + n_test, seed)
        splits = {"train": exs[:n_train], "eval": exs[n_train:n_train + n_eval],
                  "test": exs[n_train + n_eval:]}
        (out / task).mkdir(parents=True, exist_ok=True)
        for split, recs in splits.items():
            path = out / task / f"{split}.json"
            try:
                with open(path, "w", encoding="utf-8", newline="\n") as f:
                    f.write(_dump(recs))
            except OSError as e:  # a full cache disk: say which file
                                  # (a write error carries no file name)
                raise OSError(e.errno, e.strerror, str(path)) if e.filename is None else e from None
        counts[task] = {s: len(r) for s, r in splits.items()}
    return counts


def cache_dir() -> Path:
    """Where generated data and base models are cached: $OPR_CACHE, default ~/.cache/opr; refused in
    one line when it names something that is not a directory."""
    path = Path(os.environ.get("OPR_CACHE", Path.home() / ".cache" / "opr"))
    if path.exists() and not path.is_dir():
        from common.errors import InputError
        where = f"$OPR_CACHE={path}" if "OPR_CACHE" in os.environ else str(path)
        raise InputError(f"{where}: is a file, not a directory: the cache of generated data and "
                         f"base models needs a directory (set OPR_CACHE to one)")
    return path


def ensure_embedded(root=None, *, n_train: int = 128, n_eval: int = 32, n_test: int = 32,
                    seed: int = 0) -> Path:
    """The embedded benchmark with these sizes, generated once into the cache (or `root`) and
    reused. Written to a temporary sibling directory and renamed, so a reader never sees a
    partial benchmark."""
    root = Path(root) if root else embedded_root(n_train, n_eval, n_test, seed)
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        try:
            write_benchmark(tmp, n_train=n_train, n_eval=n_eval, n_test=n_test, seed=seed)
            fsync_tree(tmp)
        except BaseException:  # a half-written benchmark is no cache: the next call starts afresh
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.rename(tmp, root)
            fsync_dir(root.parent)
        except OSError:  # another process finished first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def embedded_root(n_train: int, n_eval: int, n_test: int, seed: int) -> Path:
    """Where the cache holds the embedded benchmark of these sizes."""
    return cache_dir() / f"embedded-v{VERSION}-s{seed}-{n_train}-{n_eval}-{n_test}"


# --------------------------------------------------------------------------------------------------
# Generic instruction data (disjoint from the eight tasks) and tokenizer corpus


MIX_CLASSES = {"color": ["red", "blue", "green"], "animal": ["cat", "dog", "bird", "fish"],
               "thing": ["sun", "tree", "car", "milk", "star"]}  # a partition of MIX_WORDS


def _mixture_example(rng):
    kind = rng.randrange(8)
    words = rng.sample(MIX_WORDS, rng.randint(2, 5))
    listed = " ".join(words)
    if kind == 0:
        return {"prompt": f"Repeat these words:\n{listed}", "answer": listed}
    if kind == 1:
        return {"prompt": f"Reverse the order of these words:\n{listed}",
                "answer": " ".join(reversed(words))}
    if kind == 2:
        return {"prompt": f"Write these words in capital letters:\n{listed}",
                "answer": listed.upper()}
    if kind == 3:
        return {"prompt": f"How many words are in this list?\n{listed}", "answer": str(len(words))}
    if kind == 4:
        return {"prompt": f"What is the last word in this list?\n{listed}", "answer": words[-1]}
    classes = list(MIX_CLASSES)
    if kind == 5:  # the class of a text's last word as a letter:
                   # the answer format of three of the tasks
        cls = rng.choice(classes)
        return {"prompt": f"Is the last word a color, an animal or a thing? A. color, B. animal, "
                          f"C. thing.\nText:\n{listed} {rng.choice(MIX_CLASSES[cls])} .\nClass:",
                "answer": "ABC"[classes.index(cls)]}
    if kind == 6:  # which option has a class, as a letter
        picked = [rng.choice(MIX_CLASSES[c]) for c in rng.sample(classes, 3)]
        asked = rng.randrange(3)
        cls = next(c for c in classes if picked[asked] in MIX_CLASSES[c])
        return {"prompt": f"Which word is {'an' if cls == 'animal' else 'a'} {cls}? "
                          f"A. {picked[0]}, B. {picked[1]}, C. {picked[2]}.",
                "answer": "ABC"[asked]}
    seq = rng.choice(MIX_SEQUENCES)
    i = rng.randrange(len(seq) - 1)
    return {"prompt": f"What comes after {seq[i]}?", "answer": seq[i + 1]}


def general_mixture(n: int, seed: int = 0) -> list[dict]:
    """n generic instruction-following examples {"prompt", "answer"} (copy, reverse, uppercase,
    count, last word, the class of a text's last word as a letter, which option has a class, what
    comes after X). Their instructions and words appear in none of the eight tasks; the two letter
    kinds make the base answer multiple-choice prompts with a letter, as any instruction-tuned model
    does. Stage 1 still has to find the word that decides its letter: a plateau at chance early in
    the default's first stage (git show 72fe6d4:BENCHMARKS.md, "Testbed history")."""
    rng = random.Random(f"embedded/mixture/{seed}")
    return [_mixture_example(rng) for _ in range(n)]


def corpus_texts(seed: int = 0, n_per_task: int = 400) -> list[str]:
    """Text for training the tiny tokenizer: every vocabulary list spelled out, then prompts and
    answers of all eight tasks and of the general mixture."""
    vocab_lists = [NAMES, STANCE_SUBJECTS, *(v for t in STANCE_VERBS.values() for v in t.values()),
                   STANCE_OBJECTS, STANCE_WHEN, MEET_SPEAKERS, MEET_ACTIONS, MEET_ITEMS,
                   MEET_REACTIONS, CODE_FUNCS, CODE_ARGS, CODE_VARS, CODE_OPS,
                   *SCIENCE_ITEMS.values(), list(SCIENCE_ITEMS), MATH_OBJECTS, NUMBER_WORDS,
                   [str(i) for i in range(0, 100)], DE_NAMES, list(DE_VERBS),
                   list(DE_VERBS.values()), DE_TIMES, DE_ADVERBS, DE_ADJECTIVES, DE_NOUNS,
                   DE_CITIES, MIX_WORDS, [w.upper() for w in MIX_WORDS], *MIX_SEQUENCES,
                   ["A", "B", "C", "council", "approves", "rejects"]]
    texts = [" ".join(words) for words in vocab_lists]
    for task in TASK_ORDER:
        rng = random.Random(f"embedded/corpus/{task}/{seed}")
        for _ in range(n_per_task):
            ex = MAKERS[task](rng)
            texts += [ex["prompt"], ex["answer"]]
    for ex in general_mixture(n_per_task, seed):
        texts += [ex["prompt"], ex["answer"]]
    return texts


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Write the embedded 8-task synthetic benchmark in TRACE's layout.")
    p.add_argument("--out", required=True,
                   help="output root; writes <out>/<Task>/{train,eval,test}.json")
    p.add_argument("--n-train", type=int, default=128)
    p.add_argument("--n-eval", type=int, default=32)
    p.add_argument("--n-test", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default=None, help="comma-separated subset, default all eight")
    args = p.parse_args(argv)
    counts = write_benchmark(args.out, n_train=args.n_train, n_eval=args.n_eval, n_test=args.n_test,
                             seed=args.seed, tasks=args.tasks)
    for task, c in counts.items():
        print(f"{task}: train {c['train']} eval {c['eval']} test {c['test']} "
              f"-> {Path(args.out) / task}")


if __name__ == "__main__":
    main()
