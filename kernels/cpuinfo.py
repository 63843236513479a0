"""What /proc/cpuinfo says about the CPU: its feature flags (cpu_flags: which instructions
kernels/cpu.c may use, whether the CPU pins can hold) and its model (cpu_model: part of a step's
key where results follow the CPU). A leaf of kernels/: both the package (cpu_numerics) and
kernels/cpu.py (its compiler flags) read it, so neither imports the other for it."""
import functools
import platform
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict:
    """The first CPU's fields in /proc/cpuinfo (Linux); empty where there is none."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set:
    """The CPU's feature flags (empty where /proc/cpuinfo has none)."""
    return set(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """Vendor, model name and numbers of the CPU, as /proc/cpuinfo gives them (else the
    platform's own words)."""
    # (x86; ARM)
    keys = ("vendor_id", "model name", "cpu family", "model", "CPU implementer", "CPU part")
    fields = _cpuinfo()
    return (" ".join(f"{k}={fields[k]}" for k in keys if fields.get(k))
            or platform.processor() or platform.machine())
