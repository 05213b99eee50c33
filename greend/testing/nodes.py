"""A synchronous job over several nodes, each under its own daemon's policy, on
simulated GPUs (:func:`run_nodes`): the multi-node counterpart of
:func:`greend.testing.harness.run_policy`. Everything is ``source="sim"``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from greend.policies.base import Setting
from greend.probes.sim import SimGpu

from .harness import FakeClock, SimJob, _Acc, _apply_decision, _find_clock, _in_force, _snapshot

__all__ = ["Node", "NodesResult", "run_nodes"]


@dataclass
class Node:
    """One node of a job that spans several (:func:`run_nodes`): its own daemon's policy,
    its GPUs (on their own fake clock) and its part of the job (``job``: this node's
    GPUs, FLOPs and stragglers; every node's part has the same job id)."""

    policy: Any
    gpus: Sequence[SimGpu]
    job: SimJob
    clock: FakeClock | None = None
    starts_at: int = 0  # the job's step its daemon's policy first decides at (daemons start apart)


@dataclass
class NodesResult:
    """A multi-node run: the job's step times (every node waits for the slowest), each
    node's GPU energy (steps only), each node's final setting, and the agreed paces the
    nodes were given (iteration, pace)."""

    step_s: list[float]
    energy_j: list[float]
    final: list[Setting]
    paces: list[tuple[int, float | None]]
    source: str = "sim"


@dataclass
class _NodeRun:
    """What :func:`run_nodes` keeps of one node: its GPUs by index, clock, policy state,
    the job's measure, this period's figures per GPU, and the pace it last told the job."""

    by: dict[int, SimGpu]
    clk: FakeClock | None
    state: Any
    acc: _Acc
    t0: float
    energy: dict[int, float] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)
    clock: dict[int, int] = field(default_factory=dict)
    period: float = 0.0
    local: float | None = None  # its uncapped step time, as the daemon pushes it
    floor: float | None = None  # the lowest uncapped step time it measured at the job's level
    ask: int = 0  # the job step it asks every node to re-check from (0: none), as the daemon pushes it

    @classmethod
    def of(cls, n: Node) -> _NodeRun:
        clk = n.clock if n.clock is not None else _find_clock(n.gpus)
        run = cls({g.index: g for g in n.gpus}, clk, n.policy.new_state(), _Acc(_in_force(n.gpus[0])),
                  clk() if clk is not None else 0.0)  # fmt: skip
        run.clock = {g.index: 0 for g in n.gpus}
        run.new_period()
        return run

    def new_period(self) -> None:
        self.energy = dict.fromkeys(self.by, 0.0)
        self.busy = dict.fromkeys(self.by, 0.0)
        self.period = 0.0


def run_nodes(
    nodes: Sequence[Node],
    *,
    steps: int,
    sync_every: int = 100,
    noise: float = 0.0,
    seed: int = 0,
    settle_steps: int = 1,
) -> NodesResult:
    """A synchronous job over several nodes, each under its own daemon's policy: every
    step of the job takes as long as the slowest node's (the collective waits for it), and
    that is the step time every node measures (a real rank times its whole step, the wait
    included); each GPU is busy only for its own work. Each node tells the job its
    uncapped step time, as the daemon does (its policy's ``baseline_time_per_flop_s``
    times the node's FLOPs per step); the ranks agree on the slowest every ``sync_every``
    steps and read the agreement one period later, and every node's policy gets it as the
    job's ``pace_s``; its lowest uncapped step (``floor_time_per_flop_s``) the same way, the
    MIN as ``floor_s``. A node's policy decides every step from ``Node.starts_at``."""
    rng = random.Random(seed)
    parts = [_NodeRun.of(n) for n in nodes]
    step_s: list[float] = []
    energy = [0.0] * len(nodes)
    paces: list[tuple[int, float | None]] = []
    # The local paces as the last agreement read them, the nodes' lowest uncapped steps, and
    # the job steps they ask a re-check from.
    told: list[float | None] = []
    floors: list[float | None] = []
    asks: list[int] = []
    sim_t = 0.0
    for it in range(steps):
        if it % sync_every == 0:  # an agreement: the paces published before the last one
            agreed = max((p for p in told if p is not None), default=None)
            floor = min((f for f in floors if f is not None), default=None)
            ask = max(asks, default=0)
            for n in nodes:
                n.job.pace_s, n.job.floor_s, n.job.recheck_at = agreed, floor, ask
                n.job.pace_count = (n.job.pace_count or 0) + (agreed is not None)  # (a rank sends only a pace)
            paces.append((it, agreed))
            told, floors, asks = [p.local for p in parts], [p.floor for p in parts], [p.ask for p in parts]
        own = []
        for n, p in zip(nodes, parts, strict=True):
            sj = n.job
            flops, m = sj.workload(it)
            dur = en = 0.0
            for i in sj.gpus:
                g = p.by[i]
                speed = sj.speed_of(i, it)
                if abs(g.speed_factor() - speed) > 1e-12:
                    g.set_speed_factor(speed)
                c = g.run_steps([(flops * sj.work.get(i, 1.0), m, sj.precision)], defer=True)[0]
                dur, en = max(dur, c.duration_s), en + c.energy_j
                p.energy[i] += c.energy_j
                p.busy[i] += c.duration_s
                p.clock[i] = c.sm_clock_mhz
            own.append((dur, en, flops * len(sj.gpus)))
        t = max(d for d, _, _ in own)
        step_s.append(t)
        sim_t += t
        for k, (n, p) in enumerate(zip(nodes, parts, strict=True)):
            _, en, fl = own[k]
            energy[k] += en
            if p.clk is not None:
                p.clk.advance(t)
            p.period += t
            if p.acc.skip > 0:  # (no noise drawn for a step left out)
                p.acc.skip -= 1
            else:
                n_t = t * max(0.05, 1.0 + rng.gauss(0.0, noise)) if noise > 0 else t
                n_e = en * max(0.05, 1.0 + rng.gauss(0.0, noise)) if noise > 0 else en
                p.acc.count(n_t, n_e, fl)
            sj = n.job
            snap = _snapshot(
                p.t0 + sim_t, n.gpus, [sj], {sj.job: p.acc}, {sj.job: it + 1}, it, lambda *_: True,
                p.energy, p.busy, p.clock, None, p.period,
            )  # fmt: skip
            p.new_period()
            if it < n.starts_at:
                continue
            decision = n.policy.decide(snap, p.state)
            details = (decision.details.get("jobs") or {}).get(sj.job) if isinstance(decision.details, dict) else None
            details = details if isinstance(details, dict) else {}
            tpf, low = details.get("baseline_time_per_flop_s"), details.get("floor_time_per_flop_s")
            p.local = float(tpf) * fl if tpf else p.local  # (the daemon's local_pace push)
            p.floor = float(low) * fl if low else p.floor  # (and its floor)
            p.ask = int(details.get("recheck_at") or p.ask)  # (and the step it asks a re-check from)
            before = tuple(_in_force(p.by[i]) for i in sj.gpus)
            _apply_decision(decision, [sj], p.by)
            if tuple(_in_force(p.by[i]) for i in sj.gpus) != before:
                p.acc = _Acc(_in_force(p.by[sj.gpus[0]]), skip=settle_steps, since_s=sim_t)
    for n in nodes:
        for g in n.gpus:
            g.commit()
    return NodesResult(step_s, energy, [_in_force(n.gpus[0]) for n in nodes], paces)
