"""Unit conversions at the hardware edge. Nothing but SI travels past a probe."""

from __future__ import annotations

__all__ = ["j_to_kwh", "mj_to_j", "mw_to_w", "uj_to_j", "uw_to_w", "w_to_mw", "w_to_uw"]


def mw_to_w(mw: float) -> float:
    return mw / 1_000.0


def w_to_mw(w: float) -> int:
    return int(round(w * 1_000.0))


def mj_to_j(mj: float) -> float:
    return mj / 1_000.0


def uj_to_j(uj: float) -> float:
    return uj / 1_000_000.0


def uw_to_w(uw: float) -> float:
    return uw / 1_000_000.0


def w_to_uw(w: float) -> int:
    return int(round(w * 1_000_000.0))


def j_to_kwh(j: float) -> float:
    return j / 3_600_000.0
