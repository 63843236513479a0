"""The house's rules (issue 59, part 5): no product module over 600 lines, no product line over 100 columns
(characters, not bytes), BENCHMARKS.md a state page within 1,200 lines. The product: every .py outside tests/,
bench/ and hidden directories (.venv-vllm), the pytest configuration conftest.py aside."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES, MAX_COLUMNS = 600, 100


def product_files() -> list[Path]:
    files = []
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] in ("tests", "bench") or any(p.startswith(".") for p in parts) or parts == ("conftest.py",):
            continue
        files.append(path)
    return files


def test_the_scan_sees_the_product():
    names = {p.relative_to(REPO).as_posix() for p in product_files()}
    assert {"train.py", "run.py", "plan.py", "engine/engine.py", "methods/opr.py"} <= names
    assert not any(n.startswith(("tests/", "bench/", ".venv")) for n in names) and "conftest.py" not in names


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(REPO)}: {n}" for p in product_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(long)


def test_no_line_over_100_columns():
    wide = [f"{p.relative_to(REPO)}:{i}: {len(line)}" for p in product_files()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"lines over {MAX_COLUMNS} columns: " + ", ".join(wide)


def test_benchmarks_is_a_state_page():
    """Today's numbers with their commands and dates; a superseded section leaves it (git keeps it)."""
    n = len((REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines())
    assert n <= 1200, f"BENCHMARKS.md: {n} lines, over 1,200: move superseded sections out (git keeps them)"
