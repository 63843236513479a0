"""A training stage's data: the mixture's records (the task's own examples and replay buffers, any
format a task manifest reads) tokenized with the model's chat template, response-only targets,
over-long examples dropped and counted, never truncated."""
from common.errors import InputError, UserError
from common.jsonl import read_records
from data.manifest import as_prompt_record
from data.packing import tokenize_sft


def load_mixture(paths: list[str]) -> list[dict]:
    """The records of every file in `paths` as {"prompt", "response", "replay"}: JSON, JSON Lines
    or Parquet files of {prompt, response} or {prompt, answer} records, or of any format a task
    manifest reads (chat messages, instruction/input/output, prompt/completion:
    data.manifest.as_prompt_record)."""
    records = []
    for path in paths:
        # a list prompt: a chat prompt's turns (data/manifest.py). "answer" is a gold answer: never
        # blank; a "response" may be a model's (a replay buffer's), which can be empty
        for r in read_records(path, required=("prompt",), any_of=("response", "answer"),
                              types={"prompt": (str, list)}, nonblank=("answer",),
                              convert=as_prompt_record):
            response = r["response"] if isinstance(r.get("response"), str) else r["answer"]
            # a record with a "source" (score.py's buffers, run.py's gold replay) is replay:
            # its loss is logged apart
            records.append({"prompt": r["prompt"], "response": response, "replay": "source" in r})
    return records


def tokenize_mixture(paths: list[str], tok, max_len: int, sdft_template: str | None = None):
    """train.py's step 1: the mixture's examples (longer than max_len dropped and counted) ->
    (examples, dropped, and with sdft_template (sdft) the student's prompts x and the teacher's x
    with the demonstration in context, else None, None)."""
    records = load_mixture(paths)
    examples, dropped = tokenize_sft(records, tok, max_len)
    if not examples:
        raise InputError(f"no example of {','.join(paths)} fits --max-len {max_len}")
    if sdft_template is None:
        return examples, dropped, None, None
    kept = [r for r in records if tok.sft_length(r["prompt"], r["response"]) <= max_len]
    try:
        teacher_ids = [tok.prompt_ids(sdft_template.format(prompt=r["prompt"], demo=r["response"]))
                       for r in kept]
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"--sdft-template must use only {{prompt}} and {{demo}} "
                        f"(double other braces): {e!r}")
    if "{prompt}" not in sdft_template or "{demo}" not in sdft_template:
        raise UserError("--sdft-template must contain both {prompt} and {demo}")
    return examples, dropped, [tok.prompt_ids(r["prompt"]) for r in kept], teacher_ids
