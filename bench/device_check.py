"""The device check: what a real GPU shows of greend, in under 5 minutes, touching no GPU setting.

Run:  python bench/device_check.py [--json device-check.json] [--budget-s 270] [--only PART ...]

READ-ONLY. This script never changes a GPU setting: no clock locks, no power limits,
no persistence mode, no MIG, no reset, no applications clocks. It is enforced, not
promised:

- :func:`guard_nvml` replaces every NVML function that writes (``nvml*Set*``,
  ``*Reset*``, ``*Clear*``, ``*Create*``, ``*Destroy*``, ... : anything whose verb is
  not a read) with one that refuses and records the attempt, in this process and in the
  daemon it starts (launched through the same guard);
- the daemon runs with ``--dry-run`` (every actuator records what it would set and
  touches nothing) and policy ``none``; the script reads ``dry_run`` back from
  ``status`` and stops the daemon unless it is true;
- the GPU's settings (power limit, persistence mode, MIG mode, applications clocks,
  compute mode) are read before and after the run: any difference, or any refused
  write, is reported and the script exits 2.

Parts (each isolated: one that fails prints its error and the others still run; each
gets what is left of ``--budget-s``; on a machine without a GPU each GPU part is
skipped with the reason and the script still exits 0 with the JSON written):

``nvml``       greend's NVML probe over a steady load: the energy counter against the
               script's own power samples integrated (trapezoid), in %; the sample
               rate the probe reaches flat out, its cost per tick, and how often the
               counter moves.
``daemon``     ``greend run --dry-run`` on the real GPU: its status, then a real training
               job (a small transformer, bf16) through GreenCallback; the report's GPU
               energy against the script's own NVML count over the same steps (goal:
               within 2 %), and its GFLOPS/W against FlopCounterMode's FLOPs over those joules.
``hotpath``    the callback on CUDA under ``torch.cuda.set_sync_debug_mode("error")``:
               synchronisations from greend's code across a run (goal: 0), attributed by
               the frames of each error; then its per-step cost on the training thread as
               ``bench/bench_callback.py`` measures it (bare loop, greend, A/A control).
``precision``  the transformer's step time, energy per step, power and GFLOPS/W at fp32,
               tf32, bf16 and fp8 (torchao float8 where the GPU has it), switched through
               GreenCallback, levels interleaved over rounds.
``sim``        the simulator's H100 model (``greend.probes.sim``) against the precision
               part's figures, ratio by ratio.

Exit status: 0 when every part ran or was skipped, 1 when a part failed, 2 when a GPU
setting changed or a write was attempted. ``--force-cpu`` runs the torch parts on the
CPU with tiny sizes (with ``LD_LIBRARY_PATH`` on the NVML stand-in, the daemon part
too): a test of this script's paths, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

PARTS = ("nvml", "daemon", "hotpath", "precision", "sim")
ENERGY_GOAL_PCT = 2.0
MEM_SHARE = 0.3  # the workload's memory-bound share the sim is asked about (bench_precision's)
GREEND_DIR = str(ROOT / "greend")  # frames from here (or the installed package) are greend's

# ---------------------------------------------------------------- read-only guard

# NVML names are nvml<Object...><Verb><What>; these objects come before the verb, and
# these verbs only read. Anything else (Set, Reset, Clear, Create, Destroy, Register, ...)
# is refused.
_NVML_OBJECTS = {"Device", "System", "Unit", "Vgpu", "Gpu", "Instance", "Compute", "Event", "Gpm", "Nv", "Link"}
_NVML_READ_VERBS = {"Get", "Init", "Shutdown", "Error", "Query", "Validate", "Is", "On"}
# GPM (SM activity): samples are host buffers NVML fills from the GPU's counters; taking,
# reading and freeing them changes no setting (nvmlGpmSetStreamingEnabled does, and is refused).
_NVML_READERS = {
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
}


def is_nvml_writer(name: str) -> bool:
    """True for an NVML function that may change the GPU or the driver's state."""
    if not name.startswith("nvml") or len(name) < 5 or not name[4].isupper() or name in _NVML_READERS:
        return False
    for word in re.findall(r"[A-Z][a-z0-9]*", name[4:]):
        if word in _NVML_OBJECTS:
            continue
        return word not in _NVML_READ_VERBS
    return True


class ReadOnlyViolation(RuntimeError):
    """An NVML write was attempted under the device check."""


