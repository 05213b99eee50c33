"""Readings as rows, for ``--format csv|json`` and ``--output FILE`` logging at an
``--interval`` (``greenctl status`` and ``greenctl measure``), as ``nvidia-smi
--query-gpu ... --format=csv -l`` writes them: one row per device per sample, a header
once per file, SI units in the column names."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["COLUMNS", "SampleLog", "status_rows"]

COLUMNS = (
    "time_unix_s",
    "device",
    "name",
    "source",
    "power_w",
    "energy_j",
    "sm_clock_mhz",
    "clock_cap_mhz",
    "power_limit_w",
    "util_gpu_pct",
)


def status_rows(st: dict[str, Any], at_s: float | None = None, gpus: list[int] | None = None) -> list[dict[str, Any]]:
    """One row per GPU and per CPU zone of a ``status`` reply (``gpus``: those only,
    and no CPU zones unless counted ones exist)."""
    t = time.time() if at_s is None else at_s
    rows: list[dict[str, Any]] = []
    for g in st.get("gpus") or []:
        if gpus is not None and g.get("index") not in gpus:
            continue
        rows.append(
            {
                "time_unix_s": round(t, 3),
                "device": f"gpu{g.get('index')}",
                "name": g.get("name"),
                "source": g.get("source"),
                "power_w": g.get("power_w"),
                "energy_j": g.get("energy_j"),
                "sm_clock_mhz": g.get("sm_clock_mhz"),
                "clock_cap_mhz": g.get("clock_cap_mhz"),
                "power_limit_w": g.get("power_limit_w"),
                "util_gpu_pct": g.get("util_gpu_pct"),
            }
        )
    for c in st.get("cpus") or []:
        rows.append(
            {
                "time_unix_s": round(t, 3),
                "device": f"cpu:{c.get('zone')}",
                "name": c.get("path"),
                "source": c.get("source"),
                "power_w": c.get("power_w"),
                "energy_j": c.get("energy_j"),
                "sm_clock_mhz": None,
                "clock_cap_mhz": None,
                "power_limit_w": c.get("power_limit_w"),
                "util_gpu_pct": None,
            }
        )
    return rows


class SampleLog:
    """Rows to a stream or a file, as CSV (a header first) or JSON lines."""

    def __init__(self, fmt: str, out: TextIO | None = None, path: Path | None = None) -> None:
        if fmt not in ("csv", "json"):
            raise ValueError(f"--format {fmt!r}: expected csv or json")
        self.fmt = fmt
        self._owned = path is not None
        if path is not None:
            fresh = not path.exists() or path.stat().st_size == 0
            self._out: TextIO = open(path, "a", encoding="utf-8", newline="")  # held for the log's life: close()
        else:
            fresh = True
            assert out is not None
            self._out = out
        self._header_due = fresh and fmt == "csv"

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.fmt == "json":
            for r in rows:
                self._out.write(json.dumps(r) + "\n")
        else:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore", lineterminator="\n")
            if self._header_due:
                w.writeheader()
                self._header_due = False
            for r in rows:
                w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
            self._out.write(buf.getvalue())
        self._out.flush()

    def close(self) -> None:
        if self._owned:
            self._out.close()
