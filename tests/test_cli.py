"""common/cli.py: the flag types on hand-checked values, the one-line message of each kind of expected failure, and
main_cli's exit codes. The scripts' own failures end to end: test_tracebacks.py, test_fuzz.py."""
import errno
import signal

import pytest

from common.errors import UserError
from common.cli import Parser, Terminated, comma_list, float_in, int_at_least, main_cli, user_message


def parse(capsys, flag_type, value):
    """value through `--x` of a Parser -> (the parsed value, None) or (None, the one error line)."""
    p = Parser(prog="t.py")
    p.add_argument("--x", type=flag_type)
    try:
        return p.parse_args([f"--x={value}"]).x, None
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        return None, err.strip()


def test_flag_types_accept_and_name_what_they_refuse(capsys):
    assert parse(capsys, int_at_least(1), "3") == (3, None)
    assert parse(capsys, int_at_least(1), "0")[1] == "t.py: error: argument --x: must be >= 1, got 0 (see --help)"
    assert "expected an integer, got '1.5'" in parse(capsys, int_at_least(1), "1.5")[1]
    unit = float_in(0, 1, lo_open=True)
    assert parse(capsys, unit, "1") == (1.0, None) and parse(capsys, unit, " 0.25 ") == (0.25, None)
    assert "must be > 0, got 0" in parse(capsys, unit, "0")[1]
    assert "must be <= 1, got 1.5" in parse(capsys, unit, "1.5")[1]
    for bad in ("nan", "inf", "-inf"):
        assert "must be a finite number" in parse(capsys, float_in(), bad)[1]
    rhos = comma_list(float_in(0, 1), unique=True)
    assert parse(capsys, rhos, "0.1, 0.2") == ("0.1, 0.2", None)  # checked, returned as given
    assert "0.10 appears twice in '0.1,0.10'" in parse(capsys, rhos, "0.1,0.10")[1]
    assert "empty element in '0.1,,0.2'" in parse(capsys, rhos, "0.1,,0.2")[1]
    assert "must be <= 1, got 2 (in '0.5,2')" in parse(capsys, rhos, "0.5,2")[1]
    line = parse(capsys, int_at_least(1), "a\nb")[1]  # a value that holds a line break stays one line
    assert "\n" not in line and "'a\\nb'" in line


def test_user_message_of_each_expected_failure_and_none_for_a_bug():
    assert user_message(UserError("--rho 2: must be <= 1")) == "--rho 2: must be <= 1"
    assert user_message(UserError("a\nb")) == "a\\nb"
    assert user_message(FileNotFoundError(errno.ENOENT, "No such file or directory", "/d/x.json")) == \
        "/d/x.json: No such file or directory"
    assert user_message(OSError(errno.ENOSPC, "No space left on device", "/out")) == \
        "/out: No space left on device (disk full: free space and re-run)"
    assert user_message(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")) == \
        "/a: /b: Invalid cross-device link"
    assert user_message(OSError(errno.EROFS, "Read-only file system")) == \
        "Read-only file system (read-only file system: choose another output)"
    assert user_message(UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte")) == \
        "input is not UTF-8 text (invalid start byte at byte 2); convert it to UTF-8"
    assert user_message(ValueError("a bug")) is None and user_message(OSError(errno.EAGAIN, "try again")) is None


@pytest.fixture
def handlers():
    """main_cli installs its SIGTERM handler where none is set: the test process gets its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def exit_of(capsys, main):
    with pytest.raises(SystemExit) as e:
        main_cli(main, "t.py")
    return e.value.code, capsys.readouterr().err


def test_main_cli_exit_codes(capsys, handlers, monkeypatch):
    monkeypatch.delenv("OPR_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("sys.argv", ["t.py"])
    assert exit_of(capsys, lambda: None) == (0, "")
    assert exit_of(capsys, lambda: 3) == (3, "")

    def bad_input():
        raise UserError("data.jsonl: record 2: field 'prompt' missing")
    assert exit_of(capsys, bad_input) == (2, "t.py: error: data.jsonl: record 2: field 'prompt' missing\n")

    def interrupted():
        raise KeyboardInterrupt
    assert exit_of(capsys, interrupted) == (130, "t.py: interrupted\n")

    def terminated():
        raise Terminated(signal.SIGTERM)
    assert exit_of(capsys, terminated) == (143, "t.py: stopped by SIGTERM\n")

    def bug():
        raise RuntimeError("a bug keeps its traceback")
    with pytest.raises(RuntimeError, match="keeps its traceback"):
        main_cli(bug, "t.py")
    monkeypatch.setenv("OPR_DEBUG", "1")  # --debug's environment form: expected failures keep theirs too
    with pytest.raises(UserError):
        main_cli(bad_input, "t.py")
