"""Precision levels in GreenCallback: switching, refusing, and the accuracy guard's fast rule.

Real torch training on the CPU against :class:`greend.testing.fake_daemon.FakeDaemon` (a real
Unix socket that speaks docs/protocol.md and records the ``precision_event``
messages the callback sends).
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from greend.errors import GreendWarning
from greend.testing.fake_daemon import FakeDaemon
from greend.training.callback import GreenCallback
from greend.training.fp8 import Fp8Converter
from greend.training.mixed_precision import (
    Guard,
    fp8_targets,
    grads_finite,
    is_downgrade,
    precision_support,
)
from tests.support import wait_for

HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="fp8-emulated needs torchao (pip install 'greend[fp8]')")

FAST = dict(
    flush_interval_s=0.02,
    heartbeat_s=0.2,
    reconnect_min_s=0.1,
    reconnect_max_s=0.2,
    reply_timeout_s=1.0,
    stall_timeout_s=1.0,
    close_timeout_s=2.0,
    connect_timeout_s=1.0,
)
IN, HID, OUT, BATCH = 32, 64, 16, 16


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, OUT))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x[:, :OUT] * 0.5


class Loop:
    """A training loop that goes through step.backward/optimizer_step (fp16-ready)."""

    def __init__(self, cb: GreenCallback, model: nn.Module) -> None:
        self.cb, self.model = cb, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.i = 0
        self.losses: list[float] = []
        self.levels: list[str] = []
        self.out_dtypes: list[torch.dtype] = []
        self.fp8_layers: list[int] = []
        self.stepped: list[bool] = []

    def run(self, n: int, *, poison: Callable[[int], str | None] = lambda i: None) -> None:
        for _ in range(n):
            x, y = batch(self.i)
            kind = poison(self.i)
            with self.cb.step(samples=BATCH, flops=1e9) as st:
                with st.autocast():
                    out = self.model(x)
                loss = nn.functional.mse_loss(out.float(), y)
                if kind == "loss":
                    loss = loss * float("inf")
                hook = None
                if kind == "grad":
                    hook = self.model[0].weight.register_hook(lambda g: g * float("inf"))
                st.backward(loss)
                if hook is not None:
                    hook.remove()
                self.stepped.append(st.optimizer_step(self.opt))
                self.opt.zero_grad(set_to_none=True)
            self.levels.append(st.precision)
            self.out_dtypes.append(out.dtype)
            self.fp8_layers.append(sum(1 for m in self.model.modules() if type(m).__name__ == "Float8Linear"))
            self.losses.append(float(loss.detach()))
            self.i += 1


def switch(daemon: FakeDaemon, cb: GreenCallback, level: str) -> None:
    assert daemon.directive(level) == 1
    assert wait_for(lambda: cb.requested_precision == level)


# Switching -------------------------------------------------------------------------------


@needs_torchao
def test_switching_levels_keeps_parameters_and_optimizer_state(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()
    params = [id(p) for p in model.parameters()]
    levels = ["fp32", "bf16", "fp16", "fp8-emulated"]
    with GreenCallback(
        probe_trial=False,
        job="switch",
        model=model,
        socket=sock_path,
        precisions=levels,
        loss_scaling=True,
        fp8_min_features=16,
        **FAST,
    ) as cb:
        assert wait_for(lambda: cb.connected)
        assert daemon.registers[0]["precisions"] == levels
        loop = Loop(cb, model)
        loop.run(3)
        plan = ["bf16", "fp32", "fp16", "fp8-emulated", "bf16", "fp8-emulated", "fp32"]
        for level in plan:
            switch(daemon, cb, level)
            loop.run(3)
            assert [id(p) for p in model.parameters()] == params
            # The optimizer's state is keyed by the same Parameter objects, and kept counting.
            assert {id(p) for p in loop.opt.state} == set(params)
            assert all(int(s["step"]) == loop.i for s in loop.opt.state.values())
        scaler = cb._control.scaler
    assert loop.levels == ["fp32"] * 3 + [lvl for lvl in plan for _ in range(3)]
    by_level = dict(zip(loop.levels, loop.out_dtypes))
    assert by_level["fp32"] == torch.float32
    assert by_level["bf16"] == torch.bfloat16 and by_level["fp8-emulated"] == torch.bfloat16
    assert by_level["fp16"] == torch.float16
    # fp8: the middle linears (not the head) ran as Float8Linear, and only at that level.
    assert {lvl: n for lvl, n in zip(loop.levels, loop.fp8_layers)} == {
        "fp32": 0,
        "bf16": 0,
        "fp16": 0,
        "fp8-emulated": 2,
    }
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert scaler is not None and scaler.get_scale() > 0  # fp16 ran through the GradScaler
    assert all(math.isfinite(v) for v in loop.losses) and all(loop.stepped)
    assert loop.losses[-1] < loop.losses[0]
    assert wait_for(lambda: len(daemon.steps) == loop.i)
    assert [s["precision"] for s in daemon.steps] == loop.levels
    assert daemon.precision_events == []  # nothing was refused or rolled back


@needs_torchao
def test_fp8_converter_round_trip_keeps_modules_and_parameters() -> None:
    model = make_model()
    before = {n: m for n, m in model.named_modules()}
    conv = Fp8Converter(model, fp8_targets(model, 16), emulate=True)
    assert conv.convert() == 2 and conv.active
    assert type(model[2]).__name__ == "Float8Linear" and model[2].weight is before["2"].weight
    conv.revert()
    assert not conv.active
    assert all(model.get_submodule(n) is m for n, m in before.items() if n)


@needs_torchao
def test_the_jobs_own_hooks_on_a_converted_linear_fire_at_fp8_and_after() -> None:
    """A forward hook the job put on a linear that fp8 converts (an activation monitor)
    fires at fp8 too (before: silent whenever greend took the job to fp8, with no word), a
    backward hook too, and a hook removed while converted is gone after the revert."""
    model = make_model()
    seen: list[str] = []
    fwd = model[2].register_forward_hook(lambda m, i, o: seen.append("fwd"))
    model[2].register_full_backward_hook(lambda m, gi, go: seen.append("bwd"))
    conv = Fp8Converter(model, fp8_targets(model, 16), emulate=True)
    conv.convert()
    assert type(model[2]).__name__ == "Float8Linear"
    x, y = batch(0)
    nn.functional.mse_loss(model(x).float(), y).backward()
    assert seen == ["fwd", "bwd"], seen
    fwd.remove()  # (the handle the job holds is the original module's)
    conv.revert()
    seen.clear()
    nn.functional.mse_loss(model(x).float(), y).backward()
    assert seen == ["bwd"], seen
    # A full backward hook the job puts on the converted module (the one it finds in the
    # model at fp8) fires after the revert and the next conversion too.
    fresh = make_model()
    conv = Fp8Converter(fresh, fp8_targets(fresh, 16), emulate=True)
    conv.convert()
    fresh[2].register_full_backward_hook(lambda m, gi, go: seen.append("late"))
    for _ in range(2):
        conv.revert()
        seen.clear()
        nn.functional.mse_loss(fresh(x).float(), y).backward()
        assert seen == ["late"], seen
        conv.convert()


def test_fp8_targets_skip_head_small_and_odd_layers() -> None:
    model = nn.Sequential(
        nn.Embedding(10, 64),
        nn.Linear(64, 2048),
        nn.LayerNorm(2048),
        nn.Linear(2048, 1030),
        nn.Linear(1030, 1024),
        nn.Linear(1024, 1024),
        nn.Linear(1024, 10),
    )
    assert fp8_targets(model) == ["5"]  # 3 and 4 are not multiples of 16, 1 is small, 6 is the head
    assert fp8_targets(model, 16) == ["1", "5"]
    named = nn.ModuleDict(
        {"body": nn.Linear(1024, 1024), "lm_head": nn.Linear(1024, 1024), "tail": nn.Linear(1024, 16)}
    )
    assert fp8_targets(named, 16) == ["body"]


# Support and refusals ------------------------------------------------------------------------


def test_fp8_emulated_is_offered_only_when_listed(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()
    with GreenCallback(job="default", model=model, socket=sock_path, fp8_min_features=16, **FAST) as cb:
        support = cb.supported_precisions()
        assert support["fp8-emulated"] is not None and "precisions=" in support["fp8-emulated"]
        assert wait_for(lambda: cb.connected)
        assert "fp8-emulated" not in daemon.registers[0]["precisions"]
        switch(daemon, cb, "fp8-emulated")
        with pytest.warns(GreendWarning, match="fp8-emulated"):
            Loop(cb, model).run(2)
        assert cb.precision == "fp32"
        assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
        assert wait_for(lambda: len(daemon.precision_events) == 1)
    ev = daemon.precision_events[0]
    assert ev["kind"] == "refused" and ev["from"] == "fp32" and ev["to"] == "fp8-emulated"
    assert ev["reason"] == support["fp8-emulated"]
    listed = precision_support(torch.device("cpu"), ["fp32", "fp8-emulated"], model=model, fp8_min_features=16)
    assert listed["fp8-emulated"] == (None if HAVE_TORCHAO else listed["fp8-emulated"])
    assert listed["bf16"] == "not in the precisions= this callback was given"
    assert precision_support(torch.device("cpu"), ["fp8-emulated"], model=None)["fp8-emulated"] is not None


@pytest.mark.parametrize("level,needle", [("fp8", "8.9"), ("tf32", "CUDA")])
def test_an_unsupported_level_is_never_applied_and_the_reason_is_reported(
    daemon: FakeDaemon, sock_path: Path, level: str, needle: str
) -> None:
    model = make_model()
    with GreenCallback(initial_precision="fp32", job=f"no-{level}", model=model, socket=sock_path, **FAST) as cb:
        reason = cb.supported_precisions()[level]
        assert reason is not None and needle in reason
        assert wait_for(lambda: cb.connected)
        assert level not in daemon.registers[0]["precisions"]
        switch(daemon, cb, level)
        with pytest.warns(GreendWarning, match=level):
            Loop(cb, model).run(3)
        assert cb.precision == "fp32" and cb.refused[level] == reason
        assert wait_for(lambda: len(daemon.precision_events) == 1)
        cb.flush()  # the steps read in a batch go out now
        assert wait_for(lambda: len(daemon.steps) == 3)
    assert daemon.precision_events[0] == {"kind": "refused", "from": "fp32", "to": level, "reason": reason, "step": 0}
    assert {s["precision"] for s in daemon.steps} == {"fp32"}


def test_fp16_without_loss_scaling_is_refused(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GreenCallback(job="fp16-plain", model=model, socket=sock_path, **FAST) as cb:
        assert cb.supported_precisions()["fp16"] is None
        assert wait_for(lambda: cb.connected)
        switch(daemon, cb, "fp16")
        with pytest.warns(GreendWarning, match="loss scaling"):
            for i in range(3):
                x, y = batch(i)
                with cb.step(samples=BATCH, flops=1e9) as st:  # a plain loop: no step.backward
                    with st.autocast():
                        loss = nn.functional.mse_loss(model(x).float(), y)
                    st.loss(loss)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                assert st.precision == "fp32"
        assert wait_for(lambda: len(daemon.precision_events) == 1)
    assert daemon.precision_events[0]["kind"] == "refused"
    assert "step.backward" in daemon.precision_events[0]["reason"]


# The guard ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::greend.training.callback.GreendWarning")  # the barred retry warns once
@pytest.mark.parametrize("what", ["loss", "grad"])
def test_nonfinite_right_after_a_switch_rolls_back_within_one_step(
    daemon: FakeDaemon, sock_path: Path, what: str
) -> None:
    model = make_model()
    with GreenCallback(
        probe_trial=False, job=f"inf-{what}", model=model, socket=sock_path, cooldown_steps=1000, **FAST
    ) as cb:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        loop.run(6)
        switch(daemon, cb, "bf16")
        bad = loop.i + 1  # the second step after the switch
        loop.run(4, poison=lambda i: what if i == bad else None)
        assert loop.levels[bad - 1 : bad + 2] == ["bf16", "bf16", "fp32"]  # back from the very next step
        assert loop.stepped[bad] is False  # the poisoned update was skipped: weights stay clean
        assert all(torch.isfinite(p).all() for p in model.parameters())
        # The failed level is barred: asking again is refused with the reason. (The daemon
        # learnt of the rollback and says fp32 first; then it asks bf16 again.)
        switch(daemon, cb, "fp32")
        switch(daemon, cb, "bf16")
        loop.run(3)
        assert cb.precision == "fp32" and "barred" in cb.refused["bf16"]
        loop.run(10)  # the training finishes
        assert wait_for(lambda: len(daemon.precision_events) == 2)
        cb.flush()  # the steps read in a batch go out now
        assert wait_for(lambda: len(daemon.steps) == loop.i)
    rollback, refused = daemon.precision_events
    assert rollback["kind"] == "rollback" and rollback["from"] == "bf16" and rollback["to"] == "fp32"
    assert rollback["step"] == bad
    word = "loss" if what == "loss" else "gradient"
    assert f"non-finite {word}" in rollback["reason"] and "barred" in rollback["reason"]
    # The trend figure: the mean loss over the guard's window before the switch (6 fp32 steps).
    assert rollback["trend"] == pytest.approx(sum(loop.losses[:6]) / 6)
    assert refused["kind"] == "refused" and refused["to"] == "bf16" and "barred" in refused["reason"]
    steps = daemon.steps
    assert steps[bad]["precision"] == "bf16" and steps[bad].get("nonfinite") is True
    assert steps[bad + 1]["precision"] == "fp32"
    assert all(math.isfinite(v) for i, v in enumerate(loop.losses) if i != bad)
    assert loop.losses[-1] < loop.losses[0]


@pytest.mark.filterwarnings("ignore::greend.training.callback.GreendWarning")
def test_a_rollback_never_overtakes_the_steps_it_rolls_back(sock_path: Path) -> None:
    """Rows held for the daemon's cadence (5 s here, its longest) go out before a precision event:
    the daemon follows a rank's level by its rows, so steps at bf16 that arrived after the
    rollback would read as a second move."""
    d = FakeDaemon(sock_path, rows_every_s=5.0).start()
    try:
        model = make_model()
        with GreenCallback(
            probe_trial=False, job="held-rows", model=model, socket=sock_path, cooldown_steps=1000, **FAST
        ) as cb:
            assert wait_for(lambda: cb.connected)
            loop = Loop(cb, model)
            loop.run(6)
            switch(d, cb, "bf16")
            bad = loop.i + 1
            loop.run(4, poison=lambda i: "loss" if i == bad else None)
            assert loop.levels[bad : bad + 2] == ["bf16", "fp32"]
            assert wait_for(lambda: len(d.precision_events) == 1)
        (ev,) = d.precision_events
        assert ev["kind"] == "rollback" and ev["step"] == bad
        # Every step up to the rolled-back one was in the daemon's hands before the event.
        assert d.received_at_events[0] >= bad + 1, (d.received_at_events, bad)
        assert [r["precision"] for r in d.rows if r["first_step"] <= bad][-1] == "bf16"
    finally:
        d.stop()


def test_nonfinite_at_the_starting_level_is_not_a_rollback(daemon: FakeDaemon, sock_path: Path) -> None:
    model = make_model()
    with GreenCallback(job="inf-fp32", model=model, socket=sock_path, **FAST) as cb:
        loop = Loop(cb, model)
        loop.run(4, poison=lambda i: "loss" if i == 2 else None)
        assert loop.levels == ["fp32"] * 4 and loop.stepped == [True] * 4  # the guard is not armed
        cb.flush()  # the steps read in a batch go out now
        assert wait_for(lambda: len(daemon.steps) == 4)
    assert daemon.precision_events == [] and daemon.steps[2].get("nonfinite") is True


def test_guard_rules() -> None:
    g = Guard(window=4, cooldown_steps=10)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        g.losses.append(v)
    assert g.trend() == pytest.approx(3.5) and not g.armed
    g.on_switch("fp32", "bf16", step=5)
    g.on_switch("bf16", "fp8", step=9)
    assert g.armed and len(g.stack) == 2
    ev = g.rollback("fp8", step=12, what="loss", loss=None)
    assert ev is not None and (ev.from_level, ev.to_level, ev.step, ev.trend) == ("fp8", "bf16", 12, None)
    assert "3 steps after the switch bf16 -> fp8" in ev.reason
    assert g.barred_reason("fp8", 20) is not None and g.barred_reason("fp8", 23) is None
    g.on_switch("bf16", "fp32", step=30)  # the daemon stepped back up: nothing to roll back to
    assert not g.armed and g.rollback("fp32", 31, "loss", None) is None
    assert is_downgrade("fp32", "tf32") and is_downgrade("bf16", "fp8-emulated") and not is_downgrade("bf16", "fp16")
    assert ev.fields()["kind"] == "rollback" and "loss" not in ev.fields()


def test_grads_finite() -> None:
    model = make_model()
    nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
    assert grads_finite(model.parameters())
    model[2].weight.grad[0, 0] = float("nan")
    assert not grads_finite(model.parameters())
    assert grads_finite([])


def test_guard_calls_a_loss_spike_after_a_downgrade_and_only_then() -> None:
    from greend.training.mixed_precision import Guard

    g = Guard(window=8, cooldown_steps=10, spike_tolerance=0.5)
    for v in (1.0, 1.1, 0.9, 1.0):
        g.losses.append(v)
    assert g.spike(5.0) is None  # no downgrade in force: not the guard's business
    g.on_switch("fp32", "bf16", step=4)  # trend before the switch: 1.0
    assert g.spike(1.4) is None  # worse, within the tolerance
    assert g.spike(1.6) is None and g.excused  # a first spike of a job that never spiked: maybe one bad batch
    assert g.spike(1.1) is None and not g.excused
    why = g.spike(1.6)  # the second: the level's
    assert why is not None and "60% above the trend" in why and "2 spikes in 4 steps at bf16" in why, why
    ev = g.rollback("bf16", 6, "loss", 1.6, why)
    assert ev is not None and ev.to_level == "fp32" and "loss spike at step 6" in ev.reason
    assert g.barred_reason("bf16", 7) is not None and g.spike(9.0) is None  # back at fp32
    assert Guard(spike_tolerance=None).spike(1e9) is None


def test_a_jump_the_level_above_shows_too_is_a_shift_not_a_spike() -> None:
    """(``confirm=True``: whether a loss is a spike at all; a first one alone is excused
    without a reference batch, below.) A benign shift in the data landed between a trial's
    blocks: the bf16 steps between them read the new level (3.6, 3.5, 3.6), the next fp8
    step read it too (2.72 where the twin at bf16 read 2.717), and the spike rule, against
    the trend frozen at the directive (0.5), rolled fp8 back and barred it (2 of 2 runs of a
    red-team's workload). The steps at the level above now say the data moved; a jump they
    do not show is still a spike."""
    from greend.training.mixed_precision import Guard

    def guard() -> Guard:
        g = Guard(window=8, cooldown_steps=10, spike_tolerance=0.5)
        for v in (0.5, 0.52, 0.48, 0.5):
            g.losses.append(v)
        g.on_switch("bf16", "fp8", step=100)
        return g

    g = guard()
    for step, v in ((150, 3.6), (151, 3.5), (152, 3.6)):
        g.note_above(v, step)
    assert g.spike(2.72, 160) is None  # below the level above's latest steps: the data's
    assert g.stack[-1].trend == 3.6  # the trend from now on
    assert g.spike(3.7, 161) is None
    assert g.spike(9.0, 162, confirm=True) is not None  # a spike against the new trend still is
    g = guard()
    for step, v in ((150, 0.5), (151, 0.49), (152, 0.52)):
        g.note_above(v, step)
    assert g.spike(2.72, 160, confirm=True) is not None  # the level above did not jump: the lower level's spike
    g = Guard(window=8, cooldown_steps=10, spike_tolerance=0.5)
    for v in (0.5, 0.52, 0.48, 0.5):
        g.losses.append(v)
    for step, v in ((97, 3.6), (98, 3.5), (99, 3.6)):  # before the downgrade: not its evidence
        g.note_above(v, step)
    g.on_switch("bf16", "fp8", step=100)
    assert g.spike(2.72, 160, confirm=True) is not None
    g = guard()
    for step, v in ((150, 3.6), (151, 3.5), (152, 3.6)):
        g.note_above(v, step)
    assert g.spike(2.72, 240, confirm=True) is not None  # steps at the level above too long ago to say


def test_a_job_that_spikes_on_its_own_is_judged_by_its_rate_of_spikes() -> None:
    """A heavy-tailed loss: one batch in about 60 is 5 to 13 times the rest, at fp32 as at
    bf16. Its first spike after the switch was read as bf16's (rolled back, the fp32 twin
    spiking at the same step); now the spikes fp32 had over its last 512 steps give the
    rate to expect, and one spike at that rate is the data's. A divergence (spike after
    spike) still rolls back within a few steps, naming the rates."""
    import random

    from greend.training.mixed_precision import SPIKE_HISTORY, Guard

    rng = random.Random(3)

    def loss(spiky: bool) -> float:
        return (rng.uniform(5, 13) if spiky and rng.random() < 1 / 60 else 1.0) * (1 + rng.gauss(0, 0.02))

    g = Guard(window=32, cooldown_steps=10, spike_tolerance=0.5)
    for _ in range(SPIKE_HISTORY + 100):
        g.losses.append(loss(True))
    g.on_switch("fp32", "bf16", step=1000)
    d = g.stack[-1]
    assert d.own_steps == SPIKE_HISTORY - 32 and 3 <= d.own_spikes <= 15, (d.own_spikes, d.own_steps)
    assert g.spike(1.0, 1001) is None and g.spike(9.0, 1002) is None  # one spike, at the job's own rate
    for step in range(1003, 1050):
        assert g.spike(loss(False), step) is None
    # Spike after spike: no rate of one-off spikes makes that likely.
    whys = [g.spike(8.0 + k, 1050 + k) for k in range(4)]
    assert whys[0] is None and any(whys), whys
    why = next(w for w in whys if w)
    assert "spikes in" in why and f"where fp32 had {d.own_spikes} in {d.own_steps}" in why, why

    # The count's tail at a large mean (a long spike_steps): no underflow to "never".
    from greend.training.mixed_precision import _poisson_tail

    assert _poisson_tail(2000, 800.0) < 1e-6 and abs(_poisson_tail(800, 800.0) - 0.5) < 0.02

    # A job that never spiked at fp32: its second spike is the level's (its first may be one
    # bad batch), or its first where a reference batch will confirm it.
    quiet = Guard(window=32, cooldown_steps=10, spike_tolerance=0.5)
    for _ in range(SPIKE_HISTORY):
        quiet.losses.append(loss(False))
    quiet.on_switch("fp32", "bf16", step=600)
    assert quiet.stack[-1].own_spikes == 0 and quiet.spike(9.0, 601, confirm=True) is not None


def test_one_bad_batch_after_the_switch_is_not_a_rollback_a_second_spike_is() -> None:
    """A red-team's tabular classifier (20 classes, 20 % label noise): one batch of random
    labels 8 steps after the switch read 149 % over the trend and rolled bf16 back at once
    (2 of 2 seeds; 0.8 % saved where the run that kept bf16 saved 62 %, the same batch in the
    fp32 twin as high). A job that never spiked at the level above now rolls back at its
    second spike within ``spike_steps``: a bad batch is one; bf16 running away is spike after
    spike (and a non-finite loss rolls back at once, by its own rule)."""
    import random

    from greend.training.mixed_precision import Guard

    rng = random.Random(5)
    g = Guard(window=32, cooldown_steps=10, spike_tolerance=0.5)
    for _ in range(400):
        g.losses.append(1.7 * (1 + rng.gauss(0, 0.05)))
    g.on_switch("fp32", "bf16", step=400)
    assert g.stack[-1].own_spikes == 0
    for step in range(401, 408):
        assert g.spike(1.7 * (1 + rng.gauss(0, 0.05)), step) is None
    assert g.spike(4.3, 408) is None and g.excused  # the bad batch: excused, kept out of the trend
    for step in range(409, 480):
        assert g.spike(1.7 * (1 + rng.gauss(0, 0.05)), step) is None and not g.excused
    why = g.spike(4.1, 480)  # a second one within spike_steps: the level's
    assert why is not None and "2 spikes in 80 steps at bf16" in why and "where fp32 had none in" in why, why
    # Spike after spike from the first (bf16 running away): rolled back at the second step.
    g2 = Guard(window=32, cooldown_steps=10, spike_tolerance=0.5)
    for _ in range(400):
        g2.losses.append(1.7 * (1 + rng.gauss(0, 0.05)))
    g2.on_switch("fp32", "bf16", step=400)
    assert g2.spike(9.0, 401) is None and g2.spike(12.0, 402) is not None
    # Put to a reference batch, a first spike is a candidate; its reason reads right where the
    # level above's own steps were too few to count its spikes.
    g3 = Guard(window=8, cooldown_steps=10, spike_tolerance=0.5)
    for v in (1.0, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0, 1.0):
        g3.losses.append(v)
    g3.on_switch("fp32", "bf16", step=8)
    why = g3.spike(9.0, 9, confirm=True)
    assert why is not None and "1 spike in 1 step at bf16" in why and "fp32 had too few steps kept" in why, why


@needs_torchao
@pytest.mark.filterwarnings("ignore::greend.training.callback.GreendWarning")
def test_an_inf_under_fp8_emulated_rolls_back_to_bf16_and_undoes_the_conversion(
    daemon: FakeDaemon, sock_path: Path
) -> None:
    model = make_model()
    params = [id(p) for p in model.parameters()]
    with GreenCallback(
        probe_trial=False,
        job="fp8-rollback",
        model=model,
        socket=sock_path,
        fp8_min_features=16,
        precisions=["fp32", "bf16", "fp8-emulated"],
        cooldown_steps=1000,
        **FAST,
    ) as cb:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        loop.run(4)
        switch(daemon, cb, "bf16")
        loop.run(4)
        switch(daemon, cb, "fp8-emulated")
        loop.run(2)
        assert loop.levels[-1] == "fp8-emulated" and loop.fp8_layers[-1] > 0
        bad = loop.i
        loop.run(4, poison=lambda i: "loss" if i == bad else None)
        # Back one level, to the one it came down from, from the very next step: the
        # fp8 conversion undone, the same Parameter objects, fp8 barred.
        assert loop.levels[bad : bad + 2] == ["fp8-emulated", "bf16"]
        assert loop.fp8_layers[bad + 1 :] == [0, 0, 0]
        assert [id(p) for p in model.parameters()] == params
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert "fp8-emulated" in cb._control.guard.barred
        assert wait_for(lambda: any(e["kind"] == "rollback" for e in daemon.precision_events))
    ev = next(e for e in daemon.precision_events if e["kind"] == "rollback")
    assert ev["from"] == "fp8-emulated" and ev["to"] == "bf16" and ev["step"] == bad


@pytest.mark.parametrize("before", ["bf16", "plain"])
def test_a_forward_before_the_first_step_does_not_set_the_jobs_own_level(before: str) -> None:
    """The job's own level is what its steps run: a forward outside any step (an
    evaluation or a check before training, under an autocast of its own or none) neither
    moves an fp32 job to bf16 nor fixes a bf16 job (its own torch.autocast around each
    step) at fp32."""
    own_bf16 = before == "plain"  # the bf16 job checks its model with a plain forward first
    model = nn.Linear(8, 4)
    x = torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = GreenCallback(job=f"pre-{before}", model=model, socket="/nonexistent/g.sock", connect_timeout_s=0.01)
    try:
        with torch.no_grad():
            if before == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(x)
            else:
                model(x)
        dtypes = []
        for _ in range(3):
            with cb.step(samples=16, batch=x) as st:
                if own_bf16:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(x)
                else:
                    with st.autocast():
                        out = model(x)
                dtypes.append(out.dtype)
                st.loss(out.float().pow(2).mean())
        want = "bf16" if own_bf16 else "fp32"
        assert cb._control.own == want and cb.precision == want
        assert dtypes == [torch.bfloat16 if own_bf16 else torch.float32] * 3
    finally:
        cb.close()


class _SelfAutocast(nn.Module):
    """A model that enters bf16 autocast in its own forward, after a first layer outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (computes without the autocast: not yet a verdict)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(h)


