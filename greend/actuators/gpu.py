"""The GPU knobs: locked SM clocks (``nvmlDeviceSetGpuLockedClocks`` /
``nvmlDeviceResetGpuLockedClocks``) and the power limit
(``nvmlDeviceSetPowerManagementLimit``, within
``nvmlDeviceGetPowerManagementLimitConstraints``).

:class:`GpuBackend` is what the :class:`~greend.actuators.controller.Controller`
drives; :class:`NvmlGpuBackend` implements it over the NVML device layer
(:class:`~greend.probes.nvml_device.NvmlDevices`) it shares with the NVML probe,
which only reads. Real NVML and the simulator's fake of it run the same code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from greend.actuators.state import backend_key
from greend.errors import NoData, NoPermission, NotSupported, ProbeError
from greend.probes.nvml import NvmlProbe
from greend.probes.nvml_device import SimulatedNvml
from greend.units import mw_to_w, w_to_mw

__all__ = ["GpuBackend", "NvmlGpuBackend"]

log = logging.getLogger(__name__)


@runtime_checkable
class GpuBackend(Protocol):
    """The GPU knobs, in SI units. Errors are greend probe errors (``NoPermission``,
    ``DeviceLost``, ``NotSupported``, ``ProbeError``); the Controller names knob and fix.

    ``kind``: ``"nvml"`` or ``"sim"``; ``sim_dir``: the simulator's directory (sim only);
    ``deadline_s``: the longest one driver call may take before its GPU is called
    unresponsive (the Controller waits for a GPU another write holds about twice that).
    """

    kind: str
    sim_dir: str | None

    @property
    def deadline_s(self) -> float: ...

    def indices(self) -> list[int]: ...

    def lost(self) -> dict[int, str]:
        """Index -> why, for the GPUs enumerated once and lost since (off the bus)."""
        ...

    def uuid(self, index: int) -> str: ...

    def known_uuid(self, index: int) -> str | None:
        """The UUID of the GPU at ``index`` as last enumerated, without a driver call
        (None: not known)."""
        ...

    def index_of_uuid(self, uuid: str, was_at: int | None = None) -> int | None:
        """The index of the GPU with ``uuid`` now (None: none); ``was_at``, the index it
        was saved at, lets a backend answer at once for a GPU there that does not answer."""
        ...

    def epoch(self, index: int) -> int:
        """A count that changes when GPU ``index`` is found again after a loss, a reset
        or a driver reload, any of which may have dropped greend's settings on it."""
        ...

    def power_limit_w(self, index: int) -> float: ...

    def default_power_limit_w(self, index: int) -> float: ...

    def power_limit_constraints_w(self, index: int) -> tuple[float, float]: ...

    def supported_sm_clocks_mhz(self, index: int) -> tuple[int, ...]: ...

    def set_locked_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None: ...

    def reset_locked_clocks(self, index: int) -> None: ...

    def set_power_limit_w(self, index: int, power_w: float) -> None: ...

    def held_clock_mhz(self, index: int) -> int | None:
        """The max SM clock the GPU holds now, read back after a lock (NVML has no getter
        for locked clocks: the SM clock while the locked clocks are all that hold it);
        None when the GPU cannot tell now (idle, or held by power or heat as well)."""
        ...

    def refused_knobs(self, index: int) -> dict[str, dict[str, str]]:
        """Knob -> {"reason": "not_supported" | "mig" | "no_permission", "message"} for the
        knobs GPU ``index`` refused (never tried again)."""
        ...


# The bits of NVML's clocks-event reasons (nvmlClocksEventReason*): the locked or
# application clocks hold the clock (0x2); anything else (idle, power, heat, sync
# boost...) means the clock read says nothing of the lock.
_HELD_BY_CLOCK_SETTING = 0x2


