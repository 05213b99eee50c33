"""The ranks of a job take each probe block's outcome together (``Prober.agreed``).

Each rank judges a block on its own losses, and they differ (each rank trains on its own
share of the data), so on their own the ranks would call the next block at once on some
ranks only, or roll back on some: for a while the ranks would run two levels in one step
(one rank at fp16 through the GradScaler beside one at fp32 averages scaled and unscaled
gradients; a rollback on one rank held the ranks at two levels until their next agreement
on the level, 100 to 200 steps). So, at the same steps on every rank:

* a block is judged at the start of the step after its last window step at the latest
  (the losses still in flight are waited for, once a block): a rank that reads its losses
  late no longer starts the next block later than the others;
* a rank's word on it other than "the next block at the drawn gap" (the next at once, a
  long one at once where its blocks lean, or roll back) goes to the job's store (the
  rendezvous store the level's agreement uses: no collective);
* at ``Prober.decide_at``, :data:`greend.training.probe.READ_LAG` steps later (the ranks of
  a job that trains together are a step or two apart at most), every rank reads the
  largest word written and takes it (``Prober.decide``).

A store that fails leaves each rank on its own words from then on, logged once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from greend.training.probe import Prober
from greend.training.warn import OnceWarnings

__all__ = ["RanksWord"]


class RanksWord:
    """One job's words on its probe blocks, for :class:`greend.training.book.StepBook`."""

    def __init__(self, control: Any, warnings: OnceWarnings, drain: Callable[[], None]) -> None:
        self.control = control  # (PrecisionControl: its job_peers() and probe_rollback())
        self.warnings = warnings
        self.drain = drain  # judges every ended step, waiting for the losses in flight
        self.told: tuple[int, int, int] | None = None  # the last word written to the store

    def at(self, prober: Prober, index: int) -> None:
        """At the start of step ``index`` near a block of ``prober`` (agreed)."""
        block = prober.block
        if block is not None and index > block.last and prober.blocks_done <= block.seq:
            self.drain()  # (judges the block: its last window step has ended, on every rank)
            if self.control.prober is not prober:
                return
        word = prober.word
        agreed = None
        try:
            peers = self.control.job_peers()
            if peers is None:
                raise RuntimeError("the job's ranks have no store to meet in")
            if word is not None and word[2] and self.told != word:
                self.told = word
                peers.raise_to(f"probe/{word[0]}", word[1], float(word[2]))
            if word is not None and index >= prober.decide_at:
                got = peers.read(f"probe/{word[0]}", word[1])
                agreed = None if got is None else int(got)
        except Exception as e:
            self.warnings.warn("agree", f"greend could not agree the probes' outcome across ranks: {e}")
            prober.agreed = False
        if word is None or index < prober.decide_at:
            return
        why = prober.decide(agreed)
        if why is not None:
            self.control.probe_rollback(index - 1, why, None)
