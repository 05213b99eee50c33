"""The ranks of a job agree on its pace (:class:`PaceAgreement`, a part of
:class:`greend.training.book.StepBook`).

At every ``sync_every``-th step index a rank writes its daemon's ``local_pace`` (the
node's uncapped step time, its lowest uncapped step and the job step it asks a re-check
from: the channel's ``local_*``) to the job's rendezvous store and reads what the ranks
wrote one epoch before (:meth:`greend.training.peers.JobPeers.agree_pace`); what it read
goes to the channel's ``agreed_*``, which the sender sends the daemon as op ``pace``.

The job's first pace is read early: a rank that wrote a pace and has read none yet reads
the epoch it wrote a quarter epoch later, at its next hand-over from there
(:meth:`~greend.training.peers.JobPeers.read_pace`), where it would otherwise wait an
epoch: at the default ``sync_every`` of 100, from step 128 instead of step 208 with the
16-step hand-overs. Ranks in step have all written it by then.

Training thread only (the steps' hand-over and judging). A failure is logged once and never
raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from greend.training.warn import OnceWarnings

__all__ = ["FIRST_READ_SHARE", "PaceAgreement"]

# A rank that wrote the job's first pace reads it back this share of an epoch later.
FIRST_READ_SHARE = 4


class PaceAgreement:
    """The pace's part of the book (see the module)."""

    def __init__(
        self, channel: Any, peers: Callable[[], Any], warnings: OnceWarnings, sync_every: int, world_size: int
    ) -> None:
        self._channel = channel
        self._peers = peers  # the job's JobPeers, or None where there is no store
        self._warnings = warnings
        self.every = sync_every if world_size > 1 else 0  # (0: a job of one rank agrees nothing)
        self.agreed_pace_s: float | None = None  # the last pace all ranks agreed on
        self.done_to = -1  # the last step index agreed at (read_ended's steps after a hand-over)
        self.first_read: tuple[int, int] | None = None  # (epoch, from step index): the first pace's

    def through(self, first: int, n: int) -> None:
        """Steps ``first`` .. ``first + n - 1`` were handed over: the agreements due in them."""
        every = self.every
        for index in range(first + (-(first + 1)) % every, first + n, every):
            self.agree(index)  # (index + 1) is a multiple of sync_every
        if self.first_read is not None and first + n > self.first_read[1]:
            self.read_first()

    def agree(self, index: int) -> None:
        """Write this rank's figures for the epoch that ends at step ``index`` and take what
        the ranks wrote for the one before."""
        ch = self._channel
        try:
            peers = self._peers()
            if peers is None:
                return
            epoch = (index + 1) // self.every
            wrote = ch.local_pace_s is not None and ch.local_pace_s > 0
            agreed, floor, ask = peers.agree_pace(epoch, ch.local_pace_s, ch.local_floor_s, ch.local_recheck_at or 0)
        except Exception as e:
            self._warnings.warn("pace", f"greend could not agree the job's pace across ranks: {e}")
            return
        if agreed is not None and agreed > 0:
            self.first_read = None
            self._take(agreed, floor, ask)
        elif wrote and self.agreed_pace_s is None:  # the job's first pace: read early
            self.first_read = (epoch, index + max(1, self.every // FIRST_READ_SHARE))

    def read_first(self) -> None:
        """The job's first pace, from the epoch this rank wrote it in."""
        assert self.first_read is not None
        epoch, self.first_read = self.first_read[0], None
        try:
            peers = self._peers()
            agreed, floor, ask = (None, None, 0) if peers is None else peers.read_pace(epoch)
        except Exception as e:
            self._warnings.warn("pace", f"greend could not agree the job's pace across ranks: {e}")
            return
        if agreed is not None and agreed > 0 and self.agreed_pace_s is None:
            self._take(agreed, floor, ask)

    def _take(self, agreed: float, floor: float | None, ask: int) -> None:
        ch = self._channel
        self.agreed_pace_s, ch.agreed_floor_s, ch.agreed_recheck_at = agreed, floor, max(ch.agreed_recheck_at, ask)
        ch.agreed_pace_s = agreed  # (last: the sender sends all three as op "pace" once it is set)
