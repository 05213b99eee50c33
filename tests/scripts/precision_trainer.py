"""A small real regression training whose precision greend may switch, for the e2e tests.

    python tests/scripts/precision_trainer.py --socket S --job J [--steps 400] [--no-greend]
        [--precisions fp32,bf16] [--inject-inf-after-switch K | --inject-spike-after-switch K]
        [--step-sleep 0.01]

An MLP (32 -> 128 -> 128 -> 8) learns a fixed random linear map plus noise, on
data this script makes from ``--seed``. Every step goes through
``step.autocast()``, ``step.backward(loss)`` and ``step.optimizer_step(opt)``, so
any level (fp16 with its GradScaler included) runs and the guard sees the
gradients. ``--inject-inf-after-switch K``: K steps after the first step that ran
below fp32, that step's loss is multiplied by inf (once); ``--inject-spike-after-switch
K``: by 10 instead (a finite spike, gradients 10x too).

Prints one JSON line: job, steps, final_loss (the mean training loss over the
last 20 steps), eval_loss (on a held-out set, in fp32, after training), levels
(the precision of every step), poisoned (the step index that got the inf, or
null), precision_events (the callback's own), stats.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

IN, HID, OUT = 32, 128, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", default="")
    ap.add_argument("--job", default="precision")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--precisions", default="")
    ap.add_argument("--inject-inf-after-switch", type=int, default=-1)
    ap.add_argument("--inject-spike-after-switch", type=int, default=-1)
    ap.add_argument("--no-greend", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, OUT))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    w_true = torch.randn(IN, OUT, generator=gen) / IN**0.5
    x_eval = torch.randn(1024, IN, generator=gen)
    y_eval = x_eval @ w_true + 0.3 * torch.randn(1024, OUT, generator=gen)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(args.seed * 100_003 + i)
        x = torch.randn(args.batch, IN, generator=g)
        return x, x @ w_true + 0.3 * torch.randn(args.batch, OUT, generator=g)

    cb = None
    if not args.no_greend:
        from greend import GreenCallback

        kw = {}
        if args.precisions:
            kw["precisions"] = args.precisions.split(",")
        cb = GreenCallback(
            job=args.job,
            model=model,
            socket=args.socket,
            gpus=[args.gpu],
            mem_share=0.3,
            heartbeat_s=0.5,
            reconnect_min_s=0.2,
            reconnect_max_s=0.5,
            flush_interval_s=0.05,
            loss_scaling=True,
            **kw,
        )
    levels: list[str] = []
    losses: list[float] = []
    first_low: int | None = None
    poisoned: int | None = None
    for i in range(args.steps):
        x, y = batch(i)
        if cb is None:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            levels.append("fp32")
        else:
            with cb.step(samples=args.batch, batch=x) as st:
                if st.precision != "fp32" and first_low is None:
                    first_low = i
                with st.autocast():
                    out = model(x)
                loss = nn.functional.mse_loss(out.float(), y)
                for after, factor in (
                    (args.inject_inf_after_switch, float("inf")),
                    (args.inject_spike_after_switch, 10.0),
                ):
                    if after >= 0 and first_low is not None and poisoned is None and i == first_low + after:
                        loss = loss * factor
                        poisoned = i
                st.backward(loss)
                st.optimizer_step(opt)
                opt.zero_grad(set_to_none=True)
            levels.append(st.precision)
        losses.append(float(loss.detach()))
        if args.step_sleep:
            time.sleep(args.step_sleep)
    with torch.no_grad():
        eval_loss = float(nn.functional.mse_loss(model(x_eval), y_eval))
    stats: dict[str, float] = {}
    events: list[dict[str, object]] = []
    if cb is not None:
        events = cb.precision_events
        cb.close()
        stats = {k: v for k, v in vars(cb.stats).items() if isinstance(v, (int, float))}
    tail = [v for v in losses[-20:] if v == v and abs(v) != float("inf")]
    print(
        json.dumps(
            {
                "job": args.job,
                "steps": args.steps,
                "final_loss": sum(tail) / len(tail),
                "eval_loss": eval_loss,
                "levels": levels,
                "poisoned": poisoned,
                "precision_events": events,
                "stats": stats,
            }
        )
    )


if __name__ == "__main__":
    main()
