"""greenctl top: a live frame of GPUs, caps and jobs; current efficiency between refreshes."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from greend.cli.top import measure, render_frame, run_top
from greend.errors import DaemonUnavailable
from greend.ipc.client import Client
from tests.support import DaemonProc, start_daemon, wait_for


def _status(flops: float, gpu_j: float, steps: int, *, state: str = "running") -> dict:
    return {
        "host": "n1",
        "version": "x",
        "gpus": [
            {
                "index": 0,
                "name": "H100",
                "source": "sim",
                "power_w": 350.0,
                "power_limit_w": 500.0,
                "power_limit_range_w": [200.0, 700.0],
                "clock_cap_mhz": 1500,
                "sm_clock_mhz": 1500,
                "util_gpu_pct": 99,
                "temperature_c": 60,
                "energy_j": gpu_j,
            }
        ],
        "jobs": [
            {
                "job": "j1",
                "state": state,
                "ranks": 1,
                "gpus": [0],
                "steps": steps,
                "flops": flops,
                "gpu_energy_j": gpu_j,
                "energy_j": gpu_j,
                "gflops_per_w": flops / gpu_j / 1e9,
                "saved_pct": 12.5,
            }
        ],
        "policy": {"name": "efficient", "precision": None, "last_decision": {"reason": "gpu0 capped at 1500 MHz"}},
        "totals": {"gpu_energy_j": gpu_j},
    }


def test_current_efficiency_is_the_interval_not_the_run() -> None:
    a = measure(None, _status(flops=1e15, gpu_j=10_000.0, steps=100), at_s=10.0)
    assert a.current == {}  # one reading: nothing measured between two yet
    b = measure(a, _status(flops=1e15 + 4e14, gpu_j=11_000.0, steps=150), at_s=12.0)
    now, rate = b.current["j1"]
    assert now == pytest.approx(4e14 / 1000.0 / 1e9)  # 400 GFLOPS/W over the interval
    assert rate == pytest.approx(25.0)  # 50 steps in 2 s
    # The run's figure (1.4e15 / 11,000 J = 127 GFLOPS/W) is not the current one.
    text = _render(b)
    assert "400.00" in text and "127.27" in text and "12.5%" in text
    assert "capped at 1500 MHz" in text and "gpu0 (sim)" in text
    # An ended job has no current figure.
    c = measure(b, _status(flops=2e15, gpu_j=12_000.0, steps=200, state="ended"), at_s=14.0)
    assert "j1" not in c.current


def _render(frame) -> str:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render_frame(frame, socket="S", interval_s=1.0))
    return buf.getvalue()


def test_a_lost_daemon_is_shown_and_top_keeps_trying() -> None:
    calls = {"n": 0}

    def request() -> dict:
        calls["n"] += 1
        if calls["n"] == 2:
            raise DaemonUnavailable("no greend socket at S")
        if calls["n"] >= 4:
            raise KeyboardInterrupt  # the user quits
        return _status(flops=1e15 * calls["n"], gpu_j=1000.0 * calls["n"], steps=calls["n"])

    buf = io.StringIO()
    console = Console(file=buf, width=160, color_system=None, force_terminal=True)  # every frame written
    run_top(request, socket="S", interval_s=0.0, console=console)
    assert calls["n"] == 4  # it went on after the daemon came back
    assert "daemon unavailable: no greend socket at S; retrying" in buf.getvalue()


def test_in_a_pipe_every_frame_is_written_as_it_is_read() -> None:
    """`greenctl top | cat` printed one frame, at Ctrl-C (a rich Live writes to a pipe only
    at its end), and nothing under SIGTERM. Each frame is now written and flushed at once."""
    calls = {"n": 0}
    flushed = [0]  # frames flushed so far
    seen: list[int] = []  # frames flushed when each reading was taken

    class Out(io.StringIO):
        def flush(self) -> None:
            flushed[0] = self.getvalue().count("greend top")

    def request() -> dict:
        calls["n"] += 1
        seen.append(flushed[0])
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return _status(flops=1e15 * calls["n"], gpu_j=1000.0 * calls["n"], steps=calls["n"])

    out = Out()
    run_top(request, socket="S", interval_s=0.0, console=Console(file=out, width=80, color_system=None))
    assert seen == [0, 1, 2, 3]  # each frame flushed before the next reading


def test_top_once_against_a_daemon_with_a_training_job(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    torch = pytest.importorskip("torch")
    from greend import GreenCallback

    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    stop = threading.Event()

    def train() -> None:
        m = torch.nn.Linear(32, 32)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        with GreenCallback(job="topjob", socket=str(d.socket), gpus=[0], model=m) as cb:
            while not stop.is_set():
                with cb.step(samples=16) as step:
                    loss = m(torch.randn(16, 32)).pow(2).mean()
                    step.loss(loss)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                time.sleep(0.002)

    def registered() -> bool:
        with Client(d.socket) as c:
            return any(j.get("job") == "topjob" for j in c.request("status")["jobs"])

    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:
        assert wait_for(registered, 20)
        r = d.ctl("top", "--once", "--interval", "0.5")
    finally:
        stop.set()
        t.join(10)
    assert "topjob" in r.stdout and "running" in r.stdout, r.stdout
    row = next(line for line in r.stdout.splitlines() if "topjob" in line)
    cells = row.split()  # job, state, GPUs, steps, steps/s, ...
    assert cells[4] != "-" and float(cells[4]) > 0, row  # steps/s measured between the two readings
    assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout  # a pipe: 80 columns
    assert "gpu0 (sim)" in r.stdout
    bad = d.ctl("top", "--interval", "0", check=False)
    assert bad.returncode == 2 and "--interval 0: expected seconds >= 0.1" in bad.stderr


def _busy_node(n_jobs: int = 3) -> dict:
    st = _status(flops=1e15, gpu_j=10_000.0, steps=100)
    st["gpus"] = [
        {
            **st["gpus"][0],
            "index": i,
            "name": "NVIDIA H100 80GB HBM3 (simulated)",
            "energy_j": 123456.0,
            "sm_active_pct": 40.0 + i if i else None,  # gpu0: no GPM
        }
        for i in range(4)
    ]
    st["jobs"] = [
        {**st["jobs"][0], "job": f"llama-70b-finetune-run-{i}", "energy_j": 1000.0 * (i + 1), "steps": 100 * (3 - i)}
        for i in range(n_jobs)
    ]
    return st


def test_top_once_fits_80_columns_without_cutting_a_job_id() -> None:
    frame = measure(measure(None, _busy_node(), at_s=0.0), _busy_node(), at_s=1.0)
    buf = io.StringIO()
    Console(file=buf, width=80, color_system=None).print(
        render_frame(frame, socket="/run/greend/greend.sock", interval_s=1.0)
    )
    lines = buf.getvalue().splitlines()
    assert max(len(x) for x in lines) <= 80, "\n".join(lines)
    assert "…" not in buf.getvalue()  # nothing truncated
    assert sum("llama-70b-finetune-run-" in x for x in lines) == 3
    assert "gpu3 (sim)" in buf.getvalue() and "H100 80GB HBM3" in buf.getvalue()
    gpu_rows = {x.split()[0]: x.split() for x in lines if x.strip().startswith("gpu")}
    assert gpu_rows["gpu3"][-3] == "43" and gpu_rows["gpu0"][-3] == "-"  # the SMs-busy column


@pytest.mark.parametrize(("sort", "first"), [("job", "run-0"), ("energy", "run-2"), ("steps", "run-0")])
def test_top_sorts_the_jobs(sort: str, first: str) -> None:
    frame = measure(None, _busy_node(), at_s=0.0)
    buf = io.StringIO()
    Console(file=buf, width=80, color_system=None).print(render_frame(frame, socket="S", interval_s=1.0, sort=sort))
    rows = [x for x in buf.getvalue().splitlines() if "llama-70b" in x]
    assert first in rows[0], rows
