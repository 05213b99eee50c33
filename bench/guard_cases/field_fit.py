"""Neural field (coordinate MLP with Fourier features) fitting an 8-bit grayscale image whose
targets are the raw pixel values 0..255 (not normalised: a common shortcut). The fit keeps
improving as a power law; bf16 rounds outputs in 128..255 to 1.0 (var 1/12) and 64..128 to 0.5, a
penalty that is ~nothing while the MSE is tens of gray levels^2 and grows as it converges to ~1.

  python bench/guard_cases/field_fit.py [--steps 3000] [--seed 0] [--no-greend] [--socket S --job J]
      [--lr 3e-3] [--decay 400] [--batch 512] [--bright 1.0] [--rects N] [--res R]
      [--milestones 0.5,0.75] [--warmup W] [--fp32-encoding]
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
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--decay", type=float, default=400.0, help="lr / (1 + step/decay)")
ap.add_argument("--batch", type=int, default=512)
ap.add_argument("--bright", type=float, default=1.0, help="scale of the image's dynamic range around 128")
ap.add_argument("--res", type=int, default=64)
ap.add_argument("--rects", type=int, default=8)
ap.add_argument("--warmup", type=int, default=0, help="linear lr warmup over this many steps")
ap.add_argument("--fp32-encoding", action="store_true")
ap.add_argument("--milestones", type=lambda t: [float(v) for v in t.split(",") if v], default=[])
args = ap.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(1000 + args.seed)
R = args.res
u = torch.linspace(-1, 1, R)
yy, xx = torch.meshgrid(u, u, indexing="ij")
img = torch.zeros(R, R)
for _ in range(6):  # smooth blobs
    c = torch.rand(2, generator=g) * 2 - 1
    s = 0.2 + 0.4 * torch.rand(1, generator=g)
    a = (torch.rand(1, generator=g) - 0.5) * 160
    img += a * torch.exp(-((xx - c[0]) ** 2 + (yy - c[1]) ** 2) / (2 * s**2))
for _ in range(args.rects):  # flat-shaded shapes with sharp edges (hard for an MLP: slow power law)
    c = torch.rand(2, generator=g) * 2 - 1
    wh = 0.1 + 0.5 * torch.rand(2, generator=g)
    a = (torch.rand(1, generator=g) - 0.5) * 80
    img += a * (((xx - c[0]).abs() < wh[0]) & ((yy - c[1]).abs() < wh[1])).float()
for _ in range(3):  # gentle gratings
    f = torch.randn(2, generator=g) * 2.0
    img += 12 * torch.sin(math.pi * (f[0] * xx + f[1] * yy) + 6.28 * torch.rand(1, generator=g))
img = 140 + args.bright * (img - img.mean())
img = img.clamp(0, 255).round()  # an 8-bit image
coords = torch.stack([xx.flatten(), yy.flatten()], 1)
target = img.flatten()[:, None]
B = torch.randn(2, 48, generator=g) * 2.5


class Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(96, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
        with torch.no_grad():
            self.net[-1].bias.fill_(140.0)

    def forward(self, p):
        if args.fp32_encoding:  # the positional encoding's projection kept out of autocast
            with torch.autocast("cpu", enabled=False):
                z = 2 * math.pi * p.float() @ B
        else:
            z = 2 * math.pi * p @ B  # a matmul: autocast runs it in bf16 (phases rounded to 1/8-1/4 rad)
        return self.net(torch.cat([torch.sin(z), torch.cos(z)], 1))


model = Field()
opt = torch.optim.Adam(model.parameters(), lr=args.lr)


def set_lr(i, ev):
    f = 1 / (1 + i / args.decay) if args.decay > 0 else 1.0
    for m in args.milestones:  # step decay (x0.3 at each milestone, as a fraction of the run)
        if i >= m * args.steps:
            f *= 0.3
    if args.warmup:
        f *= min(1.0, 0.05 + i / args.warmup)
    for gr in opt.param_groups:
        gr["lr"] = args.lr * f


def batch(i, ev):
    gi = torch.Generator().manual_seed(args.seed * 100_003 + i)
    idx = torch.randint(0, R * R, (args.batch,), generator=gi)
    return coords[idx], target[idx]


def loss_of(out, y):
    return nn.functional.mse_loss(out.float(), y)


rtlib.run(args, model, opt, batch, loss_of, lambda: loss_of(model(coords), target), set_lr)
