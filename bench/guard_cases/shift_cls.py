"""Benign data/schedule shifts on a tabular classifier (MLP, 20 classes, Gaussian-mixture features,
label noise), harmless at bf16. The shift hits the fp32 twin at the same absolute step.

  python bench/guard_cases/shift_cls.py [--steps 2000] [--seed 0] [--batch 64] --kind KIND --event-at SPEC[,SPEC...]

KIND (applied at each resolved event step; SPEC: see rtlib: abs:K, trial0:+k, trial1:-k, down:+k, probeB:+k):
  harder   the class means move 35 % closer (a harder curriculum stage / new data source)  [loss up]
  easier   label noise 20 % -> 5 % from here                                             [loss down]
  lrdrop   learning rate x0.1 (step decay)                                               [loss down]
  restart  learning rate back to its initial value, cosine over --period steps (SGDR)    [loss up, then down]
  badrun   the next --bad-len batches have random labels (a corrupted shard)             [spike]
  drift    the feature map rotates slowly over the next --drift-len steps               [slow rise]
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rtlib
import torch
from torch import nn

ap = argparse.ArgumentParser()
rtlib.base_args(ap)
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--kind", default="harder")
ap.add_argument("--period", type=int, default=400)
ap.add_argument("--bad-len", type=int, default=8)
ap.add_argument("--drift-len", type=int, default=600)
ap.add_argument("--noise", type=float, default=0.2)
ap.add_argument("--sep", type=float, default=1.6)
ap.add_argument("--hardness", type=float, default=0.65)
args = ap.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)
D, C = 48, 20
g = torch.Generator().manual_seed(7 + args.seed)
means = torch.randn(C, D, generator=g) * args.sep / math.sqrt(D) * math.sqrt(D) / 4
rot = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
model = nn.Sequential(nn.Linear(D, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, C))
opt = torch.optim.Adam(model.parameters(), lr=args.lr)


def sample(n, gen, i, ev):
    passed = [e for e in ev if e is not None and e <= i]
    sep, noise, theta = 1.0, args.noise, 0.0
    if args.kind == "harder" and passed:
        sep = args.hardness ** len(passed)
    if args.kind == "easier" and passed:
        noise = 0.05
    if args.kind == "drift" and passed:
        theta = min(1.0, (i - passed[0]) / args.drift_len) * 0.6
    y = torch.randint(0, C, (n,), generator=gen)
    x = means[y] * sep + torch.randn(n, D, generator=gen)
    if theta:
        r = torch.eye(D) * math.cos(theta) + (rot - rot.T) / 2 * math.sin(theta)
        x = x @ r
    flip = torch.rand(n, generator=gen) < noise
    y = torch.where(flip, torch.randint(0, C, (n,), generator=gen), y)
    if args.kind == "badrun" and any(e is not None and e <= i < e + args.bad_len for e in ev):
        y = torch.randint(0, C, (n,), generator=gen)
    return x, y


def batch(i, ev):
    return sample(args.batch, torch.Generator().manual_seed(args.seed * 100_003 + i), i, ev)


def set_lr(i, ev):
    passed = [e for e in ev if e is not None and e <= i]
    lr = args.lr
    if args.kind == "lrdrop":
        lr *= 0.1 ** len(passed)
    if args.kind == "restart":
        # constant lr until the first restart; then cosine from lr down to lr/20 over --period, restarting at each event
        if passed:
            t = (i - passed[-1]) % args.period
            lr = args.lr / 20 + (args.lr - args.lr / 20) * 0.5 * (1 + math.cos(math.pi * t / args.period))
        else:
            lr = args.lr / 20 if any(e is None for e in ev) or not ev else args.lr / 20
    for gr in opt.param_groups:
        gr["lr"] = lr


_eval = None


def evaluate():
    # held-out at the data as it is at the end of the run
    ev = batch.ev_final
    x, y = sample(8192, torch.Generator().manual_seed(999), args.steps - 1, ev)
    return nn.functional.cross_entropy(model(x).float(), y)


def loss_of(out, y):
    return nn.functional.cross_entropy(out.float(), y)


_b = batch


def batch(i, ev):
    batch.ev_final = ev
    return _b(i, ev)


batch.ev_final = []
rtlib.run(args, model, opt, batch, loss_of, evaluate, set_lr)
