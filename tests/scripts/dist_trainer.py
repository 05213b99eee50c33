"""One rank of a two-process gloo job on the CPU, reporting to its own node's daemon.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/scripts/dist_trainer.py --socket S --job J --seconds 25

Each rank stands for a node: rank r talks to the daemon at its own socket. The
model is wrapped in DistributedDataParallel, so every step all-reduces gradients
over gloo, and GreenCallback agrees the job's pace every --sync-every steps.
Prints one JSON line: rank, steps, the agreed pace, the final loss, the precision
each step ran at, the first step below fp32 and the callback's precision events.
``--penalty-rank R --penalty P``: rank R reports its loss P higher at bf16 (its share of
the data fares worse there; the step itself is unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", default=None, help="the job id (default: from the launcher's environment)")
    ap.add_argument("--seconds", type=float, default=25.0, help="train at most this long")
    ap.add_argument("--stop-file", help="stop early once this file exists (every rank agrees)")
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--steps", type=int, default=0, help="train exactly this many steps (0: by --seconds)")
    ap.add_argument("--precisions", default="", help="levels greend may move the job between (fp32,bf16)")
    ap.add_argument("--penalty-rank", type=int, default=-1, help="the rank whose losses report --penalty at bf16")
    ap.add_argument("--penalty", type=float, default=0.0, help="(its share of the data fares this much worse there)")
    ap.add_argument(
        "--greend-ranks", default="all", help="which ranks load GreenCallback: all, none, or a comma list (0,2)"
    )
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank + 1)
    lossf = nn.CrossEntropyLoss()

    from contextlib import nullcontext

    from greend import GreenCallback

    with_greend = args.greend_ranks == "all" or (
        args.greend_ranks != "none" and str(rank) in args.greend_ranks.split(",")
    )
    cb = (
        GreenCallback(
            job=args.job,
            model=model,
            socket=args.socket,
            gpus=[0],
            mem_share=0.3,
            sync_every=args.sync_every,
            heartbeat_s=0.5,
            **({"precisions": args.precisions.split(",")} if args.precisions else {}),
        )
        if with_greend
        else None
    )
    t_end = time.monotonic() + args.seconds
    steps = 0
    loss = torch.tensor(0.0)
    levels: list[str] = []  # the precision each step ran at
    while True:
        # Every rank runs the same number of steps: agree on stopping, as real jobs do.
        if args.steps:
            go = steps < args.steps
        else:
            go = time.monotonic() < t_end and not (args.stop_file and os.path.exists(args.stop_file))
        flag = torch.tensor([1.0 if go else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0.0:
            break
        x = torch.randn(32, 64, generator=gen)
        y = torch.randint(0, 8, (32,), generator=gen)
        with cb.step(samples=32, batch=x) if cb is not None else nullcontext() as st:
            with st.autocast() if st is not None else nullcontext():  # (greend's level, in effect)
                loss = lossf(model(x), y)
            if st is not None:
                worse = rank == args.penalty_rank and st.precision == "bf16"
                st.loss(loss.detach() * (1 + args.penalty) if worse else loss)
                levels.append(st.precision)
            opt.zero_grad()
            loss.backward()
            opt.step()
        steps += 1
        time.sleep(0.01)
    if cb is not None:
        cb.close()
    pace = cb.agreed_pace_s if cb is not None else None
    first_low = next((i for i, level in enumerate(levels) if level != "fp32"), None)
    print(json.dumps({"rank": rank, "steps": steps, "agreed_pace_s": pace, "final_loss": float(loss.detach()),
                      "levels": levels, "first_low": first_low,
                      "events": cb.precision_events if cb is not None else []}))  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()
    # torch's gloo backend here aborts now and then in the interpreter's teardown, after
    # all of the above ("terminate called without an active exception", SIGABRT), with or
    # without greend loaded (seen with --greend-ranks none too). The run is complete: leave
    # without that teardown so the exit status says how the training went.
    os._exit(0)


if __name__ == "__main__":
    main()
