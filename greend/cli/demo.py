"""``greenctl demo``: a daemon, a real (small) training with the callback, and its report.

It starts ``greend run`` as a subprocess with its socket, state dir and SQLite
store in a temporary directory, on two simulated GPUs (or on the real ones when
NVML and CUDA both work and ``--gpus real|auto`` allows it), trains a small MLP
on synthetic data for about ``seconds`` with :class:`greend.GreenCallback`
(a progress line shows loss, power and GFLOPS/W as the daemon sees them), then
prints the job's report. On simulated GPUs every figure of GPU energy is the
simulator's and is labelled ``sim``; the training itself is real torch on the CPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from greend.errors import DaemonUnavailable, GreendError
from greend.ipc.client import Client

__all__ = ["run_demo"]


def _real_gpus_available() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def _start_daemon(tmp: Path, sim: bool) -> tuple[subprocess.Popen[bytes], Path, Path]:
    sock = tmp / "greend.sock"
    state = tmp / "state"
    cfg = tmp / "greend.toml"
    cfg.write_text('[daemon]\nsocket_group = ""\n')  # a private socket: this user only
    log = tmp / "greend.log"
    cmd = [
        sys.executable,
        "-m",
        "greend.daemon_main",
        "run",
        "--config",
        str(cfg),
        "--socket",
        str(sock),
        "--state-dir",
        str(state),
        "--hz",
        "10",
    ]
    if sim:
        cmd += ["--sim", "2"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GreendError(f"the demo daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with Client(sock, timeout_s=1.0) as c:
                if c.request("status")["ticks"] > 0:
                    return proc, sock, log
        except (DaemonUnavailable, GreendError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise GreendError(f"the demo daemon did not answer within 30 s:\n{log.read_text()}")


def _bar(frac: float, width: int = 24) -> str:
    n = int(round(max(0.0, min(1.0, frac)) * width))
    return "#" * n + "." * (width - n)


def _train(sock: Path, seconds: float, use_cuda: bool, job: str) -> dict[str, Any]:
    import torch
    from torch import nn

    from greend.training.callback import GreenCallback

    torch.manual_seed(0)
    device = torch.device("cuda:0" if use_cuda else "cpu")
    # A teacher network labels random inputs: a task the student can really learn.
    n_in, n_hidden, n_out, batch = 256, 1024, 10, 128
    teacher = nn.Sequential(nn.Linear(n_in, 64), nn.Tanh(), nn.Linear(64, n_out)).to(device)
    x_all = torch.randn(8192, n_in, device=device)
    with torch.no_grad():
        y_all = teacher(x_all).argmax(dim=1)
    model = nn.Sequential(
        nn.Linear(n_in, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_out)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lossf = nn.CrossEntropyLoss()
    params = sum(p.numel() for p in model.parameters())
    sys.stderr.write(f"model: {params / 1e6:.2f}M parameters, batch {batch}\n")
    cb = GreenCallback(job=job, model=model, socket=sock, gpus=None if use_cuda else [0], mem_share=0.3)
    status = Client(sock, timeout_s=1.0)
    t_start = time.monotonic()
    last_shown = 0.0
    shown: dict[str, Any] = {}
    step = 0
    loss_value = float("nan")
    while True:
        elapsed = time.monotonic() - t_start
        if elapsed >= seconds:
            break
        i = (step * batch) % x_all.shape[0]
        xb, yb = x_all[i : i + batch], y_all[i : i + batch]
        with cb.step(samples=batch, batch=xb) as st:
            with st.autocast():
                loss = lossf(model(xb), yb)
            st.loss(loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        loss_value = float(loss.detach())
        step += 1
        if elapsed - last_shown >= 0.5:
            last_shown = elapsed
            try:
                r = status.request("report", job=cb.job)
                shown = {"w": r.get("avg_gpu_power_w"), "g": r.get("gflops_per_w")}
            except GreendError:
                pass
            w, g = shown.get("w"), shown.get("g")
            sim = " (sim)" if not use_cuda else ""
            sys.stderr.write(
                f"\r[{_bar(elapsed / seconds)}] {elapsed:4.1f}/{seconds:.0f} s  step {step:5d}  "
                f"loss {loss_value:.3f}  GPU {'-' if w is None else f'{w:.0f}'} W{sim}  "
                f"GFLOPS/W {'-' if g is None else f'{g:.2f}'}{sim}   "
            )
            sys.stderr.flush()
    sys.stderr.write("\n")
    status.close()
    cb.close()
    return {
        "job": cb.job,
        "steps": step,
        "final_loss": loss_value,
        "dropped": cb.stats.dropped if hasattr(cb.stats, "dropped") else 0,
    }


def run_demo(seconds: float = 30.0, gpus: str = "auto", keep: Path | None = None) -> int:
    from greend.cli.render import render_report

    if gpus not in ("auto", "sim", "real"):
        raise GreendError(f"--gpus {gpus!r}: expected sim, real or auto")
    real = gpus == "real" or (gpus == "auto" and _real_gpus_available())
    if gpus == "real" and not _real_gpus_available():
        raise GreendError("--gpus real: no NVML or no CUDA here; use --gpus sim")
    tmp = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="greend-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(
        f"greend demo: daemon on {'the real GPUs' if real else '2 simulated H100s (figures labelled sim)'}, "
        f"state in {tmp}"
    )
    proc, sock, log = _start_daemon(tmp, sim=not real)
    try:
        job = f"demo-{os.getpid()}"
        print(f"training a small MLP on synthetic data for {seconds:.0f} s ({'CUDA' if real else 'CPU'}), job {job}")
        trained = _train(sock, seconds, use_cuda=real, job=job)
        report: dict[str, Any] | None = None
        deadline = time.monotonic() + 10
        with Client(sock, timeout_s=2.0) as c:
            while time.monotonic() < deadline:
                report = c.request("report", job=trained["job"])
                if report["state"] == "ended":
                    break
                time.sleep(0.1)
        assert report is not None
        print()
        print(render_report(report))
        print()
        print(f"final training loss {trained['final_loss']:.4f} after {trained['steps']} steps")
        if keep is not None:
            print(
                f"the store is kept: sqlite3 {tmp / 'state' / 'greend.db'} "
                "'SELECT job, gflops_per_w, gpu_energy_j FROM greend_job'"
            )
        else:
            print("run with --keep DIR to keep the daemon's SQLite store for a look")
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
