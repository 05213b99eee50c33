"""A simulated GPU's process table: the processes that compute on it.

``gpu<i>.procs.json``, beside the device's state, lists the pids the daemon attached
(a rank, once its steps ran on that GPU: :meth:`greend.probes.sim.SimGpu.attach_process`);
the fake NVML serves it as ``nvmlDeviceGetComputeRunningProcesses``. A process stays
listed until it exits, and a zombie has exited, as the driver drops a process's context
when the process ends.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ._sim_files import write_json_atomic

log = logging.getLogger(__name__)


def procs_path(state_dir: Path, index: int) -> Path:
    """The process table of GPU ``index`` in ``state_dir``."""
    return state_dir / f"gpu{index}.procs.json"


def read_procs(path: Path) -> list[int]:
    """The pids the table lists, exited ones included ([] when it is missing or unreadable)."""
    try:
        return [int(p) for p in json.loads(path.read_text(encoding="utf-8")).get("pids", [])]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError, TypeError) as e:
        log.warning("%s unreadable (%s): no processes listed", path, e)
        return []


def add_proc(path: Path, pid: int) -> None:
    """List ``pid`` in the table (the caller holds the device's lock)."""
    pids = set(read_procs(path)) | {pid}
    write_json_atomic(path, {"pids": sorted(pids)})


def live_procs(path: Path) -> list[int]:
    """The listed processes that still run, sorted."""
    return sorted(p for p in read_procs(path) if alive(p))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: its context would be gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's: it exists
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]
