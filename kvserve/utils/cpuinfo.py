"""What /proc/cpuinfo says about this machine's CPU, read once: its flags (which CPU kernels it can run) and its
model name (what every benchmark report names). No torch here, so the benchmark client can ask too."""
from __future__ import annotations

import functools
import platform


@functools.cache
def _first_processor() -> dict[str, str] | None:
    """The first processor's fields in /proc/cpuinfo; None without /proc (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo") as f:
            fields: dict[str, str] = {}
            for line in f:
                if not line.strip():
                    if fields:  # the blank line after the first processor's block
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
            return fields
    except OSError:
        return None


def cpu_flags() -> frozenset[str] | None:
    """The first CPU's flags; None where /proc/cpuinfo is missing or lists none."""
    fields = _first_processor()
    return None if fields is None or "flags" not in fields else frozenset(fields["flags"].split())


def cpu_model_name() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Processor"), else platform.processor()'s guess."""
    return (_first_processor() or {}).get("model name") or platform.processor()
