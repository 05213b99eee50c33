"""The book of the :class:`~greend.actuators.controller.Controller`: what greend holds
and for whom. The saved originals (the state file, :mod:`greend.actuators.state`), the
intentions a dry-run records instead, the owner of every knob, and the state lock that
guards them all; the GPU and RAPL knobs (:mod:`greend.actuators._gpu_knobs`,
:mod:`greend.actuators._rapl_knobs`) write their changes here.

The state lock is taken only around changes of the state, never across a call into
the driver.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import CLOCK_KNOB, POWER_KNOB, SavedState, StateFile
from greend.errors import StateError
from greend.settings import Setting


class SettingsBook:
    """The saved settings of ``state_dir`` (loaded strictly: a corrupt file raises
    :class:`~greend.errors.StateError`) and, under ``dry_run``, the intended ones, which
    live in memory only: nothing is written to the file then."""

    def __init__(self, state_dir: str | os.PathLike[str], dry_run: bool) -> None:
        self.state_file = StateFile(state_dir)
        self.dry_run = dry_run
        self.lock = threading.RLock()  # the state only: never held across a driver call
        self.state: SavedState = self.state_file.load()
        # dry-run: the intended settings, in memory only
        self.dry_gpu: dict[int, Setting] = {}
        self.dry_gpu_owner: dict[int, str] = {}
        self.dry_cpu: dict[str, tuple[float, str]] = {}  # zone rel path -> (W, owner)

    def save(self) -> None:
        if not self.dry_run:
            self.state_file.save(self.state)

    def drop_empty(self) -> None:
        self.state.gpus = [g for g in self.state.gpus if g.knobs]
        self.state.cpus = [c for c in self.state.cpus if c.constraints]

    def finish(self, report: RestoreReport) -> None:
        """After a restore: drop the emptied entries and save (the file goes once
        empty); a failing save is reported in ``report``."""
        self.drop_empty()
        try:
            self.save()
        except StateError as e:
            report.failed.append(RestoreFailure(str(self.state_file.path), "state", str(e)))

    def owners(self, in_force: bool = False) -> dict[str, list[str]]:
        """Owner -> the knobs it holds ("gpu0.clock_cap_mhz", "package-0 (intel-rapl:0)");
        ``in_force``: only those greend's write took or is making (a refused first write
        leaves its entry for the restore, but holds nothing)."""
        with self.lock:
            out: dict[str, list[str]] = {}
            if self.dry_run:
                for i, o in self.dry_gpu_owner.items():
                    s = self.dry_gpu[i]
                    if s.clock_cap_mhz is not None:
                        out.setdefault(o, []).append(f"gpu{i}.{CLOCK_KNOB}")
                    if s.power_limit_w is not None:
                        out.setdefault(o, []).append(f"gpu{i}.{POWER_KNOB}")
                for z, (_, o) in self.dry_cpu.items():
                    out.setdefault(o, []).append(z)
            else:
                for g in self.state.gpus:
                    for k, ks in g.knobs.items():
                        if not in_force or ks.set is not None or ks.pending is not None:
                            out.setdefault(ks.owner, []).append(f"gpu{g.index}.{k}")
                for c in self.state.cpus:
                    if any(st.set_uw is not None for st in c.constraints):  # (a refused first cap holds nothing)
                        out.setdefault(c.owner, []).append(c.device)
            return {o: sorted(v) for o, v in sorted(out.items())}

    def snapshot(self, refused: Mapping[int, Any]) -> dict[str, Any]:
        """JSON for ``greenctl status``: what greend holds (or would hold, dry-run);
        ``refused``: GPU index -> the knobs its driver refused."""
        with self.lock:
            gpus: dict[str, Any] = {}
            if self.dry_run:
                for i, s in sorted(self.dry_gpu.items()):
                    gpus[str(i)] = {
                        "clock_cap_mhz": s.clock_cap_mhz,
                        "power_limit_w": s.power_limit_w,
                        "owner": self.dry_gpu_owner.get(i),
                    }
                cpus = {z: {"power_limit_w": w, "owner": o} for z, (w, o) in sorted(self.dry_cpu.items())}
            else:
                for g in self.state.gpus:
                    gpus[str(g.index)] = {
                        "uuid": g.uuid,
                        **{k: ks.set for k, ks in g.knobs.items()},
                        "original": {k: ks.original for k, ks in g.knobs.items()},
                        "owners": {k: ks.owner for k, ks in g.knobs.items()},
                    }
                cpus = {
                    c.zone_id: {
                        "name": c.name,
                        "power_limit_w": c.set_w,
                        "owner": c.owner,
                        "original_uw": {str(x.index): x.original_uw for x in c.constraints},
                    }
                    for c in self.state.cpus
                }
            return {
                "dry_run": self.dry_run,
                "state_file": str(self.state_file.path),
                "gpus": gpus,
                # knobs NVML refused (NO_PERMISSION, NOT_SUPPORTED, MIG): not tried again
                "refused": {str(i): r for i, r in refused.items()},
                "cpus": cpus,
                "owners": self.owners(),
            }