def guard_nvml(module: Any, log_path: str | None = None) -> list[str]:
    """Replace every writing NVML function of ``module`` (pynvml) with one that refuses,
    appends its name to ``log_path`` (if given) and raises :class:`ReadOnlyViolation`.
    Returns the names guarded. Idempotent."""
    guarded: list[str] = []
    for name in dir(module):
        fn = getattr(module, name)
        if not callable(fn) or isinstance(fn, type) or not is_nvml_writer(name):
            continue
        guarded.append(name)
        if getattr(fn, "_device_check_guard", False):
            continue

        def refuse(*_a: Any, _name: str = name, **_k: Any) -> Any:
            ATTEMPTS.append(_name)
            if log_path:
                with open(log_path, "a") as fh:
                    fh.write(_name + "\n")
            raise ReadOnlyViolation(f"{_name}: the device check is read-only; no GPU setting may change")

        refuse._device_check_guard = True  # type: ignore[attr-defined]  # a marker on a function object
        setattr(module, name, refuse)
    if log_path:  # the daemon's guard says it is in place (the attempts follow, a name a line)
        with open(log_path, "a") as fh:
            fh.write(f"# guarded {len(guarded)}\n")
    return guarded


ATTEMPTS: list[str] = []  # writes refused in this process


def settings_diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The settings that differ between two snapshots, as readable lines."""
    return [
        f"{k}: {before.get(k)!r} -> {after.get(k)!r}"
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    ]


# ---------------------------------------------------------------- pure figures


def trapezoid_j(samples: Sequence[tuple[float, float]], t0: float | None = None, t1: float | None = None) -> float:
    """Energy (J) of (time s, power W) samples by the trapezoid rule, inside [t0, t1]."""
    pts = [(t, p) for t, p in samples if (t0 is None or t >= t0) and (t1 is None or t <= t1)]
    return sum((b[0] - a[0]) * (a[1] + b[1]) / 2.0 for a, b in zip(pts, pts[1:], strict=False))


def agreement_pct(value: float, reference: float) -> float:
    """How far ``value`` lies from ``reference``, in % of the reference (signed)."""
    if reference == 0:
        return math.inf if value else 0.0
    return (value - reference) / reference * 100.0


def update_period_s(reads: Sequence[tuple[float, float]]) -> float | None:
    """The median time between changes of a counter read at (time s, value) points."""
    changes = [t for (t, v), (_, prev) in zip(reads[1:], reads, strict=False) if v != prev]
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def attribute_sync(filenames: Iterable[str], greend_dirs: Iterable[str]) -> str:
    """Whose synchronisation an error's frames show: "greend" when any frame lies in
    greend's package (the callback issued it), else "workload"."""
    dirs = [d.rstrip(os.sep) + os.sep for d in greend_dirs]
    return "greend" if any(f.startswith(d) for f in filenames for d in dirs) else "workload"


def ratio_rows(measured: dict[str, dict[str, float]], sim: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Ratio by ratio, the GPU's against the simulator's: step time, energy per step and
    power of each level against fp32 (and fp8 against bf16). ``measured`` and ``sim``
    map a level to ``{"step_s", "energy_j", "power_w"}`` (a missing or None figure: n/a)."""
    pairs = [(lvl, "fp32") for lvl in ("tf32", "bf16", "fp8")] + [("fp8", "bf16")]
    rows = []
    for a, b in pairs:
        if a not in sim or b not in sim:
            continue
        for what in ("step_s", "energy_j", "power_w"):
            s = _ratio(sim[a].get(what), sim[b].get(what))
            m = _ratio(measured.get(a, {}).get(what), measured.get(b, {}).get(what))
            rows.append({"ratio": f"{what} {a}/{b}", "gpu": m, "sim": s, "sim_over_gpu": _ratio(s, m)})
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


# ---------------------------------------------------------------- the run's frame


class _ListHandler(logging.Handler):
    """Keeps the messages of the records it sees."""

    def __init__(self, out: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage())


class Skip(Exception):
    """A part that cannot run here; the message says why."""


@dataclass
class Figure:
    name: str
    value: Any
    unit: str = ""
    note: str = ""


@dataclass
class Ctx:
    args: argparse.Namespace
    deadline: float
    tmp: Path
    torch: Any = None
    device: Any = None  # torch.device for the torch parts, or None
    no_device: str = ""  # why there is none
    nvml: Any = None
    handle: Any = None
    nvml_index: int | None = None
    no_nvml: str = ""
    gpu: dict[str, Any] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    daemon_proc: subprocess.Popen[bytes] | None = None
    socket: Path | None = None
    guard_log: Path | None = None

    @property
    def tiny(self) -> bool:
        return self.device is not None and self.device.type == "cpu"

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def need_gpu(self) -> None:
        if self.device is None:
            raise Skip(self.no_device)

    def need_nvml(self) -> None:
        if self.nvml is None:
            raise Skip(self.no_nvml)

    def energy_j(self) -> float | None:
        """The GPU's NVML total-energy counter (mJ -> J), read by the script itself."""
        if self.handle is None:
            return None
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3

    def sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def setup(ctx: Ctx) -> None:
    """Find torch's CUDA device and the NVML handle of the same GPU; guard NVML."""
    a = ctx.args
    try:
        import torch

        ctx.torch = torch
        if a.force_cpu:
            ctx.device = torch.device("cpu")
        elif torch.cuda.is_available():
            ctx.device = torch.device("cuda", 0)
        else:
            ctx.no_device = f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    except ImportError as e:
        ctx.no_device = f"torch is not installed ({e}): pip install '.[train]'"
    try:
        import pynvml

        guard_nvml(pynvml)
        pynvml.nvmlInit()
    except Exception as e:  # no package, no driver: NVMLError_LibraryNotFound
        ctx.no_nvml = f"no NVML here ({type(e).__name__}: {e})"
        return
    ctx.nvml = pynvml
    index = 0
    if ctx.device is not None and ctx.device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        index = int(visible) if visible.isdigit() else 0  # torch's first device, by NVML's index
        uuid = str(getattr(ctx.torch.cuda.get_device_properties(ctx.device), "uuid", ""))
        for i in range(pynvml.nvmlDeviceGetCount()):  # better: the same GPU by its UUID
            if uuid and _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))).endswith(uuid):
                index = i
    ctx.nvml_index = index
    ctx.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    ctx.gpu = {
        "index": index,
        "name": _text(pynvml.nvmlDeviceGetName(ctx.handle)),
        "uuid": _text(pynvml.nvmlDeviceGetUUID(ctx.handle)),
        "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
    }
    try:
        ctx.gpu["cuda_driver"] = pynvml.nvmlSystemGetCudaDriverVersion()
    except Exception:
        pass


