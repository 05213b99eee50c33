"""``greenctl demo``: the same training twice, as it is and with greend's controller on.

It starts ``greend run`` as a subprocess (its socket, state dir and SQLite store in
a temporary directory) on one simulated H100, or on the real GPUs when NVML and CUDA
both work and ``--gpus real|auto`` allows it, and trains a small MLP (first 300 steps
off the clock, then measured) on synthetic data with :class:`greend.GreenCallback`, twice, for the same number of steps:

1. as it is: the job at its own level (``--precision``, bf16 by default, as most GPU
   training runs today) under the ``none`` policy (greend only measures);
2. with greend's controller on: the ``efficient`` clock policy and the ``precision``
   policy, which takes the job one level down (bf16 -> fp8, emulated by torchao on the
   CPU and priced as fp8 on the simulated GPU; fp32 -> bf16 for ``--precision fp32``)
   once the loss is stable, and rolls back if it is not. Never above the job's level.

Then it prints both runs side by side (time, GPU energy, GFLOPS/W, final loss), the
saving in J and %, and the saving the job's own report estimates against its own
baseline, so the two can be compared.

On simulated GPUs the step's cost is the simulator's, from the FLOPs the step
reports: the CPU model's counted FLOPs are reported scaled up (``scale``) so a step
is GPU-sized (0.1 s at the job's own level on an H100 at full clock, 0.3 memory bound
there), and the loop is paced to the simulated step time, so the simulated GPU is busy,
not idling, while the CPU trains for real. Every simulated figure is labelled ``(sim)``.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from greend.errors import GreendError
from greend.ipc.client import Client
from greend.testing.daemon_proc import daemon_command, wait_until_up

__all__ = ["BASE_STEP_S", "compare_runs", "render_comparison", "run_demo"]

# A simulated step at the job's own level on an H100 at its top clock takes this long (s),
BASE_STEP_S = 0.1
# and is this memory bound there (a transformer's step in bf16 is about this).
MEM_SHARE = 0.3
# The levels the demo's job may start at, and the one greend may take it down to.
NEXT_LEVEL = {"bf16": "fp8-emulated", "fp32": "bf16"}
# Steps the demo's student is trained before the measured runs (see _train).
PRETRAIN_STEPS = 300

BASELINE_CONFIG = """[daemon]
socket_group = ""
hz = 10.0
"""

CONTROLLED_CONFIG = """[daemon]
socket_group = ""
hz = 10.0

[policy]
name = "efficient"
period_s = 0.2
settle_s = 0.05
precision = "precision"

[policy.params]
max_slowdown = 0.05
min_steps = 6

[policy.precision_params]
window = 16
min_steps = 8
max_slope = 0.05
max_noise = 0.05
probation_steps = 40
tolerance = 0.1
cooldown_s = 600.0
"""

TORCH_MISSING = (
    "greenctl demo trains a small torch model and needs the train extra: pip install 'greend[train]' "
    "(on a machine without a GPU install torch's CPU wheel first: "
    "pip install torch --index-url https://download.pytorch.org/whl/cpu)"
)


class DemoInterrupted(BaseException):  # like KeyboardInterrupt: no except GreendError swallows it
    """SIGTERM during the demo (its daemons are stopped and its files removed)."""


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


def _start_daemon(tmp: Path, sim: bool, config: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "greend.sock"
    state = tmp / "state"
    cfg = tmp / "greend.toml"
    cfg.write_text(config)  # a private socket: this user only
    log = tmp / "greend.log"
    cmd = daemon_command(cfg, sock, state)
    if sim:
        cmd += ["--sim", "1"]
    with open(log, "wb") as fh:
        # A session of its own: a Ctrl-C in the terminal reaches the demo, which stops
        # the daemon after the training, not the daemon under the training's feet.
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(proc, sock, log, timeout_s=30)
    except GreendError as e:
        proc.kill()
        raise GreendError(f"the demo daemon: {e}") from None
    return proc, sock, log


def _stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _bar(frac: float, width: int = 24) -> str:
    n = int(round(max(0.0, min(1.0, frac)) * width))
    return "#" * n + "." * (width - n)


def _model_flops(model: Any, xb: Any, yb: Any, lossf: Any) -> float:
    """The model's counted FLOPs of one training step (forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        lossf(model(xb), yb).backward()
    model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


