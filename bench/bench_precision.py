"""Step time and energy per step at every precision level this machine runs, side by side.

Run:  python bench/bench_precision.py [--rounds 8] [--steps 12] [--width 512] [--batch 128]
      [--guard-only] [--seeds 3]

One MLP (width -> 2*width -> width -> 16), trained through GreenCallback against
a fake daemon that switches the level between steps (the real switch path:
autocast dtypes, the fp8 conversion, the GradScaler). The levels are interleaved:
``--rounds`` rounds, each running every level for ``--steps`` timed steps (after two
untimed steps at the level), in an order rotated each round, so drift of the machine
(other load, clocks, caches) falls on every level alike. Per level it prints:

* ``step ms``: median wall time of a training step here over all rounds (measured),
  and the ratio to fp32 with its range over the rounds (each round's median against
  the same round's fp32): how repeatable the ratio is;
* ``sim J/step``: the simulated H100's energy for a step of the counted FLOPs
  at that level (``greend.probes.sim``: the model the daemon prices steps with on
  ``--sim`` GPUs), labelled sim; fp8-emulated runs at bf16's rate there;
* ``gpu J/step``: on a CUDA GPU, measured: the NVML total-energy counter's
  delta over the timed steps (mJ, Volta and newer; run enough ``--steps`` to
  span a second or more, the counter updates every 20-100 ms), else n/a;
* ``cpu J/step``: the CPU package energy per step from RAPL, where readable
  (``/sys/class/powercap``; root-only since Linux 5.10), else n/a.

Levels this machine cannot run are listed with the reason. fp8-emulated is
offered because this benchmark lists it (never on a real run by default).

Then, unless ``--no-workloads``, real trainings under the daemon's precision policy
(``greend run --sim 1``, the policy's defaults): for each workload of
``tests/scripts/precision_trainer.py`` (a regression, a 10-class classifier with 5 %
label noise at batch 32, a recommender with a 3.8 % click rate at batch 256, and a
regression with targets near 16 where bf16 costs a few percent, without and with a
reference batch), the step at which greend switched it to bf16, any rollback, its
held-out loss at the end and its training loss over the last 300 steps, both against
the same training's fp32 twin (the same seed, without greend). Then the accuracy
guard's cases, ``--seeds`` (3) runs each (``--guard-only``: these alone; ``--only``:
some of them): a noiseless regression whose loss falls as a long power law toward 1e-4
near targets of 5 (3000 steps; bf16's rounding of the outputs, 1/32, is a penalty that
grows as it converges), a sensor regression with an unnormalised target near 72 (bf16
rounds to 0.5: +7 % under its noise), a recommender whose click rate moves from ~2.5 %
to ~4.5 % 150 steps after the switch (the twin sees the same shift at the same step: a
change in the data, no penalty), and two noisy harmless jobs (a classifier with label
noise at batch 32, a recommender with a 3.8 % click rate); with the daemon's saving
(sim), every rollback's reason (its evidence), and the steps run at the level above for
the probes (``greend.training.probe``), in % of the steps after the switch.

On CPUs without native bf16 (no AVX512-BF16/AMX) bf16 and fp16 autocast are far
slower than fp32 (on the 2-core build VM: ~50x for a 1024-wide MLP); the sim
column is what the same step costs on an H100.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from greend.ipc.client import Client  # noqa: E402
from greend.probes.sim import H100  # noqa: E402
from greend.testing.daemon_proc import PRECISION_SIM_CONFIG, running_daemon  # noqa: E402
from greend.testing.fake_daemon import FakeDaemon  # noqa: E402
from greend.training.callback import GreenCallback  # noqa: E402
from greend.training.fp8 import warm_up_torchao  # noqa: E402
from greend.training.mixed_precision import PRECISIONS  # noqa: E402

MEM_SHARE = 0.3


def rapl_uj() -> int | None:
    p = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
    try:
        return int(p.read_text())
    except (OSError, ValueError):
        return None


class NvmlEnergy:
    """The GPU's NVML total-energy counter (mJ) for the CUDA device the model is on, or
    nothing where there is no GPU, no driver, or no counter (read-only: sets nothing)."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        self.why = "no CUDA device"
        if device.type != "cuda":
            return
        try:
            import os

            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:  # torch's index is into the visible list; NVML's is the node's
                index = int(visible.split(",")[index])
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # NOT_SUPPORTED before Volta
            self.handle, self.nvml = handle, pynvml
        except Exception as e:
            self.why = f"NVML energy counter unavailable: {e}"

    def mj(self) -> int | None:
        if self.handle is None:
            return None
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per level per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after each switch")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--no-workloads", dest="workloads", action="store_false", help="skip the real trainings")
    ap.add_argument("--workload-steps", type=int, default=1200)
    ap.add_argument(
        "--guard-only",
        action="store_true",
        help="only the accuracy guard's cases (a penalty near a loss floor, an unnormalised target, a "
        "benign shift in a noisy job, two noisy harmless jobs), --seeds runs each",
    )
    ap.add_argument("--seeds", type=int, default=3, help="runs (seeds) of each of the guard's hard cases")
    ap.add_argument("--only", default="", help="the guard's cases of these tasks only (comma separated)")
    ap.add_argument("--save", default="", help="write each training and its twin (levels, losses, probe checks) "
                    "to this folder as TASK-N-SEED.json")  # fmt: skip
    ap.add_argument(
        "--show-probes", action="store_true", help="print each probe block judged and the losses around the first"
    )
    args = ap.parse_args()
    global SHOW_PROBES
    SHOW_PROBES = args.show_probes
    guard = [w for w in GUARD_WORKLOADS if not args.only or w[0] in args.only.split(",")]
    if args.guard_only:
        workloads(args.workload_steps, guard, range(args.seeds), args.save)
        return
    torch.manual_seed(0)
    w = args.width
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = nn.Sequential(nn.Linear(w, 2 * w), nn.ReLU(), nn.Linear(2 * w, w), nn.ReLU(), nn.Linear(w, 16)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, w, device=device)
    y = torch.randn(args.batch, 16, device=device)
    with FlopCounterMode(display=False) as fc:
        nn.functional.mse_loss(model(x), y).backward()
    opt.zero_grad(set_to_none=True)
    flops = float(fc.get_total_flops())
    warm_up_torchao()  # import it now, not in a thread competing with the fp32 timings
    gpu_energy = NvmlEnergy(device)

    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "greend.sock"
        daemon = FakeDaemon(sock).start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cb = GreenCallback(
                    job="bench-precision",
                    model=model,
                    socket=sock,
                    precisions=list(PRECISIONS),
                    loss_scaling=True,
                    fp8_min_features=min(1024, w),
                    flops_per_step=flops,
                    flush_interval_s=0.02,
                    # Step time only: the spike rule would bar a level whose loss is worse
                    # (fp8-emulated's here) after one round, leaving a ratio of one round's
                    # steps; accuracy is the workloads' part below. Non-finite steps still
                    # roll back.
                    spike_tolerance=None,
                )
            support = cb.supported_precisions()
            levels = [lvl for lvl in PRECISIONS if support[lvl] is None]
            times: dict[str, list[float]] = {lvl: [] for lvl in levels}
            round_ms: dict[str, list[float]] = {lvl: [] for lvl in levels}  # each round's median
            cpu_uj: dict[str, int | None] = {lvl: 0 for lvl in levels}
            gpu_mj: dict[str, int | None] = {lvl: 0 for lvl in levels}
            ran: dict[str, str] = {}
            off: dict[str, int] = {}  # timed steps that ran at another level (a rollback)
            for r in range(args.rounds):
                order = levels[r % len(levels) :] + levels[: r % len(levels)]
                for level in order:
                    daemon.directive(level)
                    deadline = time.monotonic() + 5
                    while cb.requested_precision != level and time.monotonic() < deadline:
                        time.sleep(0.005)
                    these: list[float] = []
                    for i in range(args.warmup + args.steps):
                        if i == args.warmup:
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                            e0, g0 = rapl_uj(), gpu_energy.mj()
                        t = time.perf_counter()
                        with cb.step(samples=args.batch) as st:
                            with st.autocast():
                                out = model(x)
                            st.backward(nn.functional.mse_loss(out.float(), y))
                            st.optimizer_step(opt)
                            opt.zero_grad(set_to_none=True)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        if i >= args.warmup:
                            if st.precision == level:
                                these.append(time.perf_counter() - t)
                            else:  # the guard rolled the level back: not this level's step
                                off[level] = off.get(level, 0) + 1
                    e1, g1 = rapl_uj(), gpu_energy.mj()
                    c, g = cpu_uj[level], gpu_mj[level]
                    cpu_uj[level] = (
                        c + e1 - e0 if c is not None and e0 is not None and e1 is not None and e1 >= e0 else None
                    )
                    gpu_mj[level] = g + g1 - g0 if g is not None and g0 is not None and g1 is not None else None
                    times[level] += these
                    round_ms[level].append(statistics.median(these) * 1e3 if these else math.nan)
                    if these:
                        ran[level] = level
            n = args.rounds * args.steps
            rows = []
            for level in levels:
                c, g = cpu_uj[level], gpu_mj[level]
                ratios = [a / b for a, b in zip(round_ms[level], round_ms[levels[0]], strict=True) if a == a]
                sim = H100.step_cost(flops, MEM_SHARE, ran[level])
                if not times[level]:
                    continue
                rows.append((level, ran[level], statistics.median(times[level]) * 1e3, min(ratios), max(ratios),
                             sim.energy_j, g / 1e3 / n if g is not None else None,
                             c / 1e6 / n if c is not None else None))  # fmt: skip
            cb.close()
        finally:
            daemon.stop()

    print(
        f"MLP {w}-{2 * w}-{w}-16, batch {args.batch}, {flops / 1e9:.2f} GFLOP per step (fwd+bwd), "
        f"on {device.type} ({torch.get_num_threads()} threads); levels interleaved over {args.rounds} rounds "
        f"of {args.steps} steps each: the median of {args.rounds * args.steps} steps per level"
    )
    print(
        f"{'level':<14}{'ran':<14}{'step ms':>10}{'vs fp32':>9}{'(rounds)':>16}{'sim J/step':>14}{'vs fp32':>9}"
        f"{'gpu J/step':>12}{'cpu J/step':>12}"
    )
    base_t, base_e = rows[0][2], rows[0][5]
    for level, ran_at, ms, lo, hi, ej, gpu, cpu in rows:
        gpu_txt = f"{gpu:.3f}" if gpu is not None else "n/a"
        cpu_txt = f"{cpu:.3f}" if cpu is not None else "n/a"
        spread = f"{lo:.2f}-{hi:.2f}x"
        print(
            f"{level:<14}{ran_at:<14}{ms:>10.2f}{ms / base_t:>8.2f}x{spread:>16}{ej:>10.4f} sim{ej / base_e:>8.3f}x"
            f"{gpu_txt:>12}{cpu_txt:>12}"
        )
    if gpu_energy.handle is None:
        print(f"gpu J/step: n/a ({gpu_energy.why})")
    if rapl_uj() is None:
        print("cpu J/step: n/a (RAPL energy_uj not readable here: no /sys/class/powercap, or not root)")
    print("sim J/step: the simulated H100 (greend.probes.sim, mem_share 0.3) at each level; source=sim")
    for lvl, k in off.items():
        print(f"{lvl}: {k} timed step(s) ran at another level (the accuracy guard rolled it back): left out")
    for lvl in PRECISIONS:
        if support[lvl] is not None:
            print(f"not here: {lvl}: {support[lvl]}")

    if args.workloads:
        workloads(args.workload_steps, WORKLOADS, (0,))
        workloads(args.workload_steps, guard, range(args.seeds), args.save)


