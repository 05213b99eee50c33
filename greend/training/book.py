"""The callback's book of steps: what every step reads, and what happens after it ends.

:class:`StepBook` is the :class:`greend.training.step.StepHost` the steps see (the level in
force, the FLOP cache, the ended steps, the rare paths: a directive at a step boundary, a
shape to count). Every 16 steps or 50 ms the ended steps are booked: one record per step
for the sender (``Channel.queue``) and the accuracy guard's look at each loss; a batch with
nothing to judge goes to the sender thread whole (:meth:`StepBook.book_handed`), else the
training thread reads the losses in one pass without a stream sync
(:class:`greend.training.loss_reader.LossReader`) and lets the guard judge them. Python
right after a step's torch work runs cold: one pass for 16 steps costs a fraction of 16
(``bench/bench_callback.py``). Training thread only, but for :meth:`StepBook.directive`
(the sender thread: a flag) and :meth:`StepBook.book_handed`. FLOPs per step: a fixed
figure, ``6 * params * tokens``, or counted once per shape key (FlopCounterMode).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import Any

import torch

from greend.training._autocast_check import AutocastCheck
from greend.training._probe_ranks import JointJudge
from greend.training.flops import FlopCounter, FlopEstimates, batch_signature, model_params
from greend.training.loss_reader import LossReader
from greend.training.mixed_precision import weight_layers
from greend.training.precision_control import PrecisionControl
from greend.training.probe import NEVER, probe_tag
from greend.training.sender import Channel
from greend.training.step import ReusedAutocast, Step
from greend.training.warn import OnceWarnings, log

__all__ = ["FLOPS_FROM_TOKENS", "JUDGE_BATCH", "StepBook"]

# Steps whose loss may be in flight at once, beyond the batch just ended (its copy just
# started), before the oldest is waited for: a GPU queue this deep behind the CPU is
# already the user's own back-pressure. (Counting the batch just ended, the training
# thread waited for its copy, a full sync of the GPU, every 16 steps.)
MAX_UNJUDGED = 8
# Steps whose losses are read together, in one pass at the end of the last of them,
# while the guard is not watching for spikes. A non-finite loss then rolls back up to
# this many steps later; during the spike window after a downgrade every step is read
# at its end.
JUDGE_BATCH = 16
# ... or when the oldest of them ended this long ago (slow steps are read one by one;
# the daemon hears of a step at most this much later than it would have).
JUDGE_WITHIN_S = 0.05
# Batches handed to the sender thread and not booked yet beyond which the training
# thread books them itself (a sender thread that died or is starved, or losses that far
# behind on the GPU: it then waits for the oldest, as drain does).
MAX_HANDED = 64
FLOPS_FROM_TOKENS = -1.0  # a Step's flops placeholder under model_flops=True (compared with `is`)
_isfinite = math.isfinite


class StepBook:
    """The steps' side of the callback (see the module's docstring)."""

    def __init__(
        self,
        *,
        control: PrecisionControl,
        channel: Channel,
        warnings: OnceWarnings,
        model: torch.nn.Module | None,
        flops_per_step: float | None,
        model_flops: bool,
        max_flop_counts: int,
        world_size: int,
        sync_every: int,
    ) -> None:
        self.control = control
        self.channel = channel
        self._warnings = warnings
        self._joint = JointJudge(control, warnings, lambda: self.drain(keep=0))  # (probes, several ranks)
        # Read by every step (StepHost).
        self.precision = control.level
        self.boundary = True  # the first step looks for a directive and agreement
        self.flop_cache: dict[Hashable, Any] = {}
        self.ended: list[Step] = []
        self.judge_every = JUDGE_BATCH
        self.judge_by = 0.0
        self.judge_within_s = JUDGE_WITHIN_S
        self.shared_autocast = control.shared_autocast()
        # After the steps.
        self.next_index = 0
        self.losses = LossReader()  # reads step losses without a stream sync
        self.max_unjudged = MAX_UNJUDGED
        self.unjudged: deque[Step] = deque()  # ended steps whose loss is still in flight
        # Batches of ended steps with nothing to judge (see read_ended), handed to the
        # sender thread to book: (steps, the first one's index, the level then in force).
        # Whoever books them holds the lock; the training thread books what is left
        # before it judges, reads or changes the guard (drain, flush).
        self.handed: deque[tuple[list[Step], int, str]] = channel.handed
        self.lock = threading.Lock()
        # Set for good by the first step that holds a loss not on the CPU (Step.loss: reads
        # start here) or is given index= (GreenCallback.step: each batch is judged here).
        self.held = False
        self.indexed = False
        self.hold_cpu = False  # Step.loss holds a CPU loss for the sender thread to read: set below
        self.closed = False
        # Step.backward/optimizer_step call loss_scaler/gradients_watched only until one of
        # them has noted that the loop scales its losses, then only where it matters (fp16;
        # the guard armed): two calls fewer on every step.
        self.scaling_noted = False
        self.guard = control.guard
        self._entered = 0  # steps entered while the ranks agree: the agreement's clock
        self._world_size = world_size
        self.sync_every = sync_every
        self.agreed_pace_s: float | None = None  # the last pace all ranks agreed on
        self._paced_to = -1  # the last step index the pace was agreed at (read_ended's hand-over)
        # Probes (greend.training.probe): the first step index the prober wants to see
        # recorded (one compare per step; NEVER while the run is at its own level).
        self.probe_watch = NEVER
        # FLOPs: a fixed figure, 6 * params * tokens once the step ends (tokens may be set
        # late), or None: counted per shape key.
        self._model = model
        self._autocast_check = AutocastCheck(model, control.autocast_device)  # a switch: in effect?
        self.fixed_flops = float(flops_per_step) if flops_per_step is not None else None
        self._params = model_params(model) if model_flops and model is not None else 0
        self.default_flops: Any = (
            self.fixed_flops if self.fixed_flops is not None else FLOPS_FROM_TOKENS if model_flops else None
        )
        self._max_flop_counts = max_flop_counts
        self._estimates = FlopEstimates(self.flop_cache, max_flop_counts, warnings)  # shapes past them
        self._counter = FlopCounter()
        # With a model and counted FLOPs, and steps given neither batch= nor shape_key=,
        # a forward pre-hook sees each step's input shapes, so a shape change is re-counted.
        # It is put on the model by the first such step, never before: a module with a
        # hook takes torch's slower call path on every forward (a few microseconds).
        self._current: Step | None = None
        self._last_forward_signature: Hashable | None = None
        self.forward_hook: Any = None
        self._hook_failed = False
        # While the job's own level is not known: the first step's start and its model's
        # first forward look for the job's own autocast (one-shot: the hook goes after).
        self._detect_step: Step | None = None
        self._detect_hooks: list[Any] = []
        self._detect_tries = 0  # steps begun while detecting with hooks on (a step may end before its forward)
        self._detect_forward_seen = False  # a hooked layer computed inside a step
        if control.detecting and model is not None:
            # On the layers that hold weights, not on the model: their forward runs inside
            # the model's, so an autocast the model enters in its own forward (or a
            # LightningModule's training_step, where its forward is never called) is seen.
            try:
                for m in weight_layers(model):
                    self._detect_hooks.append(m.register_forward_pre_hook(self._on_first_forward))
            except Exception as e:
                log.debug("no forward pre-hook on the model to see its autocast: %s", e)
        self.hold_cpu = self._light()
        control.attach(self)

    @property
    def upcoming(self) -> int:
        """The index of the step about to start (after those ended and not yet judged)."""
        return self.next_index + len(self.ended) + len(self.unjudged)

    # StepHost: the rare paths of a step -----------------------------------------------
    def at_boundary(self, step: Step) -> None:
        control = self.control
        self.boundary = False
        check, level = self._autocast_check, self._autocast_check.level
        if level is not None and check.verdict(step) is False:  # (a switch: in effect? _autocast_check)
            control.not_in_effect(level, self.upcoming)
        self.boundary = check.level is not None
        if control.detecting:
            # An autocast around the step; else, with a model, its first forward tells
            # (by the second step's start the level in force is the job's own).
            # (a step that ended before its first forward, one that raised, tells nothing:
            # three such steps, and the level in force is the job's own)
            self._detect_tries += 1
            final = not self._detect_hooks or self._detect_forward_seen or self._detect_tries > 3
            if control.detect_own_level(final=final):
                self.precision = control.level
            if control.detecting:
                self._detect_step = step
                self.boundary = True
            else:
                self._detect_step = None
                self._drop_detect_hook()
        requested = self.channel.requested
        if requested is not control.seen_request:
            control.take_request(requested)
        if control.agreeing:
            n = self._entered
            self._entered = n + 1
            if n % self.sync_every == 0:
                control.agree(n // self.sync_every)
        if control.agreeing or self.channel.requested is not control.seen_request:
            self.boundary = True
        if self.probe_watch != NEVER:
            self._probe_boundary()
        check.begun(step)

    def _probe_boundary(self) -> None:
        """Near a probe block: the level the next step runs at (the level above inside
        the block, else the level in force), looked at each step until the block ends
        (where the ranks judge the blocks together: until they have judged it)."""
        prober = self.control.prober
        if prober is not None and prober.agreed and prober.block is not None:
            self._joint.at(prober, self.upcoming)  # (greend.training._probe_ranks)
            prober = self.control.prober
            self.probe_watch = prober.watch_from if prober is not None else NEVER
        block = prober.block if prober is not None else None
        if block is None:
            return
        index = self.upcoming
        probe = prober.level_at(index)  # type: ignore[union-attr]  # (block is not None: prober is set)
        self.control.probe_model(probe is not None, index)  # (below fp8: the linears as the step runs them)
        self.precision = probe if probe is not None else self.control.level
        if index < block.end or prober.trial:  # type: ignore[union-attr]  # (as above)
            self.boundary = True  # (the step after the block goes back to the level in force)
        elif prober.agreed and (index <= block.last or prober.decide_at != NEVER):  # type: ignore[union-attr]
            # (judged at last + 1 at the latest, with the ranks at decide_at; while the ranks
            # agree on the level every step starts at a boundary anyway: this is for after)
            self.boundary = True

    def _on_first_forward(self, module: Any, args: Any) -> None:
        """The model's first forward inside a step (one-shot pre-hook): an autocast on here
        is the job's own. A forward outside any step (an evaluation or a check before the
        training, under an autocast of its own or none) says nothing of the training's level."""
        if self._detect_step is None or self._detect_step.t1_s:  # (t1_s: set when the step ended)
            return
        # A layer computing without an autocast (an embedding before the model enters its
        # own) proves nothing yet: any later layer of the step may show one. The next step's
        # start decides on what the step showed (at_boundary).
        self._detect_forward_seen = True
        control = self.control
        if control.detect_own_level(final=False):
            self.precision = control.level
            self._detect_step.precision = control.level  # the step in flight runs at it
        if not control.detecting:
            self._drop_detect_hook()
            self._detect_step = None

    def _drop_detect_hook(self) -> None:
        """Take the one-shot detection hooks off the model (a hooked module takes torch's
        slower call path on every forward)."""
        hooks, self._detect_hooks = self._detect_hooks, []
        for hook in hooks:
            hook.remove()

    def directive(self) -> None:
        """The sender has a directive for the next step's start (Channel.on_directive)."""
        self.boundary = True

    def autocast_for(self, level: str) -> AbstractContextManager[Any]:
        ctx = self.control.autocast_for(level)
        if type(ctx) is torch.autocast:
            # A plain autocast: made once for the level and reused by its steps (making
            # one costs about what entering it does; the job's own loop pays that).
            try:
                reused = ReusedAutocast.like(ctx)
            except Exception as e:  # (a torch whose autocast keeps its settings elsewhere)
                log.debug("a new autocast for every step: %s", e)
                return ctx
            self.shared_autocast[level] = reused
            return reused
        return ctx

    def warn_once(self, key: str, message: str) -> None:
        self._warnings.warn(key, message)

    def loss_scaler(self, level: str) -> Any:
        self.scaling_noted = True  # (steps then call this only at fp16: Step.backward)
        return self.control.loss_scaler(level)

    def gradients_watched(self) -> bool:
        """Whether optimizer_step checks this step's gradients: while the run is below a
        level it came down from (a non-finite gradient then skips the update: the weights
        stay clean). A fused norm and one stream sync a step."""
        control = self.control
        control.scaling_seen = True
        self.scaling_noted = True  # (steps then call this only while the guard is armed)
        return bool(control.guard.stack) and control.manage

    def switched(self, level: str, managed: bool) -> None:
        self.precision = level
        self.boundary = self._autocast_check.switched(level, managed) or self.boundary
        if managed:
            self.judge_every = 1  # read each step from now on while the spike rule holds
            self.hold_cpu = False
        self._arm_probes()

    def _arm_probes(self) -> None:
        """Probe blocks while the run is below a level it came down from (and the daemon
        takes probe rows: it registered ``probe_every``), from the step about to start."""
        control = self.control
        prober = control.prober
        if prober is None:
            return
        upper = control.probe_upper()
        if control.rearm and prober.held is not None:
            pass  # (rolled back alone: it still takes part in the ranks' verdict on the block, JointJudge)
        elif upper is None or "probe_every" in self.channel.register_omit or control.rearm:
            prober.disarm()
        elif prober.lower != control.level or prober.upper != upper:
            index = self.upcoming
            # A step down taken at this step starts with a trial at the new level (the run
            # stays at the level above but for its blocks); a level come back to does not.
            stack = control.guard.stack
            trial = bool(stack) and stack[-1].to_level == control.level and stack[-1].step >= self.next_index
            prober.arm(upper, control.level, index, trial=trial)
            prober.agreed = control.agreeing and not prober.solo  # (the ranks meet in the job's store)
        self.probe_watch = prober.watch_from
        if prober.block is not None:
            self.boundary = True

    # FLOPs ---------------------------------------------------------------------------
    def plan_flops(self, step: Step) -> None:
        key = step._shape_key
        if key is not None:
            try:
                hash(key)
            except TypeError:
                key = step._shape_key = repr(key)
        elif self.forward_hook is not None or self._hook_forward():
            # Neither batch= nor shape_key=: the model's forward pre-hook tells the shape,
            # but only once the step runs. Guess the last step's; the step's end corrects it.
            key = step._shape_key = self._last_forward_signature
            step._shape_guessed = True
            self._current = step
        cached = self.flop_cache.get(key)
        if cached is not None:
            step.flops = cached
            return
        if len(self.flop_cache) >= self._max_flop_counts:
            step.flops = self._estimates.estimate(key)
            return
        if self._counter.active:  # a nested step: let the outer one count
            step.flops = 0
            return
        step._counting = self._counter.start()
        if not step._counting:
            step.flops = 0

    def end_flops(self, step: Step, ok: bool) -> None:
        if step._shape_guessed:
            self._current = None
            signature = step._forward_signature
            if signature is not None:
                # The model's inputs say which shape this step really had.
                if signature != step._shape_key and not step._counting:
                    cached = self.flop_cache.get(signature)
                    # A new shape: counted on the next step that has it (if there is room);
                    # this one is estimated from the shapes counted.
                    step.flops = cached if cached is not None else self._estimates.estimate(signature)
                step._shape_key = self._last_forward_signature = signature
        if step._counting:
            step._counting = False
            counted = self._counter.stop()
            if ok:
                step.flops = self._estimates.store(step._shape_key, counted)

    def _hook_forward(self) -> bool:
        """Put the forward pre-hook on the model (once); whether it is there."""
        model = self._model
        if model is None or self._hook_failed:
            return False
        try:
            self.forward_hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        except Exception as e:
            self._hook_failed = True
            log.debug("no forward pre-hook on the model: %s", e)
            return False
        return True

    def _on_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """The model's forward pre-hook: the signature of the step's first forward inputs."""
        step = self._current
        if step is not None and step._shape_guessed and step._forward_signature is None:
            try:
                step._forward_signature = batch_signature((*args, *kwargs.values()))
            except Exception:
                pass

    # After the steps -------------------------------------------------------------------
    def read_ended(self) -> None:
        """A batch of ended steps (StepHost): judged here, or handed to the sender thread.

        While the run is at a level it never came down from (the guard's stack empty)
        with no reference check and greend counting the steps, judging a step is only
        feeding the guard's trend and making its record: the batch goes to the sender
        thread whole (one append), which books it at its next round, once its losses have
        landed (a GPU's: their copy starts here, one for the batch); the training thread
        books it itself first whenever it judges, reads or changes the guard. Else (the
        guard watching, a reference check, ``index=`` given, ``model_flops``, steps
        in flight here) it is judged here."""
        if not self._light():
            self.hold_cpu = False
            self.drain(keep=self.max_unjudged + len(self.ended))
            return
        self.hold_cpu = True
        ended = self.ended
        self.ended = []
        if self.held:  # a GPU's losses: their copy starts here (one for the batch), lands meanwhile
            self._start_reads(ended)
        first = self.next_index
        n = len(ended)
        self.next_index = first + n
        self.channel.stats.recorded += n
        self.handed.append((ended, first, self.precision))
        if self._world_size > 1:
            every = self.sync_every
            for index in range(first + (-(first + 1)) % every, first + n, every):
                self._sync_pace(index)  # (index + 1) is a multiple of sync_every
        if len(self.handed) > MAX_HANDED:
            self.book_handed(here=True)

    def _light(self) -> bool:
        """Whether judging the ended steps is only booking them (see read_ended)."""
        control = self.control
        return not (
            self.indexed
            or self.unjudged
            or control.guard.stack
            or control.reference is not None
            or self.default_flops is FLOPS_FROM_TOKENS
        )

    def book_handed(self, here: bool = False) -> None:
        """Book the batches handed over (read_ended), oldest first: the guard's trend and
        one record per step for the sender. Either thread; never raises or waits: a loss
        still being copied from the GPU stops it (the sender tries again at its next round;
        the training thread, ``here``, takes the rest back for drain to judge)."""
        handed = self.handed
        if not handed and not self.lock.locked():
            return  # nothing handed and nothing being booked (the sender pops under the lock)
        with self.lock:  # (a batch the sender took is booked whole before this thread goes on)
            while handed:
                steps, first, level = handed[0]
                try:
                    done = self._book(steps, first, level)
                except Exception as e:  # never the training's problem
                    self._warnings.warn("book", f"booking the ended steps failed: {type(e).__name__}: {e}")
                    done = len(steps)
                if done == len(steps):
                    handed.popleft()
                    continue
                handed[0] = (steps[done:], first + done, level)
                if here:
                    self._take_back()
                return

    def _take_back(self) -> None:
        """The handed steps not booked yet, back to the front of the unjudged ones, their
        indexes kept (training thread, under the lock)."""
        moved: list[Step] = []
        start = self.handed[0][1]
        while self.handed:
            steps, first, _ = self.handed.popleft()
            for k, step in enumerate(steps):
                step.index = first + k
            moved.extend(steps)
        self.unjudged.extendleft(reversed(moved))
        self.next_index = start
        self.channel.stats.recorded -= len(moved)  # (counted again as drain records them)
        self._paced_to = max(self._paced_to, start + len(moved) - 1)  # (agreed when handed)

    def _book(self, steps: list[Step], index: int, level: str) -> int:
        """A handed batch: what drain does with the guard's stack empty (nothing to roll
        back to) and no reference check. Returns how many steps it booked (up to the
        first whose loss is still in flight)."""
        trend = self.control.guard.losses
        read = self.losses.start  # (a plain CPU tensor: item(), on this thread)
        value_of = self.losses.value
        queue = self.channel.queue
        stats = self.channel.stats
        full = queue.maxlen
        for k, step in enumerate(steps):
            value = step._raw
            loss = None
            nonfinite = step._nonfinite
            if type(value) is tuple:  # a read in flight (read_ended started it)
                value = value_of(value)
                if value is None:
                    return k
            if value is not None:
                step._raw = None
                if type(value) is not float:  # a CPU tensor held for this read (Step.loss)
                    try:
                        value = read(value)[0]
                    except Exception as e:
                        self._warnings.warn("loss", f"step.loss() cannot read this tensor ({e}): ignored")
                        value = None
            if value is not None:
                if _isfinite(value):
                    loss = value
                    if step.precision == level:  # else: read after a switch, not this level's trend
                        trend.append(value)
                else:
                    step._nonfinite, step._nonfinite_cause = True, "loss"
                    nonfinite = True
            if len(queue) == full:
                stats.dropped += 1  # the append below pushes out the oldest record
            queue.append((index, step.t0_s, step.t1_s, step.flops, step.samples, step.tokens, loss, nonfinite,
                          step.precision))  # fmt: skip
            index += 1
        return len(steps)

    def flush(self) -> None:
        """Read the losses of the ended steps and record them now; never waits, never raises."""
        if self.closed or not (self.ended or self.unjudged or self.handed or self.lock.locked()):
            return
        try:
            self.drain()  # never waits
        except Exception as e:  # never the training's problem
            self._warnings.warn("flush", f"reading the ended steps failed: {type(e).__name__}: {e}")

    def drain(self, keep: int | None = None) -> None:
        """Start reading the ended steps' losses, then judge and record the steps whose
        loss has landed, oldest first. ``keep``: wait for the oldest while more than this
        many are in flight (None: never wait; 0 at the end, where a wait costs nothing)."""
        if self.handed or self.lock.locked():
            self.book_handed(here=True)  # the batches handed over go first, in step order
        q = self.unjudged
        ended = self.ended
        if ended:
            self.ended = []
            q.extend(ended)
            self._start_reads(ended)
            del ended
        value_of = self.losses.value
        control = self.control
        guard = control.guard
        level_in_force = control.level  # (self.precision is the level above during a probe)
        queue = self.channel.queue
        stats = self.channel.stats
        full = queue.maxlen
        pace_every = self.sync_every if self._world_size > 1 else 0
        while q:
            step = q[0]
            value = step._raw  # a number given or read at once, or a read in flight
            if type(value) is tuple:
                value = value_of(value, wait=keep is not None and len(q) > keep)
                if value is None:
                    break
            loss = None
            if value is not None:
                step._raw = None
                # The guard's look at the loss, in step order.
                if _isfinite(value):
                    loss = value  # (a gradient found non-finite meanwhile stays so)
                    if step.precision == level_in_force:  # else: read after a switch (or a probe step)
                        if guard.stack:  # below a level it came down from: is it a spike?
                            at = step.index if step.index is not None else self.next_index
                            if at >= self.probe_watch and self._probe_settling(at):
                                # The weights settle back after a probe: a jump here is the
                                # probe's (not counted), and these losses are not the level's
                                # trend either (a jump that lasts past them is judged as one then).
                                step._spike_reason = None
                            else:
                                step._spike_reason = spike = guard.spike(value, at, control.reference is not None)
                                if spike is None and not guard.excused:
                                    guard.losses.append(value)  # (a spike is not the new level's trend)
                        else:
                            guard.losses.append(value)
                    elif guard.stack and step.precision == guard.stack[-1].from_level:
                        # A step at the level above (between a trial's blocks, in a probe):
                        # a jump it shows too is the data's, not the lower level's.
                        guard.note_above(value, step.index if step.index is not None else self.next_index)
                else:
                    step._nonfinite, step._nonfinite_cause, step._spike_reason = True, "loss", None
            q.popleft()
            # The record, for the sender.
            index = step.index
            if index is None:
                index = self.next_index
            self.next_index = index + 1
            flops = step.flops
            if flops is FLOPS_FROM_TOKENS:
                flops = step.flops = self._tokens_flops(step.tokens)
            if len(queue) == full:
                stats.dropped += 1  # the append below pushes out the oldest record
            nonfinite = step._nonfinite
            level = step.precision
            probe_why = None
            if index >= self.probe_watch:
                level, probe_why = self._probe_record(index, level, loss)
            queue.append((index, step.t0_s, step.t1_s, flops, step.samples, step.tokens, loss, nonfinite,
                          level))  # fmt: skip
            stats.recorded += 1
            if pace_every and (index + 1) % pace_every == 0 and index > self._paced_to:
                self._sync_pace(index)
            spike = step._spike_reason
            if spike and not nonfinite and control.reference is not None:
                spike = step._spike_reason = control.confirm_spike(spike)
            if (nonfinite or spike) and step.precision == level_in_force:
                # the next step runs at the level we came down from
                control.roll_back(index, step._nonfinite_cause, loss, None if nonfinite else spike)
                level_in_force = control.level
            elif probe_why is not None:
                control.probe_rollback(index, probe_why, loss)
                level_in_force = control.level
            elif control.reference is not None:
                control.reference_due(index)
        # Every step at its end while the spike rule holds (a spike rolls back from the
        # next step), else in batches.
        spiking = (
            guard.stack
            and guard.spike_tolerance is not None
            and self.next_index - guard.stack[-1].step < guard.spike_steps
        )
        self.judge_every = 1 if spiking else JUDGE_BATCH
        if self.probe_watch != NEVER:
            prober = control.prober
            block = prober.block if prober is not None else None
            if block is not None and self.next_index + len(q) + JUDGE_BATCH + 1 >= block.start:
                self.boundary = True  # the block may start within the next batch of steps

    def _start_reads(self, steps: list[Step]) -> None:
        """Start reading the losses the steps hold as tensors, together (a GPU's in one
        copy: LossReader.start_many); each step's loss becomes the read's handle."""
        # (`type() is float` first: isinstance() with torch.Tensor costs 6x more.)
        held = [step for step in steps if type(step._raw) is not float and isinstance(step._raw, torch.Tensor)]
        if not held:
            return
        handles = self.losses.start_many([step._raw for step in held])
        for step, handle in zip(held, handles, strict=True):
            if isinstance(handle, Exception):
                step._raw = None
                self._warnings.warn("loss", f"step.loss() cannot read this tensor ({handle}): ignored")
            else:
                step._raw = handle  # a read in flight: the LossReader's handle (a tuple)

    def _probe_settling(self, index: int) -> bool:
        """Whether step ``index`` is one of the steps right after a probe block where the
        weights settle back to the level in force (a jump there is the probe's, not a
        spike). The block's lower window after them is the spike rule's again: with the
        first blocks back to back, the windows span most of the first steps after a switch."""
        prober = self.control.prober
        block = prober.block if prober is not None else None
        return block is not None and block.end <= index < block.after_from

    def _probe_record(self, index: int, level: str, loss: float | None) -> tuple[str, str | None]:
        """A recorded step the prober watches: its record's level (a probe step's is
        tagged) and the reason to roll back, if the probes give one. Never raises."""
        prober = self.control.prober
        if prober is None:
            self.probe_watch = NEVER
            return level, None
        prober.horizon = self.upcoming
        probe = prober.reported_as_probe(index, level, self.control.level)
        try:
            why = prober.record(index, level, loss)
        except Exception as e:  # a probe never breaks training
            self._warnings.warn("probe", f"greend's precision probes failed ({type(e).__name__}: {e}); no more probes")
            self.control.prober = None
            why = None
            # The next steps run the level in force (not a block's or a trial's level above).
            self.precision = self.control.level
            self.control.probe_model(False, self.upcoming)
        self.probe_watch = prober.watch_from if self.control.prober is not None else NEVER
        return (probe_tag(level) if probe else level), why

    def _tokens_flops(self, tokens: int | None) -> float:
        if tokens is None:
            self._warnings.warn("tokens", "model_flops=True needs step(tokens=...): reporting 0 FLOPs")
            return 0.0
        return 6.0 * self._params * tokens

    def _sync_pace(self, index: int) -> None:
        """Agree on the job's pace and floor with the other ranks at a decision point, in
        the job's rendezvous store (greend.training.peers.agree_pace: no collective),
        from the daemon's ``local_pace``. A failure is logged once, never raised."""
        try:
            peers = self.control.job_peers()
            if peers is None:
                return
            ch, epoch = self.channel, (index + 1) // self.sync_every
            agreed, floor, ask = peers.agree_pace(epoch, ch.local_pace_s, ch.local_floor_s, ch.local_recheck_at or 0)
        except Exception as e:
            self._warnings.warn("pace", f"greend could not agree the job's pace across ranks: {e}")
            return
        if agreed is not None and agreed > 0:
            self.agreed_pace_s, ch.agreed_floor_s, ch.agreed_recheck_at = agreed, floor, max(ch.agreed_recheck_at, ask)
            ch.agreed_pace_s = agreed  # (last: the sender sends all three as op "pace" once it is set)

    def close(self) -> None:
        """The last losses (waited for: training is over), the model's hook taken off, and a
        FLOP count a step left running (a step never exited: the training raised between
        two hooks of a trainer) stopped: it would slow every torch call after it."""
        self.closed = True
        self._drop_detect_hook()
        self._autocast_check.disarm()
        if self._counter.active:
            self._counter.stop()
        try:
            self.drain(keep=0)
            self.control.read_reference(wait=True)
        except Exception as e:
            log.debug("reading the last losses failed: %s", e)
        if self.forward_hook is not None:
            self.forward_hook.remove()
            self.forward_hook = None
