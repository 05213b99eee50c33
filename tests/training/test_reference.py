"""The reference check (``GreenCallback(reference_loss=...)``): after a downgrade, a fixed
batch's loss at the level against fp32 on the same weights, judged statistically.

Real torch training on the CPU against :class:`greend.testing.fake_daemon.FakeDaemon`. To
make the level's excess exact, some reference functions scale their loss while autocast
is on (what a real penalty looks like is in tests/e2e/test_e2e_precision.py, on a real
regression where bf16 costs a few percent).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from greend.errors import GreendWarning
from greend.testing.fake_daemon import FakeDaemon
from greend.training.callback import GreenCallback
from greend.training.mixed_precision import Guard
from greend.training.probe import PROBE_STEPS, block_start
from greend.training.reference import MIN_CHECKS, ReferenceJudge
from tests.support import wait_for
from tests.training.test_precision import FAST, IN, batch, make_model, needs_torchao, switch


def reference(model: nn.Module, penalty: float = 0.0) -> Callable[[], torch.Tensor]:
    """The loss of a fixed batch; ``penalty`` more (relative) whenever autocast is on."""
    x, y = batch(10_000)

    def loss() -> torch.Tensor:
        value = nn.functional.mse_loss(model(x).float(), y)
        return value * (1.0 + penalty) if torch.is_autocast_enabled("cpu") else value

    return loss


class Loop:
    def __init__(self, cb: GreenCallback, model: nn.Module) -> None:
        self.cb, self.model = cb, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.i = 0
        self.levels: list[str] = []

    def run(self, n: int, spike_at: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        for _ in range(n):
            x, y = batch(self.i)
            with self.cb.step(samples=len(x), flops=1e9) as st:
                with st.autocast():
                    out = self.model(x)
                loss = nn.functional.mse_loss(out.float(), y)
                if self.i in spike_at:
                    loss = loss * 10.0  # gradients 10x too
                st.backward(loss)
                st.optimizer_step(self.opt)
                self.opt.zero_grad(set_to_none=True)
            self.levels.append(st.precision)
            self.i += 1


def test_the_judge_wants_three_checks_and_a_sure_excess() -> None:
    j = ReferenceJudge(tolerance=0.02)
    assert j.judge(9, "bf16", 1.0, 1.10) is None and j.judge(19, "bf16", 1.0, 1.10) is None  # too few
    why = j.judge(29, "bf16", 1.0, 1.10)
    assert why is not None and "+10.0%" in why and "last 3 checks" in why and "tolerance 2%" in why
    # Over the tolerance on average, but not surely worse than fp32: the rounding of a given
    # set of weights helps or hurts a batch by a few percent either way.
    j = ReferenceJudge(tolerance=0.02)
    for step, x in enumerate((0.09, -0.05, 0.08, -0.04, 0.06)):
        assert j.judge(step, "bf16", 1.0, 1.0 + x) is None, step
    # A new level starts its own count; fp32 itself non-finite says nothing; the level
    # non-finite where fp32 is finite rolls back at once.
    assert j.judge(99, "fp16", 1.0, 1.5) is None and j.summary()["checks"] == 1  # type: ignore[index]
    assert j.judge(100, "fp16", math.inf, 1.0) is None
    assert "nan" in (j.judge(101, "fp16", 1.0, math.nan) or "")
    assert MIN_CHECKS == 3


def test_a_level_worse_on_the_reference_batch_rolls_back_for_good(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()
    with GreenCallback(
        probe_trial=False,
        job="ref-worse",
        model=model,
        socket=sock_path,
        reference_loss=reference(model, penalty=0.10),
        reference_every=5,
        cooldown_steps=1000,
        **FAST,
    ) as cb:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        loop.run(6)
        assert cb.reference_checks == []  # nothing to compare at fp32
        switch(daemon, cb, "bf16")
        loop.run(20)
        assert wait_for(lambda: len(daemon.precision_events) == 1)
    assert daemon.registers[0]["reference_every"] == 5
    checks = cb.reference_checks
    assert [c["step"] for c in checks] == [9, 14, 19]  # every 5th step below fp32
    assert all(c["excess"] == pytest.approx(0.10, abs=0.02) for c in checks)
    assert loop.levels[6:20] == ["bf16"] * 14 and set(loop.levels[20:]) == {"fp32"}  # from the next step
    (ev,) = daemon.precision_events
    assert ev["kind"] == "rollback" and (ev["from"], ev["to"]) == ("bf16", "fp32") and ev["step"] == 19
    assert "reference check at step 19" in ev["reason"] and "+10.0%" in ev["reason"] and "barred" in ev["reason"]
    assert ev["loss"] == pytest.approx(checks[-1]["loss"]) and ev["trend"] == pytest.approx(checks[-1]["fp32"])
    assert "bf16" in cb._control.guard.barred


@contextlib.contextmanager
def bf16_job_asked_fp8(
    daemon: FakeDaemon, sock_path: Path, model: nn.Module, steps: int, **kw: Any
) -> Iterator[tuple[GreenCallback, Loop]]:
    """A job that trains in bf16 (fp8-emulated offered, ``kw`` GreenCallback's options over
    these): 3 steps, the daemon asks fp8-emulated, ``steps`` more; the callback still open."""
    with GreenCallback(job="to-fp8", model=model, socket=sock_path, initial_precision="bf16",
                       precisions=["bf16", "fp8-emulated"], fp8_min_features=16, **kw, **FAST) as cb:  # fmt: skip
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        loop.run(3)
        switch(daemon, cb, "fp8-emulated")
        loop.run(steps)
        yield cb, loop


@needs_torchao
def test_no_reference_check_runs_while_a_trial_has_the_fp8_linears_put_back(
    daemon: FakeDaemon, sock_path: Path
) -> None:
    """A step down to fp8 starts with a trial: bf16 steps (the fp8 linears put back to
    nn.Linear) but for two fp8 blocks. A reference check due at such a step would run its
    "fp8" pass on the plain linears and book an excess of exactly 0 for fp8: none runs
    there; those due once the run is at fp8 run and see Float8Linear layers."""
    model = make_model()
    x, y = batch(10_000)
    fp8_seen: list[int] = []

    def ref() -> torch.Tensor:
        fp8_seen.append(sum(type(m).__name__ == "Float8Linear" for m in model.modules()))
        return nn.functional.mse_loss(model(x).float(), y)

    with bf16_job_asked_fp8(daemon, sock_path, model, 200, reference_loss=ref, reference_every=4) as (cb, _):
        pass
    checks = cb.reference_checks
    assert len(checks) >= 10 and all(c["level"] == "fp8-emulated" for c in checks)
    # Every pass at "fp8" saw the Float8Linear layers (each check: its bf16 pass, then its
    # fp8 pass): the checks due in the trial's bf16 stretches did not run.
    assert len(fp8_seen) == 2 * len(checks) and all(n > 0 for n in fp8_seen[1::2]), fp8_seen
    assert all(c["excess"] != 0.0 for c in checks), checks


@needs_torchao
def test_a_spike_is_not_checked_on_fp8_linears_put_back(daemon: FakeDaemon, sock_path: Path) -> None:
    """A spike read while a trial (or probe) step has the fp8 linears put back cannot be
    checked at fp8 on the reference batch (its "fp8" pass would run the plain linears and
    clear it as a change of the data): the spike rule's verdict stands, unchecked (a job's
    second spike rolls back; its lone first one, which the rule alone excuses, does not)."""
    model = make_model()
    x, y = batch(10_000)
    ref = lambda: nn.functional.mse_loss(model(x).float(), y)  # noqa: E731
    with bf16_job_asked_fp8(daemon, sock_path, model, 5, reference_loss=ref) as (cb, _):  # (5: in its trial)
        control = cb._control
        assert control.level == "fp8-emulated" and control.fp8 is not None and not control.fp8.active
        before = len(cb.reference_checks)
        d = control.guard.stack[-1]
        assert d.own_spikes == 0
        d.spikes = 1
        assert control.confirm_spike("a spike") is None
        d.spikes = 2
        assert control.confirm_spike("a spike") == "a spike"
        assert len(cb.reference_checks) == before  # no check ran on the plain linears


@needs_torchao
def test_a_bf16_job_at_fp8_is_judged_against_bf16_not_fp32(daemon: FakeDaemon, sock_path: Path) -> None:
    """A job that trains in bf16, taken to fp8: its reference pass ran in fp32, so the
    check measured fp8 plus bf16's own gap to fp32 (the job's choice, not greend's) and
    could roll fp8 back for it. The upper pass now runs at the job's own level."""
    model = make_model()
    x, y = batch(10_000)
    seen: list[torch.dtype | None] = []

    def ref() -> torch.Tensor:
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return nn.functional.mse_loss(model(x).float(), y)

    with bf16_job_asked_fp8(daemon, sock_path, model, 12, reference_loss=ref, reference_every=4,
                            probe_trial=False) as (cb, loop):  # fmt: skip
        pass
    checks = cb.reference_checks
    assert len(checks) >= 2 and {c["against"] for c in checks} == {"bf16"}
    # Two passes a check: the upper one at the job's bf16 (never autocast off: fp32), then fp8's.
    assert seen[0::2] == [torch.bfloat16] * len(checks)
    assert "fp32" not in loop.levels


