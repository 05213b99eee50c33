"""Pacing within a node: one slow GPU among eight, against policy ``none`` and the ideal.

Run:  python bench/bench_pacing.py [--steps 1500] [--mem-share 0.4] [--no-traces]

An 8-GPU node runs one synchronous job (every step waits for its slowest GPU).
One GPU is 10 %, 20 % or 30 % slower (its speed factor: a GPU that runs hot and
throttles), or throttles by 30 % or 10 % for the middle of the run only (it appears at a
third of the run and heals at two thirds). ``efficient`` runs with
``max_slowdown = 0`` (nothing may slow the job), through
:mod:`greend.testing.harness`, and is compared with:

* ``none``: every GPU uncapped, the job's pace;
* the ideal: the best static setting for the seven fast GPUs (the slow one
  uncapped), from a sweep of every setting: the least energy at which the job
  steps no slower than under ``none`` (for the straggler that comes and goes, the
  ideal changes setting when it comes and when it goes).

A second table: a 2-node job (8 GPUs a node), node B 10 %, 20 % or 30 % slower
(every GPU of it). The nodes share one thing, the job's pace: node B's uncapped
step time, which the ranks agree across nodes and node A's policy receives as
the job's ``pace_s`` from the first agreement a real job's ranks can carry it in (step
200: they agree every 100 steps and read the epoch before; ``harness.PACE_EVERY``). Each
node runs its own ``efficient`` (``max_slowdown = 0``);
every step of the job takes the slower node's step. Printed: node A's energy saved,
the job's (both nodes), the job's time against ``none`` and the ideal (node A's
best static setting that keeps node B's step, node B uncapped). Energy here is the
GPUs' step energy: under ``none`` node A's GPUs would also draw power while they
wait for node B, which is not counted (the savings shown are the lower bound).

A third table (printed, no target) runs the 2-node job with its steps synchronised
(:func:`greend.testing.nodes.run_nodes`): every node's step takes the slower node's
time and each node measures that, as a real rank does (its step includes the wait in the
collective), where the table before gives each node its own step and node A the pace. Node
B is 30 % slower all along, or throttles for the middle third; bounds 0 and 5 %; "last
third": the job's time against ``none`` over the last third of the run (after the heal).
Its last two rows start node B's daemon 37 steps after node A's (daemons never start
together): node B then measures its uncapped baseline while node A probes capped
settings, which the job's floor (the lowest uncapped step any node measured, agreed like
the pace) keeps from becoming room.

Printed: the job's time against ``none`` (whole run, search included), the energy
saved on the seven fast GPUs and on the job's eight (the whole run, and the last
third, once settled), and that saving as a share of the ideal's. Targets: time
within 1 % of ``none``, at least 90 % of the ideal saving. On the simulated H100
(clock knob) and on the bundled measured A40 profiles (power knob: a traced GPU
has no clock axis). Every figure is the simulator's (``source=sim``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greend.policies import get_policy
from greend.probes.sim import H100, SimSpec
from greend.testing.harness import SimJob, Straggle, make_sim_gpus, run_policy
from greend.testing.nodes import Node, run_nodes

FLOPS = 1e12
N = 8
SLOW = N - 1


@dataclass(frozen=True)
class Case:
    name: str
    factor: float
    start: float = 0.0  # share of the run
    stop: float | None = None
    b_starts_at: int = 0  # (synchronised table) the step node B's daemon starts deciding at

    def straggle(self, steps: int) -> Straggle:
        stop = None if self.stop is None else int(self.stop * steps)
        return Straggle(SLOW, self.factor, int(self.start * steps), stop)


CASES = (
    Case("1 GPU 10 % slower", 1.1),
    Case("1 GPU 20 % slower", 1.2),
    Case("1 GPU 30 % slower", 1.3),
    Case("30 % throttle, comes and goes", 1.3, 1 / 3, 2 / 3),
    Case("10 % throttle, comes and goes", 1.1, 1 / 3, 2 / 3),
)


def policy(name: str, knob: str, bound: float = 0.0, room: bool = False):
    """``none``, or ``efficient`` on ``knob`` with ``max_slowdown = bound`` (``room``: pace_room)."""
    if name == "none":
        return get_policy("none")
    return get_policy("efficient", knob=knob, max_slowdown=bound, pace_room=room)


def rule(head: str) -> None:
    """A table's header line and the rule under it."""
    print(head)
    print("-" * len(head))


