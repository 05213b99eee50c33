"""The ranks of a job judge each probe block together (``Prober.agreed``), on the job's loss.

Each rank runs the blocks on its own share of the data, and its losses alone say less
than all of them: judged apart, the ranks' verdicts differed, and a job rolled back where
any one rank said so (a 2 % penalty, within the tolerance, under 10 % step-to-step noise:
8 ranks rolled back in 49 of 60 made-up runs, one rank in 11, ``bench/bench_probe_rule.py``);
and for a while the ranks ran two levels in one step (a block called at once or a rollback
on some ranks only, a rank whose late reads shifted its next block: under fp16 one rank's
gradients through the GradScaler and the other's not, averaged by DDP). So, at the same
steps on every rank:

* a block is judged at the start of the step after its last window step at the latest
  (the losses still in flight are waited for, once a block), so late reads move nothing;
* each rank's losses around and in the block (:func:`block_text`) go to the job's store
  (the rendezvous store the level's agreement uses: no collective);
* at ``Prober.decide_at``, :data:`greend.training.probe.READ_LAG` steps later (the ranks of
  a job that trains together are a step or two apart at most), every rank reads them all
  and judges the block on their mean at each step (:func:`pooled`): the job's loss, what a
  single process with the whole batch would see, its noise that of the mean (batches alike
  on every rank at once, a data order, average out no more than they do). The same numbers
  in the same order on every rank: the same verdict, and the same decision.

The ranks' losses are read from :data:`READ_EARLY` steps before ``decide_at`` on, again at
each step until all are in; where the store fails through it all, a rank judges that block
on its own losses, at ``decide_at`` still (logged once), and tries the store again for the
next one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from greend.training.probe import Prober, _Block
from greend.training.warn import OnceWarnings

__all__ = ["READ_EARLY", "JointJudge", "block_text", "pooled"]

READ_EARLY = 8  # the ranks' losses of a block are read from this many steps before decide_at on


def block_text(blk: _Block) -> str:
    """A rank's losses of a judged block as they go to the other ranks."""
    return json.dumps({"b": blk.before, "u": blk.upper, "a": blk.after}, separators=(",", ":"))


def pooled(blk: _Block, texts: list[str]) -> tuple[_Block, int]:
    """``blk`` with the ranks' mean loss (``texts``: :func:`block_text` each, in rank order)
    at each of its steps; and how many ranks it pools. Only the ranks that have every one of
    the block's probe losses, and only the window steps where each of them has a loss: a mean
    over other ranks at other steps would move with the ranks' own loss scales (a rank with
    a harder shard missing one step reads as a jump)."""
    rows = []
    for text in texts:
        try:
            rows.append(json.loads(text))
        except ValueError:
            continue  # (not a block's losses: that rank left out)
    width = max((len(row["u"]) for row in rows), default=0)
    rows = [row for row in rows if len(row["u"]) == width]

    def mean_at(key: str) -> list[tuple[int, float]]:
        at: dict[int, list[float]] = {}
        for row in rows:
            for i, v in row[key]:
                at.setdefault(int(i), []).append(float(v))
        return [(i, sum(vs) / len(vs)) for i, vs in sorted(at.items()) if len(vs) == len(rows)]

    before = mean_at("b")
    upper = [sum(float(row["u"][k]) for row in rows) / len(rows) for k in range(width)]
    # (shared: its steps before that were the previous block's after, placed before before_from
    # where the blocks ran back to back: counted from the pooled steps, the same on every rank)
    shared = sum(1 for i, _ in before if i < blk.before_from)
    return replace(blk, before=before, upper=upper, after=mean_at("a"), shared=shared), len(rows)


class JointJudge:
    """One rank's part in judging its job's probe blocks, for :class:`greend.training.book.StepBook`."""

    def __init__(self, control: Any, warnings: OnceWarnings, drain: Callable[[], None]) -> None:
        self.control = control  # (PrecisionControl: its job_peers() and probe_rollback())
        self.warnings = warnings
        self.drain = drain  # judges every ended step, waiting for the losses in flight
        self.told: tuple[int, int] | None = None  # the last block this rank wrote its losses for
        self.heard: tuple[tuple[int, int], list[str]] | None = None  # a block's losses read from the ranks

    def at(self, prober: Prober, index: int) -> None:
        """At the start of step ``index`` near a block of ``prober`` (agreed; while the ranks
        agree on the level, every step: nothing to do costs three compares)."""
        block = prober.block
        if prober.held is None and (block is None or index <= block.last):
            return
        if block is not None and index > block.last and prober.blocks_done <= block.seq:
            self.drain()  # (judges the block: its last window step has ended, on every rank)
            if self.control.prober is not prober:
                return
        if prober.held is None:
            return
        blk, mark = prober.held[0], (prober.anchor, prober.held[0].seq)
        key = f"probe/{mark[0]}/{mark[1]}"
        if self.told != mark:
            told, self.told = self.told, mark
            forget = None if told is None else f"probe/{told[0]}/{told[1]}"  # (read by every rank by now)
            self._store("write", lambda peers: peers.tell(key, block_text(blk), forget))
        if index < prober.decide_at - READ_EARLY:
            return
        # Read from READ_EARLY steps before decide_at (every rank has written by then), again
        # at each step until every rank's losses are in: one failed read does not leave this
        # rank alone with its own losses while the others pool theirs.
        heard = self.heard[1] if self.heard is not None and self.heard[0] == mark else None
        if heard is None or len(heard) < prober.ranks:
            got = self._store("read", lambda peers: peers.hear(key, prober.ranks))
            if got is not None and (heard is None or len(got) >= len(heard)):
                heard, self.heard = got, (mark, got)
        if index < prober.decide_at:
            return
        # (None read at all: this block on this rank's losses alone; the next with the ranks again)
        job, ranks = pooled(blk, heard) if heard else (None, 1)
        why = prober.decide(job, ranks)
        if why is not None:
            self.control.probe_rollback(index - 1, why, None, together=True)
        if self.control.rearm:  # (a rollback, here or alone meanwhile: the probes wait for the agreement, off now)
            self.control.reprobe(now=False)

    def _store(self, what: str, call: Callable[[Any], Any]) -> Any:
        """``call(peers)`` on the job's store; None (logged once) where it fails."""
        try:
            peers = self.control.job_peers()
            if peers is None:
                raise RuntimeError("the job's ranks have no store to meet in")
            return call(peers)
        except Exception as e:
            self.warnings.warn("agree", f"greend could not {what} the probes' losses with the job's other ranks: {e}")
            return None
