"""The NVML device layer shared by the NVML probe (which reads) and the GPU actuator
(:mod:`greend.actuators.gpu`, which writes).

It holds the NVML module in use (``pynvml``, or the simulator's stand-in, a
:class:`SimulatedNvml`), the handle of every GPU the probe enumerated, which GPUs are
lost, and a per-GPU count of settings written, so the probe knows to read a GPU's
settings again after a write.

Every NVML error is translated through one table (:data:`NVML_ERROR_MAP`, used
by :func:`translate_nvml_error`) into :mod:`greend.errors`, raised ``from`` the
original: callers classify errors by their greend type, never by their text.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from greend.errors import DeviceLost, InvalidArgument, NoData, NoPermission, NotSupported, ProbeError

__all__ = [
    "NVML_ERROR_FIX",
    "Outcome",
    "NVML_ERROR_MAP",
    "DriverMismatch",
    "NvmlDevices",
    "NvmlUninitialized",
    "ResetRequired",
    "SimulatedNvml",
    "Unresponsive",
    "translate_nvml_error",
]

log = logging.getLogger(__name__)


class NvmlUninitialized(ProbeError):
    """NVML answered UNINITIALIZED: this process's NVML was shut down under greend
    (an unbalanced ``nvmlShutdown``, a driver reload). Initialising again recovers."""


class ResetRequired(DeviceLost):
    """The GPU needs a reset (``nvidia-smi -r``) before it answers again."""


class DriverMismatch(ProbeError):
    """The NVML library and the loaded kernel driver are of different versions
    (the state after a driver upgrade without a reboot)."""


class Unresponsive(ProbeError):
    """An NVML call on this GPU (or node-wide) did not return within the deadline.
    A call stuck inside the driver cannot be interrupted: its worker thread stays
    with it, and later calls on that GPU fail at once until it returns."""


def _default_deadline_s() -> float:
    """``GREEND_NVML_DEADLINE_S`` where it is seconds within MIN/MAX_DEADLINE_S; else (with
    a warning that names it: a 0 made every healthy GPU "unresponsive, the driver may be
    hung") the default."""
    raw = os.environ.get("GREEND_NVML_DEADLINE_S", "").strip()
    if not raw:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not MIN_DEADLINE_S <= value <= MAX_DEADLINE_S:  # (NaN too)
        log.warning(
            "GREEND_NVML_DEADLINE_S=%r is not seconds from %g to %g: the default %g s is used",
            raw, MIN_DEADLINE_S, MAX_DEADLINE_S, DEFAULT_DEADLINE_S,
        )  # fmt: skip
        return DEFAULT_DEADLINE_S
    return value


# The longest a single NVML call may take before its GPU is called unresponsive
# (GREEND_NVML_DEADLINE_S overrides). Healthy calls take well under 10 ms; a
# power-limit write up to a few hundred.
DEFAULT_DEADLINE_S = 5.0
MIN_DEADLINE_S, MAX_DEADLINE_S = 0.05, 600.0  # what GREEND_NVML_DEADLINE_S may say


class Outcome:
    """What one call of :meth:`NvmlDevices.each` gave: its value or its error."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    @classmethod
    def of(cls, call: Callable[[], Any]) -> Outcome:
        try:
            return cls(value=call())
        except BaseException as e:  # handed to the caller
            return cls(error=e)

    def get(self) -> Any:
        """The value, or the error raised (without this frame's traceback noise)."""
        if self.error is not None:
            raise self.error
        return self.value


class _Worker:
    """One thread that makes the NVML calls of one GPU (or the node-wide ones), so
    a call that hangs in the driver holds only this thread."""

    def __init__(self, name: str, on_done: Callable[[], None]) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.busy_since: float | None = None
        self.busy_with = ""
        self._on_done = on_done
        self.thread = threading.Thread(target=self._run, name=f"nvml-{name}", daemon=True)
        self.thread.start()

    def submit(self, what: str, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            self.busy_since, self.busy_with = time.monotonic(), getattr(fn, "__name__", "")
            try:
                result = fn()
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                self.busy_since = None
                self._on_done()


# NVML return codes (nvml.h; a stable C ABI, the same numbers as pynvml's
# NVML_ERROR_* constants) -> the greend error they mean. Anything else: ProbeError.
NVML_ERROR_MAP: dict[int, tuple[str, type[ProbeError]]] = {
    1: ("NVML_ERROR_UNINITIALIZED", NvmlUninitialized),
    2: ("NVML_ERROR_INVALID_ARGUMENT", InvalidArgument),
    3: ("NVML_ERROR_NOT_SUPPORTED", NotSupported),
    13: ("NVML_ERROR_FUNCTION_NOT_FOUND", NotSupported),  # driver too old for the call
    4: ("NVML_ERROR_NO_PERMISSION", NoPermission),
    15: ("NVML_ERROR_GPU_IS_LOST", DeviceLost),
    12: ("NVML_ERROR_LIBRARY_NOT_FOUND", NoData),
    9: ("NVML_ERROR_DRIVER_NOT_LOADED", NoData),
    16: ("NVML_ERROR_RESET_REQUIRED", ResetRequired),
    18: ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", DriverMismatch),
    19: ("NVML_ERROR_IN_USE", ProbeError),
    8: ("NVML_ERROR_INSUFFICIENT_POWER", ProbeError),
    10: ("NVML_ERROR_TIMEOUT", ProbeError),
    11: ("NVML_ERROR_IRQ_ISSUE", ProbeError),
    14: ("NVML_ERROR_CORRUPTED_INFOROM", ProbeError),
    999: ("NVML_ERROR_UNKNOWN", ProbeError),
}

# What to do about a code, where there is something to do; said in the message.
NVML_ERROR_FIX: dict[int, str] = {
    1: "NVML was shut down under greend (an unbalanced nvmlShutdown, a driver reload); greend initialises it again",
    16: "reset the GPU (`nvidia-smi -r -i <index>` with no processes on it) or reboot the node",
    18: "the NVIDIA driver was upgraded without a reboot: the loaded kernel module and libnvidia-ml "
    "differ; reboot the node (or reload the nvidia kernel modules)",
    19: "the GPU is in use by an operation that excludes this one (a MIG reconfiguration, a reset "
    "in progress, another tool): retry when it is done",
    8: "the GPU reports too little power to its board: check its PCIe power cables and the power supply",
    10: "the driver timed out on this call (often transient: greend tries again); if it persists, check "
    "`nvidia-smi` and `dmesg` for Xid errors",
    11: "the driver reports an interrupt problem with the GPU: check `dmesg` for Xid errors",
    14: "the GPU's infoROM is corrupted: the GPU still runs, but contact the vendor (`nvidia-smi -q` shows it)",
    999: "an unknown error inside the driver (often transient: greend tries again); if it persists, check "
    "`nvidia-smi` and `dmesg` for Xid errors",
}

NVML_ERROR_NOT_FOUND = 6


@runtime_checkable
class SimulatedNvml(Protocol):
    """An NVML module in front of simulated GPUs, as the simulator's is: ``state_dir``
    is where their state lives, ``sim_gpu(index)`` the device behind GPU ``index``.
    The simulator implements it; this layer and the probe never import the simulator."""

    state_dir: Path

    def sim_gpu(self, index: int) -> Any: ...


def translate_nvml_error(exc: BaseException, what: str) -> ProbeError:
    """The greend error for an NVML error (``exc.value`` is the NVML code).

    ``what`` names the call and device (``"gpu1 nvmlDeviceGetPowerUsage"``). The
    caller raises the result ``from exc``.
    """
    code = getattr(exc, "value", None)
    entry = NVML_ERROR_MAP.get(code) if isinstance(code, int) else None
    cls: type[ProbeError] = entry[1] if entry else ProbeError
    named = f"{entry[0]}, code {code}" if entry else f"NVML code {code}"
    fix = NVML_ERROR_FIX.get(code) if isinstance(code, int) else None
    return cls(f"{what}: {exc} ({named})" + (f" (fix: {fix})" if fix else ""))


class NvmlDevices:
    """The NVML module, the GPUs' handles, the lost GPUs and the settings writes.

    ``nvml``: the module (None: ``import pynvml`` in :meth:`import_module`).
    Thread-safe for what the two threads share: the tick thread reads, the IPC
    thread writes settings.
    """

    def __init__(self, nvml: Any | None = None, deadline_s: float | None = None) -> None:
        self._nvml = nvml
        self.deadline_s = _default_deadline_s() if deadline_s is None else float(deadline_s)
        self._workers: dict[str, _Worker] = {}
        self._unresponsive: dict[str, str] = {}  # "gpu3" / "node" -> why
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}  # index -> UUID, as enumerated
        self._lost: dict[int, str] = {}  # index -> why
        self._writes: dict[int, int] = {}  # index -> settings writes so far
        # UUID -> times the GPU was found again after a loss, a reset or a driver reload,
        # each of which may have dropped its clock lock and power limit
        self._epochs: dict[str, int] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NvmlDevices(gpus={sorted(self._handles)}, lost={sorted(self._lost)})"

    @property
    def nvml(self) -> Any:
        """The NVML module in use (None until :meth:`import_module` when defaulted)."""
        return self._nvml

    def import_module(self) -> Any:
        """The NVML module, importing ``pynvml`` if none was given (ImportError if absent)."""
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        return self._nvml

    def _worker(self, what: str) -> _Worker:
        with self._lock:
            w = self._workers.get(what)
            if w is None:
                w = self._workers[what] = _Worker(what, lambda: self._answered(what))
            return w

    def _answered(self, what: str) -> None:
        if self._unresponsive.pop(what, None) is not None:
            log.warning("%s answers NVML calls again", what)

    def deadline(self, what: str, fn: str, call: Callable[[], Any], wait_s: float | None = None) -> Any:
        """``call()`` on ``what``'s worker thread, waited for at most ``wait_s`` (default
        ``deadline_s``): :class:`Unresponsive` past it, and at once while an earlier call
        there is stuck. ``what`` is ``"gpu3"``, ``"node"``, or ``"gpu3 setters"``: a GPU's
        setters have a worker of their own, so a write stuck in the driver never queues
        the readings."""
        return self.each({what: (fn, call)}, wait_s)[what].get()

    def each(self, calls: dict[str, tuple[str, Callable[[], Any]]], wait_s: float | None = None) -> dict[str, Outcome]:
        """Every ``what -> (fn, call)`` on its own worker at once, all waited for together
        at most ``wait_s`` (default ``deadline_s``): one GPU that hangs costs the others
        nothing, and the whole costs at most one deadline, never one per GPU."""
        limit_s = self.deadline_s if wait_s is None else float(wait_s)
        pending = {what: (fn, self.submit(what, fn, call)) for what, (fn, call) in calls.items()}
        end = time.monotonic() + limit_s
        out: dict[str, Outcome] = {}
        for what, (fn, fut) in pending.items():
            try:
                out[what] = Outcome(value=fut.result(timeout=max(0.0, end - time.monotonic())))
            except FutureTimeout:
                out[what] = Outcome(error=self.overdue(what, fn, fut, limit_s))
            except BaseException as e:  # the call's own error, handed to the caller
                out[what] = Outcome(error=e)
        return out

    def submit(self, what: str, fn: str, call: Callable[[], Any]) -> Future[Any]:
        """``call()`` on ``what``'s worker, not waited for: the caller waits as long as it
        may and calls :meth:`overdue` for a call still out past its deadline. While an
        earlier call there is stuck the future fails at once with :class:`Unresponsive`;
        a call made from within a call runs inline (its future is done on return)."""
        w = self._worker(what)
        if threading.current_thread() is w.thread:
            fut: Future[Any] = Future()
            outcome = Outcome.of(call)
            if outcome.error is None:
                fut.set_result(outcome.value)
            else:
                fut.set_exception(outcome.error)
            return fut
        since = w.busy_since
        if what in self._unresponsive and since is not None:
            fut = Future()
            fut.set_exception(
                Unresponsive(
                    f"{what} {fn}: not called: {self._unresponsive[what]} "
                    f"(for {time.monotonic() - since:.0f} s; fix: check `nvidia-smi` and dmesg for Xid errors; "
                    "a hung driver needs a GPU reset or a reboot)"
                )
            )
            return fut
        call.__name__ = fn
        return w.submit(what, call)

    def overdue(self, what: str, fn: str, fut: Future[Any], waited_s: float) -> Unresponsive:
        """A call still out after ``waited_s``: cancelled if it has not started (queued
        behind a stuck call: never run late), ``what`` marked unresponsive (logged
        once) until a call there returns; the error to hand on."""
        fut.cancel()
        why = f"{fn} did not return within {waited_s:g} s"
        if what not in self._unresponsive:
            log.error("%s is unresponsive: %s; its calls fail until it returns", what, why)
        self._unresponsive[what] = why
        return Unresponsive(f"{what} {fn}: {why} (the driver may be hung)")

    @property
    def unresponsive(self) -> dict[str, str]:
        """``"gpu3"`` / ``"gpu3 setters"`` / ``"node"`` -> why, for whose calls do not return."""
        return dict(self._unresponsive)

    def call(self, what: str, fn: str, *args: Any, wait_s: float | None = None) -> Any:
        """``nvml.<fn>(*args)`` within the deadline (``wait_s``: another); an NVML error
        arrives as the greend error it means."""
        nvml = self._nvml
        assert nvml is not None, "NVML is not loaded"
        try:
            return self.deadline(what, fn, lambda: getattr(nvml, fn)(*args), wait_s)
        except ProbeError:
            raise
        except nvml.NVMLError as e:
            raise translate_nvml_error(e, f"{what} {fn}") from e
        except Exception as e:  # ctypes' TypeError/ArgumentError, a binding's bug: this call only
            raise ProbeError(f"{what} {fn}: {type(e).__name__}: {e}") from e

    # ---- the GPUs

    def forget_all(self) -> None:
        """Drop every handle, UUID and lost mark (before enumerating again)."""
        self._handles, self._uuids, self._lost = {}, {}, {}

    def add(self, index: int, handle: Any, uuid: str | None = None) -> None:
        self._handles[index] = handle
        if uuid is not None:
            self._uuids[index] = uuid

    def uuid_at(self, index: int) -> str | None:
        """The UUID of the GPU at ``index`` when it was last enumerated (no driver call)."""
        return self._uuids.get(index)

    def renumber(self, gpus: dict[int, tuple[Any, str]], lost: dict[int, str], reinit: bool = False) -> None:
        """After enumerating again: index -> (handle, UUID) of every GPU that answers,
        and index -> why for those that do not. The settings-write counts follow each
        GPU's UUID to its new index. A GPU that was lost, or every GPU where NVML was
        initialised again (``reinit``: a driver reload), starts a new :meth:`epoch`."""
        with self._lock:
            old_writes = {self._uuids[i]: n for i, n in self._writes.items() if i in self._uuids}
            was_lost = {self._uuids.get(i) for i in self._lost}
            for _, u in gpus.values():
                if reinit or u in was_lost:
                    self._epochs[u] = self._epochs.get(u, 0) + 1
            self._handles = {i: h for i, (h, _) in gpus.items()}
            # A GPU still lost keeps its UUID here: when it answers again, the look that
            # finds it knows it was lost (a new epoch: its settings are written again).
            kept = {i: self._uuids[i] for i in lost if i not in gpus and i in self._uuids}
            self._uuids = {**kept, **{i: u for i, (_, u) in gpus.items()}}
            self._writes = {i: old_writes.get(u, 0) + 1 for i, (_, u) in gpus.items()}
            for i in [i for i in self._lost if i not in lost and i in gpus]:
                log.warning("gpu%d is back (after a reset, a driver reload or a moment lost)", i)
            self._lost = dict(lost)

    def indices(self) -> list[int]:
        """The enumerated GPUs that are not lost, in index order."""
        return [i for i in sorted(self._handles) if i not in self._lost]

    def handle(self, index: int) -> Any:
        """The handle of GPU ``index``: ``DeviceLost`` if lost, ``KeyError`` if unknown."""
        if index in self._lost:
            raise DeviceLost(f"gpu{index} is lost: {self._lost[index]}")
        return self._handles[index]

    @property
    def lost(self) -> dict[int, str]:
        """Index -> why, for GPUs that fell off the bus."""
        return dict(self._lost)

    def is_lost(self, index: int) -> bool:
        return index in self._lost

    def mark_lost(self, index: int, why: str) -> None:
        if index not in self._lost:
            log.error("gpu%d is lost and left out of readings: %s", index, why)
        self._lost[index] = why

    def held_index(self, uuid: str) -> int | None:
        """The index of the GPU with ``uuid`` as greend enumerated it (no driver call),
        or None when greend holds no handle of it."""
        with self._lock:
            return next(
                (i for i, u in self._uuids.items() if u == uuid and i in self._handles and i not in self._lost), None
            )

    def index_of_uuid(self, uuid: str, was_at: int | None = None) -> int | None:
        """The index of the GPU with ``uuid``: the one greend holds a handle of (no driver
        call), else the index NVML gives it now (None: there is none), looked up on a
        worker of that UUID's own, so one GPU whose lookup hangs never holds another's.
        ``was_at``: the index it was last known at; while a call there is stuck (its open
        did not return) it is not looked up (the lookup would wait a call deadline on the
        same GPU): :class:`Unresponsive` at once."""
        held = self.held_index(uuid)
        if held is not None:
            return held
        stuck = None if was_at is None else f"gpu{was_at}"
        if stuck in self._unresponsive and self._worker(stuck).busy_since is not None:
            raise Unresponsive(
                f"{stuck} ({uuid}): not looked up by its UUID: {self._unresponsive[stuck]} (the driver may be hung)"
            )
        nvml = self._nvml
        assert nvml is not None, "NVML is not loaded"

        def lookup() -> tuple[int, Any]:
            h = nvml.nvmlDeviceGetHandleByUUID(uuid)
            return int(nvml.nvmlDeviceGetIndex(h)), h

        try:
            index, handle = self.deadline(f"lookup {uuid}", "nvmlDeviceGetHandleByUUID", lookup)
        except nvml.NVMLError as e:
            if getattr(e, "value", None) == NVML_ERROR_NOT_FOUND:
                return None
            raise translate_nvml_error(e, f"GPU {uuid} nvmlDeviceGetHandleByUUID") from e
        with self._lock:
            if self._uuids.get(index) == uuid and index in self._lost:  # it answers again: a fresh handle
                log.warning("gpu%d answers again (found by its UUID)", index)
                self._handles[index] = handle
                del self._lost[index]
                self._epochs[uuid] = self._epochs.get(uuid, 0) + 1  # (a reset may have dropped its settings)
        return index

    # ---- settings

    def epoch(self, index: int) -> int:
        """How many times GPU ``index`` was found again after a loss or a driver reload
        (0: never, since NVML was opened): settings written before it changed may be gone."""
        uuid = self._uuids.get(index)
        return 0 if uuid is None else self._epochs.get(uuid, 0)

    def settings_writes(self, index: int) -> int:
        """How many settings writes GPU ``index`` has had: a reader that saw this
        number change while it read knows its reading may be stale."""
        return self._writes.get(index, 0)

    def write(self, index: int, fn: str, *args: Any) -> None:
        """A setter ``nvml.<fn>(handle, *args)`` on GPU ``index``; a GPU that answers
        lost is marked lost. Errors arrive as greend errors."""
        handle = self.handle(index)
        try:
            self.call(f"gpu{index} setters", fn, handle, *args)
        except DeviceLost as e:
            self.mark_lost(index, str(e))
            raise
        finally:
            with self._lock:
                self._writes[index] = self._writes.get(index, 0) + 1
