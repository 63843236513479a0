"""pytest configuration shared by every test file (the repository root is on sys.path through this file).

Marker `gpu`: tests that need a CUDA device (tests/test_gpu.py). `python -m pytest -q tests` collects them and
skips them where there is no CUDA; `python -m pytest -m gpu tests` runs only them (the GPU install check).
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one (python -m pytest -m gpu tests)")
