"""model/base.py: the tiny base is built with the CPU pins and one thread, whoever builds it."""
import pytest


def test_the_tiny_base_is_built_with_the_cpu_pins_and_one_thread_whoever_builds_it(tmp_path, monkeypatch):
    """The base every chain starts from: its training runs with one thread and kernels.CPU_PINS whatever the
    caller's environment, so every x86-64 CPU with AVX2 builds the same bytes; its cache name follows the pins."""
    import kernels
    import model.base as base
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    for k in kernels.CPU_PINS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(cmd, check, env, **kw):
        seen.update(env, preexec_fn=kw.get("preexec_fn"))  # (that it dies with its builder: tests/test_zygote.py)
        raise Stop
    monkeypatch.setattr(base.subprocess, "run", fake_run)
    with pytest.raises(Stop):
        base.build_tiny(tmp_path / "tiny")
    assert {k: seen[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", *kernels.CPU_PINS)} \
        == dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **kernels.CPU_PINS)  # on the CPU
    assert callable(seen["preexec_fn"])
    assert not (tmp_path / "tiny").exists()  # nothing half-built is left under the cache name
    pinned = base.tiny_recipe_hash()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx"})  # a CPU without AVX2: its own build, its own name
    assert base.tiny_recipe_hash() != pinned
