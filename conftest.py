"""pytest configuration shared by every test file (the repository root is on sys.path through this file).

Order: the slowest files first (SLOW_FIRST, measured on 2 cores), so that README's `-n 2` does not end with one long
file running alone; within a file, and among the rest, the order stays pytest's.

Marker `gpu`: tests that need a CUDA device (tests/test_gpu.py). `python -m pytest -q tests` collects them and
skips them where there is no CUDA; `python -m pytest -m gpu tests` runs only them (the GPU install check).
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one (python -m pytest -m gpu tests)")


# the files that took longest on 2 cores (pytest --durations), slowest first; re-measure when a file grows
SLOW_FIRST = ("test_vllm_engine.py", "test_run.py", "test_reliability.py", "test_train.py", "test_run_keys.py",
              "test_gpu_check.py", "test_ilora.py", "test_ray.py", "test_tracebacks.py", "test_plan.py",
              "test_layout.py", "test_train_lora.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: pytest's order otherwise
