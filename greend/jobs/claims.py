"""A job's claims on GPUs, and the use that makes a claim count.

A rank registers the GPUs it says it uses (``gpus``: what CUDA_VISIBLE_DEVICES gave
it). Saying so does not make a GPU the job's: a process that computes nothing could
otherwise claim idle GPUs, have them capped, and keep others off them. So each claim
(job, GPU) has a state, and only a claim in use steers a GPU:

* ``pending``: the GPU lists compute processes (NVML's
  ``nvmlDeviceGetComputeRunningProcesses``, graphics and MPS lists too) and none is
  one of the job's (a rank that registered, or a descendant of one: a launcher's
  worker, a data-loader child). A pending claim caps nothing, sets nothing, and
  keeps no one off the GPU. It becomes ``active`` once the job's process shows up
  there (checked about once a second while any claim is pending); until then it
  stays pending, and ends with the job.
* ``active``: a process of the job's runs on the GPU. Its job's policy setting is
  applied there (unless the GPU is shared, below).
* ``trusted``: the device cannot say who uses it, so the claim is believed: NVML
  answers NOT_SUPPORTED (or any error) for the process list, or the pids it lists
  are not processes this daemon can see (greend in a container without the host's
  pid namespace), or the rank's own pid is unknown here (SO_PEERCRED gives 0 for a
  peer outside the daemon's pid namespace). A trusted claim steers the GPU, but it
  is never exclusive: another job's registration on that GPU is never refused
  because of it.

**Shared GPUs.** Two jobs may hold claims on one GPU (a second job is registered
beside the first where its own process computes there, or where the GPU cannot
list processes). A GPU that more than one running job holds in use (active or
trusted) is steered by none of them: neither job's setting is applied to it, so no
user's policy slows another user's work. A pending claim never counts here.

**Who may claim.** A claim is refused (PermissionError) only where the GPU lists
processes that this daemon can see and none is the job's: another job's work runs
there and this one's does not. A GPU with no process on it may be claimed (CUDA may
start after the callback registers): the claim is pending until the work shows up.

**On simulated GPUs** the simulator keeps each GPU's process table: a rank is
listed on a GPU once its reported steps ran there (the simulator executes them), so
a job that reports steps on a simulated GPU is its user, and a job that only
registers is not.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from greend.jobs.records import ClaimState, Job

__all__ = [
    "ACTIVE",
    "PENDING",
    "TRUSTED",
    "ClaimState",
    "Lookout",
    "claim_state",
    "merge",
    "process_tree",
    "steered_gpus",
    "strangers",
]

log = logging.getLogger(__name__)

PENDING: ClaimState = "pending"
ACTIVE: ClaimState = "active"
TRUSTED: ClaimState = "trusted"
_RANK = {PENDING: 0, TRUSTED: 1, ACTIVE: 2}


def claim_state(
    gpu_pids: set[int] | None, job_pids: set[int], visible: Callable[[int], bool] | None = None
) -> ClaimState:
    """The state of a claim on a GPU that lists ``gpu_pids`` (None: the device cannot
    say) by a job whose processes are ``job_pids`` (empty: unknown here)."""
    if gpu_pids is None or not job_pids:
        return TRUSTED
    if gpu_pids & job_pids:
        return ACTIVE
    seen = visible or pid_visible
    if gpu_pids and not any(seen(p) for p in gpu_pids):
        return TRUSTED  # pids of another pid namespace: who they are cannot be told here
    return PENDING


def strangers(gpu_pids: set[int] | None, job_pids: set[int], visible: Callable[[int], bool] | None = None) -> bool:
    """The GPU runs processes this daemon can see, none of them the job's: another
    job's work is there and this one's is not (a registration is refused)."""
    return bool(gpu_pids) and claim_state(gpu_pids, job_pids, visible) == PENDING


def merge(old: ClaimState | None, new: ClaimState) -> ClaimState:
    """The claim after another rank's registration or a new look: use seen stays seen."""
    return new if old is None or _RANK[new] > _RANK[old] else old


def steered_gpus(job: Job, jobs: Iterable[Job]) -> set[int]:
    """The GPUs on which ``job``'s setting is applied: its claims in use (active or
    trusted) that no other running job also holds in use."""
    mine = {g for g, st in job.claims.items() if st != PENDING}
    if not mine:
        return mine
    for other in jobs:
        if other is not job and other.running:
            mine -= {g for g, st in other.claims.items() if st != PENDING}
    return mine


def note_use(job: Job, gpu: int, jobs: Iterable[Job]) -> None:
    """``job``'s claim on ``gpu`` just came into use: say what that means for other
    jobs' pending claims there (they stay pending and steer nothing)."""
    for other in jobs:
        if other is not job and other.running and other.claims.get(gpu) == PENDING:
            log.warning(
                "GPU %d: job %s (uid %d) computes there; the claim of job %s (uid %d) on it is pending (none "
                "of its processes runs there) and stays so: it steers nothing and keeps no one off the GPU",
                gpu,
                job.job,
                job.uid,
                other.job,
                other.uid,
            )


def pid_visible(pid: int) -> bool:
    """``pid`` is a process in this daemon's pid namespace."""
    return pid > 0 and os.path.exists(f"/proc/{pid}")


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (from /proc; just ``pid`` where /proc cannot say;
    empty for an unknown pid, 0)."""
    out: set[int] = set()
    todo = [pid]
    while todo and len(out) < 4096:
        p = todo.pop()
        if p in out or p <= 0:
            continue
        out.add(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except (OSError, ValueError):
                    pass
        except OSError:
            pass
    return out


class Lookout:
    """Looks at pending claims on a thread of its own, one look at a time, so the tick
    never waits on NVML's process lists: a GPU that hangs holds each list up to its
    deadline (5 s), and a tick that waited on eight of them stalled 40 s, past systemd's
    watchdog. A look still running when the next is due is not doubled."""

    def __init__(self) -> None:
        self._busy = threading.Event()

    def kick(self, look: Callable[[], None]) -> bool:
        """Start ``look`` on its thread; False where the previous look has not ended."""
        if self._busy.is_set():
            return False
        self._busy.set()
        threading.Thread(target=self._run, args=(look,), name="greend-claims", daemon=True).start()
        return True

    def _run(self, look: Callable[[], None]) -> None:
        try:
            look()
        except Exception:  # a look that failed is tried again at the next one
            log.exception("looking at pending GPU claims failed")
        finally:
            self._busy.clear()
