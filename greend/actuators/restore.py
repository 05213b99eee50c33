"""``greend restore --state-dir DIR``: put back every setting greend saved.

Run by systemd's ``ExecStopPost`` (after the daemon exited, however it exited)
and by the daemon at start when an earlier run left settings behind (a crash,
a SIGKILL). It needs nothing from the daemon process: the saved-settings file
(:mod:`greend.actuators.state`) records which backend wrote each device (real NVML, or
the simulator and its directory), each GPU's UUID and each RAPL zone's path
under its sysfs root, and the originals.

Every NVML call may hang on a node whose driver is stuck, and ExecStopPost runs under
the unit's ``TimeoutStopSec`` (30 s): the restore is bounded. ``nvmlInit`` is waited
for at most twice the call deadline; only the GPUs the file names are opened, by their
saved index, each on its own worker with no node-wide call (a GPU found at another index
is looked up by UUID); each GPU's calls have the call deadline (``GREEND_NVML_DEADLINE_S``,
5 s) and each GPU is restored on a thread of its own. A GPU that does not answer costs
the others nothing; it is named, with what to do, and stays in the file.

Exit codes: 0 nothing to restore or everything restored; 1 some device failed
(each listed; those entries stay in the file for the next try); 2 the state
file is corrupt or unreadable (the message says what to do; the file is left in
place unless ``--force-defaults`` is given, which moves it aside as
``.corrupt-<timestamp>`` and resets every GPU to its default clocks and power
limit); 3 some GPU, or NVML itself, did not answer in time (a hung driver): the
others are restored, and the last line names the GPUs left and what to do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from greend.actuators.controller import Controller
from greend.actuators.gpu import NvmlGpuBackend
from greend.actuators.knob_errors import guarded
from greend.actuators.rapl import RaplBackend
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import StateFile
from greend.config import DEFAULT_STATE_DIR
from greend.errors import GreendError, NoData, StateError
from greend.fsutil import lock_holder
from greend.probes.nvml_device import Unresponsive

__all__ = [
    "add_recorded_backends",
    "main",
    "reset_gpus_to_defaults",
    "restore_from_state_dir",
]

log = logging.getLogger(__name__)


def _open_gpu_backend(kind: str, sim_dir: str | None, nvml_module: Any | None, only: list[int]) -> NvmlGpuBackend:
    if kind == "sim":
        assert sim_dir is not None
        return NvmlGpuBackend.open_sim(sim_dir)
    return NvmlGpuBackend.open_nvml(nvml_module, only=only)


def restore_from_state_dir(
    state_dir: str | os.PathLike[str],
    *,
    nvml_module: Any | None = None,
    force_defaults: bool = False,
    sim_dir: Path | str | None = None,
) -> RestoreReport:
    """Restore everything ``<state_dir>/saved-settings.json`` holds; never raises
    for a device or a corrupt file: the report says (see the module docstring).

    ``nvml_module``: the NVML module for entries written through real NVML
    (default ``import pynvml``; tests pass a ``FakeNvml``). ``force_defaults``:
    only for a corrupt file, move it aside and reset the GPUs (of ``sim_dir``
    when given, else of NVML) to their defaults; with a good file the saved
    originals are restored as usual (they are better than defaults).
    """
    sf = StateFile(state_dir)
    try:
        state = sf.load()
    except StateError as e:
        if not force_defaults:
            log.error("%s", e)
            return RestoreReport(state_error=str(e))
        moved = sf.move_aside()
        report = _reset_defaults(nvml_module=nvml_module, sim_dir=sim_dir)
        report.notes.insert(0, f"moved the unreadable saved-settings file to {moved}")
        report.notes.append(
            "RAPL limits greend may have set are not reset (there is no kernel default): "
            "check /sys/class/powercap/*/constraint_*_power_limit_uw"
        )
        return report
    if state.empty:
        return RestoreReport()

    ctrl = Controller(state_dir)
    try:
        add_recorded_backends(ctrl, {g.backend_key for g in state.gpus}, nvml_module)
        for root in {c.sysfs_root for c in state.cpus}:
            if Path(root).is_dir():
                ctrl.add_rapl_backend(RaplBackend(root))
            else:
                ctrl.rapl_backend_unavailable(root, f"the sysfs root {root} does not exist")
        report = ctrl.restore_all()
    finally:
        ctrl.close()
    if report.unanswered:
        report.notes.append(
            f"not restored, did not answer in time: {', '.join(report.unanswered)}; their originals stay in "
            f"{sf.path}. Check `nvidia-smi` and `dmesg` for Xid errors, reset those GPUs (`nvidia-smi -r -i "
            f"<index>`, no processes on them) or reboot, then run `greend restore --state-dir {sf.state_dir}` again"
        )
    return report


def add_recorded_backends(ctrl: Controller, keys: set[str], nvml_module: Any | None) -> None:
    """Open a GPU backend for each of ``keys`` (``"nvml"``, ``"sim:<dir>"``) that the
    saved-settings file records, and add it to ``ctrl``; one that cannot be opened is
    recorded with why (its entries' restore reports it)."""
    saved = ctrl.state_file.load().gpus
    entries = {g.backend_key: g for g in saved}
    for key in sorted(keys):
        g = entries.get(key)
        if g is None:
            continue
        only = sorted({e.index for e in saved if e.backend_key == key})
        try:
            ctrl.add_gpu_backend(_open_gpu_backend(g.backend, g.sim_dir, nvml_module, only))
        except GreendError as e:
            what = "NVML" if g.backend == "nvml" else f"the simulated GPUs in {g.sim_dir}"
            reason = "unresponsive" if isinstance(e, Unresponsive) else "failed"
            ctrl.gpu_backend_unavailable(key, f"cannot open {what}: {e}", reason)


def reset_gpus_to_defaults(backend: NvmlGpuBackend) -> RestoreReport:
    """Unlock the clocks and set the default power limit of every GPU of ``backend``,
    each on its own (``--force-defaults``, when the saved originals are lost)."""
    report = RestoreReport()
    for i in backend.indices():
        dev = f"gpu{i}"
        try:
            guarded(dev, "clock_cap_mhz", "reset the locked clocks", partial(backend.reset_locked_clocks, i))
            report.restored.append(f"{dev} clock_cap_mhz: unlocked (default)")
        except GreendError as e:
            report.failed.append(RestoreFailure(dev, "clock_cap_mhz", str(e)))
        try:
            default = guarded(
                dev, "power_limit_w", "read the default power limit", partial(backend.default_power_limit_w, i)
            )
            current = guarded(dev, "power_limit_w", "read the power limit", partial(backend.power_limit_w, i))
            if round(current * 1000) != round(default * 1000):
                guarded(
                    dev,
                    "power_limit_w",
                    f"set the default power limit {default:g} W",
                    partial(backend.set_power_limit_w, i, default),
                )
            report.restored.append(f"{dev} power_limit_w: {default:g} W (default)")
        except GreendError as e:
            report.failed.append(RestoreFailure(dev, "power_limit_w", str(e)))
    return report


def _reset_defaults(*, nvml_module: Any | None, sim_dir: Path | str | None) -> RestoreReport:
    try:
        backend = NvmlGpuBackend.open_sim(sim_dir) if sim_dir is not None else NvmlGpuBackend.open_nvml(nvml_module)
    except NoData as e:
        return RestoreReport(notes=[f"no GPUs to reset: {e}"])
    except GreendError as e:
        return RestoreReport(failed=[RestoreFailure("gpus", "all", f"cannot open the GPUs: {e}")])
    try:
        return reset_gpus_to_defaults(backend)
    finally:
        backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``greend restore``; returns the exit code (0, 1 or 2, see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="greend restore",
        description="Restore every GPU clock, GPU power limit and RAPL limit greend saved.",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where saved-settings.json is (default {DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--force-defaults",
        action="store_true",
        help="if the saved file is corrupt: move it aside and reset every GPU to its default clocks and power limit",
    )
    parser.add_argument(
        "--sim-dir", type=Path, default=None, help="with --force-defaults: reset these simulated GPUs instead of NVML's"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--force", action="store_true", help="restore even while the daemon that owns the state dir runs"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, stream=sys.stderr, format="greend restore: %(levelname)s %(message)s"
        )
    owner = lock_holder(args.state_dir)
    if owner is not None and not args.force:
        print(
            f"greend restore: the greend that owns {args.state_dir} is running (pid {owner}): it holds its "
            "settings and restores them when it stops (systemctl stop greend); --force restores now anyway",
            file=sys.stderr,
        )
        return 2
    report = restore_from_state_dir(args.state_dir, force_defaults=args.force_defaults, sim_dir=args.sim_dir)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        stream = sys.stdout if report.ok else sys.stderr
        for line in report.lines():
            print(line, file=stream)
    return report.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
