"""How kvserve picks a CPU kernel variant (kvserve/kernels/cpu): the environment's choice is honoured in a
fresh process, and a variant this CPU cannot run still has to compile, so a machine without AVX-512
catches breakage of the AVX-512 branch."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.kernels import cpu as cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_variant_compiles(isa: str, tmp_path: Path) -> None:
    if not cpu_kernels.have_compiler():
        pytest.skip("needs a C++ compiler (c++ on PATH)")
    if cpu_kernels.cpu_supports(isa):
        pytest.skip(f"this CPU runs {isa}: the kernel tests build and run it")
    try:
        objects = cpu_kernels.compile_only(isa, tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the {isa} kernels do not compile:\n{e.stderr[-4000:]}")
    assert [o.name for o in objects] == [f"{s.stem}.{isa}.o" for s in cpu_kernels.sources()]


CHOSEN = "from kvserve.kernels import cpu as k; i = k.isa(); print(i, k.ops().name if i else '-')"


def chosen_in_subprocess(code: str = CHOSEN, prefix: tuple[str, ...] = (), timeout: float = 600,
                         **env: str) -> tuple[str, str]:
    """What `code` prints (by default "<isa()> <ops().name>", or "None -" for the torch path) in a fresh
    process with `env` set (its command line after `prefix`), and its stderr."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("KVSERVE_CPU_ISA", "KVSERVE_CPU_KERNELS")}
    full_env.update(env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([*prefix, sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def test_environment_choice_is_honoured() -> None:
    if not cpu_kernels.have_compiler() or not cpu_kernels.cpu_supports("avx2"):
        pytest.skip("needs a C++ compiler and an AVX2 + FMA + F16C CPU")
    best = next(isa for isa in cpu_kernels.ISAS if cpu_kernels.cpu_supports(isa))
    assert chosen_in_subprocess()[0] == f"{best} kvserve_{best}"
    assert chosen_in_subprocess(KVSERVE_CPU_ISA="none")[0] == "None -"
    assert chosen_in_subprocess(KVSERVE_CPU_KERNELS="0")[0] == "None -"
    assert chosen_in_subprocess(KVSERVE_CPU_KERNELS="0", KVSERVE_CPU_ISA="avx2")[0] == "None -"
    assert chosen_in_subprocess(KVSERVE_CPU_ISA="avx2")[0] == "avx2 kvserve_avx2"
    if not cpu_kernels.cpu_supports("avx512"):  # refused with a warning, the best supported instead
        chosen, stderr = chosen_in_subprocess(KVSERVE_CPU_ISA="avx512")
        assert chosen == f"{best} kvserve_{best}"
        assert "lacks it" in stderr


def built_variant() -> tuple[str, Path]:
    """The best variant this CPU runs, built, and its build folder."""
    if not cpu_kernels.have_compiler() or not cpu_kernels.cpu_supports("avx2"):
        pytest.skip("needs a C++ compiler and an AVX2 + FMA + F16C CPU")
    best = next(isa for isa in cpu_kernels.ISAS if cpu_kernels.cpu_supports(isa))
    if cpu_kernels.build(best) is None:
        pytest.skip(f"the {best} kernels did not build here")
    return best, cpu_kernels._build_directory(best, cpu_kernels.compile_flags(best))


def test_a_killed_build_does_not_block_later_starts() -> None:
    # torch's lock file, as a build killed part-way leaves it: later starts had waited on it for good.
    best, build_dir = built_variant()
    stale = build_dir / "lock"
    stale.touch()
    try:
        assert chosen_in_subprocess(timeout=120)[0] == f"{best} kvserve_{best}"
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_finished_build_in_a_read_only_cache_is_loaded(tmp_path: Path, monkeypatch) -> None:
    # An image whose kernels were built by another user: the folder is there and this user cannot write it.
    best, build_dir = built_variant()
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root writes through any mode bits: run the child without that capability
        if shutil.which("setpriv") is None:
            pytest.skip("runs as root and has no setpriv to drop CAP_DAC_OVERRIDE")
        prefix = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-fowner", "--")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    copy = cpu_kernels._build_directory(best, cpu_kernels.compile_flags(best))
    library = f"kvserve_cpu_{best}.so"
    shutil.copy(build_dir / library, copy / library)
    for path in (copy / library, copy, tmp_path):
        path.chmod(0o555)
    try:
        chosen, stderr = chosen_in_subprocess(prefix=prefix, timeout=120, TORCH_EXTENSIONS_DIR=str(tmp_path))
        assert chosen == f"{best} kvserve_{best}", stderr
        assert "build failed" not in stderr
    finally:
        for path in (tmp_path, copy):
            path.chmod(0o755)


def test_amx_mode_is_honoured() -> None:
    """amx is a mode of the avx512 build (bfloat16 float weights on AMX tiles): on by default where the CPU has
    AMX-BF16, off under KVSERVE_CPU_ISA=avx512, and refused with a warning (the best supported instead) where
    the CPU lacks it."""
    if not cpu_kernels.have_compiler() or not cpu_kernels.cpu_supports("avx2"):
        pytest.skip("needs a C++ compiler and an AVX2 + FMA + F16C CPU")
    code = "from kvserve.kernels import cpu as k; print(k.describe())"
    best = next(isa for isa in cpu_kernels.ISAS if cpu_kernels.cpu_supports(isa))
    if cpu_kernels.cpu_supports("amx"):
        assert chosen_in_subprocess(code)[0] == "avx512 + amx"
        assert chosen_in_subprocess(code, KVSERVE_CPU_ISA="amx")[0] == "avx512 + amx"
        assert chosen_in_subprocess(code, KVSERVE_CPU_ISA="avx512")[0] == "avx512"
    else:
        assert chosen_in_subprocess(code)[0] == best
        chosen, stderr = chosen_in_subprocess(code, KVSERVE_CPU_ISA="amx")
        assert chosen == best and "lacks it" in stderr
    assert chosen_in_subprocess(code, KVSERVE_CPU_ISA="avx2")[0] == "avx2"


def test_unknown_isa_is_an_error(monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA"):
        cpu_kernels.requested_isa()
    monkeypatch.setenv("KVSERVE_CPU_ISA", " AVX2 ")
    assert cpu_kernels.requested_isa() == "avx2"


def test_forced_avx2_computes_in_float32() -> None:
    """KVSERVE_CPU_ISA=avx2 stands in for an AVX2 CPU, which has no bfloat16 arithmetic: dtype "auto" is float32
    there, as on such a CPU, and bfloat16 without it where /proc/cpuinfo lists AVX512-BF16 or AMX-BF16."""
    code = ("import torch; from kvserve.utils.device import resolve_dtype; "
            "print(resolve_dtype('auto', torch.device('cpu')))")
    assert chosen_in_subprocess(code, KVSERVE_CPU_ISA="avx2")[0] == "torch.float32"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        pytest.skip("needs /proc/cpuinfo to know whether this CPU has bfloat16 arithmetic")
    unforced = "torch.bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "torch.float32"
    assert chosen_in_subprocess(code)[0] == unforced
    assert chosen_in_subprocess(code, KVSERVE_CPU_ISA="avx512")[0] == unforced


def test_cpuinfo_reads_the_first_processor() -> None:
    """kvserve/utils/cpuinfo.py against lscpu (util-linux), which parses the same file with its own code."""
    from kvserve.utils.cpuinfo import cpu_flags, cpu_model_name

    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo (macOS, Windows)")
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs lscpu (util-linux)")
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "Flags" in fields:
        assert cpu_flags() == frozenset(fields["Flags"].split())
    if "Model name" in fields:
        assert cpu_model_name() == fields["Model name"]
    if platform.machine() == "x86_64":
        assert "fpu" in (cpu_flags() or ())  # every x86-64 CPU lists it
