"""The C stand-in of ``libnvidia-ml.so.1`` (``nvml_stub.c`` here), for tests that run
the real ``pynvml`` on it in a subprocess.

:func:`stub_dir` builds it into ``build/nvml_stub/`` (``make nvml-stub`` does the
same) when it is missing or older than its source, and skips the test with the
reason when there is no C compiler. :func:`stub_env` is the environment for a
subprocess: ``LD_LIBRARY_PATH`` first (pynvml loads ``libnvidia-ml.so.1`` by that
name, with no override) and the faults, as ``NVML_STUB_*`` variables (see the C
source's header for the list).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "nvml_stub.c"
BUILD_DIR = REPO / "build" / "nvml_stub"
LIBRARY = BUILD_DIR / "libnvidia-ml.so.1"


def stub_dir() -> Path:
    """The folder holding ``libnvidia-ml.so.1``, built if needed (skips without gcc)."""
    if LIBRARY.exists() and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return BUILD_DIR
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc): cannot build the NVML stand-in (tests/nvml_stub/nvml_stub.c)")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp = LIBRARY.with_suffix(f".tmp{os.getpid()}")
    r = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(SOURCE), "-lpthread"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise AssertionError(f"building the NVML stand-in failed:\n{r.stderr}")
    tmp.replace(LIBRARY)
    return BUILD_DIR


def stub_env(base: dict[str, str] | None = None, **faults: object) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the stub's folder first on
    ``LD_LIBRARY_PATH``, this checkout on ``PYTHONPATH``, no inherited
    ``NVML_STUB_*`` and ``NVML_STUB_<KEY>=value`` for each fault (``gpus=8``,
    ``hang="nvmlDeviceGetPowerUsage:3"``...)."""
    env = {k: v for k, v in (base if base is not None else os.environ).items() if not k.startswith("NVML_STUB_")}
    lib = str(stub_dir())
    env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("GREEND_SOCKET", None)
    for key, value in faults.items():
        env[f"NVML_STUB_{key.upper()}"] = str(value)
    return env
