"""A small real training run with GreenCallback, used by the end-to-end tests.

    python tests/scripts/trainer.py --socket S --job J --gpu 0 --steps 40 --width 256 [--no-greend]

Prints one JSON line: job, steps, final_loss, flops_per_step (counted here,
independently of the callback, with FlopCounterMode), and the callback's stats.
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
from torch.utils.flop_counter import FlopCounterMode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", default=None, help="the job id (default: from the launcher, as GreenCallback finds it)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--no-greend", action="store_true")
    ap.add_argument("--ready-file", default="")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.steps, args.batch, 64, generator=gen)
    y = torch.randint(0, 8, (args.steps, args.batch), generator=gen)
    lossf = nn.CrossEntropyLoss()

    # The truth the daemon's figure is checked against: one step counted here.
    probe = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 8))
    with FlopCounterMode(display=False) as fc:
        lossf(probe(x[0]), y[0]).backward()
    flops_per_step = fc.get_total_flops()

    cb = None
    if not args.no_greend:
        from greend import GreenCallback

        cb = GreenCallback(
            job=args.job,
            model=model,
            socket=args.socket,
            gpus=[args.gpu],
            mem_share=0.3,
            heartbeat_s=0.5,
            reconnect_min_s=0.2,
            reconnect_max_s=0.5,
        )
    if args.ready_file:
        Path(args.ready_file).write_text("ready")
    loss = torch.tensor(0.0)
    for i in range(args.steps):
        if cb is not None:
            with cb.step(samples=args.batch, batch=x[i]) as st:
                with st.autocast():
                    loss = lossf(model(x[i]), y[i])
                st.loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
        else:
            loss = lossf(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    stats = {}
    if cb is not None:
        cb.close()
        stats = {k: v for k, v in vars(cb.stats).items() if isinstance(v, (int, float))}
    print(
        json.dumps(
            {
                "job": cb.job if cb is not None else args.job,
                "steps": args.steps,
                "final_loss": float(loss.detach()),
                "flops_per_step": flops_per_step,
                "stats": stats,
            }
        )
    )


if __name__ == "__main__":
    main()
