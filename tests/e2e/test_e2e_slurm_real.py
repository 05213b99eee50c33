"""greend under a real Slurm: munged, slurmctld and slurmd started on this machine (one
node with a simulated GPU), a real CPU training with the callback submitted with sbatch
and srun, and the job's figures found where Slurm shows them (the job's Comment, written
by deploy/slurm/task-epilog.sh: in ``scontrol show job`` and, through a real slurmdbd on a
real MariaDB, in ``sacct``), in the node's saved report (deploy/slurm/epilog.sh) and
through greenctl under the job's Slurm name (JOBID.STEP)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import vmserver
from tests.support import REPO, DaemonProc, env, start_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.torch, pytest.mark.slow]
torch = pytest.importorskip("torch")

NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "slurmdbd", "sacct", "sacctmgr", "mariadbd",
          "mariadb-install-db")  # fmt: skip
if missing := [b for b in NEEDED if shutil.which(b) is None]:
    pytestmark.append(pytest.mark.skip(reason=f"Slurm is not installed here ({', '.join(missing)}): apt-get install slurm-wlm slurmdbd munge mariadb-server"))  # fmt: skip  # noqa: E501


def _wait(what: str, check, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Slurm:
    """A one-node Slurm cluster in a temporary directory, with greend's epilogs."""

    def __init__(self, tmp: Path, greend: DaemonProc) -> None:
        self.tmp = tmp
        self.host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
        self.procs: list[subprocess.Popen[bytes]] = []
        tmp.mkdir(mode=0o700, exist_ok=True)
        for d in ("state", "spool", "log", "munge", "reports", "db"):
            (tmp / d).mkdir(mode=0o700, exist_ok=True)
        greenctl = f"{sys.executable} -m greend.ctl --socket {greend.socket}"
        common = f"export GREENCTL='{greenctl}' PYTHON='{sys.executable}' PYTHONPATH='{REPO}'\n"
        for name, script, extra in (
            ("epilog", "epilog.sh", f"export GREEND_REPORT_DIR='{tmp / 'reports'}'\n"),
            ("task-epilog", "task-epilog.sh", ""),
        ):  # what an operator's wrapper (or /etc/default file) sets for the scripts
            w = tmp / f"{name}.sh"
            w.write_text(f"#!/bin/sh\n{common}{extra}exec sh '{REPO / 'deploy' / 'slurm' / script}'\n")
            w.chmod(0o755)
        self.munge_sock = tmp / "munge" / "munge.sock"
        ctl_port, d_port = vmserver.free_port(), vmserver.free_port()
        self.db_port, self.dbd_port = vmserver.free_port(), vmserver.free_port()
        # slurmdbd reads slurmdbd.conf beside slurm.conf; it must be its user's and 0600.
        dbd_conf = tmp / "slurmdbd.conf"
        dbd_conf.write_text(
            f"""AuthType=auth/munge
AuthInfo=socket={tmp / "munge" / "munge.sock"}
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort={self.dbd_port}
SlurmUser=root
PidFile={tmp / "slurmdbd.pid"}
LogFile={tmp / "log" / "slurmdbd.log"}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.db_port}
StorageUser=root
StorageLoc=slurm_acct_db
"""
        )
        dbd_conf.chmod(0o600)
        self.conf = tmp / "slurm.conf"
        self.conf.write_text(
            f"""ClusterName=greendtest
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={self.munge_sock}
StateSaveLocation={tmp / "state"}
SlurmdSpoolDir={tmp / "spool"}
SlurmctldPidFile={tmp / "slurmctld.pid"}
SlurmdPidFile={tmp / "slurmd.pid"}
SlurmctldLogFile={tmp / "log" / "slurmctld.log"}
SlurmdLogFile={tmp / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.dbd_port}
AccountingStoragePass={self.munge_sock}
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
Epilog={tmp / "epilog.sh"}
TaskEpilog={tmp / "task-epilog.sh"}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        )
        self.env = env() | {"SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        key = self.tmp / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        m = self.tmp / "munge"
        db = self.tmp / "db"
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={db}", "--user=root",
             "--auth-root-authentication-method=normal"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        # MariaDB on 127.0.0.1 only, without grant tables: a test's own throwaway server.
        self.procs.append(
            subprocess.Popen(
                ["mariadbd", "--no-defaults", f"--datadir={db}", f"--socket={self.tmp / 'mysql.sock'}",
                 f"--port={self.db_port}", "--bind-address=127.0.0.1", "--user=root", "--skip-grant-tables",
                 f"--pid-file={self.tmp / 'mysql.pid'}", f"--log-error={self.tmp / 'log' / 'mariadb.log'}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        _wait("MariaDB", lambda: (self.tmp / "mysql.sock").exists(), 60)
        subprocess.run(
            ["munged", "--force", f"--socket={self.munge_sock}", f"--key-file={key}", f"--pid-file={m / 'pid'}",
             f"--log-file={m / 'log'}", f"--seed-file={m / 'seed'}"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        self.procs.append(
            subprocess.Popen(["slurmdbd", "-D"], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        said: list[str] = []

        def dbd_up() -> bool:
            r = self.run("sacctmgr", "-n", "show", "cluster")
            said[:] = [r.stderr + r.stdout]
            return r.returncode == 0

        try:
            _wait("slurmdbd", dbd_up, 60)
        except AssertionError:
            raise AssertionError(f"sacctmgr: {said}\n{self.logs()}") from None
        r = self.run("sacctmgr", "-i", "add", "cluster", "greendtest")
        assert r.returncode == 0, r.stderr + r.stdout
        for daemon in ("slurmctld", "slurmd"):
            self.procs.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", str(self.conf)],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            )
        _wait("the node to be idle", lambda: "idle" in self.run("sinfo", "-h", "-o", "%T").stdout, 60)

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60, cwd=REPO)

    def job(self, jid: str) -> str:
        return self.run("scontrol", "-o", "show", "job", jid).stdout

    def stop(self) -> None:
        for p in reversed(self.procs):  # slurmd, slurmctld, then slurmdbd, then MariaDB
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        pid = self.tmp / "munge" / "pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text().strip()), 15)
            except (OSError, ValueError):
                pass

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.tmp / "log").iterdir()))


@pytest.fixture
def slurm(tmp_path: Path, daemons: list[DaemonProc]) -> Iterator[tuple[Slurm, DaemonProc]]:
    d = start_daemon(tmp_path, "--sim", "1", config='[daemon]\nsocket_group = ""\n')
    daemons.append(d)
    s = Slurm(tmp_path / "slurm", d)
    try:
        s.start()
        yield s, d
    finally:
        s.stop()


def test_a_slurm_job_shows_its_energy_in_slurm_and_in_greend(slurm: tuple[Slurm, DaemonProc]) -> None:
    s, d = slurm
    script = s.tmp / "train.sh"
    script.write_text(
        f"#!/bin/sh\n#SBATCH --job-name=greend-train\n#SBATCH --ntasks=1\n"
        f"export GREEND_SOCKET='{d.socket}'\n"
        f"srun '{sys.executable}' tests/scripts/trainer.py --socket '{d.socket}' --steps 60 --step-sleep 0.01\n"
    )
    r = s.run("sbatch", "--parsable", f"--output={s.tmp / 'train.out'}", f"--chdir={REPO}", str(script))
    assert r.returncode == 0, r.stderr
    jid = r.stdout.strip().split(";")[0]
    try:
        _wait(f"job {jid} to complete", lambda: "JobState=COMPLETED" in s.job(jid) or "FAILED" in s.job(jid), 180)
    except AssertionError:
        raise AssertionError(f"{s.job(jid)}\n{s.logs()}") from None
    info = s.job(jid)
    out = (s.tmp / "train.out").read_text()
    assert "JobState=COMPLETED" in info, f"{info}\n{out}\n{s.logs()}"
    run = f"{jid}.0"  # the callback named the run as Slurm names the step
    assert json.loads(out.strip().splitlines()[-1])["job"] == run, out

    # In Slurm: the job's Comment, written by the TaskEpilog once greend had ended the run.
    assert f"Comment=greend:{run}@{s.host}:gpu_J=" in info, info
    comment = info.split("Comment=", 1)[1].split(" ", 1)[0]
    fields = dict(kv.split("=", 1) for kv in comment.split(":", 2)[2].split(","))
    # In greend: the same run under the same name, with the same figures.
    rep = json.loads(d.ctl("report", run, "--json").stdout)
    assert rep["state"] == "ended" and rep["steps"] == 60
    assert float(fields["gpu_J"]) == pytest.approx(rep["gpu_energy_j"], abs=0.051)
    assert float(fields["GFLOPS/W"]) == pytest.approx(rep["gflops_per_w"], rel=1e-3) and rep["gflops_per_w"] > 0
    assert fields["steps"] == "60" and fields["ranks"] == "1/1"
    # In Slurm's accounting: sacct shows the same Comment, from slurmdbd's database.
    acct = ""

    def in_sacct() -> bool:
        nonlocal acct
        acct = s.run("sacct", "-j", jid, "-X", "-n", "-P", "-o", "JobID,State,Comment%400").stdout
        return f"greend:{run}@" in acct

    try:
        _wait("the job's Comment in sacct", in_sacct, 60)
    except AssertionError:
        raise AssertionError(f"sacct: {acct!r}\n{s.logs()}") from None
    jobid, state, stored = acct.strip().splitlines()[0].split("|", 2)
    assert jobid == jid and state == "COMPLETED" and stored == comment, acct
    # On the node: the Epilog saved the run's report after the job.
    saved = s.tmp / "reports" / f"{run}.{s.host}.json"
    _wait("the epilog's report", saved.exists, 30)
    assert json.loads(saved.read_text())["gpu_energy_j"] == pytest.approx(rep["gpu_energy_j"])

    # Ownership, as greend asks this controller (greend.jobs.slurm): the job is root's, so
    # another uid may not register under its id; a job id Slurm does not know is refused.
    from greend.jobs.slurm import SlurmOwners

    owners = SlurmOwners(run=lambda cmd, **kw: subprocess.run(cmd, env=s.env, **kw))
    assert owners.owner(jid) == 0
    owners.check(f"{jid}.9", 0)
    with pytest.raises(PermissionError, match=f"names Slurm job {jid} of uid 0; a process of uid 65534"):
        owners.check(f"{jid}.9", 65534)
    with pytest.raises(PermissionError, match="which Slurm does not know"):
        owners.check("987654321", 65534)
    owners.check("not-a-slurm-id", 65534)  # not a Slurm job's name: nothing to ask
