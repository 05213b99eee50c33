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

A store that fails leaves each rank on its own losses from then on, logged once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from greend.training.probe import Prober, _Block
from greend.training.warn import OnceWarnings

__all__ = ["JointJudge", "block_text", "pooled"]


def block_text(blk: _Block) -> str:
    """A rank's losses of a judged block as they go to the other ranks."""
    return json.dumps({"b": blk.before, "u": blk.upper, "a": blk.after}, separators=(",", ":"))


def pooled(blk: _Block, texts: list[str]) -> tuple[_Block, int]:
    """``blk`` with the mean of the ranks' losses (``texts``: :func:`block_text` each, in
    rank order) at each step, each step's mean over the ranks that have a loss there; and
    how many ranks it pools."""
    rows = []
    for text in texts:
        try:
            rows.append(json.loads(text))
        except ValueError:
            continue  # (not a block's losses: that rank left out)

    def by_step(key: str) -> list[tuple[int, float]]:
        at: dict[int, list[float]] = {}
        for row in rows:
            for i, v in row[key]:
                at.setdefault(int(i), []).append(float(v))
        return [(i, sum(vs) / len(vs)) for i, vs in sorted(at.items())]

    width = max((len(row["u"]) for row in rows), default=0)
    upper = [[float(row["u"][k]) for row in rows if k < len(row["u"])] for k in range(width)]
    job = replace(blk, before=by_step("b"), upper=[sum(vs) / len(vs) for vs in upper], after=by_step("a"))
    return job, len(rows)


class JointJudge:
    """One rank's part in judging its job's probe blocks, for :class:`greend.training.book.StepBook`."""

    def __init__(self, control: Any, warnings: OnceWarnings, drain: Callable[[], None]) -> None:
        self.control = control  # (PrecisionControl: its job_peers() and probe_rollback())
        self.warnings = warnings
        self.drain = drain  # judges every ended step, waiting for the losses in flight
        self.told: tuple[int, int] | None = None  # the last block this rank wrote its losses for

    def at(self, prober: Prober, index: int) -> None:
        """At the start of step ``index`` near a block of ``prober`` (agreed; while the ranks
        agree on the level, every step: nothing to do costs three compares)."""
        block = prober.block
        if prober.held_key is None and (block is None or index <= block.last):
            return
        if block is not None and index > block.last and prober.blocks_done <= block.seq:
            self.drain()  # (judges the block: its last window step has ended, on every rank)
            if self.control.prober is not prober:
                return
        if prober.held is None or prober.held_key is None:
            return
        blk, (anchor, seq) = prober.held[0], prober.held_key
        job: _Block | None = None
        ranks = 1
        try:
            peers = self.control.job_peers()
            if peers is None:
                raise RuntimeError("the job's ranks have no store to meet in")
            if self.told != (anchor, seq):
                told, self.told = self.told, (anchor, seq)
                forget = None if told is None else f"probe/{told[0]}/{told[1]}"  # (read by every rank by now)
                peers.tell(f"probe/{anchor}/{seq}", block_text(blk), forget)
            if index < prober.decide_at:
                return
            job, ranks = pooled(blk, peers.hear(f"probe/{anchor}/{seq}", prober.ranks))
        except Exception as e:
            self.warnings.warn("agree", f"greend could not judge the probes with the job's other ranks: {e}")
            prober.agreed = False  # (this block on this rank's losses alone, now)
        why = prober.decide(job, ranks)
        if why is not None:
            self.control.probe_rollback(index - 1, why, None, together=prober.agreed)
