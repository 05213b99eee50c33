"""A faithful fake of the ``pynvml`` module, backed by simulated GPUs.

:class:`FakeNvml` has the function names, arguments, return types and units of
``pynvml`` (power in mW, energy in mJ, clocks in MHz, handles from
``nvmlDeviceGetHandleByIndex``), re-exports the real module's constants
(``NVML_CLOCK_SM``, ``NVML_ERROR_*``, ``nvmlClocksEventReason*``...) and raises the
*real* ``pynvml.NVMLError(code)``, so it resolves to the driver's subclasses
(``NVMLError_GpuIsLost``...). Code written against ``pynvml`` runs on it unchanged::

    nvml = FakeNvml(tmp_path, n=2)          # or: import pynvml as nvml
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceGetPowerUsage(h)         # -> 70000 (mW)

Importing ``pynvml`` loads no library (only ``nvmlInit`` does), so the fake works on
machines without a driver.

Faults
------

Faults live in ``<state_dir>/faults.json`` (re-read whenever its mtime changes; the
record and its file are in :mod:`greend.probes._fake_nvml_faults`), so a test can
inject one into a daemon running as another process::

    FakeNvml(sim_dir).inject(1, lost=True)      # every call on gpu1: GPU_IS_LOST

Per GPU: ``lost`` (every call on the handle -> ``GPU_IS_LOST``),
``no_energy_counter`` (a pre-Volta GPU: ``GetTotalEnergyConsumption`` ->
``NOT_SUPPORTED``, compute capability 6.0, instantaneous power),
``no_permission`` (setters -> ``NO_PERMISSION``, as for a non-root process),
``no_locked_clocks`` (``Set/ResetGpuLockedClocks`` -> ``NOT_SUPPORTED``),
``reset_required`` (every call on the handle -> ``RESET_REQUIRED``), ``mig`` (MIG
mode on: ``GetMigMode`` -> ``[1, 1]``, no clock locks, no utilisation) and
``persistence_off`` (``GetPersistenceMode`` -> disabled) and ``hung`` (every call on
the GPU, ``GetHandleByIndex`` of it included, sleeps ``hang_s`` seconds, or until the
fault is cleared: a GPU that starts hanging mid-run, the stand-in's
``NVML_STUB_HANG_GPUS`` with ``NVML_STUB_HANG_WHEN``).
Node-wide: ``init_error`` (``nvmlInit`` raises that code, e.g. ``LIBRARY_NOT_FOUND``
or ``DRIVER_NOT_LOADED``), ``slow_ms`` (every call sleeps that long first),
``hang`` (``"fn"`` or ``"fn:gpu"``: that call sleeps ``hang_s`` seconds, or until the
fault is cleared when ``hang_s`` is None) and :meth:`FakeNvml.drop_init` (the
process's init count drops to 0 once, as after someone's unbalanced
``nvmlShutdown``: calls answer ``UNINITIALIZED`` until ``nvmlInit``) and
:meth:`FakeNvml.reorder` (a driver reload that numbers the GPUs differently: NVML's
index ``i`` is the simulated GPU ``order[i]`` from then on, each process's NVML is shut
down under it once, and handles issued before answer ``GPU_IS_LOST``; per-GPU faults
stay with the simulated GPU, ``gpu<i>.json``). These are the C stand-in's faults
(``tests/nvml_stub``) for fast in-process tests.

As strict as the real bindings
------------------------------

Arguments NVML takes as unsigned ints go through ``ctypes.c_uint`` as pynvml does:
a float raises ``TypeError``, a negative int wraps around. Every
``nvmlDeviceGetHandleByIndex`` returns a new handle object (handles never compare
equal by value). The init count is per process, shared by every instance, as the
library's is; an extra ``nvmlShutdown`` is not an error.

Extensions the real module lacks all start with ``fake_`` or are plain methods
(:meth:`FakeNvml.sim_gpu`, :meth:`FakeNvml.inject`); the NVML probe uses none of
them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pynvml

from ._fake_nvml_faults import FAULTS_FILE, Faults, GpuFaults, error_code, read_faults, write_faults
from ._fake_nvml_gpm import FakeGpm
from ._sim_device import SimGpu
from ._sim_files import file_lock
from ._sim_fleet import discover_sim_gpus, open_sim_gpus
from ._sim_model import H100, SimSpec

__all__ = [
    "DRIVER_VERSION",
    "FakeHandle",
    "FakeNvml",
    "Faults",
    "GpuFaults",
    "fake_process_init_count",
    "fake_reset_process_init",
    "read_faults",
    "write_faults",
]

log = logging.getLogger(__name__)

DRIVER_VERSION = "550.54.15"
PRE_VOLTA_COMPUTE_CAPABILITY = (6, 0)

# Names copied from the real module onto every FakeNvml instance.
_EXPORTED_PREFIXES = ("NVML_", "NVMLError", "nvmlClocksEventReason", "nvmlClocksThrottleReason")


class FakeHandle:
    """What ``nvmlDeviceGetHandleByIndex`` returns (a ``c_nvmlDevice_t`` for real): an
    opaque object, new on every call, equal only to itself (as two ctypes pointers
    to one device are not equal)."""

    __slots__ = ("index", "owner", "serial")

    def __init__(self, index: int, owner: int, serial: int = 0) -> None:
        self.index = index  # the simulated GPU (gpu<index>.json), whatever NVML numbers it
        self.owner = owner  # id() of the FakeNvml that issued it
        self.serial = serial  # the numbering it was issued under (see FakeNvml.reorder)

    def __repr__(self) -> str:
        return f"<FakeHandle gpu{self.index} at {id(self):#x}>"


def _raise(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


def _uint(value: Any) -> int:
    """What NVML receives for an ``unsigned int`` argument: pynvml wraps it in
    ``ctypes.c_uint`` (TypeError on a float, a negative int wraps around)."""
    return ctypes.c_uint(value).value


# The library's init count is per process: every FakeNvml in a process shares it.
_init_lock = threading.Lock()
_init_count = 0
_uninit_seen: dict[Path, int] = {}  # state_dir -> the last drop_init serial acted on
_faults_epoch = 0  # faults.json edits made by this process


def fake_process_init_count() -> int:
    """Tests only: this process's fake NVML init count."""
    return _init_count