TRAINER = ROOT / "tests" / "scripts" / "precision_trainer.py"
# (task, batch, extra trainer arguments, steps or None for --workload-steps): the last two
# are a regression where bf16 costs a few percent (targets near 16), without and with a
# reference batch (reference_loss).
Workload = tuple[str, int, tuple[str, ...], int | None]
WORKLOADS: list[Workload] = [
    ("regression", 128, (), None),
    ("classifier", 32, (), None),
    ("recommender", 256, (), None),
    ("offset-regression", 128, (), None),
    ("offset-regression", 128, ("--reference",), None),
]
# The accuracy guard's cases, harmful and benign: a penalty that grows as a noiseless loss
# nears its floor (targets near 5, bf16 rounds the outputs to 1/32; 3000 steps: the loss
# falls slowly enough for a switch after ~1200 steps, and the fp32 twin goes on falling);
# a sensor regression with an unnormalised target near 72 (bf16 rounds to 0.5: +7 % under
# its noise); a recommender whose click rate moves from ~2.5 % to ~4.5 % 150 steps after
# the switch (the twin sees the same shift at the same step: a change in the data, no
# penalty); and two noisy, harmless jobs (a 10-class classifier with 5 % label noise at
# batch 32, a recommender with a 3.8 % click rate at batch 256).
GUARD_WORKLOADS: list[Workload] = [
    ("floor-regression", 128, (), 3000),
    ("plant-regression", 128, (), None),
    ("recommender-shift", 256, ("--shift-after-switch", "150"), None),
    ("classifier", 32, (), None),
    ("recommender", 256, (), None),
]
SHOW_PROBES = False


