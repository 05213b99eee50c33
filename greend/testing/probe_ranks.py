"""The ranks of one job running probe blocks in lockstep, without torch or a store: what
:class:`greend.training.book.StepBook` and :mod:`greend.training._probe_ranks` do with
each rank's :class:`greend.training.probe.Prober`, on made-up loss streams.

Every rank runs step ``i`` at the level its Prober gives (else the lower one) and reads
its losses in batches (rank r every ``lags[r]`` steps, as a rank whose reads land later
does). Where the ranks agree (``agreed``), a block is judged at the start of the step
after its last window step at the latest, a rank's losses go to a shared store (a dict)
and every rank judges the block on the ranks' mean loss at ``decide_at``
(:mod:`greend.training._probe_ranks`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from greend.training._probe_ranks import block_text, pooled
from greend.training.probe import Prober

__all__ = ["RanksRun", "run_ranks"]

Loss = Callable[[int, str], float]  # (step, level) -> the loss that rank reports


@dataclass
class RanksRun:
    levels: list[list[str]]  # the level each rank ran at each step
    back: list[int | None]  # the step each rank rolled back at (None: kept)
    sizes: set[int] = field(default_factory=set)  # the block sizes rank 0 ran
    probe_steps: list[int] = field(default_factory=list)  # each rank's steps at the level above for the probes

    @property
    def parted(self) -> bool:
        """Whether the ranks ran two levels at some step."""
        return len({tuple(x) for x in self.levels}) > 1


def run_ranks(
    probers: Sequence[Prober],
    losses: Sequence[Loss],
    lags: Sequence[int],
    steps: int,
    *,
    start: int = 0,
    agreed: bool = True,
    upper: str = "fp32",
) -> RanksRun:
    """Run ``steps`` steps from ``start`` on every rank (``probers`` armed already); after a
    rollback a rank runs ``upper``."""
    n = len(probers)
    for p in probers:
        p.agreed = agreed
    store: dict[tuple[int, int], dict[int, str]] = {}  # (anchor, block) -> rank -> its losses
    out = RanksRun([[] for _ in range(n)], [None] * n)
    unread: list[deque[tuple[int, str, float]]] = [deque() for _ in range(n)]

    def read(r: int, upto: int, horizon: int) -> None:
        while unread[r] and unread[r][0][0] <= upto and out.back[r] is None:
            j, level, value = unread[r].popleft()
            probers[r].horizon = horizon
            if probers[r].record(j, level, value) is not None:
                out.back[r] = horizon

    for i in range(start, start + steps):
        for r, p in enumerate(probers):
            if out.back[r] is None and agreed:
                blk = p.block
                if blk is not None and i > blk.last and p.blocks_done <= blk.seq:
                    read(r, i, i)  # (judged at the step after its last window step at the latest)
                held = p.held
                if held is not None:
                    w = (p.anchor, held[0].seq)
                    store.setdefault(w, {})[r] = block_text(held[0])
                    texts = [text for _, text in sorted(store[w].items())]
                    if i >= p.decide_at and p.decide(*pooled(held[0], texts)) is not None:
                        out.back[r] = i
            if out.back[r] is not None:
                out.levels[r].append(upper)
                continue
            level = p.level_at(i) or p.lower or upper
            if r == 0 and p.block is not None and p.block.start == i:
                out.sizes.add(p.block.steps)
            out.levels[r].append(level)
            unread[r].append((i, level, losses[r](i, level)))
            if (i - start) % lags[r] == lags[r] - 1:
                read(r, i, i + 1)
    out.probe_steps = [p.probe_steps for p in probers]
    return out