def fake_reset_process_init() -> None:
    """Tests only: the process's fake NVML init count back to 0 (as a new process)."""
    global _init_count
    with _init_lock:
        _init_count = 0
        _uninit_seen.clear()


def _device_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a fake NVML function: the ``slow_ms`` and ``hang`` faults, before anything
    else (a hung call holds only its caller's thread, as in the driver)."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any) -> Any:
        self._maybe_wait(name, args[0] if args else None)
        return fn(self, *args)

    return call


class FakeNvml(FakeGpm):  # the nvmlGpm* calls: _fake_nvml_gpm.py
    """The ``pynvml`` API over the simulated GPUs in ``state_dir``.

    ``n``: how many GPUs (created where missing); None: the ``gpu<i>.json`` files
    already there. Other keyword arguments are passed to
    :func:`greend.probes.sim.open_sim_gpus` (``background_load``, ``mem_share``,
    ``speed_factor``: a scalar or one per GPU; ``spec``; ``clock``).
    """

    # The handful of constants code uses most, spelled out for readers and type
    # checkers; __init__ copies all the others from the real module.
    NVMLError = pynvml.NVMLError
    NVML_CLOCK_GRAPHICS: int = pynvml.NVML_CLOCK_GRAPHICS
    NVML_CLOCK_SM: int = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM: int = pynvml.NVML_CLOCK_MEM
    NVML_CLOCK_VIDEO: int = pynvml.NVML_CLOCK_VIDEO
    NVML_TEMPERATURE_GPU: int = pynvml.NVML_TEMPERATURE_GPU
    NVML_ERROR_UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_LIBRARY_NOT_FOUND: int = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_FUNCTION_NOT_FOUND: int = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND

    def __init__(
        self,
        state_dir: Path | str,
        n: int | None = None,
        *,
        spec: SimSpec | str = H100,
        clock: Callable[[], float] = time.time,
        background_load: float | Sequence[float] | None = None,
        mem_share: float | Sequence[float] | None = None,
        speed_factor: float | Sequence[float] | None = None,
        initial_energy_mj: float = 0.0,
        refresh_s: float = 0.0,
    ) -> None:
        for name in dir(pynvml):
            if name.startswith(_EXPORTED_PREFIXES) and not hasattr(type(self), name):
                setattr(self, name, getattr(pynvml, name))
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        count = discover_sim_gpus(self.state_dir) if n is None else n
        self._gpus: list[SimGpu] = open_sim_gpus(
            self.state_dir,
            count,
            spec=spec,
            clock=clock,
            background_load=background_load,
            mem_share=mem_share,
            speed_factor=speed_factor,
            initial_energy_mj=initial_energy_mj,
            refresh_s=refresh_s,
        )
        self.refresh_s = refresh_s  # see SimGpu._read: how stale faults.json may be
        self._count = count
        self._faults = Faults()
        self._faults_key: tuple[int, int, int, int] | None = None
        self._faults_checked_s = -1e18
        self._faults_epoch = -1  # the process's edit count when the file was last looked at

    def __repr__(self) -> str:
        return f"FakeNvml({str(self.state_dir)!r}, n={len(self._gpus)})"

    def __getattr__(self, name: str) -> Any:
        # A pynvml function the fake does not implement behaves like one the
        # installed driver lacks: it raises FUNCTION_NOT_FOUND when called.
        if name.startswith("nvml") and callable(getattr(pynvml, name, None)):

            def missing(*args: Any, **kwargs: Any) -> NoReturn:
                log.debug("FakeNvml does not implement %s", name)
                _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

            return missing
        raise AttributeError(name)

    # ---- faults (extension)

    def faults(self) -> Faults:
        """Current faults, re-read from ``faults.json`` when it changed."""
        now = time.monotonic()
        if now - self._faults_checked_s < self.refresh_s and self._faults_epoch == _faults_epoch:
            return self._faults  # looked at the file a moment ago (see SimGpu._read)
        self._faults_epoch = _faults_epoch
        self._faults_checked_s = now
        path = self.state_dir / FAULTS_FILE
        try:
            s = os.stat(path)
        except FileNotFoundError:
            self._faults, self._faults_key = Faults(), None
            return self._faults
        # An edit from this process bumps _faults_epoch: two edits within one mtime
        # tick, same size, reusing an inode, are still told apart.
        key = (s.st_ino, s.st_mtime_ns, s.st_size, _faults_epoch)
        if key != self._faults_key:
            self._faults, self._faults_key = read_faults(self.state_dir), key
        return self._faults

    def _edit_faults(self, edit: Callable[[Faults], None]) -> None:
        with file_lock(self.state_dir / ".faults.lock"):
            f = read_faults(self.state_dir)
            edit(f)
            write_faults(self.state_dir, f)
        global _faults_epoch
        _faults_epoch += 1  # every instance in this process sees the edit at once
        self._faults_checked_s = -1e18

    def inject(
        self,
        index: int,
        *,
        lost: bool | None = None,
        no_energy_counter: bool | None = None,
        no_permission: bool | None = None,
        no_locked_clocks: bool | None = None,
        reset_required: bool | None = None,
        mig: bool | None = None,
        persistence_off: bool | None = None,
        hung: bool | None = None,
    ) -> None:
        """Set (True) or clear (False) faults of GPU ``index``; None leaves one as is."""
        given = {
            "hung": hung,
            "lost": lost,
            "no_energy_counter": no_energy_counter,
            "no_permission": no_permission,
            "no_locked_clocks": no_locked_clocks,
            "reset_required": reset_required,
            "mig": mig,
            "persistence_off": persistence_off,
        }

        def edit(f: Faults) -> None:
            g = f.gpus.setdefault(index, GpuFaults())
            for name, value in given.items():
                if value is not None:
                    setattr(g, name, value)

        self._edit_faults(edit)

    def set_slow(self, ms: int) -> None:
        """Every NVML call sleeps ``ms`` milliseconds first (0: none)."""

        def edit(f: Faults) -> None:
            f.slow_ms = int(ms)

        self._edit_faults(edit)

    def set_hang(self, fn: str | None, gpu: int | None = None, seconds: float | None = None) -> None:
        """The call ``fn`` (on ``gpu``, or on every GPU and node-wide when None) sleeps
        ``seconds``, or until this fault is cleared when None; ``fn=None`` clears."""

        def edit(f: Faults) -> None:
            f.hang = "" if not fn else fn if gpu is None else f"{fn}:{gpu}"
            f.hang_s = seconds

        self._edit_faults(edit)

    def drop_init(self) -> None:
        """NVML is shut down under every process using these GPUs, once: their next
        calls answer UNINITIALIZED until they call ``nvmlInit`` again."""

        def edit(f: Faults) -> None:
            f.uninit_serial += 1

        self._edit_faults(edit)

    def reorder(self, order: Sequence[int]) -> None:
        """A driver reload that numbers the GPUs differently: NVML's index ``i`` is the
        simulated GPU ``order[i]`` from now on (a permutation of the GPUs). Every process
        using these GPUs sees NVML shut down under it once (``UNINITIALIZED`` until
        ``nvmlInit``) and its old handles answer ``GPU_IS_LOST``."""
        new = [int(i) for i in order]
        if sorted(new) != list(range(len(self._gpus))):
            raise ValueError(f"{new} is not an order of the {len(self._gpus)} GPUs")

        def edit(f: Faults) -> None:
            f.order = new
            f.order_serial += 1
            f.uninit_serial += 1

        self._edit_faults(edit)

    def _physical(self, index: int) -> int:
        """The simulated GPU NVML numbers ``index`` now."""
        order = self.faults().order
        return order[index] if order and 0 <= index < len(order) else index

    def set_init_error(self, code: int | str | None) -> None:
        """Make ``nvmlInit`` raise ``code`` (an NVML_ERROR_* value or name); None clears."""
        value = None if code is None else error_code(code)

        def edit(f: Faults) -> None:
            f.init_error = value

        self._edit_faults(edit)

    def clear_faults(self) -> None:
        def edit(f: Faults) -> None:
            f.gpus.clear()
            f.init_error, f.slow_ms, f.hang, f.hang_s = None, 0, "", None
            # uninit_serial stays: a drop already made is not made again

        self._edit_faults(edit)

    # ---- simulator access (extension)

    def sim_gpu(self, index: int) -> SimGpu:
        """The simulated device behind GPU ``index`` as NVML numbers it now (to run steps on it)."""
        return self._gpus[self._physical(index)]

    @property
    def sim_gpus(self) -> list[SimGpu]:
        return list(self._gpus)

    def fake_get_locked_clocks(self, handle: FakeHandle) -> tuple[int, int] | None:
        """The locked (min, max) SM clocks, MHz, or None. NVML has no such getter."""
        return self._gpu(handle).locked_clocks_mhz()

    # ---- plumbing

    def _maybe_wait(self, fn: str, first_arg: Any) -> None:
        f = self.faults()
        if f.slow_ms > 0:
            time.sleep(f.slow_ms / 1000.0)
        gpu = first_arg.index if isinstance(first_arg, FakeHandle) else None
        if fn == "nvmlDeviceGetHandleByIndex" and isinstance(first_arg, int):
            gpu = first_arg
        if not f.hangs(fn, gpu):
            return
        log.debug("FakeNvml: %s hangs (hang fault)", fn)
        until = None if f.hang_s is None else time.monotonic() + f.hang_s
        while until is None or time.monotonic() < until:
            time.sleep(0.02 if until is None else max(0.0, min(0.02, until - time.monotonic())))
            if until is None:
                self._faults_checked_s = -1e18
                if not self.faults().hangs(fn, gpu):
                    return

    def _check_init(self) -> None:
        global _init_count
        serial = self.faults().uninit_serial
        with _init_lock:
            if serial > _uninit_seen.get(self.state_dir, 0):  # NVML was shut down under this process
                _uninit_seen[self.state_dir], _init_count = serial, 0
            if _init_count <= 0:
                _raise(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any) -> SimGpu:
        self._check_init()
        if not isinstance(handle, FakeHandle) or handle.owner != id(self) or not (0 <= handle.index < len(self._gpus)):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        f = self.faults()
        if handle.serial != f.order_serial:  # issued before the GPUs were numbered again
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        faults = f.gpu(handle.index)
        if faults.lost:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if faults.reset_required:
            _raise(pynvml.NVML_ERROR_RESET_REQUIRED)
        return self._gpus[handle.index]

    def _gpu_faults(self, handle: FakeHandle) -> GpuFaults:
        return self.faults().gpu(handle.index)

    def _setter_gpu(self, handle: Any) -> SimGpu:
        gpu = self._gpu(handle)
        if self._gpu_faults(handle).no_permission:
            _raise(pynvml.NVML_ERROR_NO_PERMISSION)
        return gpu

    # ---- init

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        global _init_count
        _uint(flags)
        f = self.faults()
        if f.init_error is not None:
            _raise(f.init_error)
        with _init_lock:
            # drops made before this init are past
            _uninit_seen[self.state_dir] = max(_uninit_seen.get(self.state_dir, 0), f.uninit_serial)
            _init_count += 1  # NVML reference-counts init/shutdown, per process
        for g in self._gpus:  # (a shutdown before this one ended their deferring)
            g.defer_again()

    def nvmlShutdown(self) -> None:
        global _init_count
        for g in self._gpus:  # steps the daemon ran there (deferred) go into the device files,
            try:  # and later ones (a connection still closing) straight in
                g.close()
            except Exception as e:
                log.warning("simulated GPU %d: could not write its last steps: %s", g.index, e)
        with _init_lock:
            _init_count = max(0, _init_count - 1)  # an extra shutdown is not an error

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return DRIVER_VERSION

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._check_init()
        return "12." + DRIVER_VERSION

    # ---- enumeration and static facts

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        index = _uint(index)
        self._check_init()
        if not index < self._count:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        f = self.faults()
        gpu = self._physical(index)
        if f.gpu(gpu).lost:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(gpu, id(self), f.order_serial)  # a new object every time, as in pynvml

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._check_init()
        want = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self._gpus):
            if gpu.uuid == want:
                f = self.faults()
                if f.gpu(i).lost:
                    _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
                return FakeHandle(i, id(self), f.order_serial)
        _raise(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._gpu(handle)
        order = self.faults().order
        return order.index(handle.index) if order else handle.index

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._gpu(handle).spec.name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        gpu = self._gpu(handle)
        if self._gpu_faults(handle).no_energy_counter:
            return PRE_VOLTA_COMPUTE_CAPABILITY
        return gpu.spec.compute_capability

    def nvmlDeviceGetSupportedMemoryClocks(self, handle: FakeHandle) -> list[int]:
        return [self._gpu(handle).spec.mem_clock_mhz]

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle: FakeHandle, memoryClockMHz: int) -> list[int]:
        memoryClockMHz = _uint(memoryClockMHz)
        gpu = self._gpu(handle)
        if memoryClockMHz != gpu.spec.mem_clock_mhz:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return list(gpu.spec.supported_sm_clocks_mhz)

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, type: int) -> int:
        type = _uint(type)
        gpu = self._gpu(handle)
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return gpu.spec.sm_clock_max_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return gpu.spec.mem_clock_mhz
        if type == pynvml.NVML_CLOCK_VIDEO:
            return 1545
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeHandle) -> list[int]:
        s = self._gpu(handle).spec
        return [int(round(s.power_limit_min_w * 1000)), int(round(s.power_limit_max_w * 1000))]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeHandle) -> int:
        return int(round(self._gpu(handle).spec.power_limit_default_w * 1000))

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> Any:
        total = self._gpu(handle).spec.memory_total_mib * 1024 * 1024
        info = pynvml.c_nvmlMemory_t()
        info.total, info.free, info.used = total, total, 0
        return info

    # ---- live readings

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        """mW; a ~1 s average as on Ampere+, instantaneous on a pre-Volta fault."""
        gpu = self._gpu(handle)
        if self._gpu_faults(handle).no_energy_counter:
            return int(round(gpu.instant_power_w() * 1000))
        return int(round(gpu.power_w() * 1000))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        """mJ since the (simulated) driver loaded."""
        gpu = self._gpu(handle)
        if self._gpu_faults(handle).no_energy_counter:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.energy_mj()

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        type = _uint(type)
        gpu = self._gpu(handle)
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return gpu.sm_clock_mhz()
        if type == pynvml.NVML_CLOCK_MEM:
            return gpu.mem_clock_mhz()
        if type == pynvml.NVML_CLOCK_VIDEO:
            return int(gpu.sm_clock_mhz() * 0.78)
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        gpu = self._gpu(handle)
        if self._gpu_faults(handle).mig:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # per-instance only, under MIG
        gpu_pct, mem_pct = gpu.utilization_pct()
        return pynvml.c_nvmlUtilization_t(gpu=int(round(gpu_pct)), memory=int(round(mem_pct)))

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        sensor = _uint(sensor)
        gpu = self._gpu(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(round(gpu.temperature_c()))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return int(round(self._gpu(handle).power_limit_w() * 1000))

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeHandle) -> int:
        return int(round(self._gpu(handle).power_limit_w() * 1000))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        reasons = self._gpu(handle).throttle_reasons()
        bits = pynvml.nvmlClocksEventReasonNone
        if "idle" in reasons:
            bits |= pynvml.nvmlClocksEventReasonGpuIdle
        if "clock_lock" in reasons:
            bits |= pynvml.nvmlClocksEventReasonApplicationsClocksSetting
        if "power_cap" in reasons:
            bits |= pynvml.nvmlClocksEventReasonSwPowerCap
        return bits

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self.nvmlDeviceGetCurrentClocksEventReasons(handle)  # the older name

    def nvmlDeviceGetSupportedClocksEventReasons(self, handle: FakeHandle) -> int:
        self._gpu(handle)
        return (
            pynvml.nvmlClocksEventReasonGpuIdle
            | pynvml.nvmlClocksEventReasonApplicationsClocksSetting
            | pynvml.nvmlClocksEventReasonSwPowerCap
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        """The simulated GPU's process table (:meth:`SimGpu.processes`), as pynvml
        returns it: friendly objects with ``pid`` and ``usedGpuMemory`` (None: the
        simulator keeps no memory figure, as NVML says under WDDM)."""
        gpu = self._gpu(handle)
        struct = getattr(pynvml, "c_nvmlProcessInfo_v3_t", None) or pynvml.c_nvmlProcessInfo_t
        out = []
        for pid in gpu.processes():
            obj = pynvml.nvmlStructToFriendlyObject(struct(pid=pid, usedGpuMemory=0))
            obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        """None: a simulated GPU draws nothing (a data-centre GPU's usual answer)."""
        self._gpu(handle)
        return []

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        """None: the simulator runs no MPS server."""
        self._gpu(handle)
        return []

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        """[current, pending]: 1 with the ``mig`` fault, else 0."""
        self._gpu(handle)
        on = int(self._gpu_faults(handle).mig)
        return [on, on]

    def nvmlDeviceGetPersistenceMode(self, handle: FakeHandle) -> int:
        """``NVML_FEATURE_ENABLED`` (1), or disabled (0) with ``persistence_off``."""
        self._gpu(handle)
        return 0 if self._gpu_faults(handle).persistence_off else 1

    # ---- setters (root-only on real nodes)

    def _lock_gpu(self, handle: Any) -> SimGpu:
        gpu = self._setter_gpu(handle)
        f = self._gpu_faults(handle)
        if f.no_locked_clocks or f.mig:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceSetGpuLockedClocks(self, handle: FakeHandle, minGpuClockMHz: int, maxGpuClockMHz: int) -> None:
        lo, hi = _uint(minGpuClockMHz), _uint(maxGpuClockMHz)
        gpu = self._lock_gpu(handle)
        try:
            gpu.set_locked_clocks(lo, hi)
        except ValueError:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceResetGpuLockedClocks(self, handle: FakeHandle) -> None:
        self._lock_gpu(handle).reset_locked_clocks()

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeHandle, limit: int) -> None:
        """``limit`` in mW (an unsigned int), within the constraints, else INVALID_ARGUMENT."""
        limit = _uint(limit)
        gpu = self._setter_gpu(handle)
        try:
            gpu.set_power_limit_w(limit / 1000.0)
        except ValueError:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)


# Every NVML function of the fake takes the slow and hang faults first.
for _name, _fn in list(vars(FakeNvml).items()):
    if _name.startswith("nvml") and callable(_fn):
        setattr(FakeNvml, _name, _device_call(_fn))
del _name, _fn
