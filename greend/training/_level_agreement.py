"""The ranks of a job agree on its precision level (:class:`LevelAgreement`, a part of
:class:`greend.training.precision_control.PrecisionControl`).

Every ``sync_every`` steps each rank writes the level it wants (its daemon's directive
where it can run it, else the level it runs) to the job's rendezvous store and reads what
the ranks wrote one agreement before: the most precise of those levels (a MAX, as for the
pace). Ranks in step read the same key at the same step, so they switch together: down
only when every rank's daemon asks for it, up (a rollback on any rank) for all.

After a rollback while the ranks agree (a rank's own, by the guard's rules, or the ranks'
probes together), the probes of the level it leads to wait for the first agreement that
has this rank's level (where the other ranks switch to it, or are there already): the same
step on every rank. An agreement whose read fails is skipped; where it fails once this
rank's word naming the level is out, the others have read it by then, and the probes start
there too (one failed read moved them an agreement later on one rank: two levels at some
steps). At :data:`AGREE_TRIES` failed agreements in a row, or without a store, each rank
goes on alone, as a single process does. A failure is logged once and never raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from greend.protocol import PRECISIONS
from greend.training.mixed_precision import PrecisionEvent
from greend.training.probe import Prober
from greend.training.warn import log

__all__ = ["AGREE_TRIES", "LevelAgreement"]

AGREE_TRIES = 3  # agreements in a row whose store call fails: each rank on its own from then on


class LevelAgreement:
    """The agreement's part of the callback's precision (see the module)."""

    # (PrecisionControl's, which this is a part of)
    level: str
    proposal: str | None
    seen_request: str | None
    agreeing: bool
    detecting: bool
    support: dict[str, str | None]
    guard: Any
    prober: Prober | None
    _steps: Any
    _warnings: Any
    rearm: bool  # the probes wait for the agreement that has this rank's level (set by a rollback)
    _worded: int | None  # the agreement this rank's word first named that level at
    _agree_failed: int  # agreements in a row the store failed at

    if TYPE_CHECKING:

        @property
        def _next_index(self) -> int: ...
        def job_peers(self) -> Any: ...
        def above_own(self, level: str) -> str | None: ...
        def _switch(self, level: str, why: str) -> str | None: ...
        def _send_event(self, ev: PrecisionEvent) -> None: ...
        def _last_loss(self) -> float | None: ...

    def agree(self, epoch: int) -> None:
        """At the start of every ``sync_every``-th step: the job's ranks agree on its level."""
        try:
            peers = self.job_peers()
            agreed = None if peers is None else peers.agree_max("precision", epoch, None)  # (reads only)
        except Exception as e:
            self._warnings.warn("agree", f"greend could not agree the job's precision across ranks: {e}")
            if self.rearm and self._worded is not None and epoch > self._worded:
                self.reprobe()  # (the other ranks read this rank's word by now: they are at its level)
            if self._failed():
                return  # (this agreement's read and this rank's word lost; the ranks still agree)
            peers = None
        if peers is None:
            self._alone()
            return
        if agreed is not None:
            level = PRECISIONS[max(0, min(len(PRECISIONS) - 1, len(PRECISIONS) - int(agreed)))]
            self._take_agreed(level)
            if self.rearm and level == self.level:
                self.reprobe()  # (the probes from this step, on every rank at this level now)
        # This rank's word, after the agreed level is applied (never the level left behind);
        # none while the job's own level is not known (the level in force says nothing then).
        if not self.detecting:
            wanted = self.proposal or self.level
            try:
                peers.raise_to("precision", epoch, float(len(PRECISIONS) - PRECISIONS.index(wanted)))
            except Exception as e:
                self._warnings.warn("agree", f"greend could not agree the job's precision across ranks: {e}")
                if not self._failed():
                    self._alone()
                return
            if self.rearm and self._worded is None:
                self._worded = epoch
        self._agree_failed = 0

    def _failed(self) -> bool:
        """One more agreement the store failed at: whether the ranks still agree."""
        self._agree_failed += 1
        return self._agree_failed < AGREE_TRIES

    def _alone(self) -> None:
        """No store to meet in (none, or it failed AGREE_TRIES times in a row): each rank on its own."""
        self.agreeing = False
        if self.rearm:
            self.reprobe()  # (no agreement to wait for)
        if self.proposal is not None:
            self.proposal = None
            self.seen_request = None  # the directive is taken again, alone, at the next step

    def after_rollback(self) -> None:
        """A rollback, while the ranks agree: the probes wait (:meth:`agree`)."""
        self.rearm, self._worded = self.agreeing, None

    def reprobe(self, now: bool = True) -> None:
        """The probes from the step about to start (``now``), or off while they wait."""
        if now:
            self.rearm = False
        if self._steps is not None:
            self._steps.switched(self.level, False)

    def _take_agreed(self, level: str) -> None:
        """Run the level the ranks agreed on, never above the job's own level; down only
        while this rank still proposes that level or one below it (the epoch's words were
        written before: a rollback since, or a directive withdrawn, keeps it where it is,
        and its next word takes the others up)."""
        proposed = self.proposal
        if level == proposed:
            self.proposal = None
        if self._steps is not None:
            self._steps.flush()  # a rollback among the losses already in goes first
        old = self.level
        if level == old or self.support.get(level) is not None or self.above_own(level) is not None:
            return
        step = self._next_index
        if PRECISIONS.index(level) > PRECISIONS.index(old) and (
            proposed is None
            or PRECISIONS.index(proposed) < PRECISIONS.index(level)
            or self.guard.barred_reason(level, step) is not None
        ):
            why = self.guard.barred_reason(level, step) or "its daemon withdrew it"
            log.info("precision %s agreed by the ranks at step %d not taken: %s; staying at %s", level, step, why, old)
            return
        self.rearm = False  # (a switch the ranks agreed: the probes start here on every rank)
        in_trial = self.prober is not None and self.prober.trial  # (before the switch re-arms it)
        if self._switch(level, f"agreed by the job's ranks at step {step}") is None and (
            PRECISIONS.index(level) < PRECISIONS.index(old) and proposed != level
        ):
            # Up, and not what this rank's daemon asked: another rank rolled back (during a
            # trial, the level was never run but for its blocks: refused, as that rank told it).
            why = f"another rank of the job went back to {level}; the ranks agreed at step {step}"
            ev = (PrecisionEvent("refused", level, old, why + " during this rank's trial of " + old, step=step)
                  if in_trial else PrecisionEvent("rollback", old, level, why, step=step))  # fmt: skip
            ev.loss, ev.trend = self._last_loss(), self.guard.trend()
            self._send_event(ev)