def gpu_settings(ctx: Ctx) -> dict[str, Any]:
    """What this script promises not to change, read (each read that fails reads None)."""
    n, h = ctx.nvml, ctx.handle
    reads: dict[str, Callable[[], Any]] = {
        "power_limit_mw": lambda: n.nvmlDeviceGetPowerManagementLimit(h),
        "enforced_power_limit_mw": lambda: n.nvmlDeviceGetEnforcedPowerLimit(h),
        "persistence_mode": lambda: n.nvmlDeviceGetPersistenceMode(h),
        "mig_mode": lambda: list(n.nvmlDeviceGetMigMode(h)),
        "applications_sm_clock_mhz": lambda: n.nvmlDeviceGetApplicationsClock(h, n.NVML_CLOCK_SM),
        "compute_mode": lambda: n.nvmlDeviceGetComputeMode(h),
    }
    out: dict[str, Any] = {}
    for k, fn in reads.items():
        try:
            out[k] = fn()
        except Exception:
            out[k] = None
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class SteadyLoad:
    """Back-to-back bf16 matmuls on the GPU from a thread (a sync every few keeps the queue short)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.stop_ = ctx, threading.Event()
        self.thread = threading.Thread(target=self._run, name="device-check-load", daemon=True)

    def _run(self) -> None:
        torch = self.ctx.torch
        n = 8192
        a = torch.randn(n, n, device=self.ctx.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.ctx.device, dtype=torch.bfloat16)
        while not self.stop_.is_set():
            for _ in range(8):
                a @ b
            torch.cuda.synchronize(self.ctx.device)

    def __enter__(self) -> SteadyLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_.set()
        self.thread.join(30)


# ---------------------------------------------------------------- the parts


def part_nvml(ctx: Ctx) -> list[Figure]:
    ctx.need_nvml()
    if ctx.device is None or ctx.device.type != "cuda":
        if not ctx.args.force_cpu:
            raise Skip(f"NVML is here but no CUDA device for the steady load: {ctx.no_device}")
    from greend.probes.nvml import NvmlProbe

    window_s = min(ctx.args.nvml_window_s, max(1.0, ctx.left_s() / 8))
    probe = NvmlProbe(nvml=ctx.nvml)
    probe.open()
    loaded = ctx.device is not None and ctx.device.type == "cuda"
    load = SteadyLoad(ctx) if loaded else None
    try:
        if load:
            load.__enter__()
            time.sleep(3.0)  # the clocks and NVML's 1 s power average settle
        power: list[tuple[float, float]] = []
        tick_s: list[float] = []
        energy: list[tuple[float, float]] = []
        t_end = time.monotonic() + window_s
        while True:
            now = time.monotonic()
            power.append((now, ctx.nvml.nvmlDeviceGetPowerUsage(ctx.handle) / 1e3))
            t = time.perf_counter()
            r = probe.sample(now)
            tick_s.append(time.perf_counter() - t)
            g = next(x for x in r.gpus if x.index == ctx.nvml_index)
            energy.append((now, float(g.energy_j)))
            if now >= t_end:
                break
            time.sleep(0.05)
        # Flat out: the rate the probe reaches, and how often the counter moves.
        n, raw, t0 = 0, [], time.monotonic()
        while time.monotonic() - t0 < 2.0:
            probe.sample(time.monotonic())
            n += 1
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            raw.append((time.monotonic(), ctx.energy_j() or 0.0))
    finally:
        if load:
            load.__exit__()
        probe.close()
    counter = energy[-1][1] - energy[0][1]
    integ = trapezoid_j(power)
    period = update_period_s(raw)
    mean_w = integ / (power[-1][0] - power[0][0])
    return [
        Figure("load", "bf16 8192^2 matmuls" if loaded else "none (CPU run: idle GPU)"),
        Figure("window", power[-1][0] - power[0][0], "s"),
        Figure("mean power (script's NVML reads)", mean_w, "W"),
        Figure("energy, greend's probe (counter)", counter, "J"),
        Figure("energy, power samples integrated", integ, "J", f"{len(power)} samples"),
        Figure("counter vs integrated power", agreement_pct(counter, integ), "%", "NVML power is a ~1 s average"),
        Figure("probe rate flat out", n / 2.0, "ticks/s"),
        Figure("probe cost per tick, median", pct(tick_s, 50) * 1e6, "us"),
        Figure("probe cost per tick, p99", pct(tick_s, 99) * 1e6, "us", "p99: ticks with the 1 s fields"),
        Figure("counter update period, median", period * 1e3 if period else None, "ms"),
    ]


def start_daemon(ctx: Ctx) -> Path:
    """``greend run --dry-run`` on the real NVML, under the write guard; its socket."""
    if ctx.socket is not None:
        return ctx.socket
    from greend.ipc.client import Client
    from greend.testing.daemon_proc import daemon_command, wait_until_up

    d = ctx.tmp / "daemon"
    d.mkdir()
    cfg, sock, log = d / "greend.toml", d / "greend.sock", d / "greend.log"
    ctx.guard_log = d / "nvml-writes.txt"
    cfg.write_text(
        '[daemon]\nsocket_group = ""\ndry_run = true\nlog_level = "info"\n'
        '[probes]\nenabled = ["nvml", "host"]\n[policy]\nname = "none"\nprecision = "none"\n'
    )
    args = daemon_command(cfg, sock, d / "state", "--dry-run", "--hz", "10", "--sysfs-root", str(d / "no-sysfs"))
    launch = (
        "import sys; sys.path.insert(0, sys.argv.pop(1)); import device_check, pynvml; "
        "device_check.guard_nvml(pynvml, sys.argv.pop(1)); "
        "from greend.cli.greend_cmd import daemon_main; sys.argv[0] = 'greend'; daemon_main()"
    )
    # The daemon's own arguments: what follows "-m greend.daemon_main" in its command.
    cmd = [sys.executable, "-c", launch, str(BENCH), str(ctx.guard_log), *args[args.index("greend.daemon_main") + 1 :]]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "ab") as fh:
        ctx.daemon_proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    wait_until_up(ctx.daemon_proc, sock, log, timeout_s=60)
    with Client(sock) as c:
        st = c.request("status")
    if st.get("dry_run") is not True:
        stop_daemon(ctx)
        raise RuntimeError(f"the daemon is not in dry-run (status dry_run={st.get('dry_run')!r}): stopped it")
    if daemon_guarded(ctx) == 0:
        stop_daemon(ctx)
        raise RuntimeError("the daemon's NVML write guard is not in place: stopped it")
    ctx.socket = sock
    return sock


def stop_daemon(ctx: Ctx) -> None:
    p = ctx.daemon_proc
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    ctx.daemon_proc = None
    ctx.socket = None


def _guard_lines(ctx: Ctx) -> list[str]:
    try:
        return ctx.guard_log.read_text().splitlines() if ctx.guard_log else []
    except FileNotFoundError:
        return []


def daemon_writes(ctx: Ctx) -> list[str]:
    """The NVML writes the daemon attempted (each refused by its guard)."""
    return [ln for ln in _guard_lines(ctx) if ln and not ln.startswith("#")]


def daemon_guarded(ctx: Ctx) -> int:
    """How many NVML writers the daemon's guard replaced (0: no guard in place)."""
    return max((int(ln.split()[-1]) for ln in _guard_lines(ctx) if ln.startswith("# guarded")), default=0)