def _train(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(TRAINER), *args], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"precision_trainer {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def workloads(steps: int, items: list[Workload], seeds: range | tuple[int, ...], save: str = "") -> None:
    """Each workload under the real daemon's precision policy (defaults), beside its fp32
    twin (the same seed, without greend; a shift after the switch at the same step)."""
    print(f"\nreal trainings under the precision policy (defaults), {steps} steps unless said, against the fp32 twin:")
    print(
        f"{'workload':<40}{'seed':>5}{'switched':>9}{'rollbk':>7}{'final':>6}{'eval loss':>11}{'fp32 twin':>11}"
        f"{'eval':>8}{'as-run':>8}{'saved':>7}{'upper':>7}"
    )
    with running_daemon(PRECISION_SIM_CONFIG, "--sim", "1", "--hz", "20", cwd=ROOT) as (sock, tmp):
        for n, (task, batch, extra, own_steps) in enumerate(items):
            n_steps = own_steps or steps
            for seed in seeds:
                common = ["--task", task, "--batch", str(batch), "--steps", str(n_steps), "--seed", str(seed)]
                job = f"{task}-{n}-{seed}"
                r = _train("--socket", str(sock), "--job", job, *common, "--step-sleep", "0.005",
                           "--precisions", "fp32,bf16", *extra)  # fmt: skip
                shift = ["--shift-at", str(r["shift_at"])] if r.get("shift_at") is not None else []
                twin = _train("--socket", str(tmp / "none.sock"), "--job", f"{job}-fp32", *common, *shift,
                              "--no-greend")  # fmt: skip
                with Client(sock) as c:
                    rep = c.request("report", job=job)
                _print_run(task, batch, extra, n_steps, seed, r, twin, rep)
                if save:
                    Path(save).mkdir(parents=True, exist_ok=True)
                    out = {"run": r, "twin": twin, "report": rep}
                    (Path(save) / f"{job}.json").write_text(json.dumps(out, default=str))
    print(
        "(eval: the held-out loss at the end, in fp32, against the twin's; as-run: the mean training loss of the "
        "last 300 steps, at the level each ran, against the twin's; saved: the energy of the job's steps saved "
        "against its fp32 baseline (sim), probe steps included; upper: the steps run at the level above for the "
        "trial and the probes, from the directive to the last step below it, in % of the steps from the directive "
        "on; switched: the first step below the job's level (a trial's first block); final: the level of most "
        "of the last 100 steps; the "
        "policy's tolerance is 5 %)"
    )


