"""What the SQLite store's rollup keeps of each measurement (:meth:`greend.stores.sqlite.SqliteStore.roll_up`)."""

from __future__ import annotations

__all__ = ["ROLLUP_LAST", "ROLLUP_SUM"]

# Rows older than [store] raw_hours are rolled up to one per series per rollup_s (see
# SqliteStore.roll_up). The series are the tags each measurement carries (greend/points.py;
# tests/stores/test_sqlite_rollup.py checks they agree).
ROLLUP_LAST: dict[str, tuple[str, ...]] = {
    "greend_gpu": ("host", "gpu", "source", "method"),
    "greend_cpu": ("host", "zone", "path", "source"),
    "greend_host": ("host",),
    "greend_probe": ("host", "probe"),
    "greend_efficiency": ("host", "job", "run", "precision"),
}
ROLLUP_SUM: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "greend_job_steps": (
        ("host", "job", "run", "rank", "precision"),
        {
            "steps": "sum",
            "first_step": "min",
            "last_step": "max",
            "duration_s": "sum",
            "duration_sq_s2": "sum",
            "flops": "sum",
            "samples": "sum",
            "tokens": "sum",
            "nonfinite": "sum",
            "loss_mean": "wmean:loss_n",
            "loss_min": "min",
            "loss_max": "max",
            "loss_n": "sum",
            "sim_duration_s": "sum",
            "sim_energy_j": "sum",
        },
    ),
}
