"""The probes of one daemon: opening them, sampling each when due, and their self-metrics.

Each probe is timed and isolated: one that raises is marked failed for that tick and
the others go on; one that is closed (absent hardware, no permission) is tried again
after 2, 4, 8 and 16 s, then every ``PROBE_RETRY_S``. A probe that says it ``opens_in_background`` (real NVML, whose
``nvmlInit`` may take seconds after a driver load and whose calls may hang) is opened,
and opened again, on a thread of its own, never on the tick: it reads "initialising"
meanwhile, and ``on_open`` is told once it is open. A probe may ask to be sampled less often than the tick
(``interval_s``): its last readings stand in until it is due.

Where a probe stands in front of simulated GPUs, the scheduler is also the node's step
executor (:meth:`ProbeScheduler.execute_steps`): the job registry hands it the rows of
steps that ranks report, to be run on the device models.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import greend.probes as probe_registry
from greend._repeats import Repeats
from greend.errors import ConfigError, NoData, NoPermission, ProbeError
from greend.jobs.execution import ExecutedRow
from greend.probes import Probe, ProbeContext, ProbeInfo, Readings
from greend.probes.base import MeasuresProcesses, SampledEvery, SimulatesGpus
from greend.protocol import StepsRow

__all__ = ["PROBE_RETRY_S", "ProbeScheduler", "ProbeStats"]

log = logging.getLogger(__name__)

ROW_SPAN_MAX_S = 600.0  # the longest span a row's work is modelled over (a simulated GPU's) ...
ROW_OVER_PEAK = 1.5  # ... and this many times what the GPU could do in it at its peak, at most
ROW_FIRST_SPAN_S = 30.0  # a rank's first rows are modelled over this much time before they came, at most

PROBE_RETRY_S = 30.0
# A probe that failed to open is tried again after 2, 4, 8 and 16 s, then every
# PROBE_RETRY_S: one fault at start (NVML's GetCount timing out once) costs seconds of
# readings, not 30.
PROBE_RETRY_FIRST_S = 2.0


@dataclass
class ProbeStats:
    """Per-probe self-metrics, in the style of node_scrape_collector_*."""

    name: str
    open: bool = False
    success: bool = False
    duration_s: float = 0.0  # the last sample's wall time
    duration_total_s: float = 0.0  # wall time inside sample() since start
    samples: int = 0
    failures: int = 0
    last_error: str | None = None
    info: ProbeInfo | None = None
    next_open_s: float = 0.0
    next_due_s: float = float("-inf")
    last: Readings | None = None  # carried into ticks where the probe is not due
    opening_since: float | None = None  # monotonic; an open in progress on its own thread
    open_failures: int = 0  # opens failed in a row (the next try comes sooner while few)

    @property
    def state(self) -> str:
        """ "initialising" while an open runs, "open", or "unavailable"."""
        if self.opening_since is not None and not self.open:
            return "initialising"
        return "open" if self.open else "unavailable"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "state": self.state,
            "open": self.open,
            "success": self.success,
            "duration_s": self.duration_s,
            "duration_total_s": self.duration_total_s,
            "samples": self.samples,
            "failures": self.failures,
            "last_error": self.last_error,
        }
        if self.info is not None:
            d.update({k: v for k, v in self.info.to_json().items() if k != "name"})
        return d


class ReadingsTarget(Protocol):
    """Where a tick's readings go (the daemon's snapshot)."""

    def merge(self, r: Readings) -> None: ...


class ProbeScheduler:
    """The open-or-retry and sample-when-due schedule of a daemon's probes."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self.monotonic = monotonic
        self.probes: list[Probe] = []
        self.stats: dict[str, ProbeStats] = {}
        self.on_open: Callable[[Probe], None] | None = None  # told of every probe that opens
        self._closed = False
        self._repeats = Repeats()  # a failure to model steps, logged once per 5 min
        self._modelled_until: dict[tuple[int, tuple[int, ...]], float] = {}  # (pid, gpus) -> its rows' end

    def open_all(self, enabled: list[str], ctx: ProbeContext) -> None:
        try:
            self.probes = probe_registry.build(enabled, ctx)
        except KeyError as e:
            raise ConfigError(f"[probes] enabled: unknown probe {e}") from None
        for p in self.probes:
            self.stats[p.name] = ProbeStats(p.name)
            self.try_open(p, first=True)

    def try_open(self, p: Probe, *, first: bool) -> None:
        """Open ``p`` now, or start opening it on a thread of its own where it says it
        ``opens_in_background`` (once: an open in progress is left to finish)."""
        st = self.stats[p.name]
        if not getattr(p, "opens_in_background", False):
            self._open_now(p, first=first)
            return
        if st.opening_since is not None:
            return
        st.opening_since = self.monotonic()
        st.next_open_s = float("inf")  # the opener sets the next try when it is done
        threading.Thread(
            target=self._open_now, args=(p,), kwargs={"first": first}, name=f"open-{p.name}", daemon=True
        ).start()

    def _open_now(self, p: Probe, *, first: bool) -> None:
        st = self.stats[p.name]
        try:
            p.open()
        except NoData as e:
            st.open, st.last_error = False, str(e)
            (log.info if first else log.debug)("probe %s: %s", p.name, e)
        except ProbeError as e:
            st.open, st.last_error = False, str(e)
            (log.warning if first else log.debug)("probe %s: %s", p.name, e)
        except Exception as e:
            st.open, st.last_error = False, f"{type(e).__name__}: {e}"
            log.exception("probe %s failed to open", p.name)
        else:
            st.open, st.last_error = True, None
            log.info("probe %s: open", p.name)
        st.open_failures = 0 if st.open else st.open_failures + 1
        # (the exponent capped: 2.0 * 2**1024 overflows, after 8.5 h of a probe that never opens)
        retry_s = PROBE_RETRY_FIRST_S * 2 ** min(st.open_failures - 1, 5) if st.open_failures else PROBE_RETRY_S
        st.next_open_s = self.monotonic() + min(PROBE_RETRY_S, retry_s)
        try:
            st.info = p.info()
        except Exception as e:
            st.info = ProbeInfo(p.name, False, f"info() failed: {e}")
        st.opening_since = None
        if not st.open:
            return
        if self._closed:  # the daemon stopped while this opened: nothing may use it now
            self._close_one(p)
            st.open = False
            return
        if self.on_open is not None:
            try:
                self.on_open(p)
            except Exception:
                log.exception("after probe %s opened", p.name)

    def is_open(self, name: str) -> bool:
        st = self.stats.get(name)
        return bool(st and st.open)

    def sample(self, now_s: float, into: ReadingsTarget) -> list[Readings]:
        """Sample every open probe that is due into ``into`` (a probe not due this tick
        adds its last readings); returns the readings sampled now (the ledger books
        only these)."""
        fresh: list[Readings] = []
        for p in self.probes:
            st = self.stats[p.name]
            if st.opening_since is not None and not st.open:
                st.success = False  # opening on its own thread: nothing to read yet
                continue
            if not st.open:
                if now_s >= st.next_open_s:
                    self.try_open(p, first=False)
                if not st.open:
                    st.success = False
                    continue
            if now_s < st.next_due_s:
                if st.last is not None and st.success:
                    into.merge(st.last)
                continue
            st.next_due_s = now_s + (p.interval_s if isinstance(p, SampledEvery) else 0.0) - 1e-6
            t = time.perf_counter()
            try:
                r = p.sample(now_s)
            except Exception as e:
                st.success = False
                st.failures += 1
                msg = f"{type(e).__name__}: {e}" if not isinstance(e, ProbeError) else str(e)
                if msg != st.last_error:
                    log.error("probe %s failed: %s", p.name, msg)
                st.last_error = msg
                if isinstance(e, (NoData, NoPermission)):
                    st.open = False
                    st.next_open_s = now_s + PROBE_RETRY_S
            else:
                st.success = True
                st.samples += 1
                st.last = r
                into.merge(r)
                fresh.append(r)
            st.duration_s = time.perf_counter() - t
            st.duration_total_s += st.duration_s
        return fresh

    def rows(self) -> list[dict[str, Any]]:
        """Per-probe self-metrics with what each probe says of itself now (a GPU lost
        mid-run shows up here)."""
        for p in self.probes:
            st = self.stats[p.name]
            if st.open or st.opening_since is not None:
                try:
                    st.info = p.info()
                except Exception as e:
                    st.info = ProbeInfo(p.name, False, f"info() failed: {e}")
        return [s.to_json() for s in self.stats.values()]

    def gpu_probe(self) -> Probe | None:
        """The open probe that reads the GPUs (nvml or sim), the one the controller drives."""
        return next((p for p in self.probes if p.name in ("nvml", "sim") and self.is_open(p.name)), None)

    def process_cpu_s(self, pid: int) -> float | None:
        """A job process's CPU seconds (descendants included) through the host probe,
        or None where it is off or not open."""
        for p in self.probes:
            if isinstance(p, MeasuresProcesses) and self.is_open(p.name):
                return p.process_cpu_s([pid]).get(pid)
        return None

    def sim_gpu(self, index: int) -> Any | None:
        """The simulated device behind GPU ``index``, or None on real hardware."""
        for p in self.probes:
            if isinstance(p, SimulatesGpus) and self.is_open(p.name):
                try:
                    return p.sim_gpu(index)
                except (IndexError, KeyError, ValueError):
                    return None
        return None

    def modelled_gpu(self, index: int) -> bool:
        """A device model (a simulated GPU) stands for GPU ``index``."""
        return self.sim_gpu(index) is not None

    def execute_steps(
        self, gpus: Sequence[int], rows: Sequence[StepsRow], *, mem_share: float | None, precision: str, pid: int
    ) -> list[ExecutedRow] | None:
        """The node's :class:`~greend.jobs.execution.StepExecutor`: run a rank's rows on
        the simulated GPUs among ``gpus`` (None where there are none), each row's FLOPs
        split evenly over them, one device update per GPU for the whole message. Per
        row: the slowest GPU's duration and the GPUs' summed energy (a step's cost is
        linear in its FLOPs at fixed settings, so a row costs what its steps would one
        by one)."""
        sims = [g for g in (self.sim_gpu(i) for i in gpus) if g is not None]
        if not sims:
            return None
        # A row never asks the simulated GPUs for more than ROW_OVER_PEAK times the work the
        # fastest of them could do over its span: room for a client's FLOP estimate to be
        # off, never a row of 1e24 FLOPs (one unprivileged client's message), which made a
        # GPU's counter 4.4e12 J, and its device busy for days, for every job on it. The
        # span is the row's own, cut to the time since the rank's rows before it (its first
        # rows: ROW_FIRST_SPAN_S before now; a row claiming work since boot got 600 s at
        # 100 times the peak, 2.6e8 J) and to now (the clients' clock is this host's): rows
        # that claim the same time count it once, and a row of no span asks for nothing.
        now = time.monotonic()
        key = (pid, tuple(gpus))
        until = self._modelled_until.get(key, now - ROW_FIRST_SPAN_S)
        work = []
        for r in rows:
            level = r.precision or precision
            t0, t1 = max(r.t0_s, until), min(r.t1_s, now + 1.0)
            until = max(until, t1)
            span_s = min(max(t1 - t0, 0.0), ROW_SPAN_MAX_S)
            most = _peak_flops(sims, level) * ROW_OVER_PEAK * span_s
            work.append((min(r.flops / len(sims), most), mem_share, level))
        if len(self._modelled_until) > 4096:
            self._modelled_until.clear()
        self._modelled_until[key] = until
        try:
            for g in sims:  # the rank computes there: the GPU's process table lists it
                g.attach_process(pid)
            # Booked at once, written into the device files about once a second (defer).
            per_gpu = [g.run_steps(work, defer=True) for g in sims]
        except OSError as e:  # its device files cannot be written (a full state dir): not modelled
            line = self._repeats.line("sim", f"simulated GPUs {list(gpus)}: steps not modelled: {e}", self.monotonic())
            if line is not None:
                log.error("%s", line)
            return None
        return [
            ExecutedRow(max(c[i].duration_s for c in per_gpu), sum(c[i].energy_j for c in per_gpu))
            for i in range(len(work))
        ]

    def gpu_indices(self) -> list[int] | None:
        """The GPUs a job may claim: the open GPU probe's indices (None: no GPU probe)."""
        p = self.gpu_probe()
        if p is None:
            return None
        indices = getattr(p, "gpu_indices", None)
        return list(indices) if indices is not None else None

    def gpu_processes(self, index: int) -> set[int] | None:
        """The pids of the processes on GPU ``index``, as NVML lists them (host pids):
        its compute processes (nvmlDeviceGetComputeRunningProcesses), with its graphics
        and MPS clients where NVML lists those (an error there is no answer: those lists
        are left out). On simulated GPUs, the simulator's process table through the fake
        NVML. None where the device cannot say (NOT_SUPPORTED, a lost GPU, an old driver):
        greend.jobs.claims then trusts a job's claim."""
        p = self.gpu_probe()
        devices = getattr(p, "devices", None)
        if p is None or getattr(p, "source", None) not in ("nvml", "sim") or devices is None:
            return None
        try:
            handle = devices.handle(index)
            pids = {int(x.pid) for x in devices.call(f"gpu{index}", "nvmlDeviceGetComputeRunningProcesses", handle)}
        except Exception as e:  # not supported, a lost GPU, an old driver: cannot say
            log.debug("compute processes of GPU %d: %s", index, e)
            return None
        for fn in ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            try:
                pids |= {int(x.pid) for x in devices.call(f"gpu{index}", fn, handle)}
            except Exception as e:  # a list this device or binding does not have
                log.debug("%s of GPU %d: %s", fn, index, e)
        return pids

    def gpu_states(self) -> dict[str, Any] | None:
        """The GPU probe's state for ``status``: ``probe``, ``state`` ("initialising",
        "open", "unavailable"), ``detail`` and, per GPU NVML listed, its ``state`` ("ok",
        "unresponsive", "lost", "not_opened", "failing"); None where no GPU probe is enabled."""
        p = next((p for p in self.probes if p.name in ("nvml", "sim")), None)
        if p is None:
            return None
        st = self.stats[p.name]
        opening = getattr(p, "opening", None)
        reopening = getattr(p, "reopening", None) if st.open else None
        state = st.state
        if state == "initialising":
            detail = f"opening NVML: waiting on {opening}" if opening else "opening NVML"
        elif reopening:  # UNINITIALIZED mid-run: initialised again in the background
            state, detail = "initialising", f"initialising NVML again: waiting on {reopening}"
        else:
            detail = st.info.detail if st.info is not None else (st.last_error or "")
        states = getattr(p, "gpu_states", None)
        return {
            "probe": p.name,
            "state": state,
            "detail": detail,
            "gpus": states() if st.open and states is not None else [],
        }

    def close(self) -> None:
        self._closed = True
        for p in self.probes:
            if self.stats.get(p.name) is not None and self.stats[p.name].opening_since is not None:
                continue  # its opener closes it when it is done
            self._close_one(p)

    @staticmethod
    def _close_one(p: Probe) -> None:
        try:
            p.close()
        except Exception as e:
            log.warning("probe %s: close failed: %s", p.name, e)


def _peak_flops(sims: Sequence[Any], level: str) -> float:
    """The fastest of ``sims``' datasheet FLOP/s at ``level`` (at any level, for one the
    model does not know)."""
    try:
        return max(float(g.spec.peak_flops.for_precision(level)) for g in sims)
    except ValueError:
        return max(float(v) for g in sims for v in vars(g.spec.peak_flops).values())