def settings(spec: SimSpec, knob: str) -> list[dict]:
    if knob == "clock":
        return [{"locked_clocks_mhz": (spec.sm_clock_min_mhz, f)} for f in sorted(set(spec.supported_sm_clocks_mhz))]
    # The policy's grid: every 25 W down from the default limit (power_step_w), and the minimum.
    top, lo = spec.power_limit_default_w, spec.power_limit_min_w
    levels = [top - 25.0 * k for k in range(int((top - lo) // 25) + 1)] + [lo]
    return [{"power_limit_w": w} for w in levels]


def ideal_step(spec: SimSpec, knob: str, m: float, factor: float) -> tuple[float, float]:
    """(fast GPUs' energy per step, the job's step time) at the best static setting."""
    slow = spec.step_cost(FLOPS, m, speed_factor=factor)
    best = spec.step_cost(FLOPS, m)
    for kw in settings(spec, knob):
        c = spec.step_cost(FLOPS, m, speed_factor=1.0, **kw)
        if c.duration_s <= slow.duration_s * (1 + 1e-9) and c.energy_j < best.energy_j:
            best = c
    return best.energy_j, slow.duration_s


def one(spec: SimSpec, knob: str, case: Case, a: argparse.Namespace) -> dict:
    out: dict = {}
    tails = {}
    for pol_name in ("none", "efficient"):
        gpus, _ = make_sim_gpus(N, spec=spec)
        job = SimJob("j", tuple(range(N)), FLOPS, a.mem_share, straggles=(case.straggle(a.steps),))
        pol = policy(pol_name, knob)
        r = run_policy(pol, gpus, steps=a.steps, jobs=[job], settle_steps=1)
        e = [g.energy_j() for g in gpus]
        tail = r.trace[-(a.steps // 3) :]
        out[pol_name] = (r.total_time_s, sum(e[:SLOW]), sum(e))
        tails[pol_name] = sum(x.duration_s for x in tail)
    # The ideal over the run: the straggler's span at its best static setting, the rest uncapped-equivalent.
    n_slow = (int((case.stop or 1.0) * a.steps) - int(case.start * a.steps)) if case.stop or case.start else a.steps
    fast_e, _ = ideal_step(spec, knob, a.mem_share, case.factor)
    base_e = spec.step_cost(FLOPS, a.mem_share).energy_j
    slow_e = spec.step_cost(FLOPS, a.mem_share, speed_factor=case.factor).energy_j
    fast_none = a.steps * SLOW * base_e
    fast_ideal = fast_none - n_slow * SLOW * (base_e - fast_e)
    job_none = fast_none + n_slow * slow_e + (a.steps - n_slow) * base_e
    t0, f0, j0 = out["none"]
    t1, f1, j1 = out["efficient"]
    ideal_fast = 1 - fast_ideal / fast_none
    return {
        "time": t1 / t0 - 1,
        "time_tail": tails["efficient"] / tails["none"] - 1,
        "fast": 1 - f1 / f0,
        "job": 1 - j1 / j0,
        "ideal_fast": ideal_fast,
        "ideal_job": (fast_none - fast_ideal) / job_none,
        "share": (1 - f1 / f0) / ideal_fast if ideal_fast > 0 else float("nan"),
    }


def table(title: str, spec: SimSpec, knob: str, a: argparse.Namespace) -> bool:
    print(f"\n{title}")
    head = (
        f"{'case':<31} {'time vs none':>12} {'settled':>8} {'fast GPUs saved':>15} {'ideal':>6} "
        f"{'of ideal':>8} {'job saved':>9} {'ideal':>6}  targets"
    )
    rule(head)
    ok_all = True
    for case in CASES:
        ok_all &= row(case.name, one(spec, knob, case, a), settled=True)
    return ok_all


def row(name: str, o: dict, settled: bool) -> bool:
    """Print one case's row (``settled``: with the last third's time column, else with
    the last third's share of the ideal saving); whether it meets both targets."""
    ok_t, ok_s = o["time"] <= 0.01, o["share"] >= 0.9
    tail = f" {o['time_tail']:>+8.2%}" if settled else ""
    fast_w = 15 if settled else 12
    last = "" if settled else f" {o['tail_share']:>10.0%}"
    print(
        f"{name:<31} {o['time']:>+12.2%}{tail} {o['fast']:>{fast_w}.1%} {o['ideal_fast']:>6.1%} "
        f"{o['share']:>8.0%}{last} {o['job']:>9.1%} {o['ideal_job']:>6.1%}  "
        f"time {'ok' if ok_t else 'MISS'}, saving {'ok' if ok_s else 'MISS'}"
    )
    return ok_t and ok_s


TWO_NODE_FACTORS = (1.1, 1.2, 1.3)


def two_nodes(spec: SimSpec, knob: str, factor: float, a: argparse.Namespace) -> dict:
    """A 2-node job, node B ``factor`` times slower: each node's run under ``pol_name``,
    the job's steps the slower node's."""
    slow_step = spec.step_cost(FLOPS, a.mem_share, speed_factor=factor).duration_s
    runs = {}
    for pol_name in ("none", "efficient"):
        per_node = []
        for f, pace in ((1.0, slow_step), (factor, None)):  # node A, node B
            gpus, _ = make_sim_gpus(N, spec=spec)
            straggles = tuple(Straggle(i, f) for i in range(N)) if f != 1.0 else ()
            job = SimJob("j", tuple(range(N)), FLOPS, a.mem_share, straggles=straggles, pace_s=pace)
            pol = policy(pol_name, knob, room=True)
            r = run_policy(pol, gpus, steps=a.steps, jobs=[job], settle_steps=1)
            per_node.append((r, sum(g.energy_j() for g in gpus)))
        (ra, ea), (rb, eb) = per_node
        job_t = sum(max(x.duration_s, y.duration_s) for x, y in zip(ra.trace, rb.trace, strict=True))
        runs[pol_name] = (job_t, ea, ea + eb, sum(x.energy_j for x in ra.trace[-(a.steps // 3) :]))
    t0, a0, j0, tail0 = runs["none"]
    t1, a1, j1, tail1 = runs["efficient"]
    fast_e, _ = ideal_step(spec, knob, a.mem_share, factor)
    base_e = spec.step_cost(FLOPS, a.mem_share).energy_j
    ideal_a = 1 - fast_e / base_e
    return {
        "time": t1 / t0 - 1,
        "fast": 1 - a1 / a0,
        "job": 1 - j1 / j0,
        "ideal_fast": ideal_a,
        "ideal_job": (a0 * ideal_a) / j0,
        "share": (1 - a1 / a0) / ideal_a if ideal_a > 0 else float("nan"),
        "tail_share": (1 - tail1 / tail0) / ideal_a if ideal_a > 0 else float("nan"),
    }


def two_node_table(title: str, spec: SimSpec, knob: str, a: argparse.Namespace) -> bool:
    print(f"\n{title}: a 2-node job (8 GPUs a node), node B slower")
    head = (
        f"{'case':<31} {'time vs none':>12} {'node A saved':>12} {'ideal':>6} {'of ideal':>8} "
        f"{'last third':>10} {'job saved':>9} {'ideal':>6}  targets"
    )
    rule(head)
    ok_all = True
    for f in TWO_NODE_FACTORS:
        ok_all &= row(f"node B {round((f - 1) * 100)} % slower", two_nodes(spec, knob, f, a), settled=False)
    return ok_all


def synced(spec: SimSpec, knob: str, case: Case, bound: float, a: argparse.Namespace, room: bool = False) -> dict:
    """A 2-node job whose steps are synchronised (:func:`run_nodes`): every node's step
    takes the slower node's time and each node measures that, as a real rank does (its
    step includes the wait in the collective). Node B is ``case``'s factor slower, all
    along or for a span; each node under ``efficient`` (``max_slowdown = bound``) or
    ``none``, the paces agreed every 100 steps."""
    runs = {}
    for pol_name in ("none", "efficient"):
        nodes = []
        for k in range(2):
            gpus, clk = make_sim_gpus(N, spec=spec)
            st = ()
            if k == 1:
                stop = None if case.stop is None else int(case.stop * a.steps)
                st = tuple(Straggle(i, case.factor, int(case.start * a.steps), stop) for i in range(N))
            pol = policy(pol_name, knob, bound, room)
            job = SimJob("j", tuple(range(N)), FLOPS, a.mem_share, straggles=st)
            nodes.append(Node(pol, gpus, job, clk, starts_at=case.b_starts_at if k == 1 else 0))
        runs[pol_name] = run_nodes(nodes, steps=a.steps)
    r0, r1 = runs["none"], runs["efficient"]
    lo = int(case.stop * a.steps) if case.stop is not None else 2 * a.steps // 3  # after the heal, or the last third
    return {
        "time": sum(r1.step_s) / sum(r0.step_s) - 1,
        "after": sum(r1.step_s[lo:]) / sum(r0.step_s[lo:]) - 1,
        "fast": 1 - r1.energy_j[0] / r0.energy_j[0],
        "job": 1 - sum(r1.energy_j) / sum(r0.energy_j),
    }


SYNC_CASES = (
    Case("node B 30 % slower", 1.3),
    Case("node B throttles 30 %, heals", 1.3, 1 / 3, 2 / 3),
    Case("node B throttles 50 %, heals", 1.5, 1 / 3, 2 / 3),
    Case("nodes alike, B's daemon +37", 1.0, b_starts_at=37),
    Case("node B 30 % slower, B's +37", 1.3, b_starts_at=37),
)


def synced_table(title: str, spec: SimSpec, knob: str, a: argparse.Namespace) -> None:
    """Printed, no target: what the per-node model above leaves out (see the docstring)."""
    print(f"\n{title}: a 2-node job, steps synchronised (each node measures the job's step)")
    head = (
        f"{'case':<31} {'bound':>5} {'pace_room':>9} {'time vs none':>12} {'last third':>10} {'node A saved':>12} "
        f"{'job saved':>9}"
    )
    rule(head)
    for case in SYNC_CASES:
        for bound in (0.0, 0.05):
            for room in (False, True):
                o = synced(spec, knob, case, bound, a, room)
                print(
                    f"{case.name:<31} {bound:>5.0%} {'on' if room else 'off':>9} {o['time']:>+12.2%} "
                    f"{o['after']:>+10.2%} {o['fast']:>12.1%} {o['job']:>9.1%}"
                )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--mem-share", type=float, default=0.4)
    ap.add_argument("--no-traces", action="store_true", help="skip the measured A40 profiles")
    a = ap.parse_args(argv)
    print(
        f"pacing within a node: 8 GPUs, one job, {a.steps} steps, efficient max_slowdown=0 vs none vs the ideal "
        f"static setting of the fast GPUs (sim)"
    )
    ok = table(f"simulated H100, clock knob, mem_share {a.mem_share} (sim)", H100, "clock", a)
    ok &= two_node_table(f"simulated H100, clock knob, mem_share {a.mem_share} (sim)", H100, "clock", a)
    synced_table(f"simulated H100, clock knob, mem_share {a.mem_share} (sim)", H100, "clock", a)
    if not a.no_traces:
        from greend.probes.trace import bundled_trace, trace_spec

        for name in ("A40+resnet50+gpu0", "A40+bert-base-uncased+gpu0"):
            spec = trace_spec(bundled_trace(name))
            ok &= table(f"measured profile {name}, power knob (sim, curve measured)", spec, "power", a)
            ok &= two_node_table(f"measured profile {name}, power knob (sim, curve measured)", spec, "power", a)
    print("\nall targets met (sim)" if ok else "\nsome targets missed (sim): see MISS above")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
