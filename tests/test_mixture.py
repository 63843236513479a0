"""data/mixture.py: a training mixture's records in every format a task manifest reads are the prompt/response
records they stand for; bad records fail in one line naming file, record and field."""
import json
import re

import pytest

from common.errors import InputError
from data.mixture import load_mixture
from common.outputs import write_jsonl


def chat(prompt, answer) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def test_mixture_records_of_every_format_are_their_prompt_response_equivalents(tmp_path):
    """load_mixture: chat (one user turn: a string prompt; a system turn or earlier turns: the message list),
    instruction/input/output (instruction, a blank line, the input), prompt/completion, each as the prompt/response
    record it stands for; a "source" still marks replay; a bad record is one line naming file, record and field."""
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    write_jsonl(tmp_path / "chat.jsonl", [chat("the cat", "sat"), {"messages": turns + [
        {"role": "assistant", "content": "ok"}], "source": "buffer"}])
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "the cat", "input": "on a mat", "output": "sat"},
                                                      {"instruction": "a dog", "output": "ran"}]))
    write_jsonl(tmp_path / "completion.jsonl", [{"prompt": "red", "completion": "blue"}])
    write_jsonl(tmp_path / "own.jsonl", [{"prompt": "the cat", "response": "sat"},
                                        {"prompt": turns, "response": "ok", "source": "buffer"},
                                        {"prompt": "the cat\n\non a mat", "answer": "sat"},
                                        {"prompt": "a dog", "response": "ran"}, {"prompt": "red", "response": "blue"}])
    got = load_mixture([str(tmp_path / f) for f in ("chat.jsonl", "alpaca.json", "completion.jsonl")])
    assert got == load_mixture([str(tmp_path / "own.jsonl")])
    assert [r["replay"] for r in got] == [False, True, False, False, False]
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [chat("the cat", "sat"), {"messages": turns}])
    with pytest.raises(InputError, match=re.escape(f"{bad}: record 1 (line 2): field 'messages': the last message "
                                                   f"must be the assistant's answer")):
        load_mixture([str(bad)])
    write_jsonl(bad, [chat("the cat", " ")])
    with pytest.raises(InputError, match=re.escape(f"{bad}: record 0 (line 1): field 'messages[1].content' is only "
                                                   f"whitespace")):
        load_mixture([str(bad)])


def test_mixture_reads_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [chat("the cat", "sat"), {"instruction": "a dog", "input": "", "output": "ran"}]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "b.parquet")
    assert load_mixture([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]) == [
        {"prompt": "the cat", "response": "sat", "replay": False}, {"prompt": "a dog", "response": "ran", "replay": False}]
