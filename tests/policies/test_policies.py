"""The policy registry, the ``none`` and ``static`` policies, purity and the harness."""

from __future__ import annotations

import copy

import pytest

from greend import policies
from greend.errors import PolicyError
from greend.policies import POLICIES, describe_policies, get_policy
from greend.policies.base import Decision, GpuView, JobMeasure, JobView, Setting, Snapshot
from greend.policies.static import snap_clock_mhz
from greend.probes.sim import H100
from greend.testing.harness import SimJob, make_sim_gpus, run_policy


def gpu_view(i: int = 0, cap: int | None = None, limit: float = 700.0) -> GpuView:
    return GpuView(
        index=i,
        source="sim",
        power_w=500.0,
        sm_clock_mhz=1980.0,
        clock_cap_mhz=cap,
        power_limit_w=limit,
        supported_sm_clocks_mhz=H100.supported_sm_clocks_mhz,
        power_limit_min_w=200.0,
        power_limit_max_w=700.0,
        power_limit_default_w=700.0,
    )


def snap(*gpus: GpuView, jobs: tuple[JobView, ...] = (), t: float = 0.0) -> Snapshot:
    return Snapshot(t_s=t, gpus=tuple(gpus), jobs=jobs)


# ---------------------------------------------------------------- registry


def test_all_matches_namespace() -> None:
    assert sorted(policies.__all__) == policies.__all__
    for name in policies.__all__:
        assert hasattr(policies, name)


def test_registry_lists_policies_with_params() -> None:
    assert set(POLICIES) == {"none", "static", "efficient", "budget", "precision"}
    eff = POLICIES["efficient"]
    names = {p.name: p for p in eff.params}
    assert names["max_slowdown"].default == 0.05
    assert names["knob"].choices == ("clock", "power")
    assert all(p.help for info in POLICIES.values() for p in info.params)
    described = {d["name"]: d for d in describe_policies()}
    assert described["budget"]["params"][0]["required"] is True


def test_get_policy_coerces_strings() -> None:
    p = get_policy("efficient", max_slowdown="0.1", min_steps="4", knob="power")
    assert p.params()["max_slowdown"] == 0.1 and p.params()["min_steps"] == 4
    s = get_policy("static", clock_cap_mhz="1500", gpus="1,0")
    assert s.params()["gpus"] == (0, 1)


@pytest.mark.parametrize(
    "name,params,words",
    [
        ("nope", {}, ["unknown policy 'nope'", "allowed:", "efficient"]),
        ("efficient", {"max_slowdwn": 0.1}, ["unknown parameter(s) max_slowdwn", "max_slowdown"]),
        ("efficient", {"max_slowdown": -1}, ["'max_slowdown'", ">= 0"]),
        ("efficient", {"knob": "voltage"}, ["'knob'", "one of clock, power"]),
        ("efficient", {"min_steps": "many"}, ["'min_steps'", "an integer"]),
        ("efficient", {"eta": 2}, ["'eta'", "<= 1"]),
        ("budget", {}, ["'node_budget_w' is required"]),
        ("budget", {"node_budget_w": 0}, ["'node_budget_w'", "> 0"]),
        ("static", {}, ["clock_cap_mhz and/or power_limit_w"]),
        ("static", {"per_gpu": '{"0": {"clock_cap_mhz": -1}}'}, ["'per_gpu'", "not a positive number"]),
        ("static", {"per_gpu": '{"x": {"power_limit_w": 300}}'}, ["'per_gpu'", "not an integer"]),
        ("static", {"per_gpu": {"0": {"power": 300}}}, ["'per_gpu'", "unknown key(s) power"]),
        ("static", {"per_gpu": "{nope"}, ["'per_gpu'", "not JSON"]),
        ("static", {"power_limit_w": "nan"}, ["'power_limit_w'", "not finite"]),
        ("static", {"clock_cap_mhz": 1500, "gpus": "a"}, ["'gpus'", "list of integers"]),
        # An integer of 400 digits is no float: it was an OverflowError, answered 'internal'.
        ("efficient", {"max_slowdown": 10**400}, ["'max_slowdown'"]),
        ("precision", {"tolerance": 10**400}, ["'tolerance'"]),
        ("static", {"per_gpu": {"0": {"power_limit_w": 10**400}}}, ["'per_gpu'", "not a positive number"]),
    ],
)
def test_bad_params_name_the_key(name: str, params: dict, words: list[str]) -> None:
    with pytest.raises(PolicyError) as e:
        get_policy(name, **params)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------- none, static


