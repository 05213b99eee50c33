"""Jobs over several nodes whose daemons start apart: does the job keep its bound?

Run:  python bench/bench_nodes.py [--cases 24] [--seed 1] [--steps 3000] [--profile NAME]

Random synchronous jobs (:func:`greend.testing.nodes.run_nodes`: every step takes the
slowest node's time and every node times that step, as real ranks do, the wait in the
collective included): 2 to 4 nodes of 2 GPUs, each under its own daemon's ``efficient``
(default params, ``max_slowdown`` 5 or 10 %), each daemon starting 0-199 steps into the
job (daemons never start together), half the jobs with one node 10 or 30 % slower (all
along, for the middle third, or from the start for the first third), step noise 0, 1 or
2 %, half the jobs' steps growing 1.5 or 2 times in FLOPs a fifth of the way in (a
batch-size warm-up, a longer sequence). Beside each, the same job
under ``none``. Printed per case: the job's time against ``none`` over the last third of
the run (once settled) and the whole run, and the job's GPU energy saved; then the worst
excess over the bound and how many cases end over it by more than one point.

On the simulated H100 (clock knob) or, with ``--profile``, a bundled measured power-limit
profile (power knob). Every figure is the simulator's (``source=sim``).

The failure this guards: a node that measures its uncapped baseline while another node
is capped (probing, or settled at its bound) measures that node's slowdown too, and
allows its own bound on top; the job's floor (``policies/efficient_state.py``,
``floor_share``) holds every node to its bound over the fastest uncapped step any node
measured.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from greend.policies import get_policy
from greend.probes.sim import H100, SimSpec
from greend.testing.harness import Phase, SimJob, Straggle, make_sim_gpus
from greend.testing.nodes import Node, run_nodes

FLOPS = 1e12
GPUS = 2


def run(spec: SimSpec, knob: str, case: dict, steps: int, seed: int) -> dict:
    out = {}
    for pol_name in ("none", "efficient"):
        nodes = []
        for start, factor in zip(case["starts"], case["factors"], strict=True):
            gpus, clk = make_sim_gpus(GPUS, spec=spec)
            span = case["span"] or (0, None)
            st = tuple(Straggle(i, factor, *span) for i in range(GPUS)) if factor != 1.0 else ()
            if pol_name == "none":
                pol = get_policy("none")
            else:
                pol = get_policy("efficient", knob=knob, max_slowdown=case["bound"])
            phases = (Phase(steps // 5, FLOPS * case["grow"], 0.4),) if case["grow"] != 1.0 else ()
            job = SimJob("j", tuple(range(GPUS)), FLOPS, 0.4, straggles=st, phases=phases)
            nodes.append(Node(pol, gpus, job, clk, starts_at=start if pol_name != "none" else 0))
        out[pol_name] = run_nodes(nodes, steps=steps, noise=case["noise"], seed=seed)
    r0, r1 = out["none"], out["efficient"]
    lo = 2 * steps // 3
    return {
        "last": sum(r1.step_s[lo:]) / sum(r0.step_s[lo:]) - 1,
        "whole": sum(r1.step_s) / sum(r0.step_s) - 1,
        "saved": 1 - sum(r1.energy_j) / sum(r0.energy_j),
    }


def draw(rng: random.Random, steps: int) -> dict:
    n = rng.choice((2, 3, 4))
    factors = [1.0] * n
    span = None
    if rng.random() < 0.5:
        factors[rng.randrange(n)] = rng.choice((1.1, 1.3))
        span = rng.choice(
            (None, None, (steps // 3, 2 * steps // 3), (0, steps // 3))
        )  # (all along, mid-run, first third)
    return {
        "starts": [rng.randrange(0, 200) for _ in range(n)],
        "bound": rng.choice((0.05, 0.10)),
        "factors": factors,
        "span": span,
        "noise": rng.choice((0.0, 0.01, 0.02)),
        "grow": rng.choice((1.0, 1.0, 1.5, 2.0)),  # the job's FLOPs per step from a fifth of the run on
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--profile", help="a bundled measured profile (power knob), e.g. A40+resnet50+gpu0")
    a = ap.parse_args(argv)
    if a.profile:
        from greend.probes.trace import bundled_trace, trace_spec

        spec, knob, title = trace_spec(bundled_trace(a.profile)), "power", f"measured profile {a.profile}, power knob"
    else:
        spec, knob, title = H100, "clock", "simulated H100, clock knob"
    print(f"jobs over several nodes, daemons starting apart: {title}, {a.steps} steps, efficient vs none (sim)")
    head = (
        f"{'#':>3} {'nodes':>5} {'daemon starts':<20} {'bound':>5} {'slower':<14} {'noise':>5} {'FLOPs':>5} "
        f"{'last third':>10} {'whole':>7} {'saved':>6}"
    )
    print(head)
    print("-" * len(head))
    rng = random.Random(a.seed)
    excess = []
    for c in range(a.cases):
        case = draw(rng, a.steps)
        o = run(spec, knob, case, a.steps, seed=c)
        slow = [f"{f:.1f}x" for f in case["factors"] if f != 1.0]
        when = {None: "", (0, a.steps // 3): " first 3rd"}.get(case["span"], " mid-run")
        slower = (slow[0] + when) if slow else "none"
        flag = "  OVER" if o["last"] > case["bound"] + 0.01 else ""
        grow = "x" + format(case["grow"], "g")
        print(
            f"{c:>3} {len(case['starts']):>5} {str(case['starts']):<20} {case['bound']:>5.0%} {slower:<14} "
            f"{case['noise']:>5.0%} {grow:>5} {o['last']:>+10.2%} {o['whole']:>+7.2%} {o['saved']:>6.1%}{flag}"
        )
        excess.append(o["last"] - case["bound"])
    over = sum(e > 0.01 for e in excess)
    print(
        f"\nworst excess over the bound (last third): {max(excess):+.2%}; over it by over 1 point: {over} of {a.cases}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
