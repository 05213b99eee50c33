"""``efficient`` when the GPU does not do what it is asked: a knob it refuses (a card
without clock locks, MIG mode) and a clock lock the driver clamps. Driven period by
period on a small deterministic model of a GPU (no noise), the way the daemon calls it."""

from __future__ import annotations

from collections.abc import Callable

from greend.policies import get_policy
from greend.policies.base import UNCAPPED, Decision, GpuView, JobMeasure, JobView, Setting, Snapshot

FMAX = 1980
CLOCKS = tuple(range(FMAX, 344, -15))  # descending, as NVML lists them
FLOPS = 1e12


def step_cost(s: Setting) -> tuple[float, float]:
    """(time s, energy J) of one step at ``s``: half of the step scales with 1/clock; the
    power limit holds the clock down where the draw at full clock is above it."""
    clock = float(s.clock_cap_mhz or FMAX)
    if s.power_limit_w is not None:
        while clock > 345 and 100 + 300 * (clock / FMAX) ** 2 > s.power_limit_w:
            clock -= 15
    time_s = 0.1 * (0.5 + 0.5 * FMAX / clock)
    power_w = 100 + 300 * (clock / FMAX) ** 2
    return time_s, power_w * time_s


def gpu(refused: dict[str, str] | None = None) -> GpuView:
    return GpuView(
        index=0,
        source="nvml",
        power_w=400.0,
        sm_clock_mhz=float(FMAX),
        clock_cap_mhz=None,
        power_limit_w=700.0,
        supported_sm_clocks_mhz=CLOCKS,
        power_limit_min_w=200.0,
        power_limit_max_w=700.0,
        power_limit_default_w=700.0,
        refused_knobs=refused or {},
    )


def drive(
    g: GpuView,
    hold: Callable[[Setting], Setting] = lambda s: s,
    periods: int = 300,
    steps: int = 4,
    read: Callable[[int, float, float], tuple[float, float]] = lambda i, dt, de: (dt, de),
) -> list[Decision]:
    """Run the policy for ``periods`` periods of ``steps`` steps each; a setting asked for
    is put in force as ``hold`` says the GPU holds it (the measure restarts there).
    ``read(step, time, energy)``: what the job's step number ``step`` reads as (a slow
    checkpoint step, an energy reading that stalled)."""
    policy = get_policy("efficient", min_steps=4)
    state = policy.new_state()
    in_force, n, t, e, tsq, esq, total = UNCAPPED, 0, 0.0, 0.0, 0.0, 0.0, 0
    decisions = []
    for k in range(periods):
        m = JobMeasure(in_force, n, n * FLOPS, t, e, None, tsq, esq)
        job = JobView("j", (0,), "running", total, "bf16", ("bf16",), m if n else None, in_force)
        d = policy.decide(Snapshot(t_s=float(k), gpus=(g,), jobs=(job,)), state)
        decisions.append(d)
        asked = d.settings.get("j")
        if asked is not None and hold(asked) != in_force:
            in_force, n, t, e, tsq, esq = hold(asked), 0, 0.0, 0.0, 0.0, 0.0
        for _ in range(steps):
            dt, de = read(total, *step_cost(in_force))
            n, t, e, tsq, esq, total = n + 1, t + dt, e + de, tsq + dt * dt, esq + de * de, total + 1
    return decisions


def test_a_card_without_clock_locks_is_tuned_by_its_power_limit() -> None:
    ds = drive(gpu({"clock_cap_mhz": "not_supported"}))
    asked = [s for d in ds for s in d.settings.values()]
    assert asked and all(s.clock_cap_mhz is None for s in asked)  # never a clock lock
    assert any(s.power_limit_w is not None for s in asked)  # the power limit moves
    last = ds[-1]
    assert "clock_cap_mhz refused by gpu0 (not_supported): tuning power_limit_w instead" in last.reason
    assert "settled" in last.reason, last.reason
    assert last.details["jobs"]["j"]["knob"] == "power"
    assert last.details["jobs"]["j"]["candidates_measured"] > 0


def test_a_mig_gpu_is_left_alone_and_the_reason_says_why() -> None:
    ds = drive(gpu({"clock_cap_mhz": "mig", "power_limit_w": "mig"}), periods=20)
    assert all(not d.settings for d in ds)
    assert ds[-1].reason == (
        "job j: cannot act: clock_cap_mhz refused by gpu0 (mig); power_limit_w refused by gpu0 (mig)"
    )


def test_a_clamped_clock_is_measured_at_what_the_gpu_holds() -> None:
    """The driver holds at most 1095 MHz whatever lock is asked: the search measures at
    what is in force (it never stays at "0 candidates measured"), stops asking for
    clocks above 1095 MHz once it saw the clamp, and says so."""

    def clamp(s: Setting) -> Setting:
        if s.clock_cap_mhz is not None and s.clock_cap_mhz > 1095:
            return Setting(clock_cap_mhz=1095)
        return s

    ds = drive(gpu(), hold=clamp)
    notes = [d.reason for d in ds if "the GPU holds 1095 MHz" in d.reason]
    assert notes, [d.reason for d in ds[:40]]
    first = next(i for i, d in enumerate(ds) if "the GPU holds 1095 MHz" in d.reason)
    later = [s for d in ds[first + 1 :] for s in d.settings.values()]
    assert all(s.clock_cap_mhz is None or s.clock_cap_mhz <= 1095 for s in later), later
    assert ds[-1].details["jobs"]["j"]["candidates_measured"] > 0
    assert "settled" in ds[-1].reason, ds[-1].reason


