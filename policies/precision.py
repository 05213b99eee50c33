"""``precision``: step a job down in precision while the loss allows and the joules say it pays.

The daemon runs this policy beside its clock/power policy (``[policy] precision =
"precision"``, parameters in ``[policy.precision_params]``). It only fills
:attr:`Decision.precision` (job -> level), with a reason a human can read and,
in ``details["jobs"][job]["event"]``, the switch or rollback with its loss figures.

How it decides (a newcomer's tour)
----------------------------------

*The ladder.* ``ladder`` (default ``fp32,bf16,fp8``) lists the rungs, highest
first. Per job it keeps the rungs the job registered (``JobView.precisions``):
``bf16`` stands in as ``tf32`` on a GPU without bf16, ``fp8`` as ``fp8-emulated``
when only that one was offered (CPU tests list it explicitly). A level a job does
not run is never asked for. On the CPU tf32 does not exist, so nothing is spent
on a rung that buys nothing.

*Evidence.* Each decision the policy takes the job's measure (``JobView.measure``:
steps, FLOPs, time and energy since the GPU setting took effect) and books the
increment since its previous look to the level in force. The first interval
after a switch is skipped (steps still in flight at the old level), as is any
interval in which the level or the GPU setting moved. So each level gets its own
energy per FLOP.

*Stepping down.* One rung at a time, when all hold: the job has run
``min_steps`` measured steps and ``window`` losses at the current level; the loss
is stable: a least-squares line through the level's last losses (at least
``window``, up to ``8 * window``) changes by at most ``max_slope`` of the mean per
``window`` steps, and that change is known to within ``max_noise`` of the mean (its
standard error, from the residual spread and the number of losses: a noisy loss,
small batches near convergence, is stable once enough steps pin its slope down; a
falling loss is not, however quiet); no non-finite step since the level began; the next rung is not
barred; and it has not been seen to save less than ``min_saving`` before.

*Probation.* (A job that probes is judged by its probes instead, below.) A new level
is held for ``probation_steps`` steps. Meanwhile the
mean loss after the switch (skipping ``grace_steps``) is compared with the level
before it (the mean of the last ``window`` losses: a line's end would undershoot a
loss that flattens as it falls), with the standard error of that excess (the
after-losses' spread over their number, and the level's own error):
worse than ``tolerance`` (relative) by more than 2 standard errors, over at least
``min(probation_steps, window)`` losses, or any non-finite step, rolls back to the
previous level at once and bars the failed one for ``cooldown_s``. Noisy losses
(small batches, rare labels) whose excess is not yet known to be within the
tolerance keep the probation going, up to 4 x ``probation_steps``; there, a point
estimate over the tolerance that is also 2 standard errors over the trend rolls
back. At the end of probation the energy per FLOP of the two
levels is compared: a saving below ``min_saving`` goes back up too (and bars
the level for ``cooldown_s``: it buys nothing here; with no figure of both levels at one GPU
setting, it waits up to ``FIGURE_WAIT_S`` for one, then goes back). Else it is accepted.

*Jobs that probe.* A job whose ranks all run probe blocks (``JobView.probe_every``,
:mod:`greend.training.probe`: while below its own level, a few steps at the level above
every few hundred steps, compared with the steps around them) is judged on them: the
ranks roll back themselves when the level is surely worse than their tolerance against
the level above at the same point in training, for as long as it is in force, and a
falling loss, a change in the data or noise moves both sides of that comparison alike.
Its probation lasts ``probation_steps`` or :data:`PROBE_PROBATION_STEPS` (the first two
blocks), whichever is longer, with no loss comparison; then the energy is judged. The
probe steps come as probe rows: they never move the job's level, and their losses are
not the level's (``JobView.probe_steps`` counts them).

*Jobs with a reference batch.* A job whose ranks all check the level against fp32
on a fixed batch (``GreenCallback(reference_loss=...)``, :mod:`greend.training.reference`;
``JobView.reference_every``) is judged on that instead of the training losses: the
ranks roll back themselves when the level is surely worse than ``reference_tolerance``
there, during probation and for the rest of the run, and a falling loss or a change in
the data does not move that figure. Its probation lasts ``probation_steps`` or three
checks, whichever is longer, with no loss comparison; then the energy is judged.

*Proposals.* Each level the policy asks for (a step down, a rollback, a level that
bought nothing left) is a proposal until the job's ranks run it: the daemon's
``JobView.precision`` is the level the ranks' steps report, ``proposed_precision``
the one asked for and not yet applied. Meanwhile the job's losses and energy stay
the old level's and nothing is judged at the new one; the probation starts at the
step the new level took effect (``precision_since_step``), against the old level's
last window up to there. In a job of several ranks the ranks agree on the most
precise level any of them asks, so a proposal may never take: the policy then waits
(it does not ask again, roll back or bar anything); the daemon logs it as not taken.

*The callback's own rollbacks.* The callback rolls back at once on a
non-finite loss or gradient and reports it (``precision_events``, kind
``rollback``); a level it refused comes back as kind ``refused``. The policy
reads these, bars the level for ``cooldown_s`` and follows the job's level.

The policy is pure: no I/O, no clocks (``snap.t_s`` only); all memory lives in
the state object from :meth:`PrecisionPolicy.new_state`.
"""

