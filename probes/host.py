"""The host: CPU utilisation, memory, load, job CPU time, and a CPU power estimate.

All figures come from psutil (injected as ``psutil_module`` so tests can pass a
double). Where the node has no RAPL (VMs, containers) and a TDP is configured, the
probe also estimates CPU package power from utilisation, with a linear model::

    power_w = cpu_tdp_w * (IDLE_FRACTION + (1 - IDLE_FRACTION) * util_pct / 100)

with ``IDLE_FRACTION = 0.3`` (an idle server package draws roughly 30% of its TDP, a
busy one about its TDP). ``psutil.cpu_percent(interval=None)`` returns the mean
utilisation *since its previous call*, and the model is linear, so that power is the
mean power over the tick just ended: each tick adds ``power_w * dt``, which is exact
for the model (a trapezoid over instantaneous samples would smear each tick's load
into its neighbour). The figure is a :class:`CpuReading` with ``source="estimate"``
and ``path="estimate"``: never a measurement, and never shown as one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from greend.errors import NoData

from . import ProbeContext, register
from .base import CpuReading, HostReading, Probe, ProbeInfo, Readings

__all__ = ["IDLE_FRACTION", "HostProbe", "estimate_cpu_power_w"]

log = logging.getLogger(__name__)

#: Share of the TDP an idle package draws in the estimate model.
IDLE_FRACTION = 0.3

_TDP_FIX = (
    "set `cpu_tdp_w` under [probes] in the config (the CPU's TDP in watts, summed "
    "over sockets, e.g. cpu_tdp_w = 250) for a CPU power estimate (source=estimate)"
)


def estimate_cpu_power_w(util_pct: float, cpu_tdp_w: float) -> float:
    """CPU package power from utilisation (0-100 %) and the TDP: see the module docstring."""
    util = min(max(util_pct, 0.0), 100.0) / 100.0
    return cpu_tdp_w * (IDLE_FRACTION + (1.0 - IDLE_FRACTION) * util)


class HostProbe:
    """Host-wide figures each tick, and the CPU estimate where there is no RAPL.

    ``job_pids()`` names the processes of running jobs; each gets its CPU time in
    seconds (user + system, its reaped children's, and its live descendants' that are
    not themselves listed), so DataLoader workers count. A pid that has vanished or
    cannot be read is left out.
    """

    name = "host"
    # Load, memory and per-process CPU time move slowly: the tick loop samples this
    # probe once a second and carries the reading in between (see Daemon.tick).
    interval_s = 1.0

    def __init__(
        self,
        cpu_tdp_w: float = 0.0,
        job_pids: Callable[[], list[int]] = lambda: [],
        rapl_present: Callable[[], bool] = lambda: False,
        psutil_module: ModuleType | Any | None = None,
    ) -> None:
        if cpu_tdp_w < 0:
            raise ValueError(f"cpu_tdp_w must be >= 0, got {cpu_tdp_w}")
        self.cpu_tdp_w = float(cpu_tdp_w)
        self._job_pids = job_pids
        self._rapl_present = rapl_present
        self._ps: Any = psutil_module
        self._energy_j = 0.0
        self._prev_now_s: float | None = None
        self._last_power_w: float | None = None
        self._opened = False

    def open(self) -> None:
        if self._ps is None:
            try:
                import psutil
            except ImportError as e:
                raise NoData("psutil is not installed; `pip install psutil`") from e
            self._ps = psutil
        self._ps.cpu_percent(interval=None)  # primes: the first call always returns 0.0
        self._opened = True

    # -- pieces ------------------------------------------------------------------

    def _load_1m(self) -> float:
        try:
            return float(self._ps.getloadavg()[0])
        except (AttributeError, OSError):
            return 0.0

    def _own_cpu_s(self, proc: Any) -> float:
        t = proc.cpu_times()
        children_s = getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        return float(t.user + t.system + children_s)

    def process_cpu_s(self, pids: list[int]) -> dict[int, float]:
        """CPU seconds per pid, descendants included once (see the class docstring).

        A reaped child's time is in its parent's ``children_*``; a live one's is only in
        its own ``cpu_times()``, so the live descendants are added, skipping any that
        are listed themselves (they get their own entry) and everything under them.
        """
        ps = self._ps
        names = ("NoSuchProcess", "AccessDenied", "ZombieProcess")
        gone = tuple(getattr(ps, n) for n in names if hasattr(ps, n))
        procs: dict[int, Any] = {}
        descendants: dict[int, list[Any]] = {}
        for pid in dict.fromkeys(pids):
            try:
                proc = ps.Process(pid)
                procs[pid] = proc
                descendants[pid] = proc.children(recursive=True)
            except gone:
                procs.pop(pid, None)
                continue
        listed = set(procs)
        # Everything at or under another listed pid belongs to that pid's entry.
        owned_elsewhere: set[int] = set()
        for pid, kids in descendants.items():
            if pid in procs:
                for kid in kids:
                    if kid.pid in listed:
                        owned_elsewhere.add(kid.pid)
                        owned_elsewhere.update(k.pid for k in descendants.get(kid.pid, []))
        out: dict[int, float] = {}
        for pid, proc in procs.items():
            try:
                total = self._own_cpu_s(proc)
            except gone:
                continue
            for kid in descendants[pid]:
                if kid.pid in owned_elsewhere:
                    continue
                try:
                    total += self._own_cpu_s(kid)
                except gone:
                    continue  # exited between listing and reading: its time moves to a parent
            out[pid] = total
        return out

    def _estimating(self) -> bool:
        return self.cpu_tdp_w > 0 and not self._rapl_present()

    # -- the protocol ------------------------------------------------------------

    def sample(self, now_s: float) -> Readings:
        ps = self._ps
        util_pct = min(max(float(ps.cpu_percent(interval=None)), 0.0), 100.0)
        vm = ps.virtual_memory()
        host = HostReading(
            cpu_util_pct=util_pct,
            cpu_count=int(ps.cpu_count(logical=True) or 1),
            # total - available is what "used" means to a user (psutil's own `used`
            # differs per platform and leaves out reclaimable caches inconsistently).
            mem_used_bytes=int(vm.total - vm.available),
            mem_total_bytes=int(vm.total),
            load_1m=self._load_1m(),
            process_cpu_s=self.process_cpu_s(list(self._job_pids())),
        )
        cpus: list[CpuReading] = []
        if self._estimating():
            power_w = estimate_cpu_power_w(util_pct, self.cpu_tdp_w)
            if self._prev_now_s is not None and now_s > self._prev_now_s:
                # util_pct is the mean over (prev, now]: power_w is that tick's mean power.
                self._energy_j += power_w * (now_s - self._prev_now_s)
            self._prev_now_s = now_s
            self._last_power_w = power_w
            cpus.append(
                CpuReading(
                    zone="package",
                    path="estimate",
                    source="estimate",
                    energy_j=self._energy_j,
                    power_w=power_w,
                    counted=True,
                )
            )
        else:
            # Keep the time base fresh so that a later switch to estimating (RAPL gone)
            # does not count the whole gap at one tick's utilisation.
            self._prev_now_s = None
        return Readings(cpus=cpus, host=host)

    def info(self) -> ProbeInfo:
        if not self._opened:
            return ProbeInfo(self.name, False, "not opened yet")
        count = self._ps.cpu_count(logical=True) or 1
        version = getattr(self._ps, "__version__", "?")
        if self._rapl_present():
            power = "CPU power measured by the rapl probe"
            fix = None
        elif self.cpu_tdp_w > 0:
            power = (
                f"no RAPL: CPU power ESTIMATED from utilisation and "
                f"cpu_tdp_w = {self.cpu_tdp_w:g} W ({IDLE_FRACTION:g} x TDP idle .. "
                "1.0 x TDP busy; source=estimate, not a measurement)"
            )
            fix = None
        else:
            power = "no RAPL and no cpu_tdp_w: no CPU power figure at all"
            fix = _TDP_FIX
        detail = f"psutil {version}: {count} logical CPUs; {power}"
        devices = ["cpu estimate (source=estimate)"] if self._estimating() else []
        return ProbeInfo(self.name, True, detail, fix=fix, devices=devices)

    def close(self) -> None:
        self._opened = False


@register(
    "host",
    default=True,
    help="host CPU utilisation, memory, load and job CPU time (psutil); a CPU power "
    "estimate from cpu_tdp_w where there is no RAPL",
)
def _factory(ctx: ProbeContext) -> Probe:
    return HostProbe(cpu_tdp_w=ctx.cpu_tdp_w, job_pids=ctx.job_pids, rapl_present=ctx.rapl_present)