def tiny_gpt(ctx: Ctx) -> tuple[Any, Any, Callable[[], tuple[Any, Any]], dict[str, int]]:
    """A small GPT (pre-norm blocks, causal attention) on the device, its optimizer and
    a batch maker; small enough for the CPU under ``--force-cpu``."""
    torch = ctx.torch
    from torch import nn
    from torch.nn import functional as F

    shape = dict(d=64, layers=2, heads=4, seq=32, batch=4, vocab=256) if ctx.tiny else dict(ctx.args.gpt)

    class Block(nn.Module):
        def __init__(self, d: int, h: int) -> None:
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = shape["d"]
            self.emb = nn.Embedding(shape["vocab"], d)
            self.pos = nn.Parameter(torch.zeros(shape["seq"], d))
            self.blocks = nn.Sequential(*(Block(d, shape["heads"]) for _ in range(shape["layers"])))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, shape["vocab"])

        def forward(self, idx: Any) -> Any:
            return self.head(self.ln(self.blocks(self.emb(idx) + self.pos)))

    torch.manual_seed(0)
    model = GPT().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def batch() -> tuple[Any, Any]:
        idx = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), device=ctx.device)
        return idx[:, :-1], idx[:, 1:]

    return model, opt, batch, shape


def count_flops(ctx: Ctx, model: Any, x: Any, y: Any) -> float:
    """FLOPs of one training step (forward and backward) by FlopCounterMode, apart from greend."""
    from torch.nn import functional as F
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