def _train(
    sock: Path, steps: int, use_cuda: bool, job: str, *, controlled: bool, label: str, own: str
) -> dict[str, Any]:
    import torch
    from torch import nn

    from greend.training.callback import GreenCallback

    torch.manual_seed(0)
    device = torch.device("cuda:0" if use_cuda else "cpu")
    # A teacher network labels fresh random inputs at every step: a task the student
    # can really learn, with no data set to memorise, so the loss levels off. The
    # student is first trained PRETRAIN_STEPS steps off the clock (the same for both
    # runs): the measured run is the long middle of a training, where the loss is
    # nearly flat and a lower precision is tried, not its first steep steps.
    n_in, n_hidden, n_out, batch = 256, 512, 10, 128
    teacher = nn.Sequential(nn.Linear(n_in, 64), nn.Tanh(), nn.Linear(64, n_out)).to(device)
    data = torch.Generator(device=device).manual_seed(1)

    def next_batch() -> tuple[Any, Any]:
        x = torch.randn(batch, n_in, device=device, generator=data)
        with torch.no_grad():
            return x, teacher(x).argmax(dim=1)

    model = nn.Sequential(
        nn.Linear(n_in, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_out)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lossf = nn.CrossEntropyLoss()
    for _ in range(PRETRAIN_STEPS):
        xb, yb = next_batch()
        loss = lossf(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    x0, y0 = next_batch()
    flops = _model_flops(model, x0, y0, lossf)
    scale = 1.0
    from greend.probes.sim import H100

    mem_share = round(H100.fp32_mem_share(MEM_SHARE, own), 4)
    if not use_cuda:
        # A GPU-sized step: BASE_STEP_S at the job's own level at the top clock on the
        # simulated H100 (the step time is linear in its FLOPs).
        per_flop_s = H100.step_time_s(1e12, H100.sm_clock_max_mhz, mem_share, own) / 1e12
        scale = BASE_STEP_S / per_flop_s / flops
    # The job's own level, and (with greend) the one below it. On the CPU fp8 is torchao's
    # emulation (listed, as CPU tests must); on a GPU that runs fp8, the callback offers it.
    lower = NEXT_LEVEL[own]
    if use_cuda and lower == "fp8-emulated":
        lower = "fp8"
    cb = GreenCallback(
        job=job,
        model=model,
        socket=sock,
        gpus=None if use_cuda else [0],
        mem_share=mem_share,
        flops_per_step=flops * scale,
        initial_precision=own,
        precisions=[own, lower] if controlled else [own],
        fp8_min_features=256,  # the demo's hidden layers (256 and 512 wide) run in fp8
        heartbeat_s=0.5,
    )
    why_not = cb.supported_precisions().get(lower) if controlled else None
    if why_not:
        print(f"note: {lower} does not run here ({why_not}); this run's saving is the clocks' alone", flush=True)
    status = Client(sock, timeout_s=2.0)
    t_start = time.monotonic()
    last_shown = -1.0
    shown: dict[str, Any] = {}
    loss_value = float("nan")
    losses: list[float] = []
    # Pacing (simulated GPUs): the loop keeps pace with the simulated steps, so the
    # GPU is busy while it trains. The per-step time is the daemon's, from the sim's
    # time over the steps it has seen since the last look.
    target_s = 0.0
    est_step_s = BASE_STEP_S
    seen = (0, 0.0)  # (step reports, sim seconds) at the last look
    last_look = 0.0
    sim = " (sim)" if not use_cuda else ""
    try:
        for step in range(steps):
            xb, yb = next_batch()
            with cb.step(samples=batch) as st:
                with st.autocast():
                    loss = lossf(model(xb), yb)
                st.loss(loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if not use_cuda:
                    target_s += est_step_s
                    while True:
                        now = time.monotonic() - t_start
                        if now - last_look >= 0.05:
                            last_look = now
                            try:
                                r = status.request("report", job=cb.job)
                            except GreendError:
                                r = {}
                            n, s = r.get("step_reports") or 0, r.get("sim_time_s") or 0.0
                            if n > seen[0] and s > seen[1]:
                                est_step_s = (s - seen[1]) / (n - seen[0])
                                seen = (n, s)
                            shown = {"w": r.get("avg_gpu_power_w"), "g": r.get("gflops_per_w")}
                        if now >= target_s:
                            break
                        time.sleep(min(0.01, target_s - now))
            loss_value = float(loss.detach())
            losses.append(loss_value)
            elapsed = time.monotonic() - t_start
            tty = sys.stderr.isatty()  # a pipe or a log: a line every 5 s, not one endless \r line
            if elapsed - last_shown >= (0.5 if tty else 5.0) or step == steps - 1:
                last_shown = elapsed
                w, g = shown.get("w"), shown.get("g")
                sys.stderr.write(
                    ("\r" if tty else "") + f"{label:12} [{_bar((step + 1) / steps)}] step {step + 1:4d}/{steps}  "
                    f"{elapsed:5.1f} s  loss {loss_value:.3f}  {st.precision if hasattr(st, 'precision') else ''}  "
                    f"GPU {'-' if w is None else f'{w:.0f}'} W{sim}  "
                    f"GFLOPS/W {'-' if g is None else f'{g:.1f}'}{sim}" + ("   " if tty else "\n")
                )
                sys.stderr.flush()
    finally:
        sys.stderr.write("\n")
        status.close()
        cb.close()
    tail = losses[-20:]
    return {
        "job": cb.job,
        "steps": len(losses),
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "scale": scale,
        "why_not": why_not,
    }


def _wait_report(sock: Path, job: str) -> dict[str, Any]:
    report: dict[str, Any] | None = None
    deadline = time.monotonic() + 15
    with Client(sock, timeout_s=2.0) as c:
        while time.monotonic() < deadline:
            report = c.request("report", job=job)
            if report["state"] == "ended":
                break
            time.sleep(0.1)
    assert report is not None
    return report


def compare_runs(base: dict[str, Any], ctrl: dict[str, Any]) -> dict[str, Any]:
    """The saving of the controlled run against the baseline: J, %, and the time it cost."""
    e0, e1 = base["gpu_energy_j"], ctrl["gpu_energy_j"]
    # The GPU's time: the simulated steps' own where a simulator ran them (the wall time
    # there is the CPU's, which runs fp8 emulated, far slower than a GPU would).
    t0, t1 = base.get("sim_time_s") or base["duration_s"], ctrl.get("sim_time_s") or ctrl["duration_s"]
    saved = e0 - e1
    return {
        "saved_j": saved,
        "saved_pct": 100.0 * saved / e0 if e0 else None,
        "slowdown_pct": 100.0 * (t1 - t0) / t0 if t0 else None,
    }


def render_comparison(base: dict[str, Any], ctrl: dict[str, Any], sim: bool) -> str:
    """The demo's closing table: both runs side by side, and the saving."""
    from greend.cli.render import render_table

    lab = " (sim)" if sim else ""

    def row(name: str, key: str, digits: str, r0: dict[str, Any], r1: dict[str, Any]) -> list[str]:
        def f(r: dict[str, Any]) -> str:
            v = r.get(key)
            return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:{digits}}"

        return [name, f(r0), f(r1)]

    rows = [
        row("steps", "steps", "d", base, ctrl),
        row(f"GPU step time (s){lab}", "sim_time_s" if sim else "duration_s", ".1f", base, ctrl),
        row("wall time (s)", "duration_s", ".1f", base, ctrl),
        row(f"GPU energy (J){lab}", "gpu_energy_j", ".0f", base, ctrl),
        row(f"avg GPU power (W){lab}", "avg_gpu_power_w", ".0f", base, ctrl),
        row(f"GFLOPS/W{lab}", "gflops_per_w", ".1f", base, ctrl),
        row("final loss", "final_loss", ".4f", base, ctrl),
        ["precision at the end", str(base.get("precision")), str(ctrl.get("precision"))],
        ["clock cap at the end (MHz)", _last_cap(base), _last_cap(ctrl)],
    ]
    c = compare_runs(base, ctrl)
    table = render_table(["", "as it is", "with greend"], rows)
    pct = c["saved_pct"]
    slow = c["slowdown_pct"]
    line = (
        f"saved{lab}: {c['saved_j']:.0f} J of GPU energy = {'-' if pct is None else f'{pct:.1f}'} %, "
        f"at {'-' if slow is None else f'{slow:+.1f}'} % time, same steps"
    )
    for name, r in (("as it is", base), ("with greend", ctrl)):
        gpu_s, wall_s = r.get("sim_time_s"), r.get("duration_s")
        if sim and gpu_s and wall_s and wall_s > 1.25 * gpu_s:
            line += (
                f"\nnote: in the run {name!r} the CPU took {wall_s:.0f} s for {gpu_s:.0f} s of simulated GPU steps "
                "(a busy machine, or fp8 emulated on the CPU): the simulated GPU idled meanwhile, and that idle "
                "energy is in the side-by-side figure"
            )
    sv = ctrl.get("savings") or {}
    if sv.get("saved_pct") is not None:
        line += (
            f"\nthe job's own report{lab}: {sv['saved_pct']:.1f} % of its GPU energy at "
            f"{_fmt(sv.get('slowdown_pct'), '+.1f')} % time, against its own first steps at "
            f"{(sv.get('baseline') or {}).get('precision')} uncapped (an estimate from one run; the line above "
            "compares two runs)"
        )
    return table + "\n\n" + line


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else f"{v:{spec}}"


def _last_cap(r: dict[str, Any]) -> str:
    for d in reversed(r.get("decisions") or []):
        s = d.get("setting") or {}
        if s.get("clock_cap_mhz") is not None:
            return str(s["clock_cap_mhz"])
        if s.get("power_limit_w") is not None:
            return f"{s['power_limit_w']:.0f} W"
        return "none"
    return "none"


def _on_sigterm(signum: int, _frame: FrameType | None) -> None:
    raise DemoInterrupted(f"stopped by {signal.Signals(signum).name}")


def run_demo(seconds: float = 45.0, gpus: str = "auto", keep: Path | None = None, precision: str = "bf16") -> int:
    from greend.cli.render import render_report

    if not (math.isfinite(seconds) and seconds > 0):
        raise GreendError(f"--seconds {seconds}: expected a number of seconds > 0 (the length of each run)")
    if gpus not in ("auto", "sim", "real"):
        raise GreendError(f"--gpus {gpus!r}: expected sim, real or auto")
    if precision not in NEXT_LEVEL:
        raise GreendError(
            f"--precision {precision!r}: expected {' or '.join(NEXT_LEVEL)} (the level the job trains at on its own)"
        )
    if importlib.util.find_spec("torch") is None:
        raise GreendError(TORCH_MISSING)
    real = gpus == "real" or (gpus == "auto" and _real_gpus_available())
    if gpus == "real" and not _real_gpus_available():
        raise GreendError("--gpus real: no NVML or no CUDA here; use --gpus sim")
    steps = max(20, int(round(seconds / BASE_STEP_S)))
    tmp = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="greend-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    procs: list[subprocess.Popen[bytes]] = []
    print(
        f"greend demo: the same {precision} training ({steps} steps) twice, as it is and with greend's controller "
        f"on (efficient clocks + precision {precision} -> {NEXT_LEVEL[precision]}), on "
        f"{'the real GPUs' if real else 'a simulated H100 (figures labelled sim)'}; state in {tmp}"
    )
    try:
        reports: list[dict[str, Any]] = []
        for name, config, controlled, label in (
            ("as-it-is", BASELINE_CONFIG, False, "as it is"),
            ("with-greend", CONTROLLED_CONFIG, True, "with greend"),
        ):
            proc, sock, _log = _start_daemon(tmp / name, sim=not real, config=config)
            procs.append(proc)
            job = f"demo-{name}"
            trained = _train(sock, steps, use_cuda=real, job=job, controlled=controlled, label=label, own=precision)
            report = _wait_report(sock, job)
            report["final_loss"] = trained["final_loss"]
            report["flops_scale"] = trained["scale"]
            report["why_not"] = trained["why_not"]
            reports.append(report)
            _stop_daemon(proc)
        base, ctrl = reports
        print()
        print(render_report(ctrl))
        print()
        if not real and base.get("flops_scale", 1.0) != 1.0:
            print(
                f"FLOPs: the CPU model's counted FLOPs x {base['flops_scale']:.0f}, so each step is a GPU-sized "
                f"step ({BASE_STEP_S:g} s at {precision} on an H100 at full clock) for the simulator; the training "
                "is real torch on the CPU, paced to the simulated GPU"
            )
        print()
        print(render_comparison(base, ctrl, sim=not real))
        if ctrl.get("why_not"):
            print(f"note: {NEXT_LEVEL[precision]} did not run ({ctrl['why_not']}): the saving above is the clocks'")
        if keep is not None:
            print(
                f"\nthe stores are kept: sqlite3 {tmp / 'with-greend' / 'state' / 'greend.db'} "
                "'SELECT job, gflops_per_w, gpu_energy_j FROM greend_job'"
            )
        return 0
    except (KeyboardInterrupt, DemoInterrupted) as e:
        sys.stderr.write(f"\ngreenctl demo: {e or 'interrupted'}; stopping its daemon and removing its files\n")
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for p in procs:
            _stop_daemon(p)
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
