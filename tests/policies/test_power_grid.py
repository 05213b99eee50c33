"""The power knob's grid: round limits (multiples of ``power_step_w``) under a top that is
not one, replayed on two measured Quadro RTX 6000 profiles (top limit 260 W), and the
boundary bracketed to neighbours on a measured P100 profile: profiles the policy was not
built on (tests/fixtures/zeus-summary/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from greend.policies import get_policy
from greend.probes.trace import trace_spec
from greend.testing.harness import make_sim_gpus, run_policy
from tests.support import load_bench

SUMMARIES = Path(__file__).resolve().parent.parent / "fixtures" / "zeus-summary"


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    bench = load_bench("bench_dvfs")
    out: dict[str, Path] = {}
    for gpu in ("rtx6000", "p100"):
        paths = bench.zeus_summary_profiles(SUMMARIES / f"summary_power_{gpu}.csv", tmp_path_factory.mktemp(gpu))
        out.update({p.name.split("+")[1]: p for p in paths})
    return out


def _replay(path: Path, bound: float, seed: int):  # type: ignore[no-untyped-def]
    spec = trace_spec(str(path))
    gpus, _ = make_sim_gpus(1, spec=spec)
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=bound)
    return spec.profile, run_policy(pol, gpus, 1e12, 0.0, steps=1000, settle_steps=1, noise=0.02, seed=seed)


def test_the_search_measures_round_limits_under_a_260_w_top(profiles: dict[str, Path]) -> None:
    prof, r = _replay(profiles["librispeech-deepspeech2-24-adamw"], 0.05, 1)
    assert prof.max_w == 260 and min(prof.limits_w) == 100
    first = next(k for k, s in enumerate(r.trace) if s.phase == "settled")
    searched = {s.setting.power_limit_w for s in r.trace[:first] if s.setting.power_limit_w is not None}
    assert searched and all(w % 25 == 0 for w in searched), searched  # (before: 235, 210, 185, 160, 135 W)


@pytest.mark.parametrize(
    ("job", "gap"),
    [
        ("librispeech-deepspeech2-24-adamw", 0.02),
        # Its optimum runs 1.047x the uncapped step, 0.3 % under the bound: 2 % step noise
        # does not confirm that in every seed, and the policy then ends on the safe side.
        ("cifar100-shufflenetv2-512-adadelta", 0.03),
    ],
)
def test_the_policy_ends_near_the_measured_optimum_on_a_260_w_top(
    profiles: dict[str, Path], job: str, gap: float
) -> None:
    """Both optima (175 W under a 5 % bound) are measured limits; a grid from 260 W down
    (235, 210, 185, 160 W) missed them by 3.5 and 4.0 % in two of these three seeds."""
    for seed in (1, 2, 3):
        prof, r = _replay(profiles[job], 0.05, seed)
        feasible = [w for w in prof.limits_w if prof.time_ratio(w) <= 1.05]
        opt = min(prof.energy_ratio(w) for w in feasible)
        got = r.final_setting.power_limit_w or prof.max_w
        assert prof.energy_ratio(got) <= (1 + gap) * opt, (seed, got)
        over = [s for s in r.settled_steps() if prof.time_ratio(s.setting.power_limit_w or prof.max_w) > 1.05 + 1e-9]
        assert not over, (seed, got)


def test_a_limit_between_the_boundary_and_a_tie_at_the_top_is_measured(profiles: dict[str, Path]) -> None:
    """P100 BERT (batch 32): 200 and 225 W tie with uncapped on energy, 150 W runs over a
    5 % bound (1.051x) and 175 W, unmeasured by the coarse pass, costs 10 % less at 1.006x.
    The best was uncapped and its neighbour measured, so the search settled there (11.5 %
    over the optimum in seed 1); now the boundary is bracketed to neighbours first."""
    for seed in (1, 2, 3):
        prof, r = _replay(profiles["sentiment140-bert_base_uncased-32-adamw"], 0.05, seed)
        feasible = [w for w in prof.limits_w if prof.time_ratio(w) <= 1.05]
        opt = min(prof.energy_ratio(w) for w in feasible)
        got = r.final_setting.power_limit_w or prof.max_w
        assert prof.energy_ratio(got) <= 1.02 * opt and prof.time_ratio(got) <= 1.05, (seed, got)


def test_the_limits_below_the_lowest_one_measured_within_the_bound_are_searched(profiles: dict[str, Path]) -> None:
    """P100 ShuffleNetV2 (batch 256), a job that draws about 130 W: every limit runs within
    1.2 % of uncapped, and 125 W, the minimum, costs 12 % less energy than uncapped where
    the others save 1-3 %. The coarse pass measured 200 and 150 W, nothing over the bound,
    and the search settled at 225 W (10.3 % over the optimum in every seed); now a limit
    within the bound with limits below it unmeasured is followed down."""
    for seed in (1, 2, 3):
        prof, r = _replay(profiles["cifar100-shufflenetv2-256-adadelta"], 0.05, seed)
        assert (r.final_setting.power_limit_w or prof.max_w) == 125, seed
