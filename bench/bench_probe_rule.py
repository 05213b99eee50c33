"""The probes' rule alone (``greend.training.probe.Prober``) on made-up loss streams.

Run:  python bench/bench_probe_rule.py [--runs 60] [--ranks N]

Each stream is fed to a Prober as the callback does (each step at the level the Prober
asks for, else the lower one), the lower level harmless or harmful, and the rule's
verdicts counted: how often a harmless level is rolled back (false rollbacks) and how
many steps after the switch a harmful one is (the steps it ran, which the rollback does
not undo), and what the probes cost: the share of the steps run at the level above for
them ("upper", of the steps run until the rollback or the end). Tolerance 5 %,
``probe_every`` 400; every run switches at another step (the blocks' gaps are drawn
from it).

* ``order P``: a fixed dataset of P batches read in order (no shuffle), its last 4 far
  easier (loss x0.6, a cleaner source), 2 % noise, 4000 steps, harmless: a block whose
  probe steps meet the easy batches while its windows do not reads +40 %.
* ``noisy``: a falling loss with 40 % step-to-step noise, 4000 steps, harmless.
* ``+2 %``: a penalty of 2 % (within the tolerance) under 5 % noise, 4000 steps.
* ``trend +8 %``: a loss falling ~5 % per 33 steps (as right after a switch), 4 % noise,
  bf16 +8 %, 2000 steps.
* ``+7 %``: a flat loss, 5 % noise, +7 %, 2000 steps.
* ``late +25 %``: a falling loss, 5 % noise, +25 % from 1500 steps after the switch on.
* ``grows``: a penalty growing from 0 by 1 % per 100 steps, 3 % noise, 2000 steps.
* ``noisy +2 %``: a 2 % penalty under 10 % noise, 4000 steps, harmless.
* ``noisy grows``: a falling loss, 10 % noise, a penalty growing from 3 % by 0.5 points
  per 100 steps (a rounding that costs more as the loss converges), 2500 steps.

``--ranks N`` (``--alone``: beside the same runs judged rank by rank, a run counted as
rolled back where any rank rolled back, the job following that rank) runs each case as a
job of N ranks that judge each block together, on their mean loss at each step
(:mod:`greend.testing.probe_ranks`): each rank with its own noise (its share of the
data; a data order the same on every rank), reading its losses every 1, 16, 7, 4, ...
steps; "rolled back" then counts the runs whose ranks rolled back (together: a run whose
ranks ran two levels at some step is counted apart, "parted", and should be 0), "upper"
is rank 0's.

All of it is made up (the rule's own yardstick); the real trainings are in
``bench_precision.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greend.testing.probe_ranks import run_ranks
from greend.training.probe import Prober

Loss = Callable[[int, int, str, random.Random], float]  # (steps since the switch, step, level, rng)


def _noisy(rng: random.Random, sd: float) -> float:
    return 1.0 + rng.gauss(0.0, sd)


def order(period: int) -> Loss:
    def loss(t: int, i: int, level: str, rng: random.Random) -> float:
        easy = (i - 6) % period >= period - 4
        return (0.6 if easy else 1.0) * 0.1 * _noisy(rng, 0.02)

    return loss


CASES: dict[str, tuple[Loss, int, bool]] = {  # name: (loss, steps, harmful)
    **{f"order {p}": (order(p), 4000, False) for p in (11, 20, 29, 33)},
    "noisy": (lambda t, i, lvl, rng: 0.1 * (1 + t / 100) ** -0.3 * _noisy(rng, 0.4), 4000, False),
    "+2 %": (lambda t, i, lvl, rng: (1.02 if lvl == "bf16" else 1.0) * _noisy(rng, 0.05), 4000, False),
    "trend +8 %": (
        lambda t, i, lvl, rng: (1 + (t + 600) / 50) ** -1.0 * (1.08 if lvl == "bf16" else 1.0) * _noisy(rng, 0.04),
        2000,
        True,
    ),
    "+7 %": (lambda t, i, lvl, rng: (1.07 if lvl == "bf16" else 1.0) * _noisy(rng, 0.05), 2000, True),
    "late +25 %": (
        lambda t, i, lvl, rng: (
            2.0 * (1 + t / 300) ** -0.5 * (1.25 if lvl == "bf16" and t >= 1500 else 1.0) * _noisy(rng, 0.05)
        ),
        3000,
        True,
    ),
    "grows": (lambda t, i, lvl, rng: (1 + (0.0001 * t if lvl == "bf16" else 0.0)) * _noisy(rng, 0.03), 2000, True),
    "noisy +2 %": (lambda t, i, lvl, rng: (1.02 if lvl == "bf16" else 1.0) * _noisy(rng, 0.1), 4000, False),
    "noisy grows": (
        lambda t, i, lvl, rng: (
            (1 + t / 300) ** -0.3 * (1.03 + 0.00005 * t if lvl == "bf16" else 1.0) * _noisy(rng, 0.1)
        ),
        2500,
        True,
    ),
}


def run(loss: Loss, switch: int, steps: int) -> tuple[int | None, float]:
    """Steps after the switch at which the level was rolled back (or None) and the share of
    the steps run at the level above for the probes."""
    rng = random.Random(switch * 7 + 1)
    prober = Prober(tolerance=0.05, every=400)
    prober.arm("fp32", "bf16", anchor=switch)
    for i in range(switch, switch + steps):
        level = prober.level_at(i) or "bf16"
        if prober.record(i, level, loss(i - switch, i, level, rng)) is not None:
            return i - switch, prober.probe_steps / (i - switch + 1)
    return None, prober.probe_steps / steps


LAGS = (1, 16, 7, 4, 12, 2, 9, 5)  # the ranks' read batches (steps), in turn


def run_job(loss: Loss, switch: int, steps: int, ranks: int, agreed: bool = True) -> tuple[int | None, float, bool]:
    """As :func:`run` for a job of ``ranks`` ranks (each its own noise) that judge the blocks
    together (``agreed``; else each its own losses: the first rank's rollback counts); and
    whether the ranks ran two levels at some step."""
    rngs = [random.Random(switch * 7 + 1 + 1000 * r) for r in range(ranks)]
    probers = [Prober(tolerance=0.05, every=400, ranks=ranks) for _ in range(ranks)]
    for p in probers:
        p.arm("fp32", "bf16", anchor=switch)
    losses = [lambda i, lvl, g=g: loss(i - switch, i, lvl, g) for g in rngs]
    lags = [LAGS[r % len(LAGS)] for r in range(ranks)]
    job = run_ranks(probers, losses, lags, steps, start=switch, agreed=agreed)
    back = min((b for b in job.back if b is not None), default=None)
    ran = steps if back is None else back - switch + 1
    return (None if back is None else back - switch), job.probe_steps[0] / ran, job.parted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60, help="runs (switch steps) per case")
    ap.add_argument("--ranks", type=int, default=1, help="the job's ranks (several: they judge each block together)")
    ap.add_argument("--alone", action="store_true", help="with --ranks: the same runs judged rank by rank beside")
    args = ap.parse_args()
    print(
        f"{'case':<14}{'runs':>6}{'rolled back':>13}{'median step':>13}{'90th pct':>10}{'upper %':>9}"
        + (f"{'parted':>8}" if args.ranks > 1 else "")
        + (f"{'alone':>8}{'median':>8}" if args.ranks > 1 and args.alone else "")
        + f"  ({args.ranks} rank{'s' if args.ranks > 1 else ''}; steps after the switch; upper: the probes' steps"
        " at the level above, of those run)"
    )
    for name, (loss, steps, harmful) in CASES.items():
        if args.ranks > 1:
            jobs = [run_job(loss, 97 * k, steps, args.ranks) for k in range(args.runs)]
            runs = [(r, u) for r, u, _ in jobs]
            parted = f"{sum(p for _, _, p in jobs):>8}"
            if args.alone:
                alone = [run_job(loss, 97 * k, steps, args.ranks, agreed=False)[0] for k in range(args.runs)]
                apart = sorted(r for r in alone if r is not None)
                parted += f"{len(apart):>8}{apart[len(apart) // 2] if apart and harmful else '-':>8}"
        else:
            runs, parted = [run(loss, 97 * k, steps) for k in range(args.runs)], ""
        at = sorted(r for r, _ in runs if r is not None)
        upper = 100 * sum(u for _, u in runs) / len(runs)
        med = f"{at[len(at) // 2]}" if at and harmful else "-"
        p90 = f"{at[int(0.9 * len(at))]}" if at and harmful else "-"
        kind = "harmful" if harmful else "harmless"
        print(f"{name:<14}{args.runs:>6}{len(at):>13}{med:>13}{p90:>10}{upper:>9.2f}{parted}  {kind}")


if __name__ == "__main__":
    main()
