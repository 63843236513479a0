"""kernels/__init__.py: the CPU pins that make float results the same on every x86-64 CPU, and keeping freed memory
in the process. The kernels themselves: test_attention.py, test_cross_entropy.py, test_kl.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---- the CPU's part in float results (kernels.cpu_numerics, CPU_PINS) ---------------------------------------------

def test_cpu_numerics_pins_only_where_the_cpu_can_run_them_and_keeps_the_callers_own(monkeypatch):
    import kernels
    for k in kernels.CPU_PINS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "avx2", "fma"})
    env, key = kernels.cpu_numerics(portable=True)
    assert env == kernels.CPU_PINS and env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "COMPATIBLE"
    assert key == {"pins": kernels.CPU_PINS}  # nothing about the CPU itself: any such CPU computes the same bytes
    env, key = kernels.cpu_numerics(portable=False)  # not asked: the CPU's own kernels, so its model is in the key
    assert env == {} and key["pins"] == {} and key["model"] == kernels.cpu_model() and key["isa"]
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "avx"})  # no AVX2 (or not x86): cannot be pinned
    env, key = kernels.cpu_numerics(portable=True)
    assert env == {} and "model" in key
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # the caller's own choice stays, and is said; it follows the CPU
    env, key = kernels.cpu_numerics(portable=True)  # (MKL takes AUTO for AVX2 on a non-Intel CPU), so the model too
    assert env == dict(kernels.CPU_PINS, MKL_CBWR="AVX2") and key["pins"] == env and key["model"]
    env, key = kernels.cpu_numerics(portable=False)
    assert env == {"MKL_CBWR": "AVX2"} and key["pins"] == env and key["model"]
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE,STRICT")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # the caller's own settings that no CPU changes either
    env, key = kernels.cpu_numerics(portable=False)
    assert env == {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "default"} and key == {"pins": env}


def test_cpu_pins_reach_the_kernels():
    """A process started with CPU_PINS computes other bytes than one on the CPU's own kernels (the pins are read,
    by ATen and by MKL), and the same bytes every time. That another CPU computes those same bytes is MKL's and
    ATen's contract (one ISA, MKL's COMPATIBLE branch at a fixed thread count); this machine cannot show it."""
    import kernels
    import torch
    if not ({"avx2", "fma"} <= kernels.cpu_flags() and torch.backends.mkl.is_available()):
        pytest.skip("needs an x86-64 CPU with AVX2 and a torch built with MKL")
    code = ("import hashlib, torch; torch.manual_seed(0); a, w = torch.randn(64, 128), torch.randn(384, 128);"
            "x = torch.randn(300, 1000);"
            "print(hashlib.sha256(torch.nn.functional.linear(a, w).numpy().tobytes()).hexdigest(),"
            " hashlib.sha256(x.softmax(-1).numpy().tobytes()).hexdigest())")
    env = {k: v for k, v in os.environ.items() if k not in kernels.CPU_PINS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def digests(extra):
        p = subprocess.run([sys.executable, "-c", code], env=dict(env, **extra), capture_output=True, text=True,
                           check=True)
        return p.stdout.split()

    native, pinned = digests({}), digests(kernels.CPU_PINS)
    assert pinned == digests(kernels.CPU_PINS)
    if torch.__version__ == "2.13.0+cpu":  # the README's torch: the bytes every x86-64 CPU with AVX2 must compute
        # (measured on an AMD EPYC; a CPU that computes others breaks the pins' promise, and this test says so)
        assert [d[:16] for d in pinned] == ["cc456918247f3dbc", "641556035b530e56"]
    assert native[0] != pinned[0]  # the GEMM: MKL's reproducible COMPATIBLE branch, not this CPU's fastest code
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        assert native[1] != pinned[1]  # the softmax: ATen's AVX2 kernel, not this CPU's AVX-512 one


RETAIN_CHILD = """
import os, resource, sys
import torch
import kernels
took = kernels.retain_freed_memory() if sys.argv[1] == "retain" else False
def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# the first rounds may grow the heap: an aligned block does not fit the freed one until free neighbours merge
rounds = [faults_of_one_round() for _ in range(32)]
print(took, sum(rounds[-8:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
@pytest.mark.parametrize("mode", ["retain", "default", "caller"])
def test_retain_freed_memory_reuses_pages_and_keeps_a_callers_malloc_settings(mode):
    """After retain_freed_memory, a 64 MiB tensor allocated and freed again and again reuses the same pages (no page
    faults once the heap has grown); without it, or when the caller set glibc's malloc in the environment, each one
    gets fresh pages (16,384 faults of 4 KiB)."""
    import kernels
    env = {k: v for k, v in os.environ.items() if k not in (*kernels.MALLOC_ENV, "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = str(REPO)
    if mode == "caller":
        env["MALLOC_TRIM_THRESHOLD_"] = "131072"  # glibc's default: the process keeps its mmaps per block
    out = subprocess.run([sys.executable, "-c", RETAIN_CHILD, "retain" if mode != "default" else "no"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    took, faults = out[0] == "True", int(out[1])
    assert took == (mode == "retain")
    if took:
        assert faults < 100
    else:
        assert faults >= 8 * 16384 * 0.9


def test_a_cache_it_cannot_write_still_gets_the_c_kernels(tmp_path):
    """The kernels' cache is not writable (here: a file where its directory belongs; a read-only filesystem fails
    the same mkdir): the process builds a private copy, says so, and runs the C kernels, whose floats are the
    cached build's; nothing is left behind."""
    import shutil
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    (tmp_path / "opr").mkdir()
    (tmp_path / "opr" / "kernels").write_text("not a directory")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), TMPDIR=str(tmpdir), OPR_CPU_KERNELS="1")
    p = subprocess.run([sys.executable, "-c", "from kernels import cpu; print(cpu.backend())"], env=env,
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "c"
    assert f"kernels/cpu.py: cannot write {tmp_path / 'opr' / 'kernels'}" in p.stderr
    assert list(tmpdir.iterdir()) == []
