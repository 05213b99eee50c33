"""A straggler node that heals mid-run: does the job come back within its bound?

Run:  python bench/bench_heal.py [--nodes 2 3] [--heals 700 900 1050 1100 1150 1300 1600]
                                 [--noise 0 0.01 0.02] [--steps 3000] [--bound 0.05] [--slower 1.3]
                                 [--knob clock|power] [--profile NAME]

Synchronous jobs (:func:`greend.testing.nodes.run_nodes`: every step takes the slowest
node's time and every node times that step, as real ranks do) over 2 or 3 nodes of 2
simulated H100s (or, with ``--profile``, GPUs replaying a bundled measured power-limit
profile, power knob), each node under its own daemon's ``efficient`` (clock knob unless
``--knob power``, ``max_slowdown`` ``--bound``), the daemons starting at job steps 0, 50 and 120. Node B's
GPUs run 30 % slower (``--slower``) from the job's start until each step of ``--heals``, and, for each
noise level 0 and the largest, for 600 steps from step 600 and from step 1,300 (a
straggler that comes and goes). Beside each, the same job under ``none``. Printed per
case: the job's time against ``none`` from 300 steps after the heal to the end, over the
last third and over the whole run, and the job's GPU energy saved; then the worst and
mean of each and how many cases end over the bound. Every figure is the simulator's
(``source=sim``).

The failure this guards: once the straggler heals, the other nodes stay capped to its
old step and its own baseline reads theirs, so no node measures the job uncapped while
every node is; the re-checks every node runs at the same job steps when the job's step
or its agreed pace falls (``policies/_recheck.py``) bring the job back within its bound.
A milder straggler (``--slower 1.1``), which the other nodes are paced to exactly, heals
without moving the job's step or its pace; the healed node sees its GPUs use less energy
per FLOP at the same step (they wait for the others) and asks every node to re-check
from its step, in the pace the ranks agree (``recheck_at``). In the simulator a waiting
GPU draws nothing; a real one waiting in a collective still draws some power, so there
its energy falls by less than its compute time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from greend.policies import get_policy
from greend.testing.harness import SimJob, Straggle, make_sim_gpus
from greend.testing.nodes import Node, NodesResult, run_nodes

FLOPS = 1e12
GPUS = 2
STARTS = (0, 50, 120)  # the job step each node's daemon starts deciding at


def run(
    policy: str,
    n: int,
    span: tuple[int, int],
    steps: int,
    noise: float,
    seed: int,
    bound: float,
    slower: float = 1.3,
    knob: str = "clock",
    spec: Any = None,
) -> NodesResult:
    nodes = []
    for k in range(n):
        gpus, clk = make_sim_gpus(GPUS, **({"spec": spec} if spec is not None else {}))
        st = tuple(Straggle(i, slower, *span) for i in range(GPUS)) if k == 1 else ()
        job = SimJob("j", tuple(range(GPUS)), FLOPS, 0.4, straggles=st)
        pol = get_policy("none") if policy == "none" else get_policy(policy, max_slowdown=bound, knob=knob)
        nodes.append(Node(pol, gpus, job, clk, starts_at=STARTS[k] if policy != "none" else 0))
    return run_nodes(nodes, steps=steps, noise=noise, seed=seed)


def cases(nodes: list[int], heals: list[int], noises: list[float], steps: int) -> list[tuple[int, int, int, float]]:
    """(nodes, the straggle's first step, its last, noise)."""
    out = []
    for n in nodes:
        out += [(n, 0, h, z) for h in heals for z in noises if h + 300 < steps]
        out += [(n, s, s + 600, z) for s in (600, 1300) for z in sorted({noises[0], noises[-1]}) if s + 900 < steps]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    ap.add_argument("--heals", type=int, nargs="+", default=[700, 900, 1050, 1100, 1150, 1300, 1600])
    ap.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.01, 0.02])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--bound", type=float, default=0.05)
    ap.add_argument("--slower", type=float, default=1.3, help="node B's step time over the others' while it straggles")
    ap.add_argument("--knob", choices=["clock", "power"], help="clock (default) or power (with --profile)")
    ap.add_argument("--profile", help="a bundled measured profile (power knob), e.g. A40+resnet50+gpu0")
    a = ap.parse_args(argv)
    spec = None
    if a.profile:
        from greend.probes.trace import bundled_trace, trace_spec

        spec = trace_spec(bundled_trace(a.profile))
    knob = a.knob or ("power" if a.profile else "clock")
    rows = []
    head = ("nodes", "B slower", "noise", "from heal+300", "last third", "run", "saved")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 11, 5, 13, 10, 8, 6), strict=True)))
    for seed, (n, first, last, noise) in enumerate(cases(a.nodes, a.heals, sorted(a.noise), a.steps)):
        none = run("none", n, (first, last), a.steps, noise, seed, a.bound, a.slower, knob, spec)
        eff = run("efficient", n, (first, last), a.steps, noise, seed, a.bound, a.slower, knob, spec)

        def ratio(lo: int, e: NodesResult = eff, z: NodesResult = none) -> float:
            return sum(e.step_s[lo:]) / sum(z.step_s[lo:]) - 1.0

        r = (ratio(last + 300), ratio(2 * a.steps // 3), ratio(0), 1.0 - sum(eff.energy_j) / sum(none.energy_j))
        rows.append(r)
        span = f"{first}-{last}"
        print(f"{n:>5} {span:>11} {noise:>5.2f} {r[0]:>+12.2%} {r[1]:>+10.2%} {r[2]:>+8.2%} {r[3]:>6.1%}", flush=True)
    if not rows:
        print("no case: every heal is within 300 steps of the end")
        return 1
    for k, name in enumerate(("from the heal + 300 steps", "last third", "whole run")):
        xs = [r[k] for r in rows]
        over = sum(x > a.bound + 0.005 for x in xs)
        print(f"{name}: worst {max(xs):+.2%}, mean {sum(xs) / len(xs):+.2%}, over the bound: {over} of {len(xs)}")
    print(f"GPU energy saved against none: {sum(r[3] for r in rows) / len(rows):.1%} on average (sim)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