def _text(value: Any) -> str:
    """Old pynvml versions return bytes for names and UUIDs."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _knob_group(fn: str) -> str:
    return "clock_cap_mhz" if "LockedClocks" in fn else "power_limit_w"


class NvmlGpuBackend:
    """:class:`GpuBackend` over an opened :class:`~greend.probes.nvml.NvmlProbe`.

    The daemon passes the probe it samples with: the two share its device layer, so
    the probe reads a GPU's clocks and limit again after a write here. A standalone
    restore opens one with :meth:`open_nvml` or :meth:`open_sim`. The sim is the fake
    NVML, so the same code drives it.
    """

    def __init__(self, probe: NvmlProbe, *, owns_probe: bool = False) -> None:
        self.probe = probe
        self.devices = probe.devices
        self.kind = "sim" if probe.source == "sim" else "nvml"
        nvml = self.devices.nvml
        sim = self.kind == "sim" and isinstance(nvml, SimulatedNvml)
        self.sim_dir: str | None = str(Path(nvml.state_dir).resolve()) if sim else None
        self._owns_probe = owns_probe
        # What is learnt of a GPU is kept by its UUID (``_gpu``): after a reset or a driver
        # reload the driver may number the GPUs otherwise, and an index then names another GPU.
        self._clocks: dict[str, tuple[int, ...]] = {}
        # (GPU, knob) -> (reason, the refusal): NO_PERMISSION / NOT_SUPPORTED / MIG mode;
        # not tried again, logged once
        self._refused: dict[tuple[str, str], tuple[str, ProbeError]] = {}
        self._written: set[tuple[str, str]] = set()  # (GPU, knob) greend has written once: never refused
        self._refusing = threading.RLock()  # the refusals: the tick, the socket's ops and status
        self._constraints: dict[str, tuple[float, float]] = {}

    def __repr__(self) -> str:
        return f"NvmlGpuBackend(kind={self.kind!r}, sim_dir={self.sim_dir!r})"

    @classmethod
    def open_nvml(
        cls, nvml_module: Any | None = None, *, only: Iterable[int] | None = None, init_wait_s: float | None = None
    ) -> NvmlGpuBackend:
        """Open NVML (``import pynvml`` unless a module is given). Raises ``NoData``
        when there is no driver, and other probe errors as the probe does. ``only``:
        open just these GPUs, each on its own, with no node-wide call but ``nvmlInit``
        (waited for at most ``init_wait_s``, default twice the call deadline; ``Unresponsive``
        past it)."""
        probe = NvmlProbe(nvml=nvml_module, source="nvml")
        if only is None:
            probe.open()
        else:
            probe.open_only(only, init_wait_s)
        return cls(probe, owns_probe=True)

    @classmethod
    def open_sim(cls, sim_dir: Path | str) -> NvmlGpuBackend:
        """Open the simulated GPUs already in ``sim_dir`` (creates none)."""
        from greend.probes.fake_nvml import FakeNvml

        d = Path(sim_dir)
        if not d.is_dir():
            raise NoData(f"the simulated GPUs' directory {d} does not exist")
        probe = NvmlProbe(nvml=FakeNvml(d), source="sim")
        probe.open()
        return cls(probe, owns_probe=True)

    def close(self) -> None:
        """Close the probe if this backend opened it."""
        if self._owns_probe:
            self.probe.close()

    @property
    def key(self) -> str:
        return backend_key(self.kind, self.sim_dir)

    @property
    def deadline_s(self) -> float:
        return self.devices.deadline_s

    # ---- plumbing

    def _handle(self, index: int) -> Any:
        try:
            return self.devices.handle(index)
        except KeyError:
            raise NoData(
                f"there is no gpu{index} on this node (NVML lists "
                f"{', '.join(f'gpu{i}' for i in self.indices()) or 'none'})"
            ) from None

    def _call(self, index: int, fn: str, *args: Any) -> Any:
        return self.devices.call(f"gpu{index}", fn, self._handle(index), *args)

    def _gpu(self, index: int) -> str:
        """The key of GPU ``index`` in what this backend learns of it: its UUID as
        enumerated (the index only where none is known)."""
        return self.devices.uuid_at(index) or f"#{index}"

    def _write(self, index: int, fn: str, *args: Any) -> None:
        """A setter, unless its knob was refused before: a knob NVML refused with
        NO_PERMISSION or NOT_SUPPORTED, or any knob of a GPU in MIG mode, stays refused
        (it will not start working between two policy periods): recorded and logged
        once per GPU and knob, never called again. A knob greend has written before is
        never taken as refused (a refusal then is of that one value, or passing), and
        undoing a lock (``nvmlDeviceResetGpuLockedClocks``) is always tried: greend must
        be able to take back what it did."""
        self._handle(index)
        knob, gpu = _knob_group(fn), self._gpu(index)
        undo = fn == "nvmlDeviceResetGpuLockedClocks"
        refused = None if undo else self._refused.get((gpu, knob))
        if refused is not None:
            raise type(refused[1])(f"{refused[1]} (refused before: not tried again)")
        if not undo and self.probe.is_mig(index):
            err: ProbeError = NotSupported(
                f"gpu{index} {fn}: the GPU is in MIG mode: greend does not cap a GPU shared "
                "by MIG instances (a cap would slow every instance's job)"
            )
            self._refuse(index, knob, "mig", err)
            raise err
        try:
            self.devices.write(index, fn, *args)
        except NoPermission as e:
            if not undo:
                self._refuse(index, knob, "no_permission", e)
            raise
        except NotSupported as e:
            if not undo:
                self._refuse(index, knob, "not_supported", e)
            raise
        with self._refusing:
            self._written.add((gpu, knob))

    def _refuse(self, index: int, knob: str, reason: str, err: ProbeError) -> None:
        gpu = self._gpu(index)
        with self._refusing:
            if (gpu, knob) in self._refused or (gpu, knob) in self._written:
                return
            self._refused[(gpu, knob)] = (reason, err)
        log.warning("gpu%d %s refused (%s): %s; disabled for this GPU until greend restarts", index, knob, reason, err)

    def _refusals(self) -> list[tuple[int, str, str, ProbeError]]:
        """(index, knob, reason, refusal) of every refused knob of a GPU enumerated now."""
        with self._refusing:
            refused = sorted(self._refused.items())
        where = {self._gpu(i): i for i in self.indices()}
        return sorted((where[g], k, r, e) for (g, k), (r, e) in refused if g in where)

    @property
    def refused(self) -> dict[int, dict[str, str]]:
        """Index -> {knob: why} for knobs NVML refused (for status)."""
        out: dict[int, dict[str, str]] = {}
        for i, knob, _, e in self._refusals():
            out.setdefault(i, {})[knob] = str(e)
        return out

    def refused_knobs(self, index: int) -> dict[str, dict[str, str]]:
        if self.probe.is_mig(index):  # known from enumeration: refused before any write is tried
            with self._refusing:
                for k in ("clock_cap_mhz", "power_limit_w"):
                    if (self._gpu(index), k) not in self._refused:
                        why = (
                            f"gpu{index} is in MIG mode: greend does not cap a GPU shared by MIG instances "
                            "(a cap would slow every instance's job)"
                        )
                        self._refuse(index, k, "mig", NotSupported(why))
        return {k: {"reason": r, "message": str(e)} for i, k, r, e in self._refusals() if i == index}

    def held_clock_mhz(self, index: int) -> int | None:
        nvml = self.devices.nvml
        fn = next(
            (
                f
                for f in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
                if hasattr(nvml, f)
            ),
            None,
        )
        if fn is None:
            return None
        try:
            if int(self._call(index, fn)) & ~_HELD_BY_CLOCK_SETTING:
                return None  # idle, or power or heat hold it too: the clock says nothing of the lock
            mhz = int(self._call(index, "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM))
            # The reasons again: a GPU that went idle between the two reads (a step's end)
            # gave its idle clock, which the first read did not say (a "cap" of 345 MHz).
            return None if int(self._call(index, fn)) & ~_HELD_BY_CLOCK_SETTING else mhz
        except ProbeError as e:
            log.debug("gpu%d: the clock held cannot be read back: %s", index, e)
            return None

    # ---- GpuBackend

    def indices(self) -> list[int]:
        return self.devices.indices()

    def lost(self) -> dict[int, str]:
        return self.devices.lost

    def uuid(self, index: int) -> str:
        return _text(self._call(index, "nvmlDeviceGetUUID"))

    def known_uuid(self, index: int) -> str | None:
        return self.devices.uuid_at(index)

    def epoch(self, index: int) -> int:
        """Changes when GPU ``index`` is found again after a loss, a reset or a driver
        reload (which may drop its settings): see :meth:`NvmlDevices.epoch`."""
        return self.devices.epoch(index)

    def index_of_uuid(self, uuid: str, was_at: int | None = None) -> int | None:
        return self.devices.index_of_uuid(uuid, was_at)

    def power_limit_w(self, index: int) -> float:
        return mw_to_w(self._call(index, "nvmlDeviceGetPowerManagementLimit"))

    def default_power_limit_w(self, index: int) -> float:
        return mw_to_w(self._call(index, "nvmlDeviceGetPowerManagementDefaultLimit"))

    def power_limit_constraints_w(self, index: int) -> tuple[float, float]:
        gpu = self._gpu(index)
        if gpu not in self._constraints:
            lo, hi = self._call(index, "nvmlDeviceGetPowerManagementLimitConstraints")
            self._constraints[gpu] = (mw_to_w(lo), mw_to_w(hi))
        return self._constraints[gpu]

    def supported_sm_clocks_mhz(self, index: int) -> tuple[int, ...]:
        """Descending, as NVML lists them (at the highest memory clock)."""
        gpu = self._gpu(index)
        if gpu not in self._clocks:
            mem = self._call(index, "nvmlDeviceGetSupportedMemoryClocks")
            sm = self._call(index, "nvmlDeviceGetSupportedGraphicsClocks", max(mem)) if mem else []
            self._clocks[gpu] = tuple(sorted({int(f) for f in sm}, reverse=True))
        return self._clocks[gpu]

    def set_locked_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
        """``nvmlDeviceSetGpuLockedClocks``; NVML errors arrive as greend errors."""
        self._write(index, "nvmlDeviceSetGpuLockedClocks", int(min_mhz), int(max_mhz))

    def reset_locked_clocks(self, index: int) -> None:
        self._write(index, "nvmlDeviceResetGpuLockedClocks")

    def set_power_limit_w(self, index: int, power_w: float) -> None:
        """``nvmlDeviceSetPowerManagementLimit`` (W here, mW to NVML)."""
        self._write(index, "nvmlDeviceSetPowerManagementLimit", w_to_mw(power_w))