def test_a_harmless_level_is_kept_and_watched_to_the_end(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()
    with GreenCallback(
        probe_trial=False,
        job="ref-ok",
        model=model,
        socket=sock_path,
        reference_loss=reference(model),
        reference_every=4,
        **FAST,
    ) as cb:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        loop.run(3)
        switch(daemon, cb, "bf16")
        loop.run(40)
    # bf16 to the end, but for the first probe block's steps at fp32 (greend.training.probe).
    first = loop.levels.index("bf16")
    block = range(first + block_start(0, 400), first + block_start(0, 400) + PROBE_STEPS)
    assert first <= 4 and daemon.precision_events == []
    assert [lvl for i, lvl in enumerate(loop.levels) if i >= first] == [
        "fp32" if i in block else "bf16" for i in range(first, len(loop.levels))
    ]
    checks = cb.reference_checks
    assert len(checks) == 10 and all(abs(c["excess"]) < 0.02 for c in checks)  # real bf16 on this MLP


def test_the_check_runs_in_eval_mode_and_restores_every_module(daemon: FakeDaemon, sock_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 64), nn.Dropout(0.5), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16))
    model[2].eval()  # the user froze the norm's statistics
    seen: list[tuple[bool, bool]] = []
    x, y = batch(10_000)

    def ref() -> torch.Tensor:
        seen.append((model.training, torch.is_grad_enabled()))
        return nn.functional.mse_loss(model(x).float(), y)

    with GreenCallback(
        job="ref-modes", model=model, socket=sock_path, reference_loss=ref, reference_every=2, **FAST
    ) as cb:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        switch(daemon, cb, "bf16")
        loop.run(4)
    assert seen and all(s == (False, False) for s in seen)  # eval mode (dropout off), no autograd
    assert [m.training for m in model.modules()] == [True, True, True, False, True, True]
    assert [c["excess"] for c in cb.reference_checks] == pytest.approx([0.0, 0.0], abs=0.02)  # dropout was off


