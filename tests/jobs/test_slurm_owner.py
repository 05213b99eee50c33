"""A job id that names a Slurm job is its owner's (greend.jobs.slurm): the registry asks
``scontrol -o show job`` (its answers here in scontrol's own one-line format; the real
controller's are checked in tests/e2e/test_e2e_slurm_real.py)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from greend.jobs.ledger import Ledger
from greend.jobs.records import Caller
from greend.jobs.registry import JobRegistry
from greend.jobs.slurm import NO_JOB, UNKNOWN, SlurmOwners, slurm_job_of
from greend.protocol import Registration

LINE = "JobId=4242 JobName=train UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A Priority=1 JobState=RUNNING"


def _scontrol(answers: dict[str, tuple[int, str, str]], calls: list[str]) -> Any:
    def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd[-1])
        rc, out, err = answers.get(cmd[-1], (1, "", "slurm_load_jobs error: Invalid job id specified"))
        return subprocess.CompletedProcess(cmd, rc, out, err)

    return run


def test_slurm_job_ids() -> None:
    assert slurm_job_of("4242") == "4242" and slurm_job_of("4242.0") == "4242" and slurm_job_of("4242_7") == "4242"
    assert slurm_job_of("resnet-7") is None and slurm_job_of("42x") is None


def test_owners_from_scontrol_cached() -> None:
    calls: list[str] = []
    down = (1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    o = SlurmOwners("scontrol", run=_scontrol({"4242": (0, LINE, ""), "77": down}, calls))
    assert o.owner("4242") == 1001 and o.owner("4242") == 1001 and calls == ["4242"]
    assert o.owner("999") == NO_JOB and o.owner("77") == UNKNOWN
    o.check("4242.0", 1001)
    o.check("4242.0", 0)  # root
    o.check("77.0", 1002)  # the controller cannot say: accepted
    with pytest.raises(PermissionError, match="names Slurm job 4242 of uid 1001; a process of uid 1002"):
        o.check("4242.x", 1002)
    with pytest.raises(PermissionError, match="Slurm job 999, which Slurm does not know"):
        o.check("999", 1002)


def test_the_registry_refuses_another_users_slurm_job_id() -> None:
    o = SlurmOwners("scontrol", run=_scontrol({"4242": (0, LINE, "")}, []))
    reg = JobRegistry(Ledger(), hostname="h", check_owner=o.check)

    def register(job: str, uid: int, session: int) -> None:
        r = Registration(job=job, run=None, rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                         precisions=("fp32",), mem_share=None, reference_every=None)  # fmt: skip
        reg.register(r, Caller(session=session, pid=0, uid=uid))

    with pytest.raises(PermissionError, match="of uid 1001"):
        register("4242.x", 1002, 1)
    register("4242.0", 1001, 2)
    register("my-run", 1002, 3)
    assert sorted(reg.jobs) == ["4242.0", "my-run"]
