"""The project's import structure (issue 59): the step scripts stand alone, common/ is a leaf, the
packages below the pipeline do not reach up into it, the sampling engine is a package of its own
(engine/: it builds on model/, kernels/ and common/, model/ does not import it, and it reads no
task table), and no module imports itself back through others. Over the same modules, the house's size
rules (issue 59, part 5; conftest.py, the pytest configuration, aside): none over 600 lines, no line over
100 columns (characters, not bytes); and BENCHMARKS.md a state page within 1,200 lines.

An AST scan of every module of the repository (each .py outside tests/, bench/ and hidden
directories such as .venv-vllm) that reads every import statement, at the top of a file and inside
functions alike: a deferred import ties two modules together as much as a top-level one, it only
runs later. importlib.import_module with a computed name (the zygote's preloads, a manifest's
scorer) is no statement and is not seen. The scan reads the files and imports none of them.
"""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = ("train", "rollout", "score", "evaluate", "drift", "synthesize", "ssr_buffer",
                "buffer_nll")
BELOW_PIPELINE = ("data", "model", "engine", "methods", "kernels")  # the step scripts' parts
# the sampling engine's pages (nano-vllm's engine/), and what engine/ may import
ENGINE_MODULES = ("engine", "scheduler", "sampler", "native", "sampling", "vllm_engine", "workers")
ENGINE_IMPORTS = ("engine", "model", "kernels", "common")
SKIP = ("tests", "bench")  # they may import anything: nothing of the project imports them


def _module_files() -> dict[str, Path]:
    """{dotted module name: file} of the project's own modules (a package is its __init__.py)."""
    mods = {}
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] in SKIP or any(p.startswith(".") for p in parts):
            continue
        names = list(parts[:-1]) + ([] if path.name == "__init__.py" else [path.stem])
        if names:
            mods[".".join(names)] = path
    return mods


MODULES = _module_files()


