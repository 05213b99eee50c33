"""Which knob tunes a job's GPUs: the policy's own (a clock cap or a power limit), or the
other one where a GPU refused it or has nothing to search."""

from __future__ import annotations

from .base import GpuView

__all__ = ["KNOB_NAMES", "knob_for", "tunable"]

KNOB_NAMES = {"clock": "clock_cap_mhz", "power": "power_limit_w"}


def tunable(g: GpuView, knob: str) -> bool:
    """Whether ``knob`` has settings to search on ``g``."""
    if knob == "clock":
        return len(g.supported_sm_clocks_mhz) > 1
    return g.power_limit_min_w is not None and g.power_limit_max_w is not None


def knob_for(own: str, views: list[GpuView]) -> tuple[str | None, str]:
    """The knob to tune these GPUs with (the policy's ``own`` first), and why not its own:
    a knob a GPU refused (NOT_SUPPORTED on a consumer card, MIG mode, NO_PERMISSION) is
    never asked for; the other knob (clock <-> power limit) does the job where it works.
    (None, why) when neither can act."""
    if not views:
        return None, "its GPUs are not read (yet)"
    why: list[str] = []
    for knob in (own, "power" if own == "clock" else "clock"):
        name = KNOB_NAMES[knob]
        refusing = {g.index: g.refused_knobs[name] for g in views if name in g.refused_knobs}
        if refusing:
            by = ", ".join(f"gpu{i} ({r})" for i, r in sorted(refusing.items()))
            why.append(f"{name} refused by {by}")
        elif not all(tunable(g, knob) for g in views):
            why.append(f"{name} not tunable on its GPUs")
        else:
            return knob, "; ".join(why) + (f": tuning {name} instead" if why else "")
    return None, "; ".join(why)