def test_none_decides_nothing() -> None:
    p = get_policy("none")
    d = p.decide(snap(gpu_view()), p.new_state())
    assert d.settings == {} and d.gpu_settings == {} and d.cpu_power_limit_w == {} and d.reason


def test_snap_clock() -> None:
    clocks = H100.supported_sm_clocks_mhz
    assert snap_clock_mhz(1500, clocks) == 1500
    assert snap_clock_mhz(1507, clocks) == 1500  # not above the cap
    assert snap_clock_mhz(100, clocks) == 345  # below all: the lowest
    assert snap_clock_mhz(5000, clocks) == 1980


def test_static_snaps_and_clamps_and_targets_gpus() -> None:
    p = get_policy("static", clock_cap_mhz=1507, power_limit_w=900, gpus=[1])
    d = p.decide(snap(gpu_view(0), gpu_view(1)), p.new_state())
    assert set(d.gpu_settings) == {1}
    assert d.gpu_settings[1] == Setting(clock_cap_mhz=1500, power_limit_w=700.0)
    p = get_policy("static", power_limit_w=50)
    d = p.decide(snap(gpu_view(0), gpu_view(1)), p.new_state())
    assert d.gpu_settings == {0: Setting(power_limit_w=200.0), 1: Setting(power_limit_w=200.0)}


def test_static_per_gpu_targets() -> None:
    # One value per GPU (a JSON string from `greenctl policy set --param`, or a TOML
    # table); a GPU not named gets the common value, if any.
    p = get_policy("static", per_gpu='{"0": {"clock_cap_mhz": 1400}, "2": {"power_limit_w": 450}}')
    d = p.decide(snap(gpu_view(0), gpu_view(1), gpu_view(2)), p.new_state())
    assert d.gpu_settings == {0: Setting(clock_cap_mhz=1395), 2: Setting(power_limit_w=450.0)}
    assert "gpu0: clock_cap_mhz 1400" in d.reason
    assert p.params()["per_gpu"] == {
        "0": {"clock_cap_mhz": 1400, "power_limit_w": None},
        "2": {"clock_cap_mhz": None, "power_limit_w": 450.0},
    }
    p = get_policy("static", power_limit_w=500, per_gpu={1: {"clock_cap_mhz": 1200}})
    d = p.decide(snap(gpu_view(0), gpu_view(1)), p.new_state())
    assert d.gpu_settings == {0: Setting(power_limit_w=500.0), 1: Setting(clock_cap_mhz=1200)}


def test_static_is_idempotent() -> None:
    p = get_policy("static", clock_cap_mhz=1500, power_limit_w=400)
    d = p.decide(snap(gpu_view(0, cap=1500, limit=400.0)), p.new_state())
    assert d.gpu_settings == {}
    assert "1500 MHz" in d.reason


def test_static_on_the_simulator() -> None:
    gpus, _ = make_sim_gpus(2)
    r = run_policy(get_policy("static", clock_cap_mhz=1400, gpus=[0]), gpus, 1e12, 0.4, steps=30)
    assert gpus[0].locked_clocks_mhz() == (345, 1395) and gpus[1].locked_clocks_mhz() is None
    assert r.source == "sim"


# ---------------------------------------------------------------- purity