@pytest.mark.parametrize("case", ["autocast in forward", "bf16 weights", "first step raised"])
def test_a_bf16_job_is_seen_as_bf16_however_it_runs_bf16(case: str) -> None:
    """The job's own level when it does not say it: an autocast its model enters in its own
    forward, weights that are bf16 outright, and an autocast around the model in a first
    step that raised before its forward (a skipped batch) all make a bf16 job, from its
    first step that ran: a first step booked at fp32 made fp32 the daemon's idea of the
    job's own level and of its baseline."""
    model: nn.Module = _SelfAutocast() if case == "autocast in forward" else nn.Linear(8, 4)
    x = torch.randn(16, 8)
    if case == "bf16 weights":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = "own-" + case.replace(" ", "-")
        cb = GreenCallback(job=job, model=model, socket="/nonexistent/g.sock", connect_timeout_s=0.01)
    levels = []
    try:
        for i in range(4):
            try:
                with cb.step(samples=16, batch=x) as st:
                    if case == "first step raised" and i == 0:
                        raise ValueError("a bad batch")
                    with st.autocast():
                        if case == "first step raised":
                            with torch.autocast("cpu", dtype=torch.bfloat16):
                                out = model(x)
                        else:
                            out = model(x)
                    st.loss(out.float().pow(2).mean())
            except ValueError:
                continue
            assert out.dtype == torch.bfloat16
            levels.append(st.precision)
        assert levels == ["bf16"] * len(levels) and len(levels) >= 3
        assert cb._control.own == "bf16" and cb.precision == "bf16"
        assert not model._forward_pre_hooks and not any(m._forward_pre_hooks for m in model.modules())
    finally:
        cb.close()


