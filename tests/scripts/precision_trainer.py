"""A small real regression training whose precision greend may switch, for the e2e tests.

    python tests/scripts/precision_trainer.py --socket S --job J [--steps 400] [--no-greend]
        [--precisions fp32,bf16] [--inject-inf-after-switch K | --inject-spike-after-switch K]
        [--step-sleep 0.01] [--task T] [--reference] [--shift-at K]
        [--initial bf16 | --own-autocast] [--fp8-min-features N] [--mem-share M]

An MLP (32 -> 128 -> 128 -> 8) learns a fixed random linear map plus noise, on
data this script makes from ``--seed``. Every step goes through
``step.autocast()``, ``step.backward(loss)`` and ``step.optimizer_step(opt)``, so
any level (fp16 with its GradScaler included) runs and the guard sees the
gradients. ``--inject-inf-after-switch K``: K steps after the first step that ran
below fp32, that step's loss is multiplied by inf (once); ``--inject-spike-after-switch
K``: that step's and the next one's by 10 instead (a finite instability, spike after
spike, gradients 10x too; "poisoned" is the second). ``--task offset-regression``:
the regression's targets sit near 16, where bf16 rounds the outputs to 1/8, which
costs a few percent of a loss this small (the bias starts at 16, so the loss falls
from the first step). ``--reference``: the callback gets ``reference_loss`` on 256
held-out samples. ``--shift-at K``: from step K on the data come from another task
(another random map, or for the classifier another labelling), a data shift;
``--shift-after-switch K``: from K steps after the first step below the job's own level.
``--initial L``: ``GreenCallback(initial_precision=L)`` (a bf16 job says so);
``--own-autocast``: the script runs its forward under its own ``torch.autocast`` at
bf16 instead of ``step.autocast()``, and tells greend nothing (greend detects it).
"Switch" here means the first step below the first step's level.

Prints one JSON line: job, steps, final_loss (the mean training loss over the
last 20 steps), eval_loss (on a held-out set, in fp32, after training), levels
(the precision of every step), losses, poisoned (the step index that got the inf,
or null), precision_events (the callback's own), reference_checks, stats.
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
    ap.add_argument("--initial", default=None, help="GreenCallback(initial_precision=...)")
    ap.add_argument("--own-autocast", action="store_true", help="the job's own bf16 autocast around its forward")
    ap.add_argument("--fp8-min-features", type=int, default=None)
    ap.add_argument("--mem-share", type=float, default=0.3)
    ap.add_argument("--reference", action="store_true", help="give the callback reference_loss")
    ap.add_argument("--no-trial", action="store_true", help="GreenCallback(probe_trial=False): a step down at once")
    ap.add_argument("--reference-every", type=int, default=50)
    ap.add_argument("--shift-at", type=int, default=-1, help="the data change task from this step on")
    ap.add_argument(
        "--shift-after-switch", type=int, default=-1, help="... from K steps after the first step below fp32"
    )
    ap.add_argument(
        "--task",
        default="regression",
        choices=(
            "regression",
            "offset-regression",
            "classifier",
            "recommender",
            "floor-regression",
            "plant-regression",
            "recommender-shift",
        ),
        help="regression (MSE); offset-regression: targets near 16, noise 0.1 (MSE); classifier: "
        "10 classes, 5%% label noise (cross entropy); recommender: clicks at a 3.8%% rate (binary cross entropy); "
        "floor-regression: noiseless targets near 5, the learning rate decays as 1/(1 + step/200), so the loss "
        "falls as a long power law (~3 %% per 32 steps) toward 1e-4, where bf16's rounding of the outputs (1/32) "
        "is a penalty that grows as it converges; plant-regression: an unnormalised sensor target "
        "near 72, noise 0.5 (bf16 rounds the outputs to 0.5); recommender-shift: clicks at ~2.5 %%, ~4.5 %% "
        "after the shift (--shift-at / --shift-after-switch): a change in the data, not a penalty",
    )
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    out_dim = {"classifier": 10, "recommender": 1, "recommender-shift": 1}.get(args.task, OUT)
    model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, out_dim))
    offset = {"offset-regression": 16.0, "floor-regression": 5.0, "plant-regression": 72.0}.get(args.task, 0.0)
    with torch.no_grad():
        model[-1].bias.fill_(offset)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    w_true = torch.randn(IN, out_dim, generator=gen) / IN**0.5
    w_shifted = torch.randn(IN, out_dim, generator=gen) / IN**0.5

    def data(n: int, g: torch.Generator, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, IN, generator=g)
        if args.task == "recommender-shift":  # the shift moves the click rate, not the task
            p = torch.sigmoid(2.0 * (x @ w_true)[:, 0] - (4.65 if shifted else 5.3))
            return x, (torch.rand(n, generator=g) < p).float()
        z = x @ (w_shifted if shifted else w_true)
        if args.task == "floor-regression":
            return x, 0.5 * z + offset
        if args.task == "plant-regression":
            return x, 3.0 * z + 0.5 * torch.randn(n, out_dim, generator=g) + offset
        if args.task == "regression":
            return x, z + 0.3 * torch.randn(n, out_dim, generator=g)
        if args.task == "offset-regression":
            return x, z + 0.1 * torch.randn(n, out_dim, generator=g) + offset
        if args.task == "classifier":
            y = (2.0 * z).argmax(dim=1)
            noisy = torch.rand(n, generator=g) < 0.05  # 5 % of the labels are wrong
            return x, torch.where(noisy, torch.randint(0, 10, (n,), generator=g), y)
        # clicks: a logistic model with a bias that puts the click rate near 3.8 %
        p = torch.sigmoid(2.0 * z[:, 0] - 3.6)
        return x, (torch.rand(n, generator=g) < p).float()

    def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if args.task.endswith("regression"):
            return nn.functional.mse_loss(out.float(), y)
        if args.task == "classifier":
            return nn.functional.cross_entropy(out.float(), y)
        return nn.functional.binary_cross_entropy_with_logits(out.float()[:, 0], y)

    x_eval, y_eval = data(4096, gen)
    x_ref, y_ref = data(256, gen)  # the reference batch: held out, fixed

    shift_at = args.shift_at

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shifted = 0 <= shift_at <= i
        return data(args.batch, torch.Generator().manual_seed(args.seed * 100_003 + i), shifted)

    cb = None
    if not args.no_greend:
        from greend import GreenCallback

        kw = {}
        if args.precisions:
            kw["precisions"] = args.precisions.split(",")
        if args.initial:
            kw["initial_precision"] = args.initial
        if args.fp8_min_features is not None:
            kw["fp8_min_features"] = args.fp8_min_features
        if args.no_trial:
            kw["probe_trial"] = False
        if args.reference:
            kw["reference_loss"] = lambda: loss_of(model(x_ref), y_ref)
            kw["reference_every"] = args.reference_every
        cb = GreenCallback(
            job=args.job,
            model=model,
            socket=args.socket,
            gpus=[args.gpu],
            mem_share=args.mem_share,
            heartbeat_s=0.5,
            reconnect_min_s=0.2,
            reconnect_max_s=0.5,
            flush_interval_s=0.05,
            loss_scaling=True,
            **kw,
        )
    decay = 200.0 if args.task == "floor-regression" else None  # the learning rate's decay (steps)
    levels: list[str] = []
    losses: list[float] = []
    first_low: int | None = None
    poisoned: int | None = None
    for i in range(args.steps):
        x, y = batch(i)  # (a shift set at this step applies from the next one)
        if decay is not None:
            for group in opt.param_groups:
                group["lr"] = args.lr / (1.0 + i / decay)
        if cb is None:
            own = args.initial or ("bf16" if args.own_autocast else "fp32")
            if own == "bf16":  # the job as it is, at its own level, without greend
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
            else:
                out = model(x)
            loss = loss_of(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            levels.append(own)
        else:
            with cb.step(samples=args.batch, batch=x) as st:
                if st.precision != (levels[0] if levels else st.precision) and first_low is None:
                    first_low = i
                    if args.shift_after_switch >= 0:
                        shift_at = i + args.shift_after_switch
                if args.own_autocast:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(x)
                else:
                    with st.autocast():
                        out = model(x)
                loss = loss_of(out, y)
                for after, factor, n in (
                    (args.inject_inf_after_switch, float("inf"), 1),
                    (args.inject_spike_after_switch, 10.0, 2),
                ):
                    if after >= 0 and first_low is not None and first_low + after <= i < first_low + after + n:
                        if poisoned is None or poisoned == i - 1:
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
        eval_loss = float(loss_of(model(x_eval), y_eval))
    stats: dict[str, float] = {}
    events: list[dict[str, object]] = []
    checks: list[dict[str, object]] = []
    probes: list[dict[str, object]] = []
    if cb is not None:
        events = cb.precision_events
        checks = cb.reference_checks
        probes = getattr(cb, "probe_checks", [])  # (a callback without probes: none)
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
                "losses": losses,
                "poisoned": poisoned,
                "shift_at": shift_at if shift_at >= 0 else None,
                "precision_events": events,
                "reference_checks": checks,
                "probe_checks": probes,
                "stats": stats,
            }
        )
    )


if __name__ == "__main__":
    main()