def test_a_failing_reference_is_dropped_and_training_goes_on(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()

    def broken() -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (a reference batch too large)")

    # A GreendWarning however many came before (the first of the run spent here on a bad
    # loss): the job's accuracy check is off, which its log alone would not show.
    with pytest.warns(GreendWarning, match="reference_loss failed.*out of memory"):
        with GreenCallback(
            initial_precision="fp32",
            probe_trial=False,
            job="ref-broken",
            model=model,
            socket=sock_path,
            reference_loss=broken,
            reference_every=2,
            **FAST,
        ) as cb:
            assert wait_for(lambda: cb.connected)
            with cb.step(samples=1) as st:
                st.loss("not a loss")  # type: ignore[arg-type]  # (the run's first warning)
            loop = Loop(cb, model)
            switch(daemon, cb, "bf16")
            loop.run(10)
    assert set(loop.levels) == {"bf16"} and cb.reference_checks == [] and daemon.precision_events == []
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("penalty, rolled_back", [(0.0, False), (2.0, True)], ids=["data-shift", "precision"])
def test_a_spike_rolls_back_only_if_the_reference_batch_confirms_it(
    daemon: FakeDaemon, sock_path: Path, penalty: float, rolled_back: bool
) -> None:
    """A loss 10x its trend two steps after the switch: with a reference batch that bf16
    computes as well as fp32, the data changed and nothing rolls back (nor at the next
    spike: the trend before the switch no longer counts); where the reference batch is 3x
    worse at bf16 too, it rolls back at once."""
    model = make_model()
    with GreenCallback(
        probe_trial=False,
        job=f"ref-spike-{penalty}",
        model=model,
        socket=sock_path,
        reference_loss=reference(model, penalty=penalty),
        reference_every=1000,
        cooldown_steps=1000,
        **FAST,
    ) as cb:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        loop.run(6)
        switch(daemon, cb, "bf16")
        loop.run(10, spike_at={8, 12})
        if rolled_back:
            assert wait_for(lambda: len(daemon.precision_events) == 1)
    spikes = [c for c in cb.reference_checks if c.get("spike")]
    if rolled_back:
        assert loop.levels[8] == "bf16" and set(loop.levels[9:]) == {"fp32"}
        (ev,) = daemon.precision_events
        assert "loss spike at step 8" in ev["reason"] and "on the reference batch bf16 is +200.0%" in ev["reason"]
        assert [c["step"] for c in spikes] == [8]
    else:
        assert set(loop.levels[6:]) == {"bf16"} and daemon.precision_events == []
        assert [c["step"] for c in spikes] == [8]  # the second spike was not even a candidate


def test_the_spike_rule_holds_for_spike_steps_after_the_switch() -> None:
    g = Guard(window=4, spike_steps=50)
    for v in (1.0, 1.0, 1.0, 1.0):
        g.losses.append(v)
    g.on_switch("fp32", "bf16", step=100)
    assert g.spike(5.0, 148) is None and g.spike(5.0, 149) is not None  # (the second spike)
    assert g.spike(5.0, 150) is None  # later jumps are the data's
    g.data_changed()
    assert g.spike(5.0, 120) is None


def test_bad_reference_arguments_are_refused_by_name(sock_path: Path) -> None:
    for kw, word in (
        ({"reference_loss": 3}, "reference_loss"),
        ({"reference_every": 0}, "reference_every"),
        ({"reference_tolerance": -0.1}, "reference_tolerance"),
        ({"spike_steps": 0}, "spike_steps"),
    ):
        with pytest.raises(ValueError, match=word):
            GreenCallback(job="bad", socket=sock_path, **kw)  # type: ignore[arg-type]


def test_loud_warnings_each_reach_the_user_once_and_others_only_the_first() -> None:
    """The callback's first problem is a GreendWarning; later ones only where they take
    protection away (``loud``), once each, and without "unchanged" (a rollback that
    failed left the run where it was); the rest go to the log alone."""
    import warnings

    from greend.training.warn import OnceWarnings

    w = OnceWarnings()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        w.warn("connect", "no daemon")
        w.warn("tokens", "no tokens")  # (quiet: logged only)
        w.warn("rollback:fp32", "rolling back to fp32 failed: boom", loud=True)
        w.warn("rollback:fp32", "rolling back to fp32 failed: boom", loud=True)  # (once a key)
    texts = [str(x.message) for x in got if issubclass(x.category, GreendWarning)]
    assert texts == [
        "greend: no daemon (training continues unchanged)",
        "greend: rolling back to fp32 failed: boom (training continues)",
    ], texts