def gpt_step(step: Any, model: Any, x: Any, y: Any, opt: Any) -> None:
    """One training step of the tiny GPT inside greend's ``step``: forward at the level
    in force, the loss reported, backward, the optimizer."""
    from torch.nn import functional as F

    with step.autocast():
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    step.loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def part_daemon(ctx: Ctx) -> list[Figure]:
    ctx.need_nvml()
    ctx.need_gpu()

    from greend.ipc.client import Client
    from greend.training.callback import GreenCallback

    sock = start_daemon(ctx)
    with Client(sock) as c:
        st = c.request("status")
    gpus = st["gpus"] if isinstance(st["gpus"], list) else list(st["gpus"].values())
    g = next((x for x in gpus if x["index"] == ctx.nvml_index), None)
    if g is None:
        raise RuntimeError(f"the daemon does not show gpu{ctx.nvml_index}: {gpus}")
    model, opt, batch, _ = tiny_gpt(ctx)
    x, y = batch()
    flops = count_flops(ctx, model, x, y)
    job = f"device-check-{os.getpid()}"
    precision = "fp32" if ctx.tiny else "bf16"
    run_s = min(ctx.args.job_s, max(3.0, ctx.left_s() / 6))
    cb = GreenCallback(job=job, model=model, socket=sock, gpus=[ctx.nvml_index], initial_precision=precision)
    steps = 0
    ctx.sync()
    e0, t0 = ctx.energy_j(), time.monotonic()
    while time.monotonic() - t0 < run_s or steps < 3:
        with cb.step(samples=x.shape[0], batch=x) as step:
            gpt_step(step, model, x, y, opt)
        steps += 1
    ctx.sync()
    t1 = time.monotonic()
    cb.close()  # the job's end: the daemon's window runs from its first step to here
    e1 = ctx.energy_j()
    deadline, rep = time.monotonic() + 20, {}
    with Client(sock) as c:
        while time.monotonic() < deadline:
            rep = c.request("report", job=job)
            if rep.get("state") == "ended":
                break
            time.sleep(0.1)
    if rep.get("state") != "ended":
        raise RuntimeError(f"the job did not end in the daemon within 20 s: {rep.get('state')}")
    assert e0 is not None and e1 is not None
    script_j = e1 - e0
    ours = flops * steps / script_j / 1e9 if script_j > 0 else None
    agree = agreement_pct(rep["gpu_energy_j"], script_j)
    return [
        Figure("daemon dry_run (status)", st["dry_run"], "", "required: true"),
        Figure("status gpu", f"gpu{g['index']} {g.get('name')} source={g.get('source')} {g.get('power_w')} W"),
        Figure("job", f"{steps} steps at {precision}, {t1 - t0:.1f} s, {flops / 1e9:.1f} GFLOP a step"),
        Figure("report GPU energy", rep["gpu_energy_j"], "J"),
        Figure("script's NVML count, same steps", script_j, "J"),
        Figure(
            "report vs script energy",
            agree,
            "%",
            f"goal within {ENERGY_GOAL_PCT:g} %: " + ("met" if abs(agree) <= ENERGY_GOAL_PCT else "NOT met"),
        ),
        Figure("report FLOPs vs FlopCounterMode", _ratio(rep.get("flops"), flops * steps), "x"),
        Figure("report GFLOPS/W", rep.get("gflops_per_w"), "GFLOPS/W"),
        Figure("FlopCounterMode FLOPs / script joules", ours, "GFLOPS/W"),
        Figure("NVML writes the daemon attempted", len(daemon_writes(ctx)), "", "required: 0"),
        Figure("NVML writers guarded in the daemon", daemon_guarded(ctx), "", "required: > 0"),
    ]