def test_a_clamp_read_back_late_is_measured_at_what_the_gpu_holds() -> None:
    """The GPU was idle when the first lock above 1095 MHz was written: the daemon could
    not read back what it holds and reported the request for 2 periods, while the steps
    ran at 1095 MHz; then the read-back shows the clamp (the measure, relabelled, goes on).
    The policy moves to what the GPU holds at once, books its measure there, never asks
    above 1095 MHz again, and settles (it does not ask the same lock forever)."""
    policy = get_policy("efficient", min_steps=4)
    state = policy.new_state()
    reported = held = UNCAPPED
    asked_cap: float | None = None  # what the GPU was asked where it holds another cap
    late: int | None = None  # periods until the late read-back; None: no clamp seen yet
    n, t, e, total = 0, 0.0, 0.0, 0
    last_asked = UNCAPPED
    decisions = []
    for k in range(600):
        if late is not None and late >= 0:
            if late == 0:  # the read-back: what the GPU holds, and what was asked
                asked_cap, reported = float(reported.clock_cap_mhz or 0), held
            late -= 1
        shown = asked_cap if reported == held and asked_cap is not None else None
        g = GpuView(**{**gpu().__dict__, "clock_cap_mhz": reported.clock_cap_mhz, "clock_cap_asked_mhz": shown})
        m = JobMeasure(
            reported, n, n * FLOPS, t, e, None, n * (t / n) ** 2 if n else 0.0, n * (e / n) ** 2 if n else 0.0
        )
        job = JobView("j", (0,), "running", total, "bf16", ("bf16",), m if n else None, reported)
        d = policy.decide(Snapshot(t_s=float(k), gpus=(g,), jobs=(job,)), state)
        decisions.append(d)
        s = d.settings.get("j")
        if s is not None and s != reported:
            clamped = s.clock_cap_mhz is not None and s.clock_cap_mhz > 1095
            if s != last_asked:  # the controller writes only a new request
                last_asked = s
                held = Setting(clock_cap_mhz=1095) if clamped else s
                asked_cap = float(s.clock_cap_mhz or 0) if clamped else None
                if clamped and late is None:  # the first clamp: read back late
                    reported, late = s, 2
                else:
                    reported = held
                n, t, e = 0, 0.0, 0.0
        dt, de = step_cost(held)
        n, t, e, total = n + 1, t + dt, e + de, total + 1  # a step a period: a candidate takes 4
    first = next((i for i, d in enumerate(decisions) if "the GPU holds 1095 MHz" in d.reason), None)
    assert first is not None, decisions[-1].reason  # not stuck asking the same lock
    later = [s for d in decisions[first + 1 :] for s in d.settings.values()]
    assert all(s.clock_cap_mhz is None or s.clock_cap_mhz <= 1095 for s in later), later
    assert decisions[-1].details["jobs"]["j"]["candidates_measured"] > 0
    assert "settled" in decisions[-1].reason, decisions[-1].reason


def test_a_baseline_whose_energy_read_nothing_is_measured_again_not_divided_by() -> None:
    """The job's first 16 steps read no energy (the GPU's readings stalled): the policy
    raised ZeroDivisionError every period after that, which stopped control on the node.
    It measures the baseline again and tunes the job."""
    ds = drive(gpu(), read=lambda i, dt, de: (dt, 0.0 if i < 16 else de))
    assert any("read no time or energy" in d.reason for d in ds[:10])
    assert "settled at" in ds[-1].reason and "energy/FLOP" in ds[-1].reason, ds[-1].reason


def test_a_checkpoint_every_50_steps_is_no_new_phase() -> None:
    """One step in 50 takes ten times as long (a checkpoint): the drift watch took each for
    a new phase and started the search again, 48 times in 2,400 steps. The job's own noise
    says a single long step is none."""
    ds = drive(gpu(), periods=600, read=lambda i, dt, de: (10 * dt, 10 * de) if i % 50 == 49 else (dt, de))
    assert sum("phase change" in d.reason for d in ds) <= 1
    assert "settled at" in ds[-1].reason, ds[-1].reason


def test_a_real_new_phase_is_still_seen() -> None:
    """From step 1,200 every step takes twice as long (a new phase): the search starts again."""
    ds = drive(gpu(), periods=500, read=lambda i, dt, de: (2 * dt, 2 * de) if i >= 1200 else (dt, de))
    changes = [k for k, d in enumerate(ds) if "phase change" in d.reason]
    assert changes and 300 <= changes[0] <= 305, changes