def _print_run(task: str, batch: int, extra: tuple[str, ...], n_steps: int, seed: int, r: dict, twin: dict,
               rep: dict) -> None:  # fmt: skip
    levels = r["levels"]
    switched = next((i for i, lvl in enumerate(levels) if lvl != levels[0]), None)
    # The callback's too; a step down turned down in its trial is "refused" (never switched to)
    rollbacks = [e for e in rep["precision_log"] if e["kind"] in ("rollback", "refused")]
    diff = (r["eval_loss"] / twin["eval_loss"] - 1) * 100
    label = f"{task} (batch {batch}{', reference' if '--reference' in extra else ''}, {n_steps} steps)"
    at = switched if switched is not None else "never"
    train = (_tail(r) / _tail(twin) - 1) * 100
    last = levels[-100:]
    final = max(set(last), key=last.count)
    # The steps' own energy saved (sim): the simulated GPU idles between these small CPU
    # steps, so the share of the job's whole GPU energy is ~0.
    saved_j, steps_j = (rep.get("savings") or {}).get("saved_j"), rep.get("sim_energy_j")
    ok = isinstance(saved_j, (int, float)) and isinstance(steps_j, (int, float)) and steps_j > 0
    saved_s = f"{100 * saved_j / (steps_j + saved_j):>6.1f}%" if ok else f"{'n/a':>7}"
    # The steps the guard ran at the level above, from the directive (a trial's first step:
    # trial_start(0) before its first block) to the last step below it, in % of the steps
    # from the directive on.
    upper = f"{'-':>7}"
    if switched is not None:
        from greend.training.probe import trial_start

        trial = any(c.get("trial") for c in r.get("probe_checks") or [])
        start = max(0, switched - trial_start(0, 400)) if trial else switched
        end = max(i for i, lvl in enumerate(levels) if lvl != levels[0]) + 1
        upper = f"{100 * levels[start:end].count(levels[0]) / (n_steps - start):>6.1f}%"
    print(
        f"{label:<40}{seed:>5}{at:>9}{len(rollbacks):>7}{final:>6}{r['eval_loss']:>11.5g}{twin['eval_loss']:>11.5g}"
        f"{diff:>+7.2f}%{train:>+7.2f}%{saved_s}{upper}"
    )
    for e in rollbacks:
        print(f"      {'rollback' if e['kind'] == 'rollback' else 'turned down'} at step {e['step']}: {e['reason']}")
    if SHOW_PROBES and switched is not None:
        a = switched + 80
        print("      losses", [(i, levels[i], f"{r['losses'][i]:.3g}") for i in range(a, min(a + 40, n_steps))])
        for c in r.get("probe_checks", []):
            print("      probe", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()})


def _tail(r: dict, n: int = 300) -> float:
    tail = r["losses"][-n:]
    return sum(tail) / len(tail)


if __name__ == "__main__":
    main()