def part_hotpath(ctx: Ctx) -> list[Figure]:
    ctx.need_gpu()
    import importlib.util

    torch = ctx.torch
    from torch import nn

    from greend.training.callback import GreenCallback

    spec = importlib.util.spec_from_file_location("bench_callback", BENCH / "bench_callback.py")
    assert spec is not None and spec.loader is not None
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    sock = start_daemon(ctx) if ctx.nvml is not None else ctx.tmp / "no-daemon.sock"
    hidden, batch = 192, 64
    lossf = nn.CrossEntropyLoss()
    xs = [torch.randn(batch, 256, device=ctx.device) for _ in range(8)]
    ys = [torch.randint(0, 10, (batch,), device=ctx.device) for _ in range(8)]
    twins = []
    for _ in range(3):
        m, _opt = bc.make_twin(hidden)
        m.to(ctx.device)
        twins.append((m, torch.optim.SGD(m.parameters(), lr=1e-3)))
    cuda = ctx.device.type == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = GreenCallback(job=f"device-check-hot-{os.getpid()}", model=twins[0][0], socket=sock)
    greend_dirs = [GREEND_DIR, str(Path(sys.modules["greend"].__file__ or GREEND_DIR).parent)]
    syncs = {"greend": 0, "workload": 0}
    first: dict[str, str] = {}

    def under_error_mode(fn: Callable[[], None]) -> None:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as e:
            if "synchroniz" not in str(e).lower() and "sync" not in str(e).lower():
                raise
            who = attribute_sync((f.filename for f in traceback.extract_tb(e.__traceback__)), greend_dirs)
            syncs[who] += 1
            first.setdefault(who, f"{e}".splitlines()[0][:200])
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)

    steps = 40 if ctx.tiny else 400
    bare = bc.NullCallback()
    for i in range(20):  # the workload alone must not synchronise, or the check is void
        under_error_mode(lambda i=i: bc.run_block(*twins[1], bare, lossf, xs[i % 8 :], ys[i % 8 :], batch, 1))
    workload_alone = syncs["workload"]
    # A sync error inside greend's own fail-open code would become a warning or a log line,
    # not an exception here: both are collected and counted as greend's.
    said: list[str] = []
    handler = _ListHandler(said)
    logging.getLogger("greend").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            under_error_mode(lambda i=i: bc.run_block(*twins[0], cb, lossf, xs[i % 8 :], ys[i % 8 :], batch, 1))
        ctx.sync()
    logging.getLogger("greend").removeHandler(handler)
    said += [str(w.message) for w in caught]
    swallowed = [m for m in said if "synchroniz" in m.lower()]
    syncs["greend"] += len(swallowed)
    if swallowed:
        first.setdefault("greend", swallowed[0][:200])
    # The per-step cost, as bench_callback measures it: thread CPU time, interleaved blocks.
    rounds = 4 if ctx.tiny else ctx.args.hot_rounds
    block = 20 if ctx.tiny else 150
    arms = {"bare": bare, "greend": cb, "control": bc.NullCallback()}
    per: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(rounds):
        if ctx.left_s() < 20:
            break
        order = names[r % 3 :] + names[: r % 3]
        for arm in order:
            twin = twins[(names.index(arm) + r) % 3]
            per[arm].append(bc.run_block(*twin, arms[arm], lossf, xs, ys, batch, block)[0])
    under_error_mode(cb.close)
    ctx.sync()
    n = len(per["bare"])
    g = bc.summary([a - b for a, b in zip(per["greend"], per["bare"], strict=True)]) if n >= 2 else None
    c = bc.summary([a - b for a, b in zip(per["control"], per["bare"], strict=True)]) if n >= 2 else None
    return [
        Figure("sync debug mode", "error" if cuda else "n/a (CPU run)"),
        Figure("syncs from greend", syncs["greend"] if cuda else None, "", first.get("greend", "goal: 0")),
        Figure("syncs from the workload alone", workload_alone if cuda else None, "", "must be 0 for the check"),
        Figure("steps checked", steps),
        Figure("daemon answering", cb.stats.connects > 0),
        Figure("bare step (thread CPU)", statistics.median(per["bare"]) * 1e6 if per["bare"] else None, "us"),
        Figure(
            "greend per step, median",
            g[0] if g else None,
            "us",
            f"[{g[3]:.2f}, {g[4]:.2f}] 95 % CI, {n} rounds of {block}" if g else "",
        ),
        Figure("A/A control per step, median", c[0] if c else None, "us"),
    ]


