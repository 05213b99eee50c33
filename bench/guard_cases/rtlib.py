"""Shared loop for the red-team workloads: run under greend (same GreenCallback settings as
tests/scripts/precision_trainer.py) or as the fp32 twin (--no-greend), print one JSON line.

Events (shifts) can be placed relative to the guard's schedule: --event-at SPEC where SPEC is
  abs:K            absolute step K
  trial0:+k / trial1:-k   k steps after/before the trial's block 0/1 first step
  down:+k          k steps after the step the run goes down (trial passed)
  probeB:+k        k steps after probe block B's first step (B = 0,1,2,...; computed schedule)
The resolved absolute step is printed as "event_at" so the twin gets --event-at abs:K.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from greend.training.probe import block_start, trial_end, trial_start

EVERY = 400


def base_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--socket", default="")
    ap.add_argument("--job", default="rt")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-greend", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.005)
    ap.add_argument("--event-at", default="", help="comma-separated SPECs (see module doc)")


def schedule(first_low: int, anchor: int | None = None) -> dict[str, int]:
    a = first_low - trial_start(0, EVERY, 0) if anchor is None else anchor
    s = {"directive": a, "trial0": a + trial_start(0, EVERY, a), "trial1": a + trial_start(1, EVERY, a)}
    down = a + trial_end(EVERY, a)
    s["down"] = down
    for b in range(12):
        s[f"probe{b}"] = down + block_start(b, EVERY, down)
    return s


def resolve(spec: str, sched: dict[str, int] | None) -> int | None:
    name, _, off = spec.partition(":")
    if name == "abs":
        return int(off)
    if sched is None:
        return None
    return sched[name] + int(off or 0)


def run(args, model, opt, batch, loss_of, evaluate, set_lr=None, on_event=None) -> None:
    """batch(i, events_passed:list[int]) -> (x, y); loss_of(out, y); evaluate() -> float;
    set_lr(i, events) optional; events = resolved absolute steps (None while unresolved)."""
    specs = [s for s in args.event_at.split(",") if s]
    events: list[int | None] = [resolve(s, None) for s in specs]
    cb = None
    if not args.no_greend:
        from greend import GreenCallback

        cb = GreenCallback(
            job=args.job,
            model=model,
            socket=args.socket,
            gpus=[0],
            mem_share=0.3,
            heartbeat_s=0.5,
            reconnect_min_s=0.2,
            reconnect_max_s=0.5,
            flush_interval_s=0.05,
            loss_scaling=True,
            precisions=["fp32", "bf16"],
        )
    levels: list[str] = []
    losses: list[float] = []
    first_low = None
    sched = None
    for i in range(args.steps):
        if set_lr is not None:
            set_lr(i, events)
        if cb is not None and sched is None:
            pr = getattr(cb._control, "prober", None)
            if pr is not None and pr.trial and pr.armed:
                sched = schedule(0, pr.anchor)
                events = [resolve(s, sched) if e is None else e for s, e in zip(specs, events)]
        x, y = batch(i, events)
        if cb is None:
            loss = loss_of(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            levels.append("fp32")
        else:
            with cb.step(samples=len(x) if hasattr(x, "__len__") else 1, batch=x) as st:
                if first_low is None and levels and st.precision != levels[0]:
                    first_low = i
                    sched = sched or schedule(i)
                    events = [resolve(s, sched) if e is None else e for s, e in zip(specs, events)]
                with st.autocast():
                    out = model(x)
                loss = loss_of(out, y)
                st.backward(loss)
                st.optimizer_step(opt)
                opt.zero_grad(set_to_none=True)
            levels.append(st.precision)
        losses.append(float(loss.detach()))
        if args.step_sleep:
            time.sleep(args.step_sleep)
    model.eval()
    with torch.no_grad():
        eval_loss = float(evaluate())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eval_bf16 = float(evaluate())
    probes, evs, stats = [], [], {}
    if cb is not None:
        evs = cb.precision_events
        probes = getattr(cb, "probe_checks", [])
        cb.close()
        stats = {k: v for k, v in vars(cb.stats).items() if isinstance(v, (int, float))}
    print(
        json.dumps(
            {
                "job": args.job,
                "steps": args.steps,
                "eval_loss": eval_loss,
                "eval_bf16": eval_bf16,
                "levels": levels,
                "losses": losses,
                "event_at": [e for e in events],
                "schedule": sched,
                "precision_events": evs,
                "probe_checks": probes,
                "stats": stats,
            },
            default=str,
        )
    )
