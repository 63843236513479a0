"""The paper's grid (one model's 8 TRACE stages of an OPR method, the paper's 32 GPU-hours) priced
by the cost model of model/costs.py, as `plan.py --paper` prints it.

    costs = paper_grid(model_cfg, profile, trace_dir="../shared/trace")   # -> [StepCost]
"""
from pathlib import Path

from model.costs import CHARS_PER_TOKEN, TEMPLATE_ANSWER, TEMPLATE_PROMPT, Profile, StepCost, price

PAPER_GPU_HOURS = 32.0   # the paper: one model's 8 stages
# Per-task sizes for the paper's grid when the TRACE files are not at hand (Qwen2.5 chat template:
# TEMPLATE_PROMPT tokens of system prompt and headers around the prompt, TEMPLATE_ANSWER after the
# answer). n_train after the over-long filter (2,048), mean prompt tokens (templated), mean answer
# tokens, test examples. ASSUMPTIONS, except where `--trace` finds the task's files (FOMC and
# NumGLUE-cm/-ds in ../shared/trace): then counts and lengths come from them, at CHARS_PER_TOKEN (no
# Qwen tokenizer here).
PAPER_TASKS = {  # task: (n_train kept, mean prompt tokens, mean answer tokens, n_test)
    "C-STANCE": (5000, 150, 1, 2000),      # Chinese stance texts, a letter answer
    "FOMC": (5000, 112, 1, 496),           # from shared/trace's files: mean chars /
                                           # CHARS_PER_TOKEN + template
    "MeetingBank": (4000, 1300, 80, 1000),  # long transcripts: ~1/5 over 2,048
                                            # tokens dropped; summaries
    "Py150": (5000, 600, 12, 1000),        # code context, the next line
    "ScienceQA": (5000, 180, 1, 2000),     # question + choices, a letter
    "NumGLUE-cm": (5000, 81, 1, 81),       # from shared/trace's files, as FOMC
    "NumGLUE-ds": (5000, 64, 1, 325),      # from shared/trace's files, as FOMC
    "20Minuten": (5000, 700, 90, 1000),    # German news articles, simplified summaries
}


def paper_tasks(trace_dir=None) -> dict:
    """PAPER_TASKS, with the rows of the tasks whose files are under trace_dir
    measured from them."""
    from data.trace import load_task
    table = dict(PAPER_TASKS)
    for task in table:
        if trace_dir is None or not (Path(trace_dir) / task / "train.json").is_file():
            continue
        train, test = load_task(trace_dir, task, "train"), load_task(trace_dir, task, "test")
        prompt = sum(len(e.prompt) for e in train) / len(train) / CHARS_PER_TOKEN + TEMPLATE_PROMPT
        answer = sum(len(e.answer) for e in train) / len(train) / CHARS_PER_TOKEN
        table[task] = (len(train), round(prompt), max(1, round(answer)), len(test))
    return table


def paper_grid(model_cfg, profile: Profile, trace_dir=None, rho: float = 0.01, max_new: int = 512,
               repeats: int = 8, checkpointing: bool = True) -> list[StepCost]:
    """One model's 8 stages of an OPR method, as run.py plans them: row 0 evaluates the base on
    every task; stage i trains on task i (+ the buffer of rho x 5000 model answers from tasks < i)
    for the task's epochs, evaluates tasks 1..i+1 (`repeats` samples per test prompt, the paper
    preset's 8), and (i < 8) rolls out every training prompt of tasks 1..i once, <= max_new new
    tokens. Training recomputes activations (the paper preset's --activation-checkpointing) unless
    checkpointing=False."""
    from data.tasks import TASK_ORDER, get_task
    table = paper_tasks(trace_dir)
    # one SFT example's tokens
    doc = {t: table[t][1] + table[t][2] + TEMPLATE_ANSWER for t in TASK_ORDER}

    def evaluation(key, deps, seen):
        e = StepCost(key, "eval", deps)
        e.prompts = repeats * sum(table[t][3] for t in seen)
        e.prompt_tokens = repeats * sum(table[t][3] * table[t][1] for t in seen)
        e.new_tokens_est = repeats * sum(table[t][3] * min(max_new, table[t][2] + 1) for t in seen)
        e.new_tokens_max = e.prompts * max_new
        return e

    costs, prev = [evaluation("s0-eval", [], TASK_ORDER)], None
    for i, task in enumerate(TASK_ORDER):
        n, ep, prior = table[task][0], get_task(task).epochs, TASK_ORDER[:i]
        c = StepCost(f"s{i + 1}-train-{task}", "train", [prev] if prev else [])
        n_buf = round(rho * n) if prior else 0
        buf = n_buf * sum(doc[t] for t in prior) / max(len(prior), 1)
        buf_max = n_buf * (sum(table[t][1] for t in prior) / max(len(prior), 1) + max_new
                           + TEMPLATE_ANSWER)
        c.train_tokens, c.train_tokens_max = (round(ep * (n * doc[task] + buf)),
                                              round(ep * (n * doc[task] + buf_max)))
        c.mean_doc, c.exact = doc[task], not prior
        costs.append(c)
        seen = TASK_ORDER[:i + 1]
        # + task i+1, for FWT
        costs.append(evaluation(f"s{i + 1}-eval", [c.key], TASK_ORDER[:i + 2]))
        if i + 1 < len(TASK_ORDER):
            r = StepCost(f"s{i + 1}-rollout", "rollout", [c.key])
            r.prompts = sum(table[t][0] for t in seen)
            r.prompt_tokens = sum(table[t][0] * table[t][1] for t in seen)
            r.new_tokens_est = sum(table[t][0] * min(max_new, table[t][2] + 1) for t in seen)
            r.new_tokens_max = r.prompts * max_new
            costs.append(r)
        prev = c.key
    for c in costs:
        price(c, model_cfg, profile, checkpointing)
        c.methods = ["opr"]
    return costs