def _jobview(steps: int, setting: Setting | None = None) -> JobView:
    setting = setting or Setting()
    m = JobMeasure(
        setting=setting, steps=steps, flops=1e12 * steps, time_s=0.05 * steps, energy_j=25.0 * steps, power_w=500.0
    )
    return JobView(
        job="j",
        gpus=(0,),
        state="running",
        steps=steps,
        precision="fp32",
        precisions=("fp32",),
        measure=m,
        setting=setting,
    )


@pytest.mark.parametrize(
    "name,params",
    [("none", {}), ("static", {"clock_cap_mhz": 1500}), ("efficient", {}), ("budget", {"node_budget_w": 600})],
)
def test_policies_are_deterministic_and_do_not_mutate_the_snapshot(name: str, params: dict) -> None:
    snaps = [snap(gpu_view(), jobs=(_jobview(n),), t=float(n)) for n in range(1, 60, 3)]
    runs = []
    for _ in range(2):
        p = get_policy(name, **params)
        st = p.new_state()
        out = []
        for s in snaps:
            before = copy.deepcopy(s)
            d = p.decide(s, st)
            assert s == before
            assert isinstance(d, Decision)
            out.append((d.settings, d.gpu_settings, d.reason))
        runs.append(out)
    assert runs[0] == runs[1]


# ---------------------------------------------------------------- harness


def test_harness_is_deterministic_and_books_sim_energy() -> None:
    res = []
    for _ in range(2):
        gpus, _ = make_sim_gpus(1)
        r = run_policy(get_policy("efficient"), gpus, 1e12, 0.4, steps=120, noise=0.02, seed=3)
        res.append((r.total_energy_j, [x.setting for x in r.trace]))
        assert r.total_energy_j == pytest.approx(sum(x.energy_j for x in r.trace))
        assert abs(gpus[0].energy_j() - r.total_energy_j) < 1.0  # the device counter agrees
    assert res[0] == res[1]


def test_harness_second_job_and_phase_change() -> None:
    gpus, _ = make_sim_gpus(2)
    jobs = [SimJob("a", (0,), 1e12, 0.05), SimJob("b", (1,), 1e12, 0.8, start_iter=50, steps=40)]
    r = run_policy(get_policy("none"), gpus, jobs=jobs, steps=120)
    assert r.jobs["a"].steps == 120 and r.jobs["b"].steps == 40
    gpus, _ = make_sim_gpus(1)
    r = run_policy(get_policy("none"), gpus, 1e12, 0.05, steps=20, phase_change_at=10, phase_mem_share=0.8)
    assert {x.mem_share for x in r.trace[:10]} == {0.05} and {x.mem_share for x in r.trace[10:]} == {0.8}


@pytest.mark.parametrize(
    "params, says",
    [
        ({"clock_cap_mhz": 99999999999999999999999}, "<= 10000"),
        ({"power_limit_w": 1e9}, "<= 10000"),
        ({"per_gpu": {"0": {"clock_cap_mhz": 20000}}}, "over 10000"),
    ],
)
def test_static_refuses_a_cap_no_gpu_could_have(params: dict[str, object], says: str) -> None:
    """(It was accepted, reported as set, and the GPU ran uncapped at its top clock.)"""
    with pytest.raises(PolicyError, match=says):
        get_policy("static", **params)


def test_a_null_parameter_is_refused_by_name_not_taken_as_a_value() -> None:
    # {"knob": null} was accepted, and the policy then failed every period (KeyError: None).
    from greend.policies.params import Param
    from greend.policies.params import validate_params as check

    Refused = PolicyError

    specs = [
        Param("knob", "str", "clock", "what to move", choices=("clock", "power")),
        Param("cap", "float", None, "a cap"),
    ]
    with pytest.raises(Refused, match="'knob' is null; give a value .* or leave it out for its default 'clock'"):
        check("efficient", specs, {"knob": None})
    assert check("efficient", specs, {"cap": None}) == {"knob": "clock", "cap": None}  # (None is its default)
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(Refused, match="nested too deeply"):
        check("efficient", specs, {"knob": deep})