from __future__ import annotations

import math
from typing import Any

from greend.errors import PolicyError
from greend.protocol import PRECISIONS

from .base import Decision, JobView, Setting, Snapshot
from .params import Param, validate_params
from .precision_state import (
    FIGURE_WAIT_S,
    GUARD_Z,
    PROBATION_EXTEND,
    PROBE_PROBATION_STEPS,
    REFERENCE_CHECKS,
    SEEN_KEEP,
    STABILITY_WINDOWS,
    STAND_INS,
    Evidence,
    JobMemory,
    Pending,
    PrecisionState,
    Probation,
    loss_trend,
    mean_text,
)

__all__ = ["REFERENCE_CHECKS", "PrecisionPolicy", "PrecisionState", "loss_trend"]


class PrecisionPolicy:
    """Steps running jobs down the precision ladder under an accuracy guard."""

    name = "precision"
    help = (
        "precision downgrades per job (fp32 -> bf16 -> fp8) when the loss is stable and the "
        "measured energy per FLOP drops; rolls back on a loss worse than its trend"
    )
    PARAMS: tuple[Param, ...] = (
        Param("ladder", "str", "fp32,bf16,fp8", "levels to walk down, highest first (comma separated)"),
        Param(
            "window", "int", 32, "losses over which the loss must be stable (and the trend is fitted)", lo=4, hi=100000
        ),
        Param(
            "max_slope",
            "float",
            0.05,
            "stable: fitted loss change per window, relative to its mean",
            lo=0,
            hi=10,
        ),
        Param(
            "max_noise",
            "float",
            0.02,
            "stable: the standard error of that change per window, relative to the mean (a noisy loss "
            "waits for more steps)",
            lo=0,
            hi=10,
        ),
        Param("min_steps", "int", 8, "measured steps a level needs before its energy counts", lo=1, hi=100000),
        Param("min_saving", "float", 0.05, "energy per FLOP a step down must save (fraction) to be kept", lo=0, hi=1),
        Param(
            "probation_steps",
            "int",
            100,
            "steps a new level is held and watched before the next step",
            lo=1,
            hi=10_000_000,
        ),
        Param("grace_steps", "int", 2, "losses right after a switch left out of the trend check", lo=0, hi=10000),
        Param(
            "tolerance",
            "float",
            0.05,
            "roll back when the loss after a switch exceeds the trend before it by more than this fraction",
            lo=0,
            lo_open=True,
            hi=10,
        ),
        Param(
            "cooldown_s",
            "float",
            600.0,
            "a level that failed (or bought nothing) is not tried again for this long",
            lo=0,
        ),
    )

    def __init__(self, **params: Any) -> None:
        p = validate_params(self.name, self.PARAMS, params)
        ladder = tuple(x.strip() for x in str(p["ladder"]).split(",") if x.strip())
        bad = [x for x in ladder if x not in PRECISIONS]
        if not ladder or bad or len(set(ladder)) != len(ladder):
            raise PolicyError(
                f"policy {self.name!r}: bad value {p['ladder']!r} for 'ladder'; allowed: "
                f"distinct levels from {', '.join(PRECISIONS)}, highest first"
            )
        self._p = p
        self.ladder = ladder
        self.window: int = p["window"]
        self.max_slope: float = p["max_slope"]
        self.max_noise: float = p["max_noise"]
        self.min_steps: int = p["min_steps"]
        self.min_saving: float = p["min_saving"]
        self.probation_steps: int = p["probation_steps"]
        self.grace_steps: int = p["grace_steps"]
        self.tolerance: float = p["tolerance"]
        self.cooldown_s: float = p["cooldown_s"]

    def params(self) -> dict[str, Any]:
        return dict(self._p)

    def new_state(self) -> PrecisionState:
        return PrecisionState()

    # ------------------------------------------------------------------ decide

    def decide(self, snap: Snapshot, state: PrecisionState) -> Decision:
        d = Decision()
        running = [j for j in snap.jobs if j.state == "running"]
        names = {j.job for j in running}
        for name in list(state.jobs):
            if name not in names:
                del state.jobs[name]
        reasons: list[str] = []
        details: dict[str, Any] = {}
        for j in running:
            js = state.jobs.get(j.job)
            if js is None:
                js = state.jobs[j.job] = JobMemory(
                    level=j.precision,
                    level_since_steps=j.steps,
                    last_steps=j.steps,
                    last_probe_steps=j.probe_steps,
                    last_nonfinite=j.nonfinite_recent,
                    nonfinite_at_start=j.nonfinite_recent,
                )
            reason, target, event = self._step_job(snap, j, js)
            if target is not None and target != j.precision:
                if target not in j.precisions:  # never ask what the job cannot run
                    reason = f"job {j.job}: {target} is not a level it runs; holding {j.precision}"
                    if js.pending is not None and js.pending.to_level == target:
                        js.pending = None  # not asked: nothing to wait for
                else:
                    d.precision[j.job] = target
            reasons.append(reason)
            details[j.job] = self._details(j, js, event)
        d.reason = "; ".join(reasons) if reasons else "precision: no running job"
        d.details = {
            "policy": self.name,
            "jobs": details,
            "reasons": {name: info["reason"] for name, info in details.items()},
        }
        return d

    # ------------------------------------------------------------------ per job

    def _rungs(self, j: JobView) -> list[str]:
        """The ladder as this job can walk it (stand-ins substituted, the rest dropped)."""
        out: list[str] = []
        for rung in self.ladder:
            for level in (rung, *STAND_INS.get(rung, ())):
                if level in j.precisions:
                    if level not in out:
                        out.append(level)
                    break
        return out

    def _step_job(self, snap: Snapshot, j: JobView, js: JobMemory) -> tuple[str, str | None, dict[str, Any] | None]:
        """One decision for one job: (reason, level to ask or None, event details or None)."""
        t = snap.t_s
        self._expire(js, t)
        self._read_events(j, js, t)
        new_losses = self._take_losses(j, js)
        if js.pending is not None:
            waiting = self._pending(snap, j, js, new_losses)
            if waiting is not None:
                return waiting
        if j.precision != js.level:
            # Someone else moved the level (the callback rolled back, an operator): follow it.
            self._enter_level(js, j, j.precision)
            js.probation = None
            return (f"job {j.job}: now at {j.precision} ({js.last_event or 'changed outside the policy'})", None, None)
        js.level_losses.extend(new_losses)
        del js.level_losses[: -max(STABILITY_WINDOWS * self.window, (PROBATION_EXTEND + 1) * self.probation_steps)]
        self._book(j, js)

        pb = js.probation
        if pb is not None:
            return self._watch(snap, j, js, pb)
        return self._maybe_step_down(snap, j, js)

    def _pending(
        self, snap: Snapshot, j: JobView, js: JobMemory, new_losses: list[float]
    ) -> tuple[str, str | None, dict[str, Any] | None] | None:
        """A level asked for and not yet applied: a decision while it is awaited (the
        job runs its old level: its losses and energy stay that level's); once the ranks
        run it, the new level begins (a step down's probation: None, watched at once;
        ``new_losses`` are booked then and emptied); None when it is gone (refused,
        withdrawn, overtaken), to decide afresh."""
        pd = js.pending
        assert pd is not None
        if j.precision == pd.to_level:
            # The ranks run it: the level's evidence starts where it took effect. This
            # interval's losses since then are its own (where the daemon does not say
            # when, all of them are booked to the old level); those before are the old level's.
            js.pending = None
            since = j.precision_since_step
            own = 0 if since is None else max(0, min(len(new_losses), j.steps - since))
            js.level_losses.extend(new_losses[: len(new_losses) - own])
            old_losses = js.level_losses[-STABILITY_WINDOWS * self.window :]
            nonfinite_before = js.last_nonfinite_prev
            self._enter_level(js, j, pd.to_level)
            js.level_losses = new_losses[len(new_losses) - own :]
            new_losses.clear()  # (booked here)
            if pd.kind != "switch":
                js.probation = None
                js.last_event = f"the ranks run {pd.to_level} again ({pd.why})"
                return (f"job {j.job}: {js.last_event}", None, None)
            # A step down: its probation, against the old level's last window up to the
            # last step it ran. A non-finite step in this interval counts against it.
            js.nonfinite_at_start = nonfinite_before
            _, _, _, sd = loss_trend(old_losses)
            last = old_losses[-self.window :] or [math.nan]
            start = since if since is not None else j.steps
            js.probation = Probation(
                pd.from_level, pd.to_level, start, js.losses_seen, sum(last) / len(last), sd, sd / math.sqrt(len(last))
            )
            js.last_event = f"the ranks run {pd.to_level} from step {start} (asked at step {pd.steps}: {pd.why})"
            return None  # the probation watches from this look on
        if j.precision == js.level and j.proposed_precision == pd.to_level and pd.to_level not in js.barred:
            # Standing: the ranks have not applied it (in a job of several ranks, every
            # rank's daemon must ask it). Its old level goes on being measured as such.
            js.level_losses.extend(new_losses)
            del js.level_losses[: -STABILITY_WINDOWS * self.window]
            self._book(j, js)
            return (
                f"job {j.job}: {pd.to_level} proposed {j.steps - pd.steps} steps ago, the ranks still run "
                f"{j.precision}",
                None,
                None,
            )
        js.pending = None  # refused, withdrawn or overtaken: decide afresh
        if j.precision == js.level:
            js.level_losses.extend(new_losses)
            self._book(j, js)
            reason = f"job {j.job}: {pd.to_level} was not applied ({js.last_event or 'the proposal is gone'})"
            return (reason, None, None)
        return None

    def _propose(self, js: JobMemory, j: JobView, level: str, kind: str, why: str) -> str:
        """Ask ``level``: the level in force (and its evidence) stays until the ranks run it."""
        js.pending = Pending(j.precision, level, kind, j.steps, why)
        js.probation = None
        return level

    def _watch(self, snap: Snapshot, j: JobView, js: JobMemory, pb: Probation) -> tuple[str, str | None, dict | None]:
        steps_in = j.steps - pb.start_steps
        if pb.to_level in js.barred:  # the job refused the level (its event came in)
            why = js.barred[pb.to_level][1]
            js.last_event = f"back to {pb.from_level}: {why}"
            self._propose(js, j, pb.from_level, "back", js.last_event)
            return (f"job {j.job}: {js.last_event}", pb.from_level, None)
        if j.nonfinite_recent > js.nonfinite_at_start:
            why = (
                f"non-finite step during probation at {pb.to_level} ({j.nonfinite_recent - js.nonfinite_at_start} "
                f"since the switch)"
            )
            return self._roll_back(snap, j, js, pb, why, None)
        after = js.level_losses[self.grace_steps :]
        if j.probe_every is not None:
            # Every rank runs probe blocks at the level above (greend.training.probe): the
            # level against the level above at the same point in training, where a falling
            # loss, a change in the data and noise move both alike. The ranks roll back
            # themselves on them (their rollback comes back as an event, with the probes'
            # figures), for as long as the level is in force; the probation waits for
            # their first verdict, then judges the energy.
            need_steps = max(self.probation_steps, PROBE_PROBATION_STEPS)
            return self._after_ranks_verdict(
                snap, j, js, pb, steps_in, need_steps, f"the job's probes at {pb.from_level}",
                f"no rollback from the probes at {pb.from_level}",
            )  # fmt: skip
        if j.reference_every is not None:
            # Every rank checks the level against fp32 on a fixed batch (the same weights):
            # a like-for-like figure that a falling loss or a change in the data does not
            # move, where the training losses before and after the switch are neither. The
            # ranks roll back themselves on it (their rollback comes back as an event, above
            # and in _read_events), for as long as the level is in force; the probation
            # waits for their first verdict, then judges the energy.
            need_steps = max(self.probation_steps, REFERENCE_CHECKS * j.reference_every)
            return self._after_ranks_verdict(
                snap, j, js, pb, steps_in, need_steps, f"the job's reference checks every {j.reference_every} steps",
                "no rollback from the reference checks",
            )  # fmt: skip
        need = min(self.probation_steps, self.window)
        longest = PROBATION_EXTEND * self.probation_steps
        worse = se = math.nan
        if len(after) >= need:
            n = len(after)
            mean_after = sum(after) / n
            scale = max(abs(pb.trend), 1e-12)
            worse = (mean_after - pb.trend) / scale
            var_after = sum((v - mean_after) ** 2 for v in after) / (n - 1) if n > 1 else pb.noise**2
            se = math.sqrt(var_after / n + pb.trend_se**2) / scale
            # Clearly worse than the tolerance: back at once. At the longest probation,
            # worse than the tolerance and surely worse than the trend: back too.
            clearly = worse - GUARD_Z * se > self.tolerance
            at_last = steps_in >= longest and worse > self.tolerance and worse - GUARD_Z * se > 0
            if clearly or at_last:
                why = (
                    f"loss after the switch {mean_after:.6g} is {worse:+.1%} (+/- {se:.1%}) over the trend before "
                    f"it {pb.trend:.6g} (tolerance {self.tolerance:.0%}, {n} steps)"
                )
                return self._roll_back(snap, j, js, pb, why, mean_after)
        if steps_in >= longest and math.isnan(worse):  # never accepted unjudged (grace_steps too large?)
            why = f"{len(after)} losses after the {self.grace_steps} left out in {steps_in} steps: too few to judge it"
            return self._roll_back(snap, j, js, pb, why, None)
        if steps_in < self.probation_steps:
            return (f"job {j.job}: probation at {pb.to_level} ({steps_in}/{self.probation_steps} steps)", None, None)
        if steps_in < longest and (math.isnan(worse) or worse + GUARD_Z * se > self.tolerance):
            # Noisy losses: not yet known to be within the tolerance. Watch on (the level
            # is in force, so the energy is saved meanwhile).
            told = "too few losses" if math.isnan(worse) else f"loss {worse:+.1%} +/- {se:.1%} over the trend"
            return (
                f"job {j.job}: probation at {pb.to_level} extended ({steps_in}/{longest} steps; {told}, "
                f"tolerance {self.tolerance:.0%})",
                None,
                None,
            )
        return self._judge_energy(snap, j, js, pb, steps_in, f"loss {mean_text(after)} vs trend {pb.trend:.6g}")

    def _after_ranks_verdict(
        self,
        snap: Snapshot,
        j: JobView,
        js: JobMemory,
        pb: Probation,
        steps_in: int,
        need_steps: int,
        judged_by: str,
        accuracy: str,
    ) -> tuple[str, str | None, dict | None]:
        """A probation whose accuracy the ranks judge (``judged_by``: probes or reference
        checks; they roll back themselves): wait ``need_steps`` for their first verdict,
        then judge the energy."""
        if steps_in < need_steps:
            return (
                f"job {j.job}: probation at {pb.to_level} ({steps_in}/{need_steps} steps; accuracy: {judged_by})",
                None,
                None,
            )
        return self._judge_energy(snap, j, js, pb, steps_in, accuracy)

    def _judge_energy(
        self, snap: Snapshot, j: JobView, js: JobMemory, pb: Probation, steps_in: int, accuracy: str
    ) -> tuple[str, str | None, dict | None]:
        """The end of a probation whose accuracy passed: keep the level if it saves energy."""
        new = self._evidence(js, pb.to_level, j.setting)
        old = None
        shared = self._shared_setting(js, pb.to_level, pb.from_level, j.setting)
        if shared is not None:
            # The two levels at one GPU setting: a clock cap's saving is not the level's.
            new, old = js.evidence[(pb.to_level, shared)], js.evidence[(pb.from_level, shared)]
        if new is None or new.steps < self.min_steps:
            return (
                f"job {j.job}: probation at {pb.to_level} done, measuring its energy "
                f"({new.steps if new else 0}/{self.min_steps} steps)",
                None,
                None,
            )
        if old is not None and old.steps >= self.min_steps and math.isfinite(old.epf) and old.epf > 0:
            saving = 1.0 - new.epf / old.epf
            verdict = f"{saving:.0%} less energy per FLOP than {pb.from_level}"
            back = f"{pb.to_level} saves {saving:+.1%} energy per FLOP over {pb.from_level}"
            back = f"{back} (needs {self.min_saving:.0%})" if saving < self.min_saving else ""
        elif shared is not None or not math.isfinite(new.epf):  # (no FLOPs counted: no figure to wait for)
            verdict, back = f"no energy per FLOP figure of {pb.from_level} to compare with", ""
        else:
            # No figure of both levels at one GPU setting (a clock policy moving the caps): a
            # level must show its saving, so it waits for one (a baseline re-check gives one).
            pb.waiting_since_s = snap.t_s if pb.waiting_since_s is None else pb.waiting_since_s
            if snap.t_s - pb.waiting_since_s < FIGURE_WAIT_S:
                msg = f"waiting for a {pb.from_level} figure at a GPU setting both levels ran at"
                return (f"job {j.job}: {pb.to_level} passed its accuracy checks ({accuracy}); {msg}", None, None)
            back = f"no {pb.from_level} figure at a GPU setting both levels ran at in {FIGURE_WAIT_S:g} s"
        if back:
            js.no_gain[pb.to_level] = snap.t_s + self.cooldown_s
            why = js.last_event = f"{back}: going back"
            self._propose(js, j, pb.from_level, "back", why)
            return (
                f"job {j.job}: {why}",
                pb.from_level,
                {"kind": "switch", "from": pb.to_level, "to": pb.from_level, "reason": why},
            )
        js.last_event = f"{pb.to_level} accepted after {steps_in} steps: {accuracy}; {verdict}"
        js.probation = None
        js.level_losses = js.level_losses[-self.window :]
        return (f"job {j.job}: {js.last_event}", None, None)

    def _maybe_step_down(self, snap: Snapshot, j: JobView, js: JobMemory) -> tuple[str, str | None, dict | None]:
        rungs = self._rungs(j)
        if j.precision not in rungs:
            return (f"job {j.job}: runs {j.precision}, not on the ladder {','.join(rungs) or '-'}; holding", None, None)
        i = rungs.index(j.precision)
        if i + 1 >= len(rungs):
            return (f"job {j.job}: at {j.precision}, the lowest level it runs on the ladder", None, None)
        nxt = rungs[i + 1]
        if nxt in js.barred:
            until, why = js.barred[nxt]
            return (
                f"job {j.job}: holding {j.precision}; {nxt} barred for {until - snap.t_s:.0f} s ({why})",
                None,
                None,
            )
        if nxt in js.no_gain:
            return (f"job {j.job}: holding {j.precision}; {nxt} bought too little here", None, None)
        if j.measure is None:
            return (f"job {j.job}: holding {j.precision}; no energy measure for its steps yet", None, None)
        ev = self._evidence(js, j.precision, j.setting)
        have = ev.steps if ev else 0
        if have < self.min_steps:
            return (f"job {j.job}: measuring {j.precision} ({have}/{self.min_steps} steps)", None, None)
        if j.nonfinite_recent > js.nonfinite_at_start:
            return (f"job {j.job}: holding {j.precision}; non-finite steps at this level", None, None)
        # The trend over as much of this level's history as is kept (up to 8 windows),
        # judged per window with its uncertainty: a noisy but flat loss is stable once
        # enough steps pin its slope down; a falling one is not, however quiet.
        recent = js.level_losses[-STABILITY_WINDOWS * self.window :]
        if len(recent) < self.window:
            return (f"job {j.job}: watching the loss at {j.precision} ({len(recent)}/{self.window} steps)", None, None)
        mean, slope, fitted, sd = loss_trend(recent)
        scale = max(abs(mean), 1e-12)
        change = slope * self.window / scale  # the fitted change per window, relative
        n = len(recent)
        se_change = sd / math.sqrt(n * (n * n - 1) / 12.0) * self.window / scale
        if abs(change) > self.max_slope or se_change > self.max_noise:
            waiting = n < STABILITY_WINDOWS * self.window and se_change > self.max_noise
            return (
                f"job {j.job}: loss not stable at {j.precision} (change {change:+.1%} per {self.window} steps "
                f"+/- {se_change:.1%} over {n} steps; limits {self.max_slope:.0%} and +/- {self.max_noise:.0%})"
                + ("; more steps will narrow it" if waiting else ""),
                None,
                None,
            )
        why = (
            f"loss stable at {fitted:.6g} (change {change:+.1%} per {self.window} steps +/- {se_change:.1%}, "
            f"over {n} steps): trying {nxt}, probation {self.probation_steps} steps"
        )
        js.last_event = why
        # The reference for probation: the level of the last window before the switch
        # (its mean, known to sd / sqrt(window)), not the fitted line's end: training
        # losses flatten as they fall, and a line through a flattening curve ends below
        # it, so the first losses after a switch looked worse than they were.
        # (The probation's reference is taken when the ranks run the new level: the old
        # level's losses up to then, :meth:`_pending`.)
        self._propose(js, j, nxt, "switch", why)
        event = {"kind": "switch", "from": j.precision, "to": nxt, "reason": why, "loss": recent[-1], "trend": fitted}
        return (f"job {j.job}: {why}", nxt, event)

    def _roll_back(
        self, snap: Snapshot, j: JobView, js: JobMemory, pb: Probation, why: str, loss: float | None
    ) -> tuple[str, str, dict[str, Any]]:
        js.barred[pb.to_level] = (snap.t_s + self.cooldown_s, why)
        text = f"rollback {pb.to_level} -> {pb.from_level}: {why}; {pb.to_level} barred for {self.cooldown_s:g} s"
        js.last_event = text
        self._propose(js, j, pb.from_level, "rollback", text)
        event = {
            "kind": "rollback",
            "from": pb.to_level,
            "to": pb.from_level,
            "reason": text,
            "loss": loss,
            "trend": pb.trend,
        }
        return (f"job {j.job}: {text}", pb.from_level, event)

    # ------------------------------------------------------------------ bookkeeping

    def _enter_level(self, js: JobMemory, j: JobView, level: str) -> None:
        js.level = level
        js.level_since_steps = j.steps
        js.level_losses = []
        js.skip = 1
        js.nonfinite_at_start = j.nonfinite_recent

    def _expire(self, js: JobMemory, t: float) -> None:
        for table in (js.barred, js.no_gain):
            for level in [lv for lv, v in table.items() if (v[0] if isinstance(v, tuple) else v) <= t]:
                del table[level]

    def _read_events(self, j: JobView, js: JobMemory, t: float) -> None:
        """Rollbacks and refusals the callback made on its own bar the level."""
        for ev in j.precision_events:
            key = (ev.get("t"), ev.get("kind"), ev.get("from"), ev.get("to"), ev.get("step"))
            if key in js.seen_events:
                continue
            js.seen_events.append(key)
            del js.seen_events[:-SEEN_KEEP]
            kind, why = ev.get("kind"), ev.get("reason") or "?"
            if kind == "rollback" and ev.get("from"):
                level = str(ev["from"])
                if level not in js.barred:  # our own rollbacks are barred already
                    js.barred[level] = (t + self.cooldown_s, f"the job rolled back: {why}")
                    js.last_event = f"the job rolled {level} back to {ev.get('to')}: {why}"
            elif kind == "refused" and ev.get("to"):
                level = str(ev["to"])
                js.barred[level] = (t + self.cooldown_s, f"the job refused it: {why}")
                js.last_event = f"the job refused {level}: {why}"

    def _take_losses(self, j: JobView, js: JobMemory) -> list[float]:
        """The losses reported since the previous look (the tail of ``loss_recent``).

        Steps minus non-finite steps and probe steps since the last look (neither
        carries a loss there). With several ranks per job this is approximate: their losses interleave.
        """
        nonfinite = max(0, j.nonfinite_recent - js.last_nonfinite)
        js.last_nonfinite_prev, js.last_nonfinite = js.last_nonfinite, j.nonfinite_recent
        probes = max(0, j.probe_steps - js.last_probe_steps)  # (their losses are not the level's)
        js.last_probe_steps = j.probe_steps
        new = max(0, j.steps - js.last_steps - nonfinite - probes)
        js.last_steps = j.steps
        if new == 0 or not j.loss_recent:
            return []
        got = list(j.loss_recent[-min(new, len(j.loss_recent)) :])
        js.losses_seen += len(got)
        return got

    def _book(self, j: JobView, js: JobMemory) -> None:
        """Book the measure's increment since the last look to the level in force."""
        m = j.measure
        prev, prev_setting = js.last_measure, js.last_setting
        js.last_measure, js.last_setting = m, j.setting
        if m is None:
            return
        if prev is None or prev_setting != j.setting or m.steps < prev.steps:
            delta = Evidence(m.steps, m.flops, m.time_s, m.energy_j)  # a fresh measure
            if prev is not None and prev_setting != j.setting:
                js.skip = max(js.skip, 1)
        else:
            delta = Evidence(
                m.steps - prev.steps, m.flops - prev.flops, m.time_s - prev.time_s, m.energy_j - prev.energy_j
            )
        if js.skip > 0:
            js.skip -= 1
            return
        if delta.steps <= 0:
            return
        key = (js.level, j.setting)
        e = js.evidence.setdefault(key, Evidence())
        e.steps += delta.steps
        e.flops += delta.flops
        e.time_s += delta.time_s
        e.energy_j += delta.energy_j

    def _shared_setting(self, js: JobMemory, a: str, b: str, now: Setting) -> Setting | None:
        """A GPU setting at which both levels ran ``min_steps``: the one in force if so,
        else the one with the most steps of the two; None if there is none."""
        both = [
            (setting, ea.steps + eb.steps)
            for (level, setting), ea in js.evidence.items()
            if level == a
            and ea.steps >= self.min_steps
            and (eb := js.evidence.get((b, setting))) is not None
            and eb.steps >= self.min_steps
        ]
        if not both:
            return None
        if any(setting == now for setting, _ in both):
            return now
        return max(both, key=lambda x: x[1])[0]

    def _evidence(self, js: JobMemory, level: str, setting: Setting) -> Evidence | None:
        """The level's evidence at this GPU setting, else at the setting with the most steps."""
        here = js.evidence.get((level, setting))
        if here is not None and here.steps >= self.min_steps:
            return here
        others = [e for (lv, _), e in js.evidence.items() if lv == level]
        return max(others, key=lambda e: e.steps) if others else here

    def _details(self, j: JobView, js: JobMemory, event: dict[str, Any] | None) -> dict[str, Any]:
        levels: dict[str, dict[str, Any]] = {}
        for (level, _), e in js.evidence.items():
            agg = levels.setdefault(level, {"steps": 0, "flops": 0.0, "energy_j": 0.0})
            agg["steps"] += e.steps
            agg["flops"] += e.flops
            agg["energy_j"] += e.energy_j
        for agg in levels.values():
            agg["energy_per_flop_j"] = agg["energy_j"] / agg["flops"] if agg["flops"] > 0 else None
        out: dict[str, Any] = {
            "level": js.level,
            "probation": None
            if js.probation is None
            else {
                "from": js.probation.from_level,
                "to": js.probation.to_level,
                "steps": j.steps - js.probation.start_steps,
                "of": self.probation_steps,
                "trend": js.probation.trend,
            },
            "barred": {lv: why for lv, (_, why) in js.barred.items()},
            "no_gain": sorted(js.no_gain),
            "levels": levels,
            "last_event": js.last_event,
            "reason": js.last_event,
        }
        if event is not None:
            out["event"] = event
            out["reason"] = event["reason"]
        return out
