"""Fixed caps: a clock cap and/or power limit on chosen GPUs (the same on each, or
one per GPU with ``per_gpu``), always.

The operator's "MIT Lincoln Lab" policy: a static power or clock cap saves up to
~15 % energy for a marginal slowdown on many training jobs, with no search.

Each decision the policy compares what is in force on each targeted GPU with its
target and names only the GPUs that differ in ``Decision.gpu_settings`` (so
re-applying nothing is free). Targets are fitted to the GPU at hand:

* ``clock_cap_mhz`` snaps to the nearest supported SM clock *not above* the cap
  (or the lowest supported clock if the cap is below all of them);
* ``power_limit_w`` is clamped to the GPU's ``[min, max]`` limit constraints.
"""

from __future__ import annotations

from typing import Any

from greend.errors import PolicyError

from .base import Decision, GpuView, Setting, Snapshot
from .params import Param, validate_params

__all__ = ["StaticPolicy", "snap_clock_mhz", "clamp_power_w"]


def snap_clock_mhz(cap_mhz: float, supported_mhz: tuple[int, ...]) -> int:
    """The highest supported clock <= ``cap_mhz`` (the lowest one if none is)."""
    if not supported_mhz:
        return int(cap_mhz)
    below = [f for f in supported_mhz if f <= cap_mhz + 1e-9]
    return max(below) if below else min(supported_mhz)


def clamp_power_w(limit_w: float, gpu: GpuView) -> float:
    """``limit_w`` clamped to the GPU's power-limit constraints (when known)."""
    lo = gpu.power_limit_min_w
    hi = gpu.power_limit_max_w
    if lo is not None:
        limit_w = max(limit_w, lo)
    if hi is not None:
        limit_w = min(limit_w, hi)
    return float(limit_w)


def in_force(gpu: GpuView) -> Setting:
    """The setting in force on ``gpu``, with a limit at its default shown as None."""
    pl = gpu.power_limit_w
    if pl is not None and gpu.power_limit_default_w is not None and abs(pl - gpu.power_limit_default_w) < 0.5:
        pl = None
    return Setting(clock_cap_mhz=gpu.clock_cap_mhz, power_limit_w=pl)


def same_setting(a: Setting, b: Setting) -> bool:
    pa, pb = a.power_limit_w, b.power_limit_w
    same_p = (pa is None and pb is None) or (pa is not None and pb is not None and abs(pa - pb) < 0.5)
    return a.clock_cap_mhz == b.clock_cap_mhz and same_p


class StaticPolicy:
    """Hold a clock cap and/or a power limit on the given GPUs (default: all)."""

    name = "static"
    help = "a fixed SM clock cap and/or power limit on the given GPUs (default all)"
    PARAMS: tuple[Param, ...] = (
        Param("clock_cap_mhz", "int", None, "max SM clock, MHz (snapped down to a supported clock)", lo=1, hi=10_000),
        Param("power_limit_w", "float", None, "power limit, W (clamped to the GPU range)", lo=0, lo_open=True, hi=1e4),
        Param("gpus", "int_list", None, "GPU indices to cap (default: every GPU, or per_gpu's)"),
        Param(
            "per_gpu",
            "gpu_map",
            None,
            "per GPU index, its own clock_cap_mhz and/or power_limit_w (overrides the values above on that GPU)",
        ),
    )

    def __init__(self, **params: Any) -> None:
        self._params = validate_params(self.name, self.PARAMS, params)
        p = self._params
        if p["clock_cap_mhz"] is None and p["power_limit_w"] is None and not p["per_gpu"]:
            raise PolicyError("policy 'static': set clock_cap_mhz and/or power_limit_w, or per_gpu (none was given)")
        if p["per_gpu"] and p["gpus"] is None and p["clock_cap_mhz"] is None and p["power_limit_w"] is None:
            p["gpus"] = tuple(sorted(p["per_gpu"]))  # only the GPUs it names

    def new_state(self) -> None:
        return None

    def params(self) -> dict[str, Any]:
        """The parameters, JSON-friendly (per_gpu's keys as strings)."""
        out = dict(self._params)
        if out["per_gpu"] is not None:
            out["per_gpu"] = {str(k): v for k, v in out["per_gpu"].items()}
        return out

    def target(self, gpu: GpuView) -> Setting:
        """What this policy holds on ``gpu``, fitted to its supported values."""
        own = (self._params["per_gpu"] or {}).get(gpu.index)
        cap = own["clock_cap_mhz"] if own else self._params["clock_cap_mhz"]
        pl = own["power_limit_w"] if own else self._params["power_limit_w"]
        return Setting(
            clock_cap_mhz=None if cap is None else snap_clock_mhz(cap, gpu.supported_sm_clocks_mhz),
            power_limit_w=None if pl is None else clamp_power_w(pl, gpu),
        )

    def decide(self, snap: Snapshot, state: Any) -> Decision:
        wanted = self._params["gpus"]
        d = Decision()
        held: list[str] = []
        targets = [g for g in snap.gpus if wanted is None or g.index in wanted]
        for g in targets:
            t = self.target(g)
            if not same_setting(in_force(g), t):
                d.gpu_settings[g.index] = t
            held.append(f"gpu{g.index}")
        missing = sorted(set(wanted or ()) - {g.index for g in snap.gpus})
        t_str = []
        if self._params["clock_cap_mhz"] is not None:
            t_str.append(f"clock <= {self._params['clock_cap_mhz']} MHz")
        if self._params["power_limit_w"] is not None:
            t_str.append(f"power <= {self._params['power_limit_w']:g} W")
        for i, own in sorted((self._params["per_gpu"] or {}).items()):
            t_str.append(f"gpu{i}: " + ", ".join(f"{k} {v:g}" for k, v in own.items() if v is not None))
        d.reason = f"static: {' and '.join(t_str)} on {', '.join(held) or 'no GPU'}"
        # A value the GPU cannot hold is held at the nearest it can: said, not read as in force.
        fitted = []
        for g in targets:
            own = (self._params["per_gpu"] or {}).get(g.index)
            pl = own["power_limit_w"] if own else self._params["power_limit_w"]
            t = self.target(g)
            if pl is not None and t.power_limit_w is not None and abs(t.power_limit_w - pl) > 0.5:
                fitted.append(f"gpu{g.index} holds {t.power_limit_w:g} W, its range's end")
        if fitted:
            d.reason += f" ({'; '.join(fitted)})"
        if missing:
            d.reason += f" (GPU(s) {', '.join(map(str, missing))} not present)"
        d.details = {
            "targets": {
                g.index: {"clock_cap_mhz": self.target(g).clock_cap_mhz, "power_limit_w": self.target(g).power_limit_w}
                for g in targets
            },
            "missing_gpus": missing,
        }
        return d
