"""What GreenCallback costs the training thread: all of it, in the README's usage.

Run:  python bench/bench_callback.py [--rounds 300] [--block 32] [--rounds-10ms 60]
      [--block-10ms 16] [--attribute] [--floor]

A real torch training step (an MLP: forward, cross-entropy, backward, AdamW,
``torch.set_num_threads(1)``) runs in the README's usage::

    with cb.step(batch=x) as step:
        with step.autocast():
            loss = lossf(model(x), y)
        step.loss(loss)
        loss.backward(); opt.step(); opt.zero_grad()

beside the same loop with a do-nothing wrapper of the same shape (an object with
``step()``, ``__enter__``/``__exit__``, ``autocast()`` and ``loss()`` that do nothing
but what the job's own loop does at its precision: a new ``torch.autocast`` every
step for a bf16 job), on one model and optimizer that every arm trains. The design
resolves a few microseconds on a noisy shared machine:

* many short blocks (``--block`` steps, a multiple of greend's 16-step batch so each
  block holds the same share of its batched work), each timed by the training
  thread's CPU time (``time.thread_time``): the whole step, the loss and whatever
  greend keeps alive included (its freeing, its batched reads, the garbage
  collections its objects cause);
* a round runs three adjacent blocks: the bare loop, greend's, and a second bare
  loop (the A/A control: the instrument's reading when nothing differs), in an
  order that cycles through all six so no arm holds a position;
* per round, the paired differences greend - bare and control - bare (adjacent
  blocks share the machine's state, so slow drift and other processes' load
  cancel); printed as the median over rounds with a bootstrap 95 % interval, and
  the mean (what a user pays on average, rare collections included) with its own.

On a ~1 ms and a ~10 ms step, a bf16 job (the ``initial_precision="bf16"`` user's
``step.autocast()``) and an fp32 one, with a real ``greend run --sim 1`` answering
and with no daemon at all (fail-open). The sender thread's own CPU time (the
socket, booking the handed-over steps, summing rows) is not the training thread's and
is printed apart, with the
garbage collections per 1000 steps in greend's blocks and the bare loop's.

The whole process's CPU time (``time.process_time``: the training thread and greend's
sender thread together) is taken over the same blocks and printed the same way, so that
what the sender thread does for the training thread is counted too; and the loop's
wall-clock time (``time.perf_counter``: what the job's throughput pays, the sender
thread's hold on the GIL included).

``--attribute`` adds, on the ~1 ms bf16 step without a daemon, the same design with
one greend call switched on at a time (``cb.step()`` alone, then with
``step.autocast()``, then with ``step.loss()``) and a table of each call alone in a
warm loop: where the microseconds go. ``--floor`` puts a minimal step wrapper in the
A/A arm's place.

Target: <= 5 us a step at the median on the ~1 ms step, with the daemon answering.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (step name, hidden width, batch, the job's own precision): ~1 ms and ~10 ms steps on
# one core of the build VM. A bf16 job runs the model under autocast: its own loop
# enters torch.autocast every step; greend's step.autocast() does it instead.
SIZES = (
    ("~1 ms", 192, 64, "bf16"),
    ("~1 ms", 192, 64, "fp32"),
    ("~10 ms", 896, 128, "bf16"),
    ("~10 ms", 896, 128, "fp32"),
)
ARMS = ("bare", "greend", "control")
# The six orders of three arms: round r runs ORDERS[r % 6], so each arm holds each
# position equally often.
ORDERS = tuple(itertools.permutations(range(3)))


class NullStep:
    """The do-nothing step: the same calls as greend's, doing nothing but what the job's
    own loop does at its precision (a new ``torch.autocast`` every step for bf16)."""

    __slots__ = ("_bf16",)
    _null = nullcontext()

    def __init__(self, bf16: bool = False) -> None:
        self._bf16 = bf16

    def __enter__(self) -> NullStep:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def autocast(self) -> Any:
        if self._bf16:
            import torch

            return torch.autocast("cpu", dtype=torch.bfloat16)
        return self._null

    def loss(self, loss: Any) -> None:
        pass


class NullCallback:
    """The do-nothing callback: ``step()`` takes the same arguments and returns a NullStep."""

    def __init__(self, bf16: bool = False) -> None:
        self._step = NullStep(bf16)

    def step(self, *, samples: int | None = None, batch: Any = None) -> NullStep:
        return self._step

    def close(self) -> None:
        pass


class FloorStep:
    """A minimal step wrapper that does what any per-step instrument must: two clock
    reads, the batch's shape looked up in a dict, the loss's value taken, one tuple kept."""

    __slots__ = ("_cb", "_samples", "_key", "_t0", "_loss", "_bf16")

    def __init__(self, cb: FloorCallback, samples: int | None, key: Any, bf16: bool) -> None:
        self._cb, self._samples, self._key, self._loss, self._bf16 = cb, samples, key, None, bf16

    def __enter__(self) -> FloorStep:
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> bool:
        cb = self._cb
        cb.rows.append((self._t0, time.monotonic(), cb.flops.get(self._key), self._samples, self._loss))
        return False

    def autocast(self) -> Any:
        return NullStep(self._bf16).autocast()

    def loss(self, loss: Any) -> None:
        self._loss = float(loss.item())


class FloorCallback:
    """``--floor``: the minimal wrapper in the control arm's place (what is left once greend
    does nothing a minimal Python instrument would not)."""

    def __init__(self, bf16: bool = False) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.flops: dict[Any, float] = {}
        self._bf16 = bf16

    def step(self, *, samples: int | None = None, batch: Any = None) -> FloorStep:
        if len(self.rows) > 1000:
            self.rows = []
        shape = batch.shape if batch is not None else None
        rows = samples if samples is not None or not shape else shape[0]  # (the batch's rows, as greend)
        return FloorStep(self, rows, shape, self._bf16)

    def close(self) -> None:
        pass


def make_twin(hidden: int) -> tuple[Any, Any]:
    """An MLP and its AdamW, the same weights every time."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def run_block(
    model: Any, opt: Any, cb: Any, lossf: Any, xs: list[Any], ys: list[Any], batch: int, n: int
) -> tuple[float, float, float]:
    """n steps in the README's usage; the training thread's CPU seconds per step, the
    whole process's (greend's sender thread included), and the loop's wall-clock seconds
    per step (what the job's throughput pays: the sender thread's hold on the GIL, too)."""
    w0 = time.perf_counter()
    p0 = time.process_time()
    t0 = time.thread_time()
    for i in range(n):
        x, y = xs[i & 7], ys[i & 7]
        with cb.step(batch=x) as step:
            with step.autocast():
                loss = lossf(model(x), y)
            step.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    del loss
    t1 = time.thread_time()
    return (t1 - t0) / n, (time.process_time() - p0) / n, (time.perf_counter() - w0) / n


