"""The NVML probe: NVIDIA GPUs through ``pynvml`` (or the simulator's stand-in for it).

``NvmlProbe`` is the only probe that imports ``pynvml``, and only inside
``open()``, so nodes without the package still start. The module is injectable
(``nvml=``): the ``sim`` probe passes the simulator's NVML, so simulated GPUs run this
very code. This module imports no simulator: a module in front of simulated GPUs says
so by its shape (:class:`~greend.probes.nvml_device.SimulatedNvml`).

What it measures, per GPU and in SI units at the edge (mW -> W, mJ -> J):

- Energy from deltas of ``nvmlDeviceGetTotalEnergyConsumption`` (Volta+),
  cumulative since ``open()``; ``energy_method="counter"``. Where the counter is
  ``NOT_SUPPORTED`` (pre-Volta), power samples are integrated with the trapezoid
  rule over the ``now_s`` the tick loop passes; ``energy_method="power_integration"``.
  NVML power on Ampere+ is a ~1 s average, so the counter is always preferred: one
  that stops working mid-run hands over to power at once and is tried again every
  ``COUNTER_RETRY_S`` (60 s), taken back from a new baseline when it answers.
- Power, SM/memory clocks, utilisation, temperature, power limits. An optional
  field a GPU does not support reads ``None``; the rest of the reading stands.
  The counter is read every tick; the other fields at most every
  ``SLOW_FIELDS_EVERY_S`` (1 s), power included while the counter works: NVML's
  power is itself a ~1 s average, and the energy (what prices the steps) comes
  from the counter. A GPU that integrates power reads it every tick.
- SM activity (``sm_active_pct``), where the GPU has NVML's GPM metrics (Hopper and
  newer): the share of its SMs busy since the last slow read (``_nvml_gpm.py``).
- ``clock_cap_mhz``: NVML has no getter for locked clocks, so the actuator layer
  (which set them) answers through the ``cap_lookup(index)`` given to the constructor
  or to :meth:`NvmlProbe.use_cap_lookup`.

The probe only reads. Settings are written by the GPU actuator
(:mod:`greend.actuators.gpu`) over the same :class:`~greend.probes.nvml_device.NvmlDevices`
(:attr:`NvmlProbe.devices`): the module, the handles, the lost GPUs and the count of
settings writes that tells the probe to read a GPU's settings again.

Failure isolation: a GPU that answers ``GPU_IS_LOST`` is logged once as an error,
marked lost and left out of later readings while the others carry on. The daemon's tick
never waits on a GPU that hangs: its last reading stands in, stale (``_nvml_reads.py``).

Recovery: while a GPU is lost or did not answer (every ``RECOVER_EVERY_S``) and after
NVML answered ``UNINITIALIZED`` (initialised again first), the GPUs are enumerated again
and matched by UUID, never by index: a GPU that comes back at another index (a driver
reload renumbers them) keeps its energy and is read at its new index. With real NVML
the driver calls of a recovery run on a thread of their own and the tick applies their
result when it is there (``probes/_nvml_state.py``): the tick never waits on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from greend.errors import DeviceLost, NoData, NotSupported, ProbeError
from greend.units import mw_to_w

from . import ProbeContext, register
from ._nvml_gpm import Gpm
from ._nvml_reads import Reads, tick_read_wait_s
from ._nvml_state import COUNTER_RETRY_S, Look, Looks, TrackedGpu
from ._nvml_state import as_text as _text
from .base import GpuReading, Probe, ProbeInfo, Readings
from .nvml_device import (
    NVML_ERROR_MAP,
    NvmlDevices,
    NvmlUninitialized,
    SimulatedNvml,
    Unresponsive,
    translate_nvml_error,
)

__all__ = ["COUNTER_RETRY_S", "NVML_ERROR_MAP", "NvmlProbe", "translate_nvml_error"]

log = logging.getLogger(__name__)

# How often lost GPUs are looked for again (a reset or a driver reload brings them back).
RECOVER_EVERY_S = 5.0

# Clocks, utilisation, temperature, power limit (and power, where the energy
# counter works) are re-read at most this often.
SLOW_FIELDS_EVERY_S = 1.0


# How long the daemon's (background) open waits for NVML's node-wide calls: a driver
# that is loading answers in seconds; one that does not answer in this long is called
# unresponsive, and the open is tried again later.
OPEN_WAIT_S = 120.0

NO_NVML_FIX = (
    "install the NVIDIA driver (it provides libnvidia-ml.so) and the nvidia-ml-py "
    "package, or run `greend run --sim N` for simulated GPUs"
)


class NvmlProbe:
    """GPUs through NVML. See the module docstring for what and how.

    ``nvml``: the module to use (default: ``import pynvml`` in ``open()``);
    ``source``: the label on every reading (``"nvml"``, or ``"sim"``);
    ``cap_lookup(index)``: the locked max SM clock in MHz the actuators applied,
    or None for uncapped/unknown.
    """

    def __init__(
        self,
        nvml: Any | None = None,
        source: str = "nvml",
        cap_lookup: Callable[[int], float | None] | None = None,
        open_wait_s: float | None = None,
        read_wait_s: float | None = None,
    ) -> None:
        self.name = source
        self.source = source
        self._cap_lookup = cap_lookup
        self._devices = NvmlDevices(nvml)
        # The module in front of simulated GPUs, when one was given (decided once: the
        # protocol check costs microseconds, and the daemon asks per step report).
        self._simulated = nvml if source == "sim" and isinstance(nvml, SimulatedNvml) else None
        self._opened = False
        self._gpus: list[TrackedGpu] = []
        self._open_errors: dict[int, str] = {}  # index -> why it was not enumerated
        self._driver_version: str | None = None
        self._unavailable: tuple[str, str | None] | None = None  # (detail, fix)
        self._recover_at_s = float("-inf")
        self._gone: dict[str, TrackedGpu] = {}  # UUID -> a GPU not found again whose index another took
        # How long open() waits for NVML's node-wide calls (the GPU count, the driver's
        # version); None: the call deadline. The daemon opens in the background and
        # waits long: a driver still loading answers late, and status says so meanwhile.
        self.open_wait_s = open_wait_s
        # Real NVML may hang or take seconds to initialise: the daemon opens it off its
        # tick thread (greend.daemon.probing), the simulator's fake inline.
        self.opens_in_background = source == "nvml"
        self._phase: tuple[str, float] | None = None  # (what open() waits on, since monotonic)
        self._count: int | None = None  # GPUs NVML listed when it was last enumerated
        self._unanswered: set[int] = set()  # indices whose calls did not return at open
        self._only: tuple[list[int], float] | None = None  # open_only(): the GPUs, nvmlInit's wait
        # Recoveries (NVML initialised again, the GPUs looked for again) in the background
        self._looks = Looks(self._look_again)
        # The GPUs' reads, each on its own worker: a read still out is taken by a later tick
        self._reads = Reads(self._devices, self._sample_gpu, read_wait_s)
        self._gpm = Gpm(self._devices)  # SM activity where the GPUs have GPM, read with the slow fields

    def __repr__(self) -> str:
        return f"NvmlProbe(source={self.source!r}, gpus={len(self._gpus)}, opened={self._opened})"

    # ---- calls through the one error table

    @property
    def nvml(self) -> Any | None:
        """The NVML module in use (None before ``open()`` when defaulted)."""
        return self._devices.nvml

    @property
    def devices(self) -> NvmlDevices:
        """The device layer this probe reads through; the GPU actuator writes through it."""
        return self._devices

    def use_cap_lookup(self, cap_lookup: Callable[[int], float | None] | None) -> None:
        """Where ``clock_cap_mhz`` comes from: the locked max SM clock the actuators applied."""
        self._cap_lookup = cap_lookup

    def _call(self, what: str, fn: str, *args: Any) -> Any:
        return self._devices.call(what, fn, *args)

    def _optional(self, gpu: TrackedGpu, fn: str, *args: Any) -> Any | None:
        """A call whose failure costs one field: None on NOT_SUPPORTED and on other
        errors (recorded and logged when they start); a lost GPU still raises."""
        try:
            value = self._call(f"gpu{gpu.index}", fn, *args)
            gpu.errors.pop(fn, None)  # (an error shown until the call answers again, not for good)
            return value
        except DeviceLost:
            raise
        except NotSupported:
            return None
        except ProbeError as e:
            line = gpu.should_log(fn, str(e), time.monotonic())
            if line is not None:
                log.warning("%s", line)
            gpu.errors[fn] = str(e)
            return None

    # ---- Probe protocol

    def open(self) -> None:
        if self._opened:
            return
        try:
            self._open()
        finally:
            self._phase = None

    def _at(self, what: str) -> None:
        self._phase = (what, time.monotonic())

    def _open(self) -> None:
        try:
            nvml = self._devices.import_module()
        except ImportError as e:
            self._no_nvml("the nvidia-ml-py package (module pynvml) is not installed")
            raise NoData(f"no NVML on this node: {e} (fix: pip install nvidia-ml-py)") from e
        self._at("nvmlInit")
        try:
            if self._only is None:
                nvml.nvmlInit()
            else:  # greend restore: bounded, a hung driver may hang nvmlInit too
                self._devices.call("node", "nvmlInit", wait_s=self._only[1])
        except nvml.NVMLError as e:
            err = translate_nvml_error(e, "nvmlInit")
            if isinstance(err, NoData):
                self._no_nvml(str(e))
                raise NoData(f"no NVML on this node: {e} (fix: {NO_NVML_FIX})") from e
            self._unavailable = (str(err), None)
            raise err from e
        self._opened = True
        try:
            self._enumerate()
        except BaseException:
            self.close()
            raise
        if not self._count:  # GPUs that do not answer are GPUs: "none" is only for none
            self.close()
            self._unavailable = ("NVML found no GPUs on this node", None)
            raise NoData("NVML found no GPUs on this node")

    def _no_nvml(self, reason: str) -> None:
        if self._unavailable is None:  # said once, quietly (NoData is expected)
            log.debug("no NVML on this node: %s", reason)
        self._unavailable = (f"no NVML on this node: {reason}", NO_NVML_FIX)

    def open_only(self, indices: Iterable[int], init_wait_s: float | None = None) -> None:
        """Open only the GPUs at ``indices``, each on its own, with no node-wide call but
        ``nvmlInit`` (waited for at most ``init_wait_s``, default two call deadlines):
        ``greend restore`` reaches the GPUs it saved while others, or the node, hang."""
        wait_s = 2 * self._devices.deadline_s if init_wait_s is None else float(init_wait_s)
        self._only = (sorted(set(indices)), wait_s)
        self.open()

    def _enumerate(self) -> None:
        wait_s = self.open_wait_s
        if self._only is None:
            self._at("nvmlSystemGetDriverVersion")
            try:
                self._driver_version = _text(self._devices.call("node", "nvmlSystemGetDriverVersion", wait_s=wait_s))
            except ProbeError:
                self._driver_version = None
            self._at("nvmlDeviceGetCount")
            count = int(self._devices.call("node", "nvmlDeviceGetCount", wait_s=wait_s))
        indices = range(count) if self._only is None else self._only[0]
        self._count = count = len(indices)
        self._at(f"opening {count} GPU(s), each on its own")
        self._gpus, self._open_errors, self._unanswered = [], {}, set()
        self._devices.forget_all()
        self._looks.take()  # a look from before this open is stale
        # Each GPU is opened on its own worker, all at once: one that hangs costs the
        # others nothing, and the open as a whole at most two call deadlines.
        opened = self._devices.each(
            {f"gpu{i}": ("open", partial(self._open_gpu, i)) for i in indices},
            wait_s=2 * self._devices.deadline_s,
        )
        for i in indices:
            self._opened_one(i, opened[f"gpu{i}"].error, opened[f"gpu{i}"].value)

    def _opened_one(self, i: int, err: BaseException | None, gpu: TrackedGpu | None) -> bool:
        """Book the outcome of opening GPU ``i``; True when it opened."""
        if err is None and gpu is not None:
            self._gpus.append(gpu)
            self._gpus.sort(key=lambda g: g.index)
            self._devices.add(i, gpu.handle, gpu.uuid)
            self._open_errors.pop(i, None)
            self._unanswered.discard(i)
            return True
        if isinstance(err, DeviceLost):
            self._devices.mark_lost(i, str(err))
        elif isinstance(err, Unresponsive):
            if i not in self._unanswered:
                again = f"; tried again every {RECOVER_EVERY_S:g} s" if self._only is None else ""
                log.error("gpu%d does not answer: %s%s", i, err, again)
            self._unanswered.add(i)
            self._open_errors[i] = str(err)
        else:
            e = err if isinstance(err, ProbeError) else ProbeError(f"gpu{i}: {type(err).__name__}: {err}")
            if self._open_errors.get(i) != str(e):
                log.error("gpu%d left out: %s", i, e)
            self._open_errors[i] = str(e)
        return False

    def _open_gpu(self, i: int) -> TrackedGpu:
        what = f"gpu{i}"
        handle = self._call(what, "nvmlDeviceGetHandleByIndex", i)
        gpu = TrackedGpu(
            index=i,
            handle=handle,
            name=_text(self._call(what, "nvmlDeviceGetName", handle)),
            uuid=_text(self._call(what, "nvmlDeviceGetUUID", handle)),
            energy_method="counter",
        )
        nvml = self._devices.nvml
        mem_clocks = self._optional(gpu, "nvmlDeviceGetSupportedMemoryClocks", handle)
        if mem_clocks:
            sm = self._optional(gpu, "nvmlDeviceGetSupportedGraphicsClocks", handle, max(mem_clocks))
            gpu.supported_sm_clocks_mhz = tuple(sorted((int(f) for f in sm or ()), reverse=True))
        fmax = self._optional(gpu, "nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM)
        if fmax is None and gpu.supported_sm_clocks_mhz:
            fmax = gpu.supported_sm_clocks_mhz[0]
        gpu.sm_clock_max_mhz = None if fmax is None else float(fmax)
        lim = self._optional(gpu, "nvmlDeviceGetPowerManagementLimitConstraints", handle)
        if lim:
            gpu.power_limit_min_w, gpu.power_limit_max_w = mw_to_w(lim[0]), mw_to_w(lim[1])
        default = self._optional(gpu, "nvmlDeviceGetPowerManagementDefaultLimit", handle)
        gpu.power_limit_default_w = None if default is None else mw_to_w(default)
        mig = self._optional(gpu, "nvmlDeviceGetMigMode", handle)
        gpu.mig = bool(mig and int(mig[0]) == 1)
        if gpu.mig:
            log.warning("gpu%d is in MIG mode: its energy is the whole GPU's (NVML has no per-instance "
                        "counter) and greend will not cap it", i)  # fmt: skip
        cc = self._optional(gpu, "nvmlDeviceGetCudaComputeCapability", handle)
        gpu.compute_capability = None if cc is None else (int(cc[0]), int(cc[1]))
        try:
            gpu.last_counter_mj = int(self._call(what, "nvmlDeviceGetTotalEnergyConsumption", handle))
        except NotSupported:
            # (a pre-Volta GPU, or a driver still coming up: tried again every COUNTER_RETRY_S)
            gpu.energy_method, gpu.counter_retry_s = "power_integration", 0.0  # (at the first tick)
            log.info("gpu%d (%s) has no energy counter: integrating power samples", i, gpu.name)
        return gpu

    def sample(self, now_s: float) -> Readings:
        if not self._opened:
            raise ProbeError(f"probe {self.name!r} sampled before open()")
        out = Readings()
        failures: list[ProbeError] = []
        look = self._looks.take()  # a look that finished in the background since the last tick
        if look is not None:
            self._apply_look(look)
        if (self._devices.lost or self._gone or self._open_errors) and now_s >= self._recover_at_s:
            self._recover_at_s = now_s + RECOVER_EVERY_S
            self._recover(reinit=False)
        live = [g for g in self._gpus if not self._devices.is_lost(g.index)]
        reinit = False
        for gpu, got in self._reads.take(live, now_s):
            if isinstance(got, GpuReading):
                out.gpus.append(got)
                gpu.errors.pop("sample", None)
                continue
            try:
                raise got
            except DeviceLost as e:
                self._devices.mark_lost(gpu.index, str(e))
            except NvmlUninitialized as e:
                failures.append(e)
                reinit = True
            except Exception as e:  # one GPU's failure, whatever it is, costs that GPU only
                if not isinstance(e, ProbeError):
                    e = ProbeError(f"gpu{gpu.index}: {type(e).__name__}: {e}")
                key = "sample"
                line = gpu.should_log(key, str(e), time.monotonic())
                if line is not None:
                    log.error("gpu%d not sampled: %s", gpu.index, line)
                gpu.errors[key] = str(e)
                failures.append(e)
        if reinit:  # NVML was shut down under us: initialise it again, read next tick
            self._recover(reinit=True)
        if failures and not out.gpus:
            raise failures[0]  # every live GPU failed: the probe failed this tick
        return out

    def _recover(self, *, reinit: bool) -> None:
        """Initialise NVML again (``reinit``) and enumerate the GPUs again: real NVML on a
        thread of its own (:class:`Looks`; the tick applies the result, never waits on
        it, and ``status`` says "initialising" meanwhile), the simulator's inline."""
        if self.opens_in_background:
            self._looks.start(reinit)
        else:
            self._rematch(reinit)

    @property
    def reopening(self) -> str | None:
        """While NVML is initialised again in the background: what on, for how long."""
        return self.opening if self._opened and self._looks.reinitialising else None

    def _look_again(self, reinit: bool) -> Look | None:
        """The driver calls of a recovery: ``nvmlInit`` again where asked, the GPU count
        where GPUs were lost, each GPU's handle and UUID and the opening of GPUs never
        seen (each GPU on its own worker). None: NVML could not be initialised or counted."""
        try:
            return self._look_calls(reinit)
        finally:
            if reinit:
                self._phase = None

    def _look_calls(self, reinit: bool) -> Look | None:
        if reinit:
            self._at("nvmlInit (again)")
            self._gpm.forget()  # GPM buffers of before the shutdown are not used again
            try:
                self._call("node", "nvmlInit")
            except ProbeError as e:
                log.error("NVML could not be initialised again: %s", e)
                return None
            log.warning("NVML was shut down under greend; initialised it again")
            self._at("nvmlDeviceGetCount (again)")
        if not reinit and self._count is not None and not (self._devices.lost or self._gone):
            count = self._count  # only GPUs that did not open to try again: no node-wide call
        else:
            try:
                count = int(self._call("node", "nvmlDeviceGetCount"))
            except ProbeError as e:
                log.debug("enumerating the GPUs again failed: %s", e)
                return None
        if reinit:
            self._at(f"looking for {count} GPU(s) again, each on its own")
        looked = self._devices.each(
            {f"gpu{i}": ("nvmlDeviceGetHandleByIndex", partial(self._identify, i)) for i in range(count)}
        )
        known = {g.uuid for g in self._gpus} | set(self._gone)
        new = [i for i in range(count) if looked[f"gpu{i}"].error is None and looked[f"gpu{i}"].value[1] not in known]
        opened = self._devices.each({f"gpu{i}": ("open", partial(self._open_gpu, i)) for i in new})
        return Look(count, looked, {i: opened[f"gpu{i}"] for i in new}, reinit)

    def _rematch(self, reinit: bool = False) -> None:
        """:meth:`_look_again` and :meth:`_apply_look`, inline."""
        look = self._look_again(reinit)
        if look is not None:
            self._apply_look(look)

    def _apply_look(self, look: Look) -> None:
        """Match every GPU the look found by its UUID, never by its index: after a
        driver reload NVML may number them differently. A GPU found again keeps its
        energy and follows its UUID to its index now (with a fresh handle; a lost one
        counts from a new baseline); one not found is lost, at its old index while no
        other GPU holds that index; a GPU never seen is opened. A GPU whose calls are
        stuck (unresponsive) stays as it is: hung is not lost."""
        count, looked = look.count, look.looked
        self._count = count
        found: dict[str, tuple[int, Any]] = {}
        failed: dict[int, str] = {}
        lost_at: dict[int, str] = {}  # indices that answer GPU_IS_LOST
        hung: set[int] = set()
        for i in range(count):
            try:
                h, uuid = looked[f"gpu{i}"].get()
            except Unresponsive:
                hung.add(i)
                continue
            except DeviceLost as e:
                failed[i] = str(e)
                lost_at[i] = str(e)
                continue
            except ProbeError as e:
                failed[i] = str(e)
                continue
            found[uuid] = (i, h)
        known = {g.uuid: g for g in self._gpus} | self._gone
        gpus: list[TrackedGpu] = []
        for uuid, (i, h) in sorted(found.items(), key=lambda kv: kv[1][0]):
            gpu = known.get(uuid)
            if gpu is None:
                opened = look.fresh.get(i)
                if opened is None or opened.error is not None:
                    failed[i] = str(opened.error if opened is not None else f"gpu{i} was not opened")
                    continue
                gpu = opened.value
                log.warning("gpu%d (%s) appeared: measured from now", i, uuid)
            else:
                if self._devices.is_lost(gpu.index) or uuid in self._gone:
                    # Back: its counter read on (a new baseline lost a moment's loss, ~5 s); one a reset
                    # set to 0 is a new baseline in book_counter. Power is not bridged over the gap.
                    gpu.last_power = None
                if gpu.index != i:
                    log.warning("gpu%d (%s) is gpu%d now: matched by its UUID", gpu.index, uuid, i)
                gpu.index, gpu.handle = i, h
                gpu.slow_at_s = float("-inf")
            self._gone.pop(uuid, None)
            self._open_errors.pop(i, None)
            self._unanswered.discard(i)
            gpus.append(gpu)
        taken = {g.index for g in gpus} | hung
        lost: dict[int, str] = {}
        for gpu in self._gpus:
            if gpu.uuid in found:
                continue
            if gpu.index in hung and not self._devices.is_lost(gpu.index):
                gpus.append(gpu)  # its calls hang: still there, reported unresponsive
                continue
            why = (self._devices.lost.get(gpu.index) or failed.get(gpu.index)
                   or f"{gpu.uuid} not found when NVML enumerated the GPUs again")  # fmt: skip
            if gpu.index in taken:
                log.error("gpu%d (%s) is gone: another GPU is gpu%d now", gpu.index, gpu.uuid, gpu.index)
                self._gone[gpu.uuid] = gpu
                continue
            if not self._devices.is_lost(gpu.index):
                log.error("gpu%d (%s) is lost and left out of readings: %s", gpu.index, gpu.uuid, why)
            lost[gpu.index] = why
            taken.add(gpu.index)
            gpus.append(gpu)
        for i, why in lost_at.items():  # lost before greend knew which GPU it is
            if i not in taken:
                lost[i] = why
        self._gpus = sorted(gpus, key=lambda g: g.index)
        self._devices.renumber({g.index: (g.handle, g.uuid) for g in gpus if g.index not in lost}, lost, look.reinit)

    def _identify(self, i: int) -> tuple[Any, str]:
        """(handle, UUID) of the GPU NVML lists at index ``i`` now."""
        h = self._call(f"gpu{i}", "nvmlDeviceGetHandleByIndex", i)
        return h, _text(self._call(f"gpu{i}", "nvmlDeviceGetUUID", h))

    def _sample_gpu(self, gpu: TrackedGpu, now_s: float, since_s: float | None = None) -> GpuReading:
        nvml, h, what = self._devices.nvml, gpu.handle, f"gpu{gpu.index}"
        # Energy is read every tick (it prices the steps); the rest once a second: one NVML call per
        # GPU per tick instead of eight, which is most of the daemon's CPU. Power too, unless it is
        # what the energy is integrated from. A settings write since the last slow read makes them due.
        writes = self._devices.settings_writes(gpu.index)
        slow = now_s - gpu.slow_at_s >= SLOW_FIELDS_EVERY_S or writes != gpu.slow_read_after_writes
        if gpu.energy_method == "counter":
            self._account_energy(gpu, what, None, now_s, since_s)
        if gpu.energy_method != "counter" or slow:
            power_mw = self._optional(gpu, "nvmlDeviceGetPowerUsage", h)
            gpu.power_w = None if power_mw is None else gpu.plausible_w(mw_to_w(power_mw))
            if gpu.energy_method != "counter":  # no counter, or it just stopped working
                self._account_energy(gpu, what, gpu.power_w, now_s, since_s)
            if gpu.energy_method != "counter" and gpu.power_w is None:  # (the gap: bridged by the next, spread)
                raise ProbeError(f"{what}: no power reading, and its energy is integrated from power: left out")
        power_w = gpu.power_w
        if slow:
            util = self._optional(gpu, "nvmlDeviceGetUtilizationRates", h)
            sm = self._optional(gpu, "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)
            mem = self._optional(gpu, "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_MEM)
            temp = self._optional(gpu, "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
            limit = self._optional(gpu, "nvmlDeviceGetEnforcedPowerLimit", h)
            if limit is None:
                limit = self._optional(gpu, "nvmlDeviceGetPowerManagementLimit", h)
            gpu.slow = (util, sm, mem, temp, limit)
            # A write that landed during these reads leaves them due: read again next tick.
            if self._devices.settings_writes(gpu.index) == writes:
                gpu.slow_at_s, gpu.slow_read_after_writes = now_s, writes
        util, sm, mem, temp, limit = gpu.slow
        return GpuReading(
            index=gpu.index,
            name=gpu.name,
            uuid=gpu.uuid,
            source=self.source,
            energy_j=gpu.energy_j,
            energy_method=gpu.energy_method,
            energy_epoch=gpu.epoch,
            power_w=power_w,
            sm_clock_mhz=None if sm is None else float(sm),
            mem_clock_mhz=None if mem is None else float(mem),
            util_gpu_pct=None if util is None else float(util.gpu),
            util_mem_pct=None if util is None else float(util.memory),
            sm_active_pct=self._gpm.read(gpu, slow),
            temperature_c=None if temp is None else float(temp),
            clock_cap_mhz=self._clock_cap(gpu.index),
            power_limit_w=None if limit is None else mw_to_w(limit),
            power_limit_min_w=gpu.power_limit_min_w,
            power_limit_max_w=gpu.power_limit_max_w,
            power_limit_default_w=gpu.power_limit_default_w,
            sm_clock_max_mhz=gpu.sm_clock_max_mhz,
            supported_sm_clocks_mhz=gpu.supported_sm_clocks_mhz,
            compute_capability=gpu.compute_capability,
        )

    def _account_energy(
        self, gpu: TrackedGpu, what: str, power_w: float | None, now_s: float, since: float | None
    ) -> None:
        read = partial(self._call, what, "nvmlDeviceGetTotalEnergyConsumption", gpu.handle)
        gpu.account_energy(read, what, power_w, now_s, real=self.source == "nvml", since_s=since)

    def _clock_cap(self, index: int) -> float | None:
        if self._cap_lookup is None:
            return None
        try:
            cap = self._cap_lookup(index)
        except Exception as e:  # the actuator layer must not break sampling
            log.warning("cap_lookup(%d) failed: %s", index, e)
            return None
        return None if cap is None else float(cap)

    @property
    def opening(self) -> str | None:
        """What an open in progress waits on, and for how long (None: not opening)."""
        phase = self._phase
        return None if phase is None else f"{phase[0]} (for {time.monotonic() - phase[1]:.0f} s)"

    def gpu_states(self) -> list[dict[str, Any]]:
        """Each GPU NVML listed, for ``greenctl status``: ``index``, ``uuid`` (None where
        it never answered), ``state`` ("ok", "unresponsive", "lost", "not_opened", "failing":
        its last read failed, the GPU left out of the readings) and ``detail`` (why)."""
        hung, lost, reopening = self._devices.unresponsive, self._devices.lost, self.reopening
        rows: dict[int, dict[str, Any]] = {}
        for g in self._gpus:
            why = lost.get(g.index) or hung.get(w := f"gpu{g.index}") or g.errors.get("sample")
            state = "lost" if g.index in lost else "unresponsive" if w in hung else "failing" if why else "ok"
            if state == "ok" and reopening:
                state, why = "initialising", f"NVML is initialised again: waiting on {reopening}"
            rows[g.index] = {"index": g.index, "uuid": g.uuid, "state": state, "detail": why}
        for i, why in self._open_errors.items():
            state = "unresponsive" if i in self._unanswered else "not_opened"
            rows[i] = {"index": i, "uuid": None, "state": state, "detail": why}
        for i, why in lost.items():
            rows.setdefault(i, {"index": i, "uuid": None, "state": "lost", "detail": why})
        return [rows[i] for i in sorted(rows)]

    def info(self) -> ProbeInfo:
        if not self._opened:
            if self._phase is not None:
                return ProbeInfo(self.name, available=False, detail=f"initialising: waiting on {self.opening}")
            detail, fix = self._unavailable or ("not opened", None)
            return ProbeInfo(self.name, available=False, detail=detail, fix=fix)
        devices = [
            f"gpu{g.index}: {g.name} ({g.uuid}), energy by {g.energy_method}"
            + (", MIG mode (whole-GPU energy, no caps)" if g.mig else "")
            + (f"; errors: {'; '.join(g.errors.values())}" if g.errors else "")
            for g in self._gpus
            if not self._devices.is_lost(g.index)
        ]
        lost = self._devices.lost
        hung = self._devices.unresponsive
        devices = [
            line
            if line.split(":")[0] not in hung
            else f"{line.split(':')[0]}: UNRESPONSIVE ({hung[line.split(':')[0]]})"
            for line in devices
        ]
        devices += [f"gpu{i}: LOST ({why})" for i, why in sorted(lost.items())]
        devices += [
            f"{g.uuid} (was gpu{g.index}): LOST (not found again; another GPU is gpu{g.index} now)"
            for g in self._gone.values()
        ]
        devices += [
            f"gpu{i}: {'UNRESPONSIVE' if i in self._unanswered else 'NOT OPENED'} ({why})"
            for i, why in sorted(self._open_errors.items())
        ]
        live = sum(not self._devices.is_lost(g.index) for g in self._gpus)
        if self.source == "sim":  # no driver behind them: say what they are
            parts = [f"{live} simulated GPU(s) (greend's NVML simulator)"]
        else:
            parts = [f"{live} GPU(s) via NVML"]
        if self._driver_version and self.source != "sim":
            parts.append(f"driver {self._driver_version}")
        if self.reopening:
            parts.append(f"initialising NVML again (waiting on {self.reopening})")
        if lost or self._gone:
            parts.append(f"lost: {', '.join([f'gpu{i}' for i in sorted(lost)] + sorted(self._gone))}")
        hung_gpus = sorted({w.split()[0] for w in hung if w != "node"} | {f"gpu{i}" for i in self._unanswered})
        if hung_gpus:
            parts.append(f"unresponsive: {', '.join(hung_gpus)}")
        not_opened = sorted(set(self._open_errors) - self._unanswered)
        if not_opened:
            parts.append(f"not opened: {', '.join(f'gpu{i}' for i in not_opened)}")
        return ProbeInfo(self.name, available=live > 0, detail=", ".join(parts), devices=devices)

    def close(self) -> None:
        if not self._opened:
            return
        self._opened = False
        self._gpm.close()  # its sample buffers, before NVML goes
        try:
            self._call("node", "nvmlShutdown")
        except Exception as e:  # closing must not fail the daemon's shutdown
            log.debug("nvmlShutdown: %s", e)

    # ---- for the daemon and the actuator layer

    @property
    def lost_gpus(self) -> dict[int, str]:
        """Index -> why, for GPUs that fell off the bus."""
        return self._devices.lost

    @property
    def device_errors(self) -> dict[int, dict[str, str]]:
        """Index -> {call: message} for per-device errors that have not cleared (a call that
        answers again clears its error)."""
        out = {g.index: dict(g.errors) for g in self._gpus if g.errors}
        for i, why in self._open_errors.items():
            out.setdefault(i, {})["open"] = why
        return out

    def is_mig(self, index: int) -> bool:
        """Whether GPU ``index`` was in MIG mode when it was enumerated."""
        return any(g.mig for g in self._gpus if g.index == index)

    @property
    def gpu_indices(self) -> list[int]:
        return [g.index for g in self._gpus if not self._devices.is_lost(g.index)]

    def sim_gpu(self, index: int) -> Any | None:
        """The simulator's device behind GPU ``index`` when source is "sim", else None."""
        if self._simulated is None:
            return None
        return self._simulated.sim_gpu(index)


@register(
    "nvml",
    default=True,
    help="NVIDIA GPUs through NVML (energy counter, power, clocks, limits)",
)
def _nvml_probe(ctx: ProbeContext) -> Probe:
    return NvmlProbe(nvml=ctx.nvml_module, source="nvml", open_wait_s=OPEN_WAIT_S, read_wait_s=tick_read_wait_s(ctx))
