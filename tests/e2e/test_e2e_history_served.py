"""History after a daemon restart reads as the live report did (labels such as ``(sim)``,
the GPUs' source, the baseline and saving, the plot), for root and for a member of the
socket's group, served through the daemon: the state dir's files stay root's."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from greend.ipc.client import Client
from greend.ipc.wire import frame_message
from tests import vmserver
from tests.e2e.test_e2e_jobs import wait_ended
from tests.e2e.test_e2e_shared_node import USER_PY
from tests.support import DaemonProc, env, start_daemon, wait_for

pytestmark = pytest.mark.e2e

GROUP = "greend-hist"
MEMBER = "greend-hist-member"


def run_job(d: DaemonProc, job: str, steps: int = 30, step_s: float = 0.04) -> None:
    """A job on simulated GPU 0, stepping with FLOPs (so it has a baseline), then ended."""
    with Client(d.socket) as c:
        c.request("register", job=job, gpus=[0], precisions=["fp32"], world_size=1, rank=0, local_rank=0)
        assert c._sock is not None
        for i in range(steps):
            t0 = time.monotonic()
            time.sleep(step_s)
            entry = {"step": i, "t0_s": t0, "t1_s": time.monotonic(), "flops": 4e12, "samples": 64}
            c._sock.sendall(frame_message("steps", {"steps": [entry]}))
        c.request("end", reason="finished")


def comparable(r: dict[str, Any]) -> dict[str, Any]:
    """A report without what only says where it came from."""
    return {k: v for k, v in r.items() if k not in ("from_history", "earlier_runs")}


@pytest.fixture()
def shared_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="greend-hist-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_history_after_a_restart_is_the_live_report(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    state = tmp_path / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state)
    daemons.append(d)
    run_job(d, "hist-1")
    live = wait_ended(d, "hist-1")
    live_text = d.ctl("report", "hist-1").stdout
    assert live["gpu_source"] == "sim" and "(sim)" in live_text
    assert live["savings"]["baseline"] is not None  # measured uncapped steps
    d.stop()

    d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state, name="d2")
    daemons.append(d2)
    with Client(d2.socket) as c:
        again = c.request("report", job="hist-1")
    assert again["from_history"] is True
    assert comparable(again) == comparable(live)  # every figure, label, source, baseline, series
    r = d2.ctl("report", "hist-1")
    assert r.stdout == live_text and "from the daemon's history" in r.stderr
    assert "GPUs None" not in r.stdout and "None steps" not in r.stdout
    listed = json.loads(d2.ctl("jobs", "--json").stdout)["jobs"]
    assert [(j["job"], j["state"], j["steps"]) for j in listed] == [("hist-1", "ended", live["steps"])]
    assert "no jobs yet" not in d2.ctl("jobs").stdout
    typo = d2.ctl("report", "hist-l", check=False)
    assert typo.returncode == 2 and "did you mean 'hist-1'?" in typo.stderr
    pytest.importorskip("matplotlib")
    plot = tmp_path / "after.png"
    d2.ctl("report", "hist-1", "--plot", str(plot))
    assert plot.stat().st_size > 10_000
    # With no daemon, from the SQLite store alone: fewer details, and no "None" for them.
    d2.stop()
    stored = d2.ctl("report", "hist-1", "--store", str(state / "greend.db"))
    assert "from the store" in stored.stderr
    assert "None" not in stored.stdout, stored.stdout
    assert "GPU energy (sim)" in stored.stdout and "saved (sim)" in stored.stdout  # still labelled sim
    # The files behind it are the daemon's alone.
    kept = list((state / "jobs").iterdir())
    assert len(kept) == 1 and (kept[0].stat().st_mode & 0o077) == 0


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None or USER_PY is None,
    reason="needs root, useradd and /usr/bin/python3: the member is a real unprivileged user",
)
def test_a_group_member_reads_history_through_the_daemon(
    tmp_path: Path, shared_dir: Path, daemons: list[DaemonProc]
) -> None:
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", GROUP], check=True)
    try:
        pwd.getpwnam(MEMBER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", GROUP, MEMBER],
            check=True,
        )
    cfg = f'[daemon]\nsocket_group = "{GROUP}"\nsocket_mode = "0660"\nadmin_group = ""\n'
    state = tmp_path / "state"
    sock = shared_dir / "g.sock"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state, config=cfg, socket=sock)
    daemons.append(d)
    run_job(d, "hist-m")
    live = wait_ended(d, "hist-m")
    d.stop()
    d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state, config=cfg, socket=sock, name="d2")
    daemons.append(d2)
    code = (
        "import json, socket, sys\n"
        "def req(op, **f):\n"
        "    s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
        "    s.sendall(json.dumps({'v': 1, 'op': op, **f}).encode() + b'\\n'); buf = b''\n"
        "    while b'\\n' not in buf: buf += s.recv(1 << 20)\n"
        "    return json.loads(buf.split(b'\\n')[0])\n"
        "rep = req('report', job='hist-m'); jobs = req('jobs')\n"
        "try:\n"
        "    open(sys.argv[2], 'rb'); direct = 'read'\n"
        "except PermissionError:\n"
        "    direct = 'refused'\n"
        "print(json.dumps({'report': rep, 'jobs': jobs, 'direct': direct}))\n"
    )
    out = subprocess.run(
        [str(USER_PY), "-c", code, str(sock), str(state / "greend.db")],
        user=MEMBER,
        group=GROUP,
        extra_groups=[GROUP],  # as after login: the socket group's member
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env(),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["report"].get("ok", True) is not False and "result" in got["report"], got["report"]
    assert comparable(got["report"]["result"]) == comparable(live)
    assert [j["job"] for j in got["jobs"]["result"]["jobs"]] == ["hist-m"]
    assert got["direct"] == "refused"  # the store itself stays root's


def _train_through_a_restart(
    tmp_path: Path,
    daemons: list[DaemonProc],
    job: str,
    sig: int,
    config: str = "",
    live: Callable[[DaemonProc, int], None] | None = None,
) -> tuple[dict[str, Any], int, DaemonProc, Path]:
    """A real torch loop with the callback; the daemon stopped with ``sig`` after 60 steps,
    20 steps with no daemon, then a new daemon on the same socket and state dir, 40 more
    steps after the callback reconnected (``live``: called then with the new daemon and
    the steps run, the job still running). (the run's ended report, the steps the loop
    ran, the new daemon, the state dir)"""
    torch = pytest.importorskip("torch")
    from greend import GreenCallback
    from tests.training.test_callback import FAST

    state = tmp_path / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state, config=config)
    daemons.append(d)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    cb = GreenCallback(job=job, model=model, socket=d.socket, gpus=[0], **FAST)
    steps = 0

    def run(n: int) -> None:
        nonlocal steps
        for _ in range(n):
            with cb.step(samples=8, batch=x) as step:
                loss = torch.nn.functional.mse_loss(model(x), y)
                step.loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
            steps += 1
            time.sleep(0.01)

    with pytest.warns(Warning, match="lost the daemon"):
        run(60)
        cb.flush()
        time.sleep(0.5)  # (the first part's steps reach the daemon)
        d.stop(sig)
        run(20)  # kept by the callback while no daemon runs
        d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state, name="d2",
                          socket=d.socket, config=config)  # fmt: skip
        daemons.append(d2)
        deadline = time.monotonic() + 20
        while cb.stats.connects < 2 and time.monotonic() < deadline:
            run(1)
        run(40)
        if live is not None:
            cb.flush()
            live(d2, steps)
        cb.close()
    whole = wait_ended(d2, job)
    assert cb.stats.connects == 2 and whole["run_id"] == cb.run
    return whole, steps, d2, state


def test_a_run_the_daemon_restarted_under_is_one_run(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """A real training goes on while greend restarts (an upgrade, ``systemctl restart``):
    the callback keeps its steps, reconnects and registers again with its run id. The
    report, ``greenctl jobs`` and the store tell the whole run: every step once, the
    energy of both parts, one row, and the restart named; not the last part with a note
    that the job "ran 1 time before"."""
    whole, steps, d2, state = _train_through_a_restart(tmp_path, daemons, "through", signal.SIGTERM)
    assert whole["steps"] == steps, (whole["steps"], steps)  # every step once
    parts = whole["parts"]
    assert len(parts) == 2 and parts[0]["end_reason"] == "interrupted: the daemon stopped"
    assert parts[0]["steps"] >= 60 and parts[0]["steps"] + parts[1]["steps"] == steps
    assert all(p["gpu_energy_j"] > 0 for p in parts)  # both parts' energy, in the whole
    assert whole["gpu_energy_j"] == pytest.approx(sum(p["gpu_energy_j"] for p in parts))
    text = d2.ctl("report", "through")
    assert "parts            2: the daemon restarted under this run" in text.stdout
    # The seconds no daemon measured, between the parts: named, not passed off as the whole run's.
    assert whole["unmeasured_s"] > 0 and "s between its parts, when no daemon measured it" in text.stdout, text.stdout
    assert "ran 1 time(s) before" not in text.stderr and f"steps            {steps} " in text.stdout
    listed = json.loads(d2.ctl("jobs", "--json").stdout)["jobs"]
    assert [(j["job"], j["steps"]) for j in listed] == [("through", steps)]
    # With no daemon, from the SQLite store, and as the cross-node reader sums it.
    d2.stop()
    stored = d2.ctl("report", "through", "--store", str(state / "greend.db"))
    assert f"steps            {steps} " in stored.stdout and "parts            2" in stored.stdout
    # Each policy's last word once, not once a part (none where no tick fell in the job's
    # 1.8 s: seen on a loaded machine).
    assert stored.stdout.count("policy none: measuring only") <= 1, stored.stdout
    assert "ran 1 time(s) before" not in stored.stderr
    across = json.loads(d2.ctl("report", "through", "--store", str(state / "greend.db"), "--store",
                               str(state / "greend.db"), "--json").stdout)  # fmt: skip
    assert across["steps"] == steps
    assert across["gpu_energy_j"] == pytest.approx(whole["gpu_energy_j"], rel=1e-6)


def test_a_run_the_daemon_restarted_under_is_one_run_while_it_runs(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """While the run goes on after the restart, status, ``greenctl top`` and the
    Prometheus series show the whole run (the part before the restart joined in), not
    the part since: the job's counters never go back to it (a Prometheus reader then
    took the drop for a counter reset, and ``--store prom://`` reported the last part)."""
    port = vmserver.free_port()
    config = (
        f'[daemon]\nsocket_group = ""\n[store]\n'
        f'urls = ["sqlite:///{tmp_path / "state" / "greend.db"}", "prometheus://127.0.0.1:{port}"]\n'
    )
    seen: dict[str, Any] = {}

    def live(d2: DaemonProc, steps: int) -> None:
        def whole() -> bool:
            (row,) = [j for j in json.loads(d2.ctl("status", "--json").stdout)["jobs"] if j["job"] == "live"]
            seen["status"] = row
            return row["steps"] == steps

        assert wait_for(whole, timeout_s=10), (seen, steps)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        seen["metrics"] = [ln for ln in text.splitlines() if ln.startswith("greend_job_steps_total{")]
        seen["top"] = d2.ctl("top", "--once").stdout
        seen["steps"] = steps

    whole, steps, _, _ = _train_through_a_restart(tmp_path, daemons, "live", signal.SIGTERM, config, live)
    row = seen["status"]
    assert [p["end_reason"] for p in row["parts"]][:1] == ["interrupted: the daemon stopped"]
    assert row["steps"] == seen["steps"] and row["parts"][0]["steps"] >= 60
    assert row["gpu_energy_j"] == pytest.approx(sum(p["gpu_energy_j"] for p in row["parts"]))
    (series,) = seen["metrics"]
    assert 'job="live"' in series and float(series.rsplit(" ", 1)[1]) == seen["steps"], series
    (top,) = [ln.split() for ln in seen["top"].splitlines() if ln.split()[:2] == ["live", "running"]]
    assert int(top[3]) > row["parts"][-1]["steps"], seen["top"]  # the whole run's steps, not the part's
    assert whole["steps"] == steps


def test_a_run_whose_daemon_was_killed_names_the_steps_it_lost(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """A daemon killed (SIGKILL, a crash) keeps no record of the run's part before: the
    ranks' next registration says how many steps they had sent, and the report names the
    ones no record holds instead of passing the rest off as the whole run."""
    whole, steps, d2, _ = _train_through_a_restart(tmp_path, daemons, "killed", signal.SIGKILL)
    assert whole.get("parts") is None  # (nothing was kept of the first part)
    assert whole["unseen_steps"] >= 60 and whole["steps"] + whole["unseen_steps"] == steps
    text = d2.ctl("report", "killed").stdout
    assert f"unseen           {whole['unseen_steps']} steps of this run went to a daemon that stopped" in text