def run_rounds(
    model: Any,
    opt: Any,
    wrappers: list[Any],
    lossf: Any,
    xs: list[Any],
    ys: list[Any],
    batch: int,
    block: int,
    rounds: int,
    process: list[list[float]] | None = None,
    wall: list[list[float]] | None = None,
) -> tuple[list[list[float]], list[int]]:
    """``rounds`` rounds of one block per wrapper, adjacent, in orders that cycle through
    every permutation (three wrappers) or rotate (more). Per wrapper: its blocks' CPU
    seconds a step (the training thread's), round by round (the whole process's into
    ``process``, its wall-clock into ``wall``, where given); and its garbage collections
    (all generations)."""
    n = len(wrappers)
    orders = ORDERS if n == 3 else tuple(tuple(range(k, n)) + tuple(range(k)) for k in range(n))
    per: list[list[float]] = [[] for _ in wrappers]
    collections = [0] * n
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            gc0 = sum(s["collections"] for s in gc.get_stats())
            thread_s, process_s, wall_s = run_block(model, opt, wrappers[i], lossf, xs, ys, batch, block)
            per[i].append(thread_s)
            if process is not None:
                process[i].append(process_s)
            if wall is not None:
                wall[i].append(wall_s)
            collections[i] += sum(s["collections"] for s in gc.get_stats()) - gc0
    return per, collections


