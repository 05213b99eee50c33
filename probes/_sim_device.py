"""A simulated GPU's device state on disk: its file, its lock, its counter, its steps.

A :class:`SimGpu` is one simulated device. It prices steps with the model
(:class:`~greend.probes._sim_model.SimSpec`), books them on its state and answers what
NVML would read (counter, power, clocks, utilisation); the fake NVML
(:mod:`greend.probes.fake_nvml`) serves it through the ``pynvml`` API.

Device state and the energy counter
-----------------------------------

A :class:`SimGpu`'s state (energy counter, locked clocks, power limit, workload
parameters) lives in ``<state_dir>/gpu<i>.json``, written atomically under an
``fcntl`` lock, so it outlives the daemon process exactly like hardware does: a
restarted daemon finds the caps a crashed one left, and another process (a test)
sees the same device. Reads do not lock: the file is replaced atomically.

The daemon runs its jobs' step reports with ``run_steps(defer=True)``: the steps are
booked in memory at once (this object's readings count them) and written into the
file about once a second (``_COMMIT_EVERY_S``), before any change of settings, and at
``commit()``/``close()`` (FakeNvml's ``nvmlShutdown``). Another process sees them up
to a second late; a daemon killed outright loses up to a second of them from the
file. One lock covers the booked state, the deferred steps and their write, so a
reading never sees steps gone from memory before they are in the file. When another
process changes the file meanwhile, the deferred steps are booked on its state: the
background power it integrated over their time is then counted beside their energy
(at most ``idle_w`` times a second, per such change).

The counter (mJ, an int, like ``nvmlDeviceGetTotalEnergyConsumption``) is
monotonic and consistent with wall time. Between events it integrates the
background power (``idle_w``, or ``idle_w + load * (P_busy - idle_w)`` with a
background load) over wall-clock time. :meth:`SimGpu.run_step` adds a step's
model energy at once and books its simulated duration as *busy credit*: the
next ``duration_s`` wall-clock seconds are not integrated again at background
power (``counter += P_bg * max(0, dt - credit)``; ``credit = max(0, credit - dt)``).
During that credit the device reports itself busy (clock, power). The time spent
busy is counted too (``busy_s``), so utilisation is, as NVML's, the share of the last
sample period (``UTIL_WINDOW_S``) during which a step ran: a GPU that waits for a slower
one at each step reads less busy than it.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import math
import os
import threading
import time
import uuid as uuid_mod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from greend.errors import StateError

from ._sim_files import write_json_atomic
from ._sim_model import H100, Optimum, SimSpec, StepCost, SweepPoint, check_mem_share
from ._sim_procs import add_proc, live_procs, procs_path

log = logging.getLogger(__name__)

STATE_VERSION = 1
POWER_WINDOW_S = 1.0  # NVML power on Ampere+ is a ~1 s average
UTIL_WINDOW_S = 1.0  # NVML's utilisation sample period (1/6 s to 1 s by product)
_HISTORY_KEEP_S = 5.0
_HISTORY_STEP_S = 0.02
_HISTORY_MAX = 256
# Steps run with run_steps(defer=True) are booked in memory and reach the device file
# at the first reading this long after this object last wrote it, at any change of
# settings, at commit() and at close() (FakeNvml's nvmlShutdown): a daemon taking many
# step reports a second writes each file about once a second, not once per report.
_COMMIT_EVERY_S = 1.0


@dataclass
class SimState:
    """What ``gpu<i>.json`` holds. The counter is kept exact (float mJ); NVML reads
    its integer part."""

    index: int
    uuid: str
    spec_name: str
    energy_mj: float = 0.0
    updated_s: float = 0.0  # wall time the counter was integrated to
    busy_credit_s: float = 0.0
    busy_s: float = 0.0  # seconds spent running steps, ever (utilisation is its rate)
    busy_power_w: float = 0.0  # of the steps in the current credit (for readings)
    busy_clock_mhz: int = 0
    busy_mem_share: float = 0.0
    locked_clocks_mhz: tuple[int, int] | None = None
    power_limit_mw: int = 0
    background_load: float = 0.0
    mem_share: float = 0.0
    speed_factor: float = 1.0
    version: int = STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)  # (flat fields: asdict's deep copy was a third of a write)
        d["locked_clocks_mhz"] = list(self.locked_clocks_mhz) if self.locked_clocks_mhz else None
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SimState:
        lc = d.get("locked_clocks_mhz")
        return cls(
            index=int(d["index"]),
            uuid=str(d["uuid"]),
            spec_name=str(d["spec_name"]),
            energy_mj=float(d["energy_mj"]),
            updated_s=float(d["updated_s"]),
            busy_credit_s=float(d.get("busy_credit_s", 0.0)),
            busy_s=float(d.get("busy_s", 0.0)),
            busy_power_w=float(d.get("busy_power_w", 0.0)),
            busy_clock_mhz=int(d.get("busy_clock_mhz", 0)),
            busy_mem_share=float(d.get("busy_mem_share", 0.0)),
            locked_clocks_mhz=(int(lc[0]), int(lc[1])) if lc else None,
            power_limit_mw=int(d["power_limit_mw"]),
            background_load=float(d.get("background_load", 0.0)),
            mem_share=float(d.get("mem_share", 0.0)),
            speed_factor=float(d.get("speed_factor", 1.0)),
            version=int(d.get("version", STATE_VERSION)),
        )


@dataclass(frozen=True)
class _View:
    """The state advanced (without writing) to one instant."""

    now_s: float
    energy_mj: float
    credit_left_s: float
    busy_s: float

    @property
    def busy(self) -> bool:
        return self.credit_left_s > 0.0


class SimGpu:
    """One simulated GPU whose state lives in ``state_dir/gpu<index>.json``.

    Opening a file that exists loads it (the caps and counter a crashed daemon left);
    a new one starts at default settings. Explicit workload parameters
    (``background_load``, ``mem_share``, ``speed_factor``) override the file.
    ``clock`` is the wall clock (seconds), injectable for deterministic tests.
    """

    def __init__(
        self,
        state_dir: Path | str,
        index: int,
        spec: SimSpec = H100,
        clock: Callable[[], float] = time.time,
        *,
        background_load: float | None = None,
        mem_share: float | None = None,
        speed_factor: float | None = None,
        initial_energy_mj: float = 0.0,
        refresh_s: float = 0.0,
    ) -> None:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        self.state_dir = Path(state_dir)
        self.index = index
        self.spec = spec
        self._clock = clock
        self.path = self.state_dir / f"gpu{index}.json"
        self._lock_path = self.state_dir / f".gpu{index}.lock"
        self._lock_fd: int | None = None  # (opened by _locked)
        self._thread_lock = threading.RLock()
        self._written_fd: int | None = None  # the file this object last wrote, held open (see _mutate)
        self._written_key: tuple[int, int, int] | None = None
        self._written_s = time.monotonic()  # when this object last wrote the file
        # Deferred steps (run_steps(defer=True)), not in the file yet: each (when, cost,
        # memory share), and the state with them booked, made from the cached state
        # _pending_base (a new object per booking: a reader may hold the last one).
        self._deferred: list[tuple[float, StepCost, float]] = []
        self._pending: SimState | None = None
        self._pending_base: SimState | None = None
        self._defer = True  # run_steps(defer=True) defers (close() ends it)
        self._cache_key: tuple[int, int, int] | None = None
        self._cache: SimState | None = None
        self._cache_checked_s = -1e18
        self.refresh_s = refresh_s  # how stale another process's changes may be seen (see _read)
        self._history: deque[tuple[float, float, float]] = deque(maxlen=_HISTORY_MAX)  # (t, mJ, busy s)
        self._last_now_s = float("-inf")
        self._mem_lock = threading.Lock()  # guards the in-memory history and clock
        self._attached: set[int] = set()  # pids this process put in the process table
        self.state_dir.mkdir(parents=True, exist_ok=True)
        wanted = {
            "background_load": None if background_load is None else self._check_load(background_load),
            "mem_share": None if mem_share is None else check_mem_share(mem_share),
            "speed_factor": None if speed_factor is None else self._check_speed(speed_factor),
        }
        with self._locked():
            if self.path.exists():
                # Opening an existing device only reads it: another process's clock
                # must not integrate the counter unless it changes something.
                st = self._read(force=True)
                if st.spec_name != spec.name:
                    log.warning("%s was created as %r, opened as %r", self.path, st.spec_name, spec.name)
                changes = {k: v for k, v in wanted.items() if v is not None and getattr(st, k) != v}
                if not changes:
                    return
                st = self._advanced(st, self._now())
            else:
                changes = {k: v for k, v in wanted.items() if v is not None}
                st = SimState(
                    index=index,
                    uuid=f"GPU-{uuid_mod.uuid4()}",
                    spec_name=spec.name,
                    energy_mj=float(initial_energy_mj),
                    updated_s=self._now(),
                    power_limit_mw=int(round(spec.power_limit_default_w * 1000)),
                )
                log.debug("created simulated GPU %d at %s", index, self.path)
            for k, v in changes.items():
                setattr(st, k, v)
            self._write(st)

    def __repr__(self) -> str:
        return f"SimGpu(index={self.index}, path={str(self.path)!r})"

    # ---- file I/O

    def _file_key(self) -> tuple[int, int, int]:
        """What tells one version of the device file from another: (inode, mtime, size)."""
        try:
            s = os.stat(self.path)
        except FileNotFoundError as e:
            raise StateError(f"simulated GPU state {self.path} is missing") from e
        return s.st_ino, s.st_mtime_ns, s.st_size

    def _read(self, force: bool = False) -> SimState:
        # Another process (a test, a restarted daemon) may change the device: look at
        # the file again, by default on every call; the daemon's sim probe allows
        # ``refresh_s`` of staleness, since a tick asks a device a dozen questions and
        # each stat costs as much as the model itself. Own writes are seen at once.
        # ``force``: parse the file, whatever the cache holds.
        now = time.monotonic()
        if not force and self._cache is not None and now - self._cache_checked_s < self.refresh_s:
            return self._cache
        self._cache_checked_s = now
        key = self._file_key()
        if not force and self._cache is not None and key == self._cache_key:
            return self._cache
        # Parsed under the lock this object writes under: a parse begun before one of
        # its writes must not install the older state over the newer one.
        with self._thread_lock:
            if not force:
                key = self._file_key()
                if self._cache is not None and key == self._cache_key:
                    return self._cache
            try:
                st = SimState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
            except FileNotFoundError as e:
                raise StateError(f"simulated GPU state {self.path} is missing") from e
            except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                raise StateError(f"simulated GPU state {self.path} is corrupt: {e}") from e
            self._cache, self._cache_key = st, key
            return st

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """This device's lock, against other threads and other processes. The lock
        file stays open for the object's life; a thread lock comes first, since flock
        does not exclude threads that share one open file."""
        with self._thread_lock:
            if self._lock_fd is None:
                self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _write(self, st: SimState) -> None:
        fd = write_json_atomic(self.path, st.to_json(), keep_open=True)
        assert fd is not None
        s = os.fstat(fd)  # (the file now at self.path: a rename keeps its inode and mtime)
        key = (s.st_ino, s.st_mtime_ns, s.st_size)
        old, self._written_fd = self._written_fd, fd
        if old is not None:
            with contextlib.suppress(OSError):  # (the new file is in place: nothing to undo)
                os.close(old)
        self._cache, self._cache_key, self._written_key = st, key, key
        self._cache_checked_s = self._written_s = time.monotonic()

    def close(self) -> None:
        """Write the deferred steps, then close the files this object holds open (the
        lock file, the last file written). The object still works: from now on each
        ``run_steps`` writes the file at once, deferred or not."""
        with self._thread_lock:
            self._defer = False
            try:
                self.commit()
            finally:
                if self._written_fd is not None:
                    os.close(self._written_fd)
                    self._written_fd = self._written_key = None
                if self._lock_fd is not None:
                    os.close(self._lock_fd)
                    self._lock_fd = None

    def defer_again(self) -> None:
        """Let ``run_steps(defer=True)`` defer again after :meth:`close` (a new NVML init)."""
        with self._thread_lock:
            self._defer = True

    def __del__(self) -> None:
        # (No write here: a finaliser may run while this thread holds the device's file
        # lock through another object. Steps still deferred are lost from the file;
        # close() and FakeNvml's nvmlShutdown write them.)
        for fd in (getattr(self, "_written_fd", None), getattr(self, "_lock_fd", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    @contextmanager
    def _mutate(self) -> Iterator[SimState]:
        """Lock, load fresh, integrate the counter to now, let the caller edit, save.

        "Fresh" costs a stat where the file is still the one this object last wrote:
        it holds that file open, so its inode number cannot pass to another file, and an
        unchanged (inode, mtime, size) means nobody replaced it. The caller edits a copy:
        readers in other threads never see half an edit."""
        with self._locked():
            key = self._file_key()
            ours = self._cache is not None and key == self._written_key and key == self._cache_key
            st = self._cache if ours else self._read(force=True)
            assert st is not None
            if self._deferred:  # steps run before this change go in first, at their times
                if self._pending is not None and self._pending_base is st:
                    st = self._pending  # booked on this very state already
                else:
                    st = copy.copy(st)
                    for t, cost, mem_share in self._deferred:
                        self._book(self._advanced(st, t), cost, mem_share)
            st = self._advanced(copy.copy(st), self._now())
            yield st
            self._write(st)
            self._deferred, self._pending, self._pending_base = [], None, None

    # ---- the counter

    def _now(self) -> float:
        """The injected wall clock, never going back within this object (a stepped
        wall clock must not make the counter run backwards)."""
        with self._mem_lock:
            self._last_now_s = max(self._last_now_s, self._clock())
            return self._last_now_s

    def _background_power_w(self, st: SimState) -> float:
        """Power with no step running: idle, or idle plus the background load."""
        if st.background_load <= 0.0:
            return self.spec.idle_w
        f = self.spec.effective_clock_mhz(st.mem_share, st.power_limit_mw / 1000.0, st.locked_clocks_mhz)
        busy = min(self.spec.busy_power_w(f, st.mem_share), st.power_limit_mw / 1000.0)
        return self.spec.idle_w + st.background_load * (busy - self.spec.idle_w)

    def _view(self, st: SimState, now: float) -> _View:
        dt = max(0.0, now - st.updated_s)
        idle_dt = max(0.0, dt - st.busy_credit_s)
        energy = st.energy_mj + self._background_power_w(st) * idle_dt * 1000.0
        left, busy = max(0.0, st.busy_credit_s - dt), st.busy_s + min(dt, st.busy_credit_s)
        return _View(now_s=max(now, st.updated_s), energy_mj=energy, credit_left_s=left, busy_s=busy)

    def _advanced(self, st: SimState, now: float) -> SimState:
        v = self._view(st, now)
        st.energy_mj, st.busy_credit_s, st.updated_s, st.busy_s = v.energy_mj, v.credit_left_s, v.now_s, v.busy_s
        return st

    def _booked(self) -> SimState:
        """The device as a reading sees it: the stored state with the deferred steps
        booked, each at its time (written to the file first once _COMMIT_EVERY_S has
        passed since the last write, or when another process replaced the file). A
        read-only object: a booking makes a new one."""
        if self._pending is None:
            return self._read()
        with self._thread_lock:  # (a commit and the deferred list change together)
            if self._pending is not None:
                base = self._read()
                if base is self._pending_base and time.monotonic() - self._written_s < _COMMIT_EVERY_S:
                    return self._pending
                self.commit()
            return self._read()

    def commit(self) -> None:
        """Write the deferred steps (``run_steps(defer=True)``) into the device file now."""
        with self._thread_lock:
            if self._deferred:
                with self._mutate():
                    pass

    def _current(self) -> tuple[SimState, _View]:
        st = self._booked()
        v = self._view(st, self._now())
        with self._mem_lock:
            h = self._history
            # One point per _HISTORY_STEP_S: plenty for a 1 s average, and power_w()'s scan stays short
            if not h or v.now_s >= h[-1][0] + _HISTORY_STEP_S:
                h.append((v.now_s, v.energy_mj, v.busy_s))
                while len(h) > 2 and h[1][0] < v.now_s - _HISTORY_KEEP_S:
                    h.popleft()
        return st, v

    # ---- readings (what NVML shows)

    def state(self) -> SimState:
        """A snapshot of the state (the counter as of the last write or booked step)."""
        return copy.copy(self._booked())  # (flat fields: a shallow copy is a whole one)

    @property
    def uuid(self) -> str:
        return self._read().uuid

    def energy_mj(self) -> int:
        """The total-energy counter, mJ, an int (as NVML reports it)."""
        return int(math.floor(self._current()[1].energy_mj))

    def energy_j(self) -> float:
        """The exact counter in joules (the truth tests compare against)."""
        return self._current()[1].energy_mj / 1000.0

    def instant_power_w(self) -> float:
        """Power right now: the running step's, else the background power."""
        st, v = self._current()
        return st.busy_power_w if v.busy else self._background_power_w(st)

    def power_w(self) -> float:
        """Power averaged over the last ~1 s of counter history (Ampere+ NVML).

        Falls back to the instantaneous power until this object has history.
        """
        st, v = self._current()
        ref = self._window_start(v, POWER_WINDOW_S)
        if ref is None:
            return st.busy_power_w if v.busy else self._background_power_w(st)
        return (v.energy_mj - ref[1]) / 1000.0 / (v.now_s - ref[0])

    def _window_start(self, v: _View, window_s: float) -> tuple[float, float, float] | None:
        """The newest history point at least ``window_s`` before ``v``; else the oldest
        one before it; None without one."""
        with self._mem_lock:
            h = self._history
            for point in reversed(h):  # newest first: the window's start is near the end
                if point[0] <= v.now_s - window_s:
                    return point
            return h[0] if h and h[0][0] < v.now_s else None

    def busy(self) -> bool:
        """True while a step's simulated duration is still running."""
        return self._current()[1].busy

    def sm_clock_mhz(self) -> int:
        st, v = self._current()
        if v.busy:
            return st.busy_clock_mhz
        if st.background_load > 0.0:
            return self.spec.effective_clock_mhz(st.mem_share, st.power_limit_mw / 1000.0, st.locked_clocks_mhz)
        return st.locked_clocks_mhz[0] if st.locked_clocks_mhz else self.spec.sm_clock_min_mhz

    def mem_clock_mhz(self) -> int:
        return self.spec.mem_clock_mhz

    def utilization_pct(self) -> tuple[float, float]:
        """(GPU busy %, memory busy %) as NVML's utilisation rates: the share of the last
        ``UTIL_WINDOW_S`` during which a step ran (the background load the rest of it).
        Until this object has history, the instant's (busy: 100 %)."""
        st, v = self._current()
        ref = self._window_start(v, UTIL_WINDOW_S)
        frac = float(v.busy) if ref is None else min(1.0, max(0.0, (v.busy_s - ref[2]) / (v.now_s - ref[0])))
        bg = st.background_load * (1.0 - frac)
        return 100.0 * (frac + bg), 100.0 * (frac * st.busy_mem_share + bg * st.mem_share)

    def busy_time_s(self) -> tuple[float, float]:
        """(now, the seconds spent running steps so far): a busy share is its rate (GPM's SM activity)."""
        return (v := self._current()[1]).now_s, v.busy_s

    def temperature_c(self) -> float:
        return self.spec.temp_ambient_c + self.spec.temp_c_per_w * self.instant_power_w()

    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        return self._read().locked_clocks_mhz

    def power_limit_w(self) -> float:
        return self._read().power_limit_mw / 1000.0

    def background_load(self) -> float:
        return self._read().background_load

    def mem_share(self) -> float:
        return self._read().mem_share

    def speed_factor(self) -> float:
        return self._read().speed_factor

    def throttle_reasons(self) -> frozenset[str]:
        """Why the clock is below fmax: ``idle``, ``clock_lock``, ``power_cap``."""
        st, v = self._current()
        if not v.busy and st.background_load <= 0.0:
            return frozenset({"idle"})
        m = st.busy_mem_share if v.busy else st.mem_share
        reasons: set[str] = set()
        lock_max = st.locked_clocks_mhz[1] if st.locked_clocks_mhz else self.spec.sm_clock_max_mhz
        if lock_max < self.spec.sm_clock_max_mhz:
            reasons.add("clock_lock")
        unthrottled = self.spec.effective_clock_mhz(m, self.spec.power_limit_max_w * 10, st.locked_clocks_mhz)
        limited = self.spec.effective_clock_mhz(m, st.power_limit_mw / 1000.0, st.locked_clocks_mhz)
        if limited < unthrottled:
            reasons.add("power_cap")
        return frozenset(reasons)

    # ---- settings

    def set_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into [min, max] (clamped to the supported range)."""
        if min_mhz <= 0 or max_mhz <= 0 or min_mhz > max_mhz:
            raise ValueError(f"invalid locked clocks: min={min_mhz} max={max_mhz} (need 0 < min <= max)")
        lo, hi = self.spec.sm_clock_min_mhz, self.spec.sm_clock_max_mhz
        clamped = (min(max(int(min_mhz), lo), hi), min(max(int(max_mhz), lo), hi))
        with self._mutate() as st:
            st.locked_clocks_mhz = clamped
            self._follow_settings(st)

    def reset_locked_clocks(self) -> None:
        with self._mutate() as st:
            st.locked_clocks_mhz = None
            self._follow_settings(st)

    def _follow_settings(self, st: SimState) -> None:
        """A busy GPU's clock follows a new lock or limit at once, as a real one does
        within milliseconds (what greend reads back after a write), not at the next step."""
        if st.busy_clock_mhz:
            st.busy_clock_mhz = self.spec.effective_clock_mhz(
                st.busy_mem_share, st.power_limit_mw / 1000.0, st.locked_clocks_mhz
            )

    def set_power_limit_w(self, power_w: float) -> None:
        s = self.spec
        if not s.power_limit_min_w <= power_w <= s.power_limit_max_w:
            raise ValueError(f"power limit {power_w} W outside [{s.power_limit_min_w}, {s.power_limit_max_w}] W")
        with self._mutate() as st:
            st.power_limit_mw = int(round(power_w * 1000))
            self._follow_settings(st)

    @staticmethod
    def _check_load(load: float) -> float:
        if not 0.0 <= load <= 1.0:
            raise ValueError(f"background_load must be in [0, 1], got {load}")
        return float(load)

    @staticmethod
    def _check_speed(speed: float) -> float:
        if speed <= 0:
            raise ValueError(f"speed_factor must be > 0, got {speed}")
        return float(speed)

    def set_background_load(self, load: float) -> None:
        """Busy fraction with no job (0..1): lets ``--sim N`` show non-idle power."""
        load = self._check_load(load)
        with self._mutate() as st:
            st.background_load = load

    def set_mem_share(self, mem_share: float) -> None:
        """The default memory-bound share of this GPU's workload (0..0.95)."""
        m = check_mem_share(mem_share)
        with self._mutate() as st:
            st.mem_share = m

    def set_speed_factor(self, speed_factor: float) -> None:
        """> 1 makes every step slower on this GPU (a straggler)."""
        s = self._check_speed(speed_factor)
        with self._mutate() as st:
            st.speed_factor = s

    # ---- steps

    def _cost(self, st: SimState, flops: float, mem_share: float | None, precision: str) -> StepCost:
        m = st.mem_share if mem_share is None else mem_share
        return self.spec.step_cost(
            flops,
            m,
            precision,
            power_limit_w=st.power_limit_mw / 1000.0,
            locked_clocks_mhz=st.locked_clocks_mhz,
            speed_factor=st.speed_factor,
        )

    def step_cost(self, flops: float, mem_share: float | None = None, precision: str = "fp32") -> StepCost:
        """What a step would cost at the current settings; changes nothing."""
        return self._cost(self._read(), flops, mem_share, precision)

    def run_step(self, flops: float, mem_share: float | None = None, precision: str = "fp32") -> StepCost:
        """Execute one step: add its energy to the counter and book its duration
        as busy credit (see the module docstring). ``mem_share`` None: the GPU's."""
        return self.run_steps([(flops, mem_share, precision)])[0]

    def run_steps(self, steps: Sequence[tuple[float, float | None, str]], *, defer: bool = False) -> list[StepCost]:
        """Execute several steps, ``(flops, mem_share, precision)`` each, in one update
        of the device file (what a batch of step reports from the daemon needs).

        ``defer``: book them in memory now, at the settings in force, and write them into
        the file later (see ``_COMMIT_EVERY_S``). This object's readings count them at
        once; another process sees them in the file about a second later at most."""
        costs: list[StepCost] = []
        with self._thread_lock:  # (decided under the lock: close() may be under way)
            if not (defer and self._defer):
                with self._mutate() as st:
                    for flops, mem_share, precision in steps:
                        cost = self._cost(st, flops, mem_share, precision)
                        self._book(st, cost, st.mem_share if mem_share is None else mem_share)
                        costs.append(cost)
                return costs
            base = self._read()
            if self._pending is not None and self._pending_base is not base:
                self.commit()  # another process changed the device: its file first
                base = self._read()
            st = copy.copy(self._pending if self._pending is not None else base)
            now = self._now()
            self._advanced(st, now)
            booked = []
            for flops, mem_share, precision in steps:  # (a step that cannot run books none)
                cost = self._cost(st, flops, mem_share, precision)
                m = st.mem_share if mem_share is None else mem_share
                self._book(st, cost, m)
                booked.append((now, cost, m))
                costs.append(cost)
            self._deferred += booked
            self._pending, self._pending_base = st, base
            if time.monotonic() - self._written_s >= _COMMIT_EVERY_S:
                self.commit()  # (readings commit too; this one keeps going without them)
        return costs

    @staticmethod
    def _book(st: SimState, cost: StepCost, mem_share: float) -> None:
        """A step's energy into the counter, its duration into the busy credit."""
        total = st.busy_credit_s + cost.duration_s
        if total > 0:  # the power/clock shown while busy: credit-weighted
            w = cost.duration_s / total
            st.busy_power_w = (1 - w) * st.busy_power_w + w * cost.power_w
            st.busy_mem_share = (1 - w) * st.busy_mem_share + w * mem_share
        st.busy_clock_mhz = cost.sm_clock_mhz
        st.energy_mj += cost.energy_j * 1000.0
        st.busy_credit_s = total

    # ---- ground truth

    def sweep(self, flops: float, mem_share: float | None = None, precision: str = "fp32") -> list[SweepPoint]:
        """The step at every supported clock, at this GPU's power limit and speed."""
        st = self._read()
        m = st.mem_share if mem_share is None else mem_share
        return self.spec.sweep(
            flops, m, precision, power_limit_w=st.power_limit_mw / 1000.0, speed_factor=st.speed_factor
        )

    def optimum(
        self,
        flops: float,
        mem_share: float | None = None,
        precision: str = "fp32",
        max_slowdown: float = 0.05,
    ) -> Optimum:
        """:meth:`SimSpec.optimum` at this GPU's power limit and speed factor."""
        st = self._read()
        m = st.mem_share if mem_share is None else mem_share
        return self.spec.optimum(
            flops,
            m,
            precision,
            max_slowdown,
            power_limit_w=st.power_limit_mw / 1000.0,
            speed_factor=st.speed_factor,
        )

    # ---- the process table (what nvmlDeviceGetComputeRunningProcesses lists)

    def attach_process(self, pid: int) -> None:
        """``pid`` computes on this GPU from now on, as a process with a CUDA context
        on a real one (the daemon attaches a rank when it runs the rank's steps here).
        It stays listed until it exits. One file write per new process."""
        pid = int(pid)
        with self._mem_lock:
            if pid in self._attached:
                return
            self._attached.add(pid)
        with self._locked():
            add_proc(procs_path(self.state_dir, self.index), pid)

    def processes(self) -> list[int]:
        """The live processes computing on this GPU (exited ones are dropped, as the
        driver drops a process's context when it exits)."""
        return live_procs(procs_path(self.state_dir, self.index))