@pytest.mark.parametrize("told", ["bf16", "fp8-emulated"])
def test_a_level_the_daemon_names_before_the_job_shows_its_own_waits_for_it(sock_path: Path, told: str) -> None:
    """A second callback of a running job (a resume in the same process, a notebook cell run
    again) that does not say its level is told the job's level in the register reply, before
    its first forward shows the job's own autocast. Taken then, the level in force was still
    the placeholder fp32: the guard recorded a step down from fp32, and its trials, probes
    and rollbacks ran and booked fp32 for a bf16 job. The directive waits until the job's
    own level is known, and is then taken against it."""
    daemon = FakeDaemon(sock_path, initial_precision=told).start()
    model = _SelfAutocast()
    x = torch.randn(16, 8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cb = GreenCallback(job="again", model=model, socket=sock_path, connect_timeout_s=1.0,
                               precisions=["bf16", "fp8-emulated"])  # fmt: skip
        assert wait_for(lambda: cb.requested_precision == told)
        levels = []
        for _ in range(6):
            with cb.step(samples=16, batch=x) as st:
                with st.autocast():
                    out = model(x)
                st.loss(out.float().pow(2).mean())
            levels.append(st.precision)
        control = cb._control
        assert control.own == "bf16"
        assert all(d.from_level == "bf16" for d in control.guard.stack)  # never a step down from fp32
        assert "fp32" not in levels and "fp32" not in control.offered()
    finally:
        cb.close()
        daemon.stop()


@needs_torchao
def test_more_precision_than_the_jobs_own_asked_below_it_takes_it_up_to_its_own_level(
    daemon: FakeDaemon, sock_path: Path
) -> None:
    """A bf16 job at fp8 asked for fp32 (or fp16: more than its own level) goes back to
    bf16, its own level, as much precision as it has; before, the request was refused and
    the job kept running at fp8, the less precision the daemon asked it to leave."""
    model = make_model()
    with GreenCallback(
        job="up-to-own", model=model, socket=sock_path, initial_precision="bf16",
        precisions=["bf16", "fp8-emulated"], probe_trial=False, fp8_min_features=16, **FAST,
    ) as cb:  # fmt: skip
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        switch(daemon, cb, "fp8-emulated")
        loop.run(3)
        assert loop.levels[-1] == "fp8-emulated"
        switch(daemon, cb, "fp32")
        loop.run(3)
        assert loop.levels[-1] == "bf16" and cb.precision == "bf16", loop.levels
        assert "fp32" not in cb.refused and set(loop.levels) == {"bf16", "fp8-emulated"}


@needs_torchao
@pytest.mark.parametrize("policy", [True, False])
def test_a_daemon_restarted_under_a_job_below_its_level_leaves_it_there_where_a_precision_policy_runs(
    sock_path: Path, policy: bool
) -> None:
    """The daemon restarts under a bf16 job it had taken to fp8: the new daemon's record
    knows no level but the job's own and its register reply asks bf16. Where a precision
    policy runs there (its reply carries the tolerance) the job keeps fp8 (its rows tell the
    new record; before, it went back to bf16 and a job of several ranks read the move as a
    rank's rollback and barred fp8); where none runs, it goes back to its own level."""
    tolerance = 0.05 if policy else None
    d1 = FakeDaemon(sock_path, precision_tolerance=tolerance).start()
    model = make_model()
    cb = GreenCallback(
        job="restarted", model=model, socket=sock_path, initial_precision="bf16",
        precisions=["bf16", "fp8-emulated"], probe_trial=False, fp8_min_features=16, **FAST,
    )  # fmt: skip
    d2: FakeDaemon | None = None
    try:
        assert wait_for(lambda: cb.connected)
        loop = Loop(cb, model)
        switch(d1, cb, "fp8-emulated")
        loop.run(20)
        cb.flush()
        assert wait_for(lambda: len(d1.steps) + sum(r.get("steps", 0) for r in d1.rows) >= 20)
        d1.stop()
        assert wait_for(lambda: not cb.connected)
        d2 = FakeDaemon(sock_path, precision_tolerance=tolerance).start()
        assert wait_for(lambda: cb.stats.connects == 2, 10.0)
        loop.run(5)
        want = "fp8-emulated" if policy else "bf16"
        assert loop.levels[-1] == want and cb.precision == want, loop.levels[-6:]
    finally:
        cb.close()
        d1.stop()
        if d2 is not None:
            d2.stop()