def data(batch: int) -> tuple[list[Any], list[Any]]:
    import torch

    torch.manual_seed(1)
    return [torch.randn(batch, 256) for _ in range(8)], [torch.randint(0, 10, (batch,)) for _ in range(8)]


def worker(args: argparse.Namespace) -> None:
    """One configuration (the daemon, or none): prints JSON."""
    import torch
    from torch import nn

    from greend.training.callback import GreenCallback

    torch.set_num_threads(1)
    if args.gpu_path:
        gpu_path()
    lossf = nn.CrossEntropyLoss()
    out: dict[str, Any] = {"sizes": [], "warm": None}
    socket, fake = args.socket, None
    if args.below:  # a daemon that asks for bf16 when told (a test double on a real socket)
        from greend.testing.fake_daemon import FakeDaemon

        # (a tolerance no penalty reaches: the guard and the probes run, and never roll back
        # this job, which overfits its eight batches to a loss floor where bf16 shows)
        fake = FakeDaemon(Path(tempfile.mkdtemp()) / "fake.sock", rows_every_s=0.5, precision_tolerance=10.0).start()
        socket = str(fake.path)
    for name, hidden, batch, precision in SIZES:
        if args.below and precision != "fp32":
            continue  # (a bf16 job's level below is fp8, which the CPU only emulates, 10x slower)
        rounds = args.rounds if name == "~1 ms" else args.rounds_10ms
        block = args.block if name == "~1 ms" else args.block_10ms
        xs, ys = data(batch)
        # One model and optimizer for every arm: twin models run a few us a step apart
        # (where their tensors lie in memory), as much as the figure sought.
        model, opt = make_twin(hidden)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no daemon: the one fail-open warning
            job = f"bench-{hidden}-{precision}"
            cb = GreenCallback(job=job, model=model, socket=socket, initial_precision=precision)
        bf16 = precision == "bf16" or fake is not None  # (below: the bare loops run the level greend runs)
        control = FloorCallback(bf16) if args.floor else NullCallback(bf16)
        wrappers = [NullCallback(bf16), cb, control]
        sender = next(t for t in threading.enumerate() if t.name == f"greend-sender-{job}")
        run_rounds(model, opt, wrappers, lossf, xs, ys, batch, block, 4)  # warm-up (greend counts FLOPs here)
        if fake is not None:
            go_below(fake, cb, model, opt, lossf, xs, ys, batch, block)
            precision = "bf16<"
        att = attribute(model, opt, cb, wrappers[0], lossf, xs, ys, batch, block, max(8, rounds // 8))
        hooks = len(model._forward_pre_hooks) + len(model._forward_hooks)  # what greend left on the model
        sender_cpu0 = _thread_cpu_s(sender)
        t_wall0 = time.monotonic()
        process: list[list[float]] = [[] for _ in wrappers]
        walls: list[list[float]] = [[] for _ in wrappers]
        per, collections = run_rounds(model, opt, wrappers, lossf, xs, ys, batch, block, rounds, process, walls)
        wall = time.monotonic() - t_wall0
        sender_cpu = _thread_cpu_s(sender) - sender_cpu0
        cb.close()
        bare, greend, ctrl = per
        steps = rounds * block
        out["sizes"].append(
            {
                "name": name,
                "precision": precision,
                "block": block,
                "step_ms": statistics.median(bare) * 1e3,
                "greend": [g - b for g, b in zip(greend, bare, strict=True)],
                "control": [c - b for c, b in zip(ctrl, bare, strict=True)],
                "process_greend": [g - b for g, b in zip(process[1], process[0], strict=True)],
                "process_control": [c - b for c, b in zip(process[2], process[0], strict=True)],
                "wall_greend": [g - b for g, b in zip(walls[1], walls[0], strict=True)],
                "wall_control": [c - b for c, b in zip(walls[2], walls[0], strict=True)],
                "gc_per_1k": [c * 1000 / steps for c in collections],
                "hooks_left": hooks,
                "attribution": att,
                "connected": cb.stats.connects > 0,
                "level_at_end": cb.precision,
                "sender_us_per_step": sender_cpu / max(1, steps) * 1e6 if sender_cpu >= 0 else None,
                "sender_share": sender_cpu / wall if sender_cpu >= 0 else None,
            }
        )
    if args.attribute:
        out["warm"] = warm_calls(args)
    print(json.dumps(out))


def go_below(fake: Any, cb: Any, model: Any, opt: Any, lossf: Any, xs: Any, ys: Any, batch: int, block: int) -> None:
    """--below: the daemon asks the fp32 job for bf16; steps until greend has switched it
    (after its trial), so the blocks timed run below the job's own level, the guard armed
    and the probes on."""
    assert fake.directive("bf16") == 1
    for _ in range(400):
        run_rounds(model, opt, [cb], lossf, xs, ys, batch, block, 1)
        if cb._control.level == "bf16" and cb._control.guard.stack:
            return
    raise SystemExit(f"--below: the job never went down to bf16 (it runs {cb._control.level})")


def gpu_path() -> None:
    """--gpu-path: greend treats the CPU losses as it treats a GPU's (greend's own code as on a
    GPU; the torch ops it issues run on the CPU, without a launch or a device copy)."""
    import torch

    from greend.training.loss_reader import LossReader
    from greend.training.step import Step

    def loss(self: Any, value: Any) -> None:  # Step.loss's branch for a tensor not on the CPU
        self._raw = value
        self._host.held = True

    Step.loss = loss  # type: ignore[method-assign]  # (this benchmark's process only)
    LossReader.batched = lambda self, value: type(value) is torch.Tensor  # type: ignore[method-assign]  # (ditto)


REGIONS = ("cb.step() + __enter__", "step.autocast() enter + exit", "step.loss()", "__exit__ (batched judging)")


def run_timed(
    model: Any, opt: Any, cb: Any, lossf: Any, xs: list[Any], ys: list[Any], batch: int, n: int, sums: list[int]
) -> None:
    """n steps of the README's usage with each of the wrapper's calls timed inside the real
    step (the training thread's CPU ns), added to ``sums`` region by region (the last:
    steps): what greend's own code costs where it runs, caches cold after torch's work.
    The clock's own cost is the same in the bare loop's run and cancels."""
    clock = time.thread_time_ns
    for i in range(n):
        x, y = xs[i & 7], ys[i & 7]
        t0 = clock()
        step = cb.step(batch=x)
        step.__enter__()
        t1 = clock()
        ac = step.autocast()
        ac.__enter__()
        t2 = clock()
        loss = lossf(model(x), y)
        t3 = clock()
        ac.__exit__(None, None, None)
        t4 = clock()
        step.loss(loss)
        t5 = clock()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t6 = clock()
        step.__exit__(None, None, None)
        t7 = clock()
        sums[0] += t1 - t0
        sums[1] += t2 - t1 + t4 - t3
        sums[2] += t5 - t4
        sums[3] += t7 - t6
        sums[4] += 1


class GcClock:
    """The training thread's CPU time inside garbage collections (gc.callbacks)."""

    def __init__(self) -> None:
        self.ns = 0
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.thread_time_ns()
        else:
            self.ns += time.thread_time_ns() - self._t0


def attribute(model: Any, opt: Any, cb: Any, bare: Any, lossf: Any, xs: list[Any], ys: list[Any], batch: int,
              block: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    """greend's calls and the bare loop's, each timed inside real steps, in alternating
    blocks; and the CPU time each spends in garbage collections. Per step, us."""
    sums = {"greend": [0] * 5, "bare": [0] * 5}
    gc_ns = {"greend": 0, "bare": 0}
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        for r in range(rounds):
            for arm in ("greend", "bare") if r % 2 else ("bare", "greend"):
                ns0 = clock.ns
                run_timed(model, opt, cb if arm == "greend" else bare, lossf, xs, ys, batch, block, sums[arm])
                gc_ns[arm] += clock.ns - ns0
    finally:
        gc.callbacks.remove(clock)
    steps = rounds * block
    g, b = sums["greend"], sums["bare"]
    regions = [g[k] / max(1, g[4]) / 1e3 - b[k] / max(1, b[4]) / 1e3 for k in range(4)]
    return {
        "regions": regions,
        "calls": sum(regions),
        "gc_us": (gc_ns["greend"] - gc_ns["bare"]) / steps / 1e3,
        "steps": steps,
    }


def warm_calls(args: argparse.Namespace) -> list[tuple[str, float]]:
    """Each greend call alone in a tight loop (caches warm: a floor, not what a step pays)."""
    import torch

    from greend.training.callback import GreenCallback

    model, _ = make_twin(192)
    x = torch.randn(64, 256)
    loss = torch.tensor(2.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = GreenCallback(job="bench-warm", model=model, socket=args.socket, initial_precision="bf16")
    with cb.step(batch=x):
        model(x)
    n = 20000
    own = torch.autocast

    def per_call(loop: Any) -> float:
        best = math.inf
        for _ in range(5):
            t0 = time.thread_time_ns()
            loop()
            best = min(best, (time.thread_time_ns() - t0) / n / 1e3)
        return best

    def empty() -> None:
        for _ in range(n):
            pass

    def step_only() -> None:
        for _ in range(n):
            with cb.step(batch=x):
                pass

    held = cb.step(batch=x)

    def autocast_only() -> None:
        for _ in range(n):
            with held.autocast():
                pass

    def own_autocast() -> None:
        for _ in range(n):
            with own("cpu", dtype=torch.bfloat16):
                pass

    def loss_only() -> None:
        for _ in range(n):
            held.loss(loss)

    def whole() -> None:
        for _ in range(n):
            with cb.step(batch=x) as step:
                with step.autocast():
                    pass
                step.loss(loss)

    with held:
        rows = [
            ("empty loop", per_call(empty)),
            ("step.autocast() enter/exit (bf16)", per_call(autocast_only)),
            ("torch.autocast('cpu', bf16) enter/exit (the job's own)", per_call(own_autocast)),
            ("step.loss(cpu tensor)", per_call(loss_only)),
        ]
    rows[1:1] = [("cb.step() + enter/exit, batched judging included", per_call(step_only))]
    rows.append(("the whole usage, no torch work", per_call(whole)))
    cb.close()
    return rows


def _thread_cpu_s(thread: threading.Thread) -> float:
    """Another thread's CPU seconds so far, or -1 where the platform cannot tell."""
    try:
        assert thread.ident is not None
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, AssertionError):
        return -1.0


def summary(diffs: list[float]) -> tuple[float, float, float, float, float]:
    """(median, p25, p75, bootstrap 95 % low, high) of per-round differences, in us."""
    us = [d * 1e6 for d in diffs]
    q = statistics.quantiles(us, n=4)
    low, high = bootstrap(us, statistics.median)
    return statistics.median(us), q[0], q[2], low, high


def mean_summary(diffs: list[float]) -> tuple[float, float, float]:
    """(mean, bootstrap 95 % low, high) of per-round differences, in us."""
    us = [d * 1e6 for d in diffs]
    low, high = bootstrap(us, statistics.fmean)
    return statistics.fmean(us), low, high


def bootstrap(us: list[float], stat: Any, n: int = 2000) -> tuple[float, float]:
    """The 95 % percentile bootstrap interval of ``stat`` over ``us``."""
    rng = random.Random(0)
    boots = sorted(stat(rng.choices(us, k=len(us))) for _ in range(n))
    return boots[int(n * 0.025)], boots[int(n * 0.975) - 1]


def start_daemon(tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A real ``greend run --sim 1`` on a temp socket and state dir."""
    from greend.testing.daemon_proc import daemon_command, wait_until_up

    sock, cfg, log = tmp / "greend.sock", tmp / "greend.toml", tmp / "greend.log"
    cfg.write_text('[daemon]\nsocket_group = ""\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            daemon_command(cfg, sock, tmp / "state", "--sim", "1", "--sim-dir", str(tmp / "sim")),
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )
    wait_until_up(proc, sock, log, timeout_s=60)
    return proc, sock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="rounds of three blocks on the ~1 ms step")
    ap.add_argument("--block", type=int, default=32, help="steps per block on the ~1 ms step")
    ap.add_argument("--rounds-10ms", type=int, default=60, help="rounds on the ~10 ms step")
    ap.add_argument("--block-10ms", type=int, default=16, help="steps per block on the ~10 ms step")
    ap.add_argument("--floor", action="store_true", help="a minimal step wrapper in the A/A arm's place")
    ap.add_argument("--attribute", action="store_true", help="each greend call alone in a warm loop, too")
    ap.add_argument(
        "--gpu-path",
        action="store_true",
        help="greend takes each CPU loss down a GPU loss's path (held, its batch stacked and copied in one go, "
        "booked once landed); CPU ops stand in for the GPU's: no kernel launches, no device copy",
    )
    ap.add_argument(
        "--below",
        action="store_true",
        help="the fp32 jobs taken down to bf16 by a daemon's directive (a test double answers instead of greend): "
        "the guard armed and the probes on, against bare loops at bf16",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    import torch

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, one torch thread")
    passed = ["--rounds", str(a.rounds), "--block", str(a.block)]
    passed += ["--rounds-10ms", str(a.rounds_10ms), "--block-10ms", str(a.block_10ms)]
    passed += ["--floor"] if a.floor else []
    passed += ["--gpu-path"] if a.gpu_path else []
    passed += ["--below"] if a.below else []
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(Path(tmp))
        rows: list[tuple[str, dict[str, Any]]] = []
        try:
            configs = (("greend --sim 1", sock), ("none", Path(tmp) / "absent.sock"))
            if a.below:
                configs = (("test double", Path(tmp) / "unused.sock"),)  # (the worker starts it)
            for daemon, path in configs:
                extra = ["--attribute"] if a.attribute and daemon == "none" else []
                child = subprocess.run(
                    [sys.executable, __file__, "--worker", "--socket", str(path), *passed, *extra],
                    capture_output=True,
                    text=True,
                )
                if child.returncode != 0:
                    raise SystemExit(child.stderr[-3000:])
                rows.append((daemon, json.loads(child.stdout.strip().splitlines()[-1])))
        finally:
            proc.terminate()
            proc.wait(20)
    report(a, rows)


def report(a: argparse.Namespace, rows: list[tuple[str, dict[str, Any]]]) -> None:
    """The tables."""
    arm = "floor: a minimal step wrapper" if a.floor else "A/A: a second bare loop"
    print(
        "\ntraining thread's CPU time a step, greend's block less the adjacent bare block (us; median over"
        f" rounds of {a.block}-step blocks ({a.block_10ms} on ~10 ms) with its bootstrap 95 % interval; the"
        f" mean with its own); {arm} in greend's place"
    )
    if a.gpu_path:
        print("--gpu-path: each loss taken down a GPU loss's path in greend (CPU ops stand in for the GPU's)")
    control = "floor" if a.floor else "A/A"
    head = f"{'daemon':<15}{'step':<7}{'level':<6}{'ms':>6}{'rounds':>7}"
    head += f"{'greend':>9}{'95 % CI':>17}{'mean':>8}{'95 % CI':>17}{control:>8}{'95 % CI':>17}{'mean':>8}"
    head += f"{'gc/1k g|b':>11}{'sender us':>10}"
    print(head)
    for daemon, res in rows:
        for s in res["sizes"]:
            g, c = summary(s["greend"]), summary(s["control"])
            gm, cm = mean_summary(s["greend"]), mean_summary(s["control"])
            sender = s["sender_us_per_step"]
            gcs = s["gc_per_1k"]
            print(
                f"{daemon:<15}{s['name']:<7}{s['precision']:<6}{s['step_ms']:6.2f}{len(s['greend']):7d}"
                f"{g[0]:9.2f}{f'[{g[3]:.2f}, {g[4]:.2f}]':>17}{gm[0]:8.2f}{f'[{gm[1]:.2f}, {gm[2]:.2f}]':>17}"
                f"{c[0]:8.2f}{f'[{c[3]:.2f}, {c[4]:.2f}]':>17}{cm[0]:8.2f}"
                f"{f'{gcs[1]:.1f}|{gcs[0]:.1f}':>11}"
                f"{(f'{sender:.2f}' if sender is not None else '-'):>10}"
            )
            if s["level_at_end"] != s["precision"].rstrip("<"):
                print(
                    f"   (greend's loop ended at {s['level_at_end']}, not the job's {s['precision']}: not comparable)"
                )
            if daemon != "none" and not s["connected"]:
                print("   (the callback never reached the daemon: this row is not the daemon-answering case)")
            if s["hooks_left"]:
                print(f"   ({s['hooks_left']} hook(s) left on the model after the first steps)")
    print(
        "(gc/1k g|b: garbage collections per 1000 steps in greend's blocks | the bare loop's; sender us: the"
        " sender thread's own CPU a step, not the training thread's; target <= 5 us on ~1 ms)"
    )
    if a.below:
        print("(bf16<: an fp32 job greend took down to bf16, the guard armed and the probes on; bare loops at bf16)")
    print(
        "\nwhere it goes: greend's calls timed inside the real steps, less the bare loop's same calls (us a step,"
        " means; gc: CPU time in garbage collections, greend's blocks less the bare loop's)"
    )
    print(f"{'daemon':<15}{'step':<7}{'level':<6}{'steps':>7}" + "".join(f"{r:>30}" for r in REGIONS)
          + f"{'calls':>8}{'gc':>7}")  # fmt: skip
    for daemon, res in rows:
        for s in res["sizes"]:
            at = s["attribution"]
            print(f"{daemon:<15}{s['name']:<7}{s['precision']:<6}{at['steps']:7d}"
                  + "".join(f"{v:30.2f}" for v in at["regions"]) + f"{at['calls']:8.2f}{at['gc_us']:7.2f}")  # fmt: skip
    for _daemon, res in rows:
        warm = res.get("warm")
        if warm:
            print("\neach call alone, in a warm loop (best of 5 x 20000; a floor: in a real step caches are cold)")
            for label, us in warm:
                print(f"  {label:<58}{us:7.2f} us")

    tables = (
        (
            "process",
            "the whole process's CPU time a step (the training thread and greend's sender thread: its socket, its"
            " booking, the held losses it reads and frees)",
        ),
        (
            "wall",
            "the training loop's wall-clock time a step (what the job's throughput pays, the sender thread's hold"
            " on the GIL included; on this 2-core machine the daemon's and the sender's CPU share the cores too)",
        ),
    )
    for key, what in tables:
        print(
            f"\n{what}, greend's block less the adjacent bare block, in the same rounds (us; median with its"
            " bootstrap 95 % interval, the mean)"
        )
        head = f"{'daemon':<15}{'step':<7}{'level':<6}{'greend':>9}{'95 % CI':>17}{'mean':>8}"
        print(head + f"{control:>8}{'95 % CI':>17}")
        for daemon, res in rows:
            for s in res["sizes"]:
                g, c = summary(s[f"{key}_greend"]), summary(s[f"{key}_control"])
                gm = mean_summary(s[f"{key}_greend"])
                print(
                    f"{daemon:<15}{s['name']:<7}{s['precision']:<6}{g[0]:9.2f}{f'[{g[3]:.2f}, {g[4]:.2f}]':>17}"
                    f"{gm[0]:8.2f}{c[0]:8.2f}{f'[{c[3]:.2f}, {c[4]:.2f}]':>17}"
                )


if __name__ == "__main__":
    main()