def part_precision(ctx: Ctx) -> list[Figure]:
    ctx.need_gpu()

    from greend.testing.fake_daemon import FakeDaemon
    from greend.training.callback import GreenCallback
    from greend.training.fp8 import warm_up_torchao

    model, opt, batch, shape = tiny_gpt(ctx)
    x, y = batch()
    flops = count_flops(ctx, model, x, y)
    warm_up_torchao()
    sock = ctx.tmp / "fake.sock"
    fake = FakeDaemon(sock).start()
    wanted = ["fp32", "bf16"] if ctx.tiny else ["fp32", "tf32", "bf16", "fp8"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cb = GreenCallback(
                job="device-check-precision",
                model=model,
                socket=sock,
                precisions=wanted,
                fp8_min_features=shape["d"],
                flops_per_step=flops,
                flush_interval_s=0.02,
                spike_tolerance=None,
                probe_every=None,  # each level's own steps only: no probe blocks at the level above
            )
        support = cb.supported_precisions()
        levels = [lvl for lvl in wanted if support.get(lvl) is None]
        per: dict[str, dict[str, list[float]]] = {lvl: {"s": [], "j": [], "n": []} for lvl in levels}
        window_s = 0.2 if ctx.tiny else ctx.args.window_s
        rounds = 2 if ctx.tiny else ctx.args.rounds
        for r in range(rounds):
            if r and ctx.left_s() < 15:
                break
            for level in levels[r % len(levels) :] + levels[: r % len(levels)]:
                fake.directive(level)
                t_wait = time.monotonic() + 5
                while cb.requested_precision != level and time.monotonic() < t_wait:
                    time.sleep(0.005)
                n, i, t0, e0 = 0, 0, 0.0, None
                while True:
                    if i == 2:  # two untimed steps after each switch
                        ctx.sync()
                        t0, e0 = time.monotonic(), ctx.energy_j()
                    with cb.step(samples=x.shape[0]) as st:
                        gpt_step(st, model, x, y, opt)
                    if st.precision != level:
                        raise RuntimeError(f"asked for {level}, the step ran at {st.precision}")
                    i += 1
                    n += i > 2
                    if i > 2 and i % 2 == 0:
                        ctx.sync()
                        if time.monotonic() - t0 >= window_s:
                            break
                e1 = ctx.energy_j()
                per[level]["s"].append((time.monotonic() - t0) / n)
                per[level]["n"].append(n)
                if e0 is not None and e1 is not None:
                    per[level]["j"].append((e1 - e0) / n)
        cb.close()
    finally:
        fake.stop()
    out: list[Figure] = [
        Figure(
            "model",
            f"GPT d={shape['d']} L={shape['layers']} seq={shape['seq']} "
            f"batch={shape['batch']}, {flops / 1e12:.3f} TFLOP a step",
        )
    ]
    measured: dict[str, dict[str, float]] = {}
    for lvl in levels:
        s = statistics.median(per[lvl]["s"])
        j = statistics.median(per[lvl]["j"]) if per[lvl]["j"] else None
        measured[lvl] = {"step_s": s, "energy_j": j, "power_w": j / s if j else None}  # type: ignore[dict-item]  # None: no energy
        out += [
            Figure(
                f"{lvl} step", s * 1e3, "ms", f"median of {len(per[lvl]['s'])} rounds, {sum(per[lvl]['n']):.0f} steps"
            ),
            Figure(f"{lvl} energy per step", j, "J"),
            Figure(f"{lvl} power", j / s if j else None, "W"),
            Figure(f"{lvl} GFLOPS/W", flops / j / 1e9 if j else None, "GFLOPS/W"),
        ]
    for lvl in wanted:
        if support.get(lvl) is not None:
            out.append(Figure(f"{lvl}", "not run", "", str(support[lvl])))
    ctx.results["precision"] = {"measured": measured, "flops": flops}
    return out


def part_sim(ctx: Ctx) -> list[Figure]:
    from greend.probes.sim import H100

    got = ctx.results.get("precision")
    flops = got["flops"] if got else 1e12
    sim = {}
    for lvl in ("fp32", "tf32", "bf16", "fp8"):
        c = H100.step_cost(flops, MEM_SHARE, lvl)
        sim[lvl] = {"step_s": c.duration_s, "energy_j": c.energy_j, "power_w": c.power_w}
    rows = ratio_rows(got["measured"] if got else {}, sim)
    figs = [
        Figure(
            r["ratio"],
            r["gpu"],
            "x",
            f"sim {r['sim']:.3f}x" + (f", sim/gpu {r['sim_over_gpu']:.2f}" if r["sim_over_gpu"] else ""),
        )
        for r in rows
    ]
    if got and "fp32" in got["measured"]:
        m = got["measured"]["fp32"]
        figs.append(
            Figure("fp32 step, sim/gpu", _ratio(sim["fp32"]["step_s"], m["step_s"]), "x", f"sim mfu {H100.mfu}")
        )
    if not got:
        why = ctx.results.get("precision_why", "the precision part did not run")
        raise SkipWith(f"no GPU figures to compare ({why}); the sim's side is printed", figs)
    return figs


class SkipWith(Skip):
    """Skipped, with the figures that could still be given."""

    def __init__(self, why: str, figures: list[Figure]) -> None:
        super().__init__(why)
        self.figures = figures


PART_FNS: dict[str, Callable[[Ctx], list[Figure]]] = {
    "nvml": part_nvml,
    "daemon": part_daemon,
    "hotpath": part_hotpath,
    "precision": part_precision,
    "sim": part_sim,
}


# ---------------------------------------------------------------- main


def run_part(ctx: Ctx, name: str) -> dict[str, Any]:
    t0 = time.monotonic()
    figs: list[Figure] = []
    if ctx.left_s() <= 5:
        status, why = "skipped", f"the time budget ({ctx.args.budget_s:g} s) is spent"
    else:
        try:
            figs = PART_FNS[name](ctx)
            status, why = "ok", ""
        except SkipWith as e:
            status, why, figs = "skipped", str(e), e.figures
        except Skip as e:
            status, why = "skipped", str(e)
        except Exception as e:  # one part's failure is reported; the others still run
            status, why = "failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
    if name == "precision" and status != "ok":
        ctx.results["precision_why"] = why.splitlines()[0] if why else status
    return {
        "status": status,
        "why": why,
        "seconds": round(time.monotonic() - t0, 2),
        "figures": {f.name: {"value": f.value, "unit": f.unit, "note": f.note} for f in figs},
    }


def fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


def print_table(report: dict[str, Any]) -> None:
    gpu = report["gpu"]
    print(
        f"device check {report['date']}  host {report['host']}  "
        + (f"GPU {gpu['name']} (driver {gpu['driver']})" if gpu else "no GPU")
    )
    print(f"{'part':<10}{'figure':<42}{'value':>14}  {'unit':<9}note")
    for name, p in report["parts"].items():
        if p["status"] != "ok":
            print(f"{name:<10}{p['status'].upper()}: {p['why'].splitlines()[0] if p['why'] else ''}")
        for fig, f in p["figures"].items():
            print(f"{name:<10}{fig:<42}{fmt(f['value']):>14}  {f['unit']:<9}{f['note']}")
    ro = report["read_only"]
    print(f"read-only: NVML writes refused {ro['writes_refused']}, settings changed {ro['settings_changed'] or 'none'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="device-check.json", help="where the figures go as JSON")
    ap.add_argument("--budget-s", type=float, default=270.0, help="the whole run's time budget (default 270)")
    ap.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    ap.add_argument("--nvml-window-s", type=float, default=12.0, help="the nvml part's measured window")
    ap.add_argument("--job-s", type=float, default=25.0, help="the daemon part's training job length")
    ap.add_argument("--hot-rounds", type=int, default=12, help="hotpath: rounds of three blocks")
    ap.add_argument("--rounds", type=int, default=4, help="precision: rounds over the levels")
    ap.add_argument("--window-s", type=float, default=1.5, help="precision: seconds a level runs per round")
    ap.add_argument("--force-cpu", action="store_true", help="run the torch parts on the CPU, tiny (a test)")
    args = ap.parse_args(argv)
    args.gpt = {"d": 1024, "layers": 6, "heads": 16, "seq": 1024, "batch": 16, "vocab": 8192}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        ctx = Ctx(args=args, deadline=start + args.budget_s, tmp=Path(tmp))
        setup(ctx)
        before = gpu_settings(ctx) if ctx.nvml else {}
        parts: dict[str, Any] = {}
        try:
            for name in args.only or PARTS:
                parts[name] = run_part(ctx, name)
                print(f"[{time.monotonic() - start:6.1f} s] {name}: {parts[name]['status']}", file=sys.stderr)
        finally:
            writes = daemon_writes(ctx)
            stop_daemon(ctx)
        after = gpu_settings(ctx) if ctx.nvml else {}
    changed = settings_diff(before, after)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": getattr(ctx.torch, "__version__", None),
        "gpu": ctx.gpu or None,
        "no_gpu": None if ctx.device is not None else ctx.no_device,
        "budget_s": args.budget_s,
        "seconds": round(time.monotonic() - start, 1),
        "parts": parts,
        "read_only": {"writes_refused": ATTEMPTS + writes, "settings_before": before, "settings_changed": changed},
    }
    Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    print(f"JSON: {args.json}  ({report['seconds']} s)")
    if changed or ATTEMPTS or writes:
        print("A GPU SETTING CHANGED OR A WRITE WAS ATTEMPTED: see read_only in the JSON", file=sys.stderr)
        return 2
    return 1 if any(p["status"] == "failed" for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
