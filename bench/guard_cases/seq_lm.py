"""Character-level causal-conv language model on a synthetic corpus (an order-2 Markov 'language'
plus 3 % 'foreign' documents from another chain), sequences of heavy-tailed length (8..384),
token-budget batches bucketed by length and read WITHOUT shuffling: every epoch runs the same
order (sorted short -> long, or a fixed random order of the buckets), so the loss is autocorrelated
(a sawtooth over each epoch) and heavy-tailed (batches full of foreign docs). Harmless at bf16.

  python bench/guard_cases/seq_lm.py [--steps 2500] [--seed 0] [--order sorted|fixed] [--tokens 2048]
      [--foreign 0.03] [--group-foreign]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rtlib
import torch
from torch import nn

ap = argparse.ArgumentParser()
rtlib.base_args(ap)
ap.add_argument("--order", default="sorted")
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--docs", type=int, default=1500)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--foreign", type=float, default=0.03)
ap.add_argument(
    "--group-foreign", action="store_true", help="foreign docs in their own batches, at the end of each epoch"
)
args = ap.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)
V = 40
g = torch.Generator().manual_seed(11 + args.seed)


def chain(temp):  # next-symbol logits: A[prev] + B[prev2] (a learnable, generalisable order-2 language)
    A, B = torch.randn(V, V, generator=g) * temp, torch.randn(V, V, generator=g) * temp * 0.6
    return torch.softmax(A[None, :, :] + B[:, None, :], -1)


P_main, P_foreign = chain(2.5), chain(2.5)


def doc(n, P, gen):
    s = [int(torch.randint(0, V, (1,), generator=gen)), int(torch.randint(0, V, (1,), generator=gen))]
    for _ in range(n - 2):
        s.append(int(torch.multinomial(P[s[-2], s[-1]], 1, generator=gen)))
    return s


def corpus(n, gen, tagged=False):
    out = []
    for _ in range(n):
        L = int(min(384, max(8, torch.empty(1).log_normal_(3.8, 0.8, generator=gen).item())))
        f = torch.rand(1, generator=gen).item() < args.foreign
        out.append((doc(L, P_foreign if f else P_main, gen), f) if tagged else doc(L, P_foreign if f else P_main, gen))
    return out


def pad(docs):
    T = max(len(d) for d in docs)
    x = torch.zeros(len(docs), T, dtype=torch.long)
    y = torch.full((len(docs), T), -100, dtype=torch.long)
    for k, d in enumerate(docs):
        t = torch.tensor(d)
        x[k, : len(d) - 1] = t[:-1]
        y[k, : len(d) - 1] = t[1:]
    return x, y


tagged = corpus(args.docs, g, tagged=True)
held = corpus(150, g)


def bucket(docs):
    docs = sorted(docs, key=len)  # bucket by length
    out, cur = [], []
    for d in docs:
        if cur and (len(cur) + 1) * len(d) > args.tokens:
            out.append(pad(cur))
            cur = []
        cur.append(d)
    out.append(pad(cur))
    return out


if args.group_foreign:  # the foreign source in its own batches, read as a block at the end of every epoch
    batches = bucket([d for d, f in tagged if not f]) + bucket([d for d, f in tagged if f])
else:
    batches = bucket([d for d, _ in tagged])
if args.order == "fixed":
    perm = torch.randperm(len(batches), generator=g).tolist()
    batches = [batches[k] for k in perm]
print(f"epoch of {len(batches)} batches", file=sys.stderr)


class CausalConvLM(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.convs = nn.ModuleList([nn.Conv1d(d, d, 3, dilation=dl) for dl in (1, 2, 4)])
        self.head = nn.Linear(d, V)

    def forward(self, x):
        h = self.emb(x).transpose(1, 2)
        for c in self.convs:
            pad_ = c.dilation[0] * 2
            h = h + torch.relu(c(nn.functional.pad(h, (pad_, 0))))
        return self.head(h.transpose(1, 2))


model = CausalConvLM()
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def batch(i, ev):
    return batches[i % len(batches)]


def loss_of(out, y):
    return nn.functional.cross_entropy(out.float().reshape(-1, V), y.reshape(-1), ignore_index=-100)


hx, hy = pad(held)
rtlib.run(args, model, opt, batch, loss_of, lambda: loss_of(model(hx), hy))
