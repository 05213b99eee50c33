"""Least-squares lines for the probes' rule (:mod:`greend.training.probe`): plain floats."""

from __future__ import annotations

__all__ = ["fit", "line_at", "mean", "residuals"]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def fit(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """The least-squares line through (x, y): (mean x, mean y, slope; 0 where x is one point)."""
    xm, ym = mean(x), mean(y)
    sxx = sum((xi - xm) ** 2 for xi in x)
    slope = sum((xi - xm) * (yi - ym) for xi, yi in zip(x, y, strict=True)) / sxx if sxx > 0 else 0.0
    return xm, ym, slope


def line_at(points: list[tuple[float, float]], at: float) -> float:
    """The least-squares line through ``points`` (x, y), at ``at``."""
    xm, ym, slope = fit([x for x, _ in points], [y for _, y in points])
    return ym + slope * (at - xm)


def residuals(x: list[float], y: list[float]) -> list[float]:
    """``y`` less the least-squares line through (x, y)."""
    xm, ym, slope = fit(x, y)
    return [yi - ym - slope * (xi - xm) for xi, yi in zip(x, y, strict=True)]
