"""Slurm job ownership: on a Slurm node, a job id that names a Slurm job is the job
of the user whose Slurm job it is.

The callback names a rank's job after Slurm's (``$SLURM_JOB_ID``, ``JOBID.STEP`` under
srun), and the Slurm Epilog (deploy/slurm/epilog.sh) saves the reports of the runs
under that id. A user who registered ``<someone's job id>.x`` would otherwise have a
report saved beside the victim's and hold up the Epilog. So where ``scontrol`` is on
the daemon's PATH, a registration by a non-root uid whose job id starts with digits
(``1234``, ``1234.0``, ``1234_7``) asks Slurm who owns job ``1234``
(``scontrol -o show job 1234``: ``UserId=name(uid)``) and is refused unless it is the
caller's uid, or where Slurm does not know the job. Slurm's own record is the proof:
a process's environment (``SLURM_JOB_ID``) is whatever its user set.

Where the controller cannot be asked (down, timed out, no configuration), the
registration is accepted and the failure logged: training is never held up by
Slurm's health, and the Epilog reads only the runs of the job's owner
(``$SLURM_JOB_UID``) in any case. Answers are kept ``ttl_s`` (30 s) per Slurm job.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SlurmOwners", "slurm_job_of"]

log = logging.getLogger(__name__)

_SLURM_ID = re.compile(r"^(\d{1,12})(?:[._+].*)?\Z")
_USER_ID = re.compile(r"\bUserId=[^(\s]*\((\d+)\)")
UNKNOWN = -1  # the controller could not be asked
NO_JOB = -2  # Slurm does not know the job


def slurm_job_of(job_id: str) -> str | None:
    """The Slurm job a greend job id names (``1234.0`` -> ``1234``), else None."""
    m = _SLURM_ID.match(job_id)
    return m.group(1) if m else None


@dataclass
class _Answer:
    owner: int
    at_s: float


class SlurmOwners:
    """Who owns a Slurm job, from ``scontrol`` (see the module's docstring)."""

    def __init__(
        self,
        scontrol: str | None = None,
        *,
        run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
        timeout_s: float = 5.0,
        ttl_s: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scontrol = scontrol or shutil.which("scontrol")
        self._run = run
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.monotonic = monotonic
        self._cache: dict[str, _Answer] = {}

    @property
    def enabled(self) -> bool:
        return self.scontrol is not None

    def owner(self, slurm_job: str) -> int:
        """The uid that owns ``slurm_job``, :data:`NO_JOB` or :data:`UNKNOWN`."""
        now = self.monotonic()
        hit = self._cache.get(slurm_job)
        if hit is not None and now - hit.at_s < self.ttl_s:
            return hit.owner
        assert self.scontrol is not None
        try:
            r = self._run(
                [self.scontrol, "-o", "show", "job", slurm_job], capture_output=True, text=True, timeout=self.timeout_s
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            r, why = None, str(e)
        m = _USER_ID.search(r.stdout) if r is not None else None
        if r is not None and r.returncode == 0 and m:
            owner = int(m.group(1))
        elif r is not None and "Invalid job id" in r.stderr + r.stdout:
            owner = NO_JOB
        else:
            # Kept as long as an answer (one line per job id and ttl, not per rank).
            owner = UNKNOWN
            if r is not None:
                why = f"scontrol rc={r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
            log.warning("slurm: cannot ask who owns job %s (%s): registration accepted", slurm_job, why)
        self._cache[slurm_job] = _Answer(owner, now)
        if len(self._cache) > 4096:
            self._cache.pop(next(iter(self._cache)))
        return owner

    def check(self, job_id: str, uid: int) -> None:
        """Raise PermissionError where ``job_id`` names a Slurm job that is not ``uid``'s
        (root is never refused)."""
        slurm_job = slurm_job_of(job_id)
        if uid == 0 or slurm_job is None or not self.enabled:
            return
        owner = self.owner(slurm_job)
        if owner == NO_JOB:
            raise PermissionError(
                f"job id {job_id!r} names Slurm job {slurm_job}, which Slurm does not know: on a Slurm node a job id "
                "that starts with digits must be one of your Slurm jobs (set GREEND_JOB to another name)"
            )
        if owner not in (UNKNOWN, uid):
            raise PermissionError(
                f"job id {job_id!r} names Slurm job {slurm_job} of uid {owner}; a process of uid {uid} cannot "
                "register under it (run inside your own Slurm job, or set GREEND_JOB to another name)"
            )
