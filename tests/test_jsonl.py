"""common/jsonl.py: JSON Lines records read with their fields' types checked, and written so that any string
round-trips."""
import sys

import pytest

# every character str.splitlines() ends a line at (computed, so that one a later Python adds is covered), and "\r\n"
LINE_BREAKS = [c for c in map(chr, range(sys.maxunicode + 1)) if len(f"a{c}b".splitlines()) > 1] + ["\r\n"]


def test_read_records_field_types(tmp_path):
    from common.jsonl import read_records
    p = tmp_path / "predictions.jsonl"
    p.write_text('{"idx": 0, "score": 100.0}\n{"idx": 1, "score": 0}\n{"idx": 2, "score": "0"}\n')
    types = {"idx": int, "score": (int, float)}
    with pytest.raises(ValueError, match=r"record 2 \(line 3\): field 'score' must be int or float, got str"):
        read_records(p, required=("idx", "score"), types=types)
    p.write_text('{"idx": 0, "score": 100.0}\n{"idx": 1, "score": 0}\n')
    assert [r["score"] for r in read_records(p, required=("idx", "score"), types=types)] == [100.0, 0]


def test_jsonl_round_trips_every_line_break_in_any_string_field(tmp_path):
    """write_jsonl -> read_records keeps every record whole, whichever line-ending character a string holds, in
    whichever field (a key, a nested string included); the file has one line per record for str.splitlines too."""
    from common.jsonl import read_records
    from common.outputs import write_jsonl
    assert {"\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"} <= set(LINE_BREAKS)
    for i, c in enumerate(LINE_BREAKS):
        records = [{"prompt": f"p{c}q", "answer": "A"}, {"prompt": "p", "answer": c},
                   {"prompt": [{"role": "user", "content": f"{c}u"}], "answer": f"a{c}", f"k{c}": [f"x{c}y", {c: c}]}]
        path = write_jsonl(tmp_path / f"r{i}.jsonl", records)
        assert read_records(path, required=("prompt", "answer"), types={"prompt": (str, list)}) == records, repr(c)
        assert len(path.read_text(encoding="utf-8").splitlines()) == len(records), repr(c)