def _targets(node, module: str, is_package: bool) -> list[str]:
    """The project modules an import statement names: `import a.b` -> a.b; `from a import b` ->
    a.b where that is a module, else a (b is a name in a); relative imports resolved against
    `module`. Names outside the project (the standard library, torch) give nothing."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # from . import x / from ..y import z
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
    found = []
    for name in names:  # the longest prefix that is a project module (a.b.c may name a.b's c)
        parts = name.split(".")
        while parts and ".".join(parts) not in MODULES:
            parts.pop()
        if parts and ".".join(parts) not in found:
            found.append(".".join(parts))
    return found


def _edges() -> dict[str, list[tuple[str, str]]]:
    """{module: [(imported project module, 'file:line: `statement`'), ...]} over every import
    statement of every module."""
    edges = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        out = edges.setdefault(module, [])
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                where = f"{path.relative_to(REPO)}:{node.lineno}: `{ast.unparse(node)}`"
                is_package = path.name == "__init__.py"
                out += [(t, where) for t in _targets(node, module, is_package) if t != module]
    return edges


EDGES = _edges()


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _path_to(start: str, package: str) -> list[str] | None:
    """The shortest chain of imports (each 'file:line: `statement`') by which `start` reaches
    `package`, or None."""
    seen, todo = {start}, [(start, [])]
    while todo:  # breadth first
        module, chain = todo.pop(0)
        for target, where in EDGES.get(module, []):
            if _in(target, package):
                return chain + [where]
            if target not in seen:
                seen.add(target)
                todo.append((target, chain + [where]))
    return None


def test_the_scan_sees_the_project():
    """Guards the tests below against passing on nothing: every step script and package is found,
    and the scan reads a top-level import (train.py's of common.cli) and a deferred one
    (methods/agem.py's, inside add_flags)."""
    for name in (*STEP_SCRIPTS, "common", "common.cli", *BELOW_PIPELINE, "pipeline"):
        assert name in MODULES, f"{name}: not found by the scan"
    assert any(t == "common.cli" for t, _ in EDGES["train"])
    assert any(t == "common.cli" for t, _ in EDGES["methods.agem"])


@pytest.mark.parametrize("script", STEP_SCRIPTS)
def test_a_step_script_imports_nothing_of_the_pipeline(script):
    """A step script runs on its own (python train.py ...): it imports nothing from pipeline/,
    neither itself nor through the modules it imports, at the top or inside a function."""
    direct = [w for t, w in EDGES[script] if _in(t, "pipeline")]
    assert not direct, f"{script}.py imports pipeline/: " + "; ".join(direct)
    chain = _path_to(script, "pipeline")
    assert chain is None, f"{script}.py reaches pipeline/ through " + " -> ".join(chain)


def test_common_is_a_leaf():
    """common/ (errors, CLI edge, JSON Lines, outputs) imports the standard library and third-party
    packages only, so every package may import it without a cycle."""
    bad = [w for m, es in EDGES.items() if _in(m, "common") for t, w in es
           if not _in(t, "common")]
    assert not bad, "common/ imports the project: " + "; ".join(bad)


@pytest.mark.parametrize("package", BELOW_PIPELINE)
def test_the_packages_below_the_pipeline_do_not_import_it(package):
    """data/, model/, engine/, methods/ and kernels/ are what the scripts are built from;
    pipeline/ is built on them, not the reverse."""
    bad = [w for m, es in EDGES.items() if _in(m, package) for t, w in es if _in(t, "pipeline")]
    assert not bad, f"{package}/ imports pipeline/: " + "; ".join(bad)


def test_the_engine_is_a_package_of_its_own():
    """The sampling engine lives in engine/: none of its modules sits in model/ beside the
    transformer it runs."""
    for name in ENGINE_MODULES:
        assert f"engine.{name}" in MODULES, f"engine/{name}.py: not found"
        assert f"model.{name}" not in MODULES, f"model/{name}.py: the engine's, for engine/"


def test_the_engine_imports_only_model_kernels_and_common():
    """engine/ runs model/'s transformer, tokenizer and checkpoints with kernels/' kernels and
    common/'s errors: it imports nothing else of the project (no data/, methods/, pipeline/)."""
    bad = [w for m, es in EDGES.items() if _in(m, "engine") for t, w in es
           if not any(_in(t, p) for p in ENGINE_IMPORTS)]
    assert not bad, "engine/ imports beyond model/, kernels/ and common/: " + "; ".join(bad)


@pytest.mark.parametrize("module", [f"engine.{name}" for name in ENGINE_MODULES])
def test_the_engine_reads_no_task_table(module):
    """A task's own length cap or temperature reaches the engine as numbers per prompt (the scripts
    read them: data.manifest.sampling_settings); no engine module reaches data/ (the task table,
    the manifests, the loaders), directly or through the modules it imports."""
    assert module in MODULES, f"{module}: not found"
    chain = _path_to(module, "data")
    assert chain is None, f"{module} reaches data/ through " + " -> ".join(chain)


def test_model_does_not_import_the_engine():
    """model/ is what the engine runs; no module of it imports engine/ (sdft, which samples from
    the training weights, is methods/sdft.py's)."""
    bad = [w for m, es in EDGES.items() if _in(m, "model") for t, w in es if _in(t, "engine")]
    assert not bad, "model/ imports engine/: " + "; ".join(bad)


def _find_cycle(edges=None) -> list[tuple[str, str]] | None:
    """One import cycle of `edges` (default: the project's) as [(module, 'file:line: `statement`'
    of its import of the next), ...], or None: a depth-first search that meets a module still on
    its stack."""
    edges = EDGES if edges is None else edges
    state = {}  # module -> 1 on the stack, 2 done
    stack = []  # [(module, where it imports the next module on the stack)]

    def visit(module):
        state[module] = 1
        for target, where in edges.get(module, []):
            stack.append((module, where))
            if state.get(target) == 1:
                start = next(i for i, (m, _) in enumerate(stack) if m == target)
                return stack[start:]
            if target not in state:
                found = visit(target)
                if found:
                    return found
            stack.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_cycle():
    """No module imports itself back through others, deferred imports included (deferring one only
    hides a circle until the function runs), so a module can be read, tested and moved with what
    it imports alone."""
    cycle = _find_cycle()
    assert cycle is None, ("import cycle: " + " -> ".join(f"{m} ({w})" for m, w in cycle)
                           + f" -> {cycle[0][0]}")


def test_the_cycle_search_finds_a_cycle():
    """The search itself: a made-up circle b -> c -> b behind a is found and reported with its
    imports; a chain without one is not."""
    edges = {"a": [("b", "a.py:1: `import b`")], "b": [("c", "b.py:2: `import c`")],
             "c": [("b", "c.py:3: `from b import x`")]}
    assert _find_cycle(edges) == [("b", "b.py:2: `import c`"), ("c", "c.py:3: `from b import x`")]
    assert _find_cycle({"a": [("b", "a.py:1: `import b`")], "b": []}) is None


PRODUCT = {m: p for m, p in MODULES.items() if m != "conftest"}  # the size rules' modules
MAX_LINES, MAX_COLUMNS = 600, 100


def test_the_size_rules_see_the_product():
    assert {"train", "run", "plan", "engine.engine", "methods.opr"} <= set(PRODUCT) and "conftest" not in PRODUCT


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(REPO)}: {n}" for p in PRODUCT.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(long)


def test_no_line_over_100_columns():
    wide = [f"{p.relative_to(REPO)}:{i}: {len(line)}" for p in PRODUCT.values()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"lines over {MAX_COLUMNS} columns: " + ", ".join(wide)


def test_benchmarks_is_a_state_page():
    """Today's numbers with their commands and dates; a superseded section leaves it (git keeps it)."""
    n = len((REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines())
    assert n <= 1200, f"BENCHMARKS.md: {n} lines, over 1,200: move superseded sections out (git keeps them)"
