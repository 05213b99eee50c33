"""A bounded, append-only, crash-safe spool of line-protocol points on local disk.

Why: a store outage must lose nothing, and influxdb-client alone is not durable
(its batching writer drops a batch after an error and buffers in memory). So the
InfluxDB store never hands points straight to the network: ``write()`` appends
them here, and a sender thread drains the spool, oldest first.

On disk, one directory per store (the daemon passes ``<state_dir>/spool/<store>``)::

    0000000000000041.ns.lp        sealed segment: complete lines, fsynced, ready to send
    0000000000000041.ns.progress  (rare) bytes of 41 already delivered, after a 413 split
    0000000000000042.ns.open      the segment being appended to (at most one)
    rejected/                     segments the server refused as malformed (400/422)

A segment is named by a sequence number (replay order) and a *tag* chosen by
the owner (the InfluxDB store uses the timestamp precision, so a segment always
says how to read its timestamps). Each line is one point and ends with ``\\n``.

Life of a point:

1. :meth:`Spool.append` writes the lines to the open segment with one
   ``os.write``; once it returns, the lines are in the kernel and survive a
   SIGKILL of the process. ``fsync`` is batched: at seal, and every
   ``fsync_s`` from :meth:`maintain` (a power loss can cost the last second).
2. The open segment is sealed (fsync, rename ``.open`` -> ``.lp``, fsync of the
   directory) when it reaches ``segment_bytes`` or is ``segment_age_s`` old, by
   :meth:`maintain` on the sender thread and without the lock, so an append (the
   daemon's tick) never waits for the disk; an append seals only a segment that has
   grown to 4 x ``segment_bytes`` because the sender has not come by. A segment being
   sealed is counted as pending, and no later one is handed out before it is listed.
3. The sender takes :meth:`oldest` sealed segment, sends it, and only after a
   2xx calls :meth:`ack`, which deletes it. Nothing is deleted before success.
4. At start, leftovers from an earlier run are recovered in sequence order: an
   ``.open`` segment is repaired (a torn final line, i.e. bytes after the last
   newline, and lines holding NUL bytes from a power loss are dropped and
   counted) and sealed, so old points are sent before any new one.

Bounded: when the spool holds more than ``max_bytes``, the oldest sealed
segments are deleted and their points counted in :attr:`Spool.dropped` (and
logged). The segment that the sender has in flight, the open segment and one
being sealed are never dropped, so the spool may overshoot the bound by a few
segments (the open one can reach 4 x ``segment_bytes`` while the sender is away).

Delivery is at-least-once. Duplicates do not happen in normal operation: a
segment is sent once and deleted after the server's 2xx. The one window for a
duplicate is a crash (or a lost reply) between the server storing a segment
and the ``unlink`` that follows: that segment (at most ``segment_bytes``) is
sent again at the next start.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from greend.errors import StoreError
from greend.fsutil import fsync_dir, write_atomic
from greend.stores._repeats import RepeatedErrors

__all__ = ["Segment", "Spool"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{16})\.([A-Za-z0-9_-]+)\.(lp|open)\Z")
_MAX_REJECTED_FILES = 32


@dataclass
class Segment:
    """One sealed segment file. ``points`` counts lines not yet delivered."""

    seq: int
    tag: str
    path: Path
    size_bytes: int
    points: int
    done_bytes: int = 0  # prefix already delivered (only after a 413 split)

    @property
    def pending_bytes(self) -> int:
        return self.size_bytes - self.done_bytes


class Spool:
    """A directory of segment files; thread-safe (one appender, one sender)."""

    def __init__(
        self,
        directory: Path,
        *,
        tag: str = "lp",
        max_bytes: int = 256 * 1024 * 1024,
        segment_bytes: int = 1024 * 1024,
        segment_age_s: float = 1.0,
        fsync_s: float = 1.0,
        clock: Callable[[], float] | None = None,
        shown: Path | None = None,
    ) -> None:
        # ``shown``: the directory as a person knows it, where ``directory`` reaches it
        # through the daemon's held descriptor (/proc/self/fd/N/...).
        if not re.fullmatch(r"[A-Za-z0-9_-]+", tag):
            raise StoreError(f"spool tag {tag!r}: letters, digits, '_' and '-' only")
        self.directory = Path(directory)
        self.shown = Path(shown) if shown is not None else self.directory  # in messages (see __init__)
        self.rejected_dir = self.directory / "rejected"
        self.tag = tag
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.segment_age_s = segment_age_s
        self.fsync_s = fsync_s
        self._clock = clock or time.monotonic
        self._lock = threading.RLock()
        self._errors = RepeatedErrors(log)  # (a full disk fails every append: logged once per 5 min)
        self._sealed: list[Segment] = []
        self._detached: dict[int, tuple[int, int]] = {}  # seq -> (bytes, points): being sealed, not listed yet
        self._busy: int | None = None  # seq the sender has in flight
        self._fd: int | None = None
        self._open_seq = 0
        self._open_path: Path | None = None
        self._open_bytes = 0
        self._open_points = 0
        self._open_since = 0.0
        self._dirty = False
        self._last_fsync = self._clock()
        self._next_seq = 1
        #: Points lost for good: dropped at the bound, torn lines, failed appends.
        self.dropped = 0
        #: Points set aside in ``rejected/`` (the server called them malformed).
        self.rejected = 0
        #: Points recovered from an earlier run at start.
        self.recovered = 0
        self.last_error: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._recover()
        except OSError as e:
            raise StoreError(
                f"cannot use the spool directory {self.shown}: {e} "
                "(check that the state dir exists and is writable by greend)"
            ) from e

    # Start-up ------------------------------------------------------------------------
    def _recover(self) -> None:
        found: list[tuple[int, str, str, Path]] = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_file() and not p.is_symlink():  # a planted symlink is never read through
                found.append((int(m.group(1)), m.group(2), m.group(3), p))
        found.sort()
        for seq, tag, kind, path in found:
            self._next_seq = max(self._next_seq, seq + 1)
            data = _read_nofollow(path)
            good = self._repair(path, data)
            if kind == "open":
                if good:
                    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    sealed = path.with_name(f"{seq:016d}.{tag}.lp")
                    os.replace(path, sealed)
                    path = sealed
                else:
                    path.unlink()
                    continue
            elif not good:
                path.unlink()
                self._progress_path(seq, tag).unlink(missing_ok=True)
                continue
            done = self._read_progress(seq, tag, len(good))
            if done and good[done - 1 : done] != b"\n":
                log.warning("spool %s: its progress file points inside a line: sent again from the start", path.name)
                done = 0  # (a duplicate point or two beats a torn line, which the server refuses)
            points = good.count(b"\n", done)
            if points == 0:
                path.unlink()
                self._progress_path(seq, tag).unlink(missing_ok=True)
                continue
            self._sealed.append(Segment(seq, tag, path, len(good), points, done))
            self.recovered += points
        fsync_dir(self.directory)
        if self.recovered:
            log.info(
                "spool %s: %d points in %d segments left from an earlier run; replaying them first",
                self.shown,
                self.recovered,
                len(self._sealed),
            )
        for p in self.directory.glob("*.tmp"):
            p.unlink(missing_ok=True)
        # Stray progress files whose segment is gone.
        for p in self.directory.glob("*.progress"):
            seq_s = p.name.split(".", 1)[0]
            if not any(f"{s.seq:016d}" == seq_s for s in self._sealed):
                p.unlink(missing_ok=True)
        self._enforce_bound()

    def _repair(self, path: Path, data: bytes) -> bytes:
        """Drop a torn final line and lines with NUL bytes; rewrite the file if needed."""
        end = data.rfind(b"\n") + 1
        good = data[:end]
        torn = 1 if end < len(data) and data[end:].strip(b"\x00 \t\r") else 0
        bad = 0
        if b"\x00" in good:
            lines = good.split(b"\n")[:-1]
            kept = [ln for ln in lines if b"\x00" not in ln and ln]
            bad = len(lines) - len(kept)
            good = b"".join(ln + b"\n" for ln in kept)
        if torn or bad or end < len(data):
            if torn or bad:
                log.warning(
                    "spool %s: dropped %d torn and %d corrupt lines (the previous run stopped mid-write)",
                    path.name,
                    torn,
                    bad,
                )
            self.dropped += torn + bad
            write_atomic(path, good)
        return good

    def _progress_path(self, seq: int, tag: str) -> Path:
        return self.directory / f"{seq:016d}.{tag}.progress"

    def _read_progress(self, seq: int, tag: str, size: int) -> int:
        p = self._progress_path(seq, tag)
        try:
            done = int(_read_nofollow(p).decode().split()[0])
        except (OSError, ValueError, IndexError):
            return 0
        return done if 0 <= done <= size else 0

    # Appending (tick path) -----------------------------------------------------------
    def append(self, data: bytes) -> int:
        """Append complete lines (each ending in ``\\n``); returns the points appended.

        Never raises: a failing disk is counted in :attr:`dropped` and
        :attr:`last_error`. One ``os.write`` per call, no fsync (see
        :meth:`maintain`).
        """
        if not data:
            return 0
        if not data.endswith(b"\n"):
            data += b"\n"
        n = data.count(b"\n")
        with self._lock:
            try:
                if self._fd is None:
                    self._open_segment()
                assert self._fd is not None
                view = memoryview(data)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except OSError as e:
                self.dropped += n
                self.last_error = f"spool append failed: {e}"
                self._errors.error("spool %s: append of %d points failed: %s", self.shown, n, e)
                if self._fd is not None:
                    try:
                        os.ftruncate(self._fd, self._open_bytes)  # no part of these lines stays (a full disk)
                    except OSError:
                        pass
                self._abandon_open()
                return 0
            self._open_bytes += len(data)
            self._open_points += n
            self._dirty = True
            if self.last_error is not None and self.last_error.startswith("spool append failed"):
                self.last_error = None  # (the disk takes points again; a seal's failure stays said)
            if self._open_bytes >= 4 * self.segment_bytes:
                # A full segment is sealed by maintain(), on the sender thread, so the tick
                # never waits for the disk; a sender that has not come by in this long: here.
                self._seal_locked()
                self._enforce_bound()
        return n

    def _open_segment(self) -> None:
        seq = self._next_seq
        self._next_seq += 1
        path = self.directory / f"{seq:016d}.{self.tag}.open"
        try:
            os.unlink(path)  # a leftover, or something planted: never appended to
        except FileNotFoundError:
            pass
        self._fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        self._open_seq, self._open_path = seq, path
        self._open_bytes = self._open_points = 0
        self._open_since = self._clock()

    def _abandon_open(self) -> None:
        """After a failed write: close the open segment and seal what it holds."""
        try:
            self._seal_locked()
        except OSError:
            self._fd = None

    # Sealing and fsync ---------------------------------------------------------------
    def seal(self) -> None:
        """Seal the open segment now (if it holds anything), e.g. before a flush."""
        with self._lock:
            detached = self._detach()
        self._finish_seal(detached)

    @property
    def segment_full(self) -> bool:
        """The open segment has reached ``segment_bytes``: :meth:`maintain` seals it."""
        return self._open_bytes >= self.segment_bytes

    def _seal_locked(self) -> None:
        """Seal the open segment (called with the lock held; waits for the disk)."""
        self._finish_seal(self._detach())

    def _detach(self) -> tuple[int, Path, int, int, int] | None:
        """Under the lock: take the open segment off (fd, path, seq, bytes, points); the
        next append opens a new one. None where none is open."""
        if self._fd is None or self._open_path is None:
            return None
        out = (self._fd, self._open_path, self._open_seq, self._open_bytes, self._open_points)
        self._detached[self._open_seq] = (self._open_bytes, self._open_points)  # (counted until listed)
        self._fd = None
        self._open_bytes = self._open_points = 0
        self._dirty = False
        return out

    def _finish_seal(self, detached: tuple[int, Path, int, int, int] | None) -> None:
        """The disk work of a seal (fsync, rename, the directory's fsync), without the lock
        where the caller holds none; then the segment is listed, in order."""
        if detached is None:
            return
        fd, path, seq, nbytes, points = detached
        try:
            self._seal_io(fd, path, seq, nbytes, points)
        finally:
            with self._lock:
                self._detached.pop(seq, None)

    def _seal_io(self, fd: int, path: Path, seq: int, nbytes: int, points: int) -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            log.warning("spool %s: fsync failed: %s", path, e)
        os.close(fd)
        if points == 0:
            path.unlink(missing_ok=True)
            return
        sealed = path.with_name(f"{seq:016d}.{self.tag}.lp")
        try:
            os.replace(path, sealed)
        except OSError as e:
            with self._lock:
                self.dropped += points
                self.last_error = f"spool seal failed: {e}"
            log.error("spool %s: seal failed, %d points lost: %s", path, points, e)
            return
        fsync_dir(self.directory)
        with self._lock:
            self._detached.pop(seq, None)  # (listed in the same breath: never counted twice)
            bisect.insort(self._sealed, Segment(seq, self.tag, sealed, nbytes, points), key=lambda g: g.seq)
            self._last_fsync = self._clock()
            self._enforce_bound()

    def maintain(self) -> None:
        """Seal the open segment when full or old enough; fsync it every ``fsync_s``.

        Called from the sender thread; the disk is waited for without the lock, so an
        append on the tick path never waits for a slow disk.
        """
        detached = None
        fd = None
        with self._lock:
            if self._fd is None:
                return
            now = self._clock()
            full = self._open_bytes >= self.segment_bytes
            if self._open_points and (full or now - self._open_since >= self.segment_age_s):
                detached = self._detach()
            elif self._dirty and now - self._last_fsync >= self.fsync_s:
                fd = os.dup(self._fd)  # (its own descriptor: the segment may be sealed meanwhile)
                self._dirty = False
                self._last_fsync = now
        if detached is not None:
            self._finish_seal(detached)
        elif fd is not None:
            try:
                os.fsync(fd)
            except OSError as e:
                log.warning("spool %s: fsync failed: %s", self.shown, e)
            finally:
                os.close(fd)

    # The bound -----------------------------------------------------------------------
    def _enforce_bound(self) -> None:
        total = self.pending_bytes
        while total > self.max_bytes:
            victim = next((s for s in self._sealed if s.seq != self._busy), None)
            if victim is None:
                return
            self._sealed.remove(victim)
            total -= victim.pending_bytes
            self.dropped += victim.points
            victim.path.unlink(missing_ok=True)
            self._progress_path(victim.seq, victim.tag).unlink(missing_ok=True)
            log.error(
                "spool %s is over its bound of %d bytes: dropped the oldest segment "
                "(%d points); %d points dropped so far",
                self.shown,
                self.max_bytes,
                victim.points,
                self.dropped,
            )

    # Sender side ---------------------------------------------------------------------
    def oldest(self) -> Segment | None:
        """The oldest sealed segment, marked in flight (never dropped) until released."""
        with self._lock:
            # Never past a segment still being sealed on another thread (seal() from a
            # flush): the segments go out in order.
            if not self._sealed or (self._detached and min(self._detached) < self._sealed[0].seq):
                self._busy = None
                return None
            seg = self._sealed[0]
            self._busy = seg.seq
            return seg

    def release(self) -> None:
        """The sender is done with its segment for now (it will retry later)."""
        with self._lock:
            self._busy = None
            self._enforce_bound()

    def read(self, seg: Segment) -> bytes:
        """The undelivered part of a segment (never past the size it was sealed at)."""
        return _read_nofollow(seg.path, seg.done_bytes)[: seg.pending_bytes]

    def advance(self, seg: Segment, nbytes: int, npoints: int) -> None:
        """Record that the next ``nbytes`` (``npoints`` lines) of ``seg`` were delivered.

        Used when a segment goes out in pieces (after a 413): the offset is kept in
        a ``.progress`` file (atomic write), so a restart does not resend them.
        """
        with self._lock:
            seg.done_bytes += nbytes
            seg.points -= npoints
            p = self._progress_path(seg.seq, seg.tag)
            try:
                write_atomic(p, f"{seg.done_bytes}\n")
            except OSError as e:
                log.warning("spool %s: cannot record progress: %s", p, e)

    def ack(self, seg: Segment) -> None:
        """The whole (rest of the) segment was delivered: delete it."""
        with self._lock:
            self._remove(seg)
            seg.path.unlink(missing_ok=True)
            self._progress_path(seg.seq, seg.tag).unlink(missing_ok=True)
            self._busy = None

    def reject(self, seg: Segment, reason: str, data: bytes | None = None) -> int:
        """Set the (rest of the) segment aside in ``rejected/``; returns its points.

        ``data``, if given, is the part refused; otherwise the undelivered rest.
        Only the newest few rejected files are kept.
        """
        with self._lock:
            body = data if data is not None else self.read(seg)
            n = body.count(b"\n")
            try:
                self.rejected_dir.mkdir(mode=0o700, exist_ok=True)
                out = self.rejected_dir / f"{seg.seq:016d}.{seg.tag}.{seg.done_bytes}.lp"
                write_atomic(out, body, mode=0o600, exact_mode=True, durable=False)
                write_atomic(out.with_suffix(".reason"), reason + "\n", mode=0o600, exact_mode=True, durable=False)
                kept = sorted(self.rejected_dir.glob("*.lp"))
                for old in kept[:-_MAX_REJECTED_FILES]:
                    old.unlink(missing_ok=True)
                    old.with_suffix(".reason").unlink(missing_ok=True)
            except OSError as e:
                log.warning("spool %s: cannot keep the rejected segment: %s", self.shown, e)
            self.rejected += n
            if data is None or len(data) >= seg.pending_bytes:
                self.ack(seg)
            else:
                self.advance(seg, len(data), n)
            return n

    def _remove(self, seg: Segment) -> None:
        try:
            self._sealed.remove(seg)
        except ValueError:
            pass

    # Views ---------------------------------------------------------------------------
    @property
    def pending_points(self) -> int:
        with self._lock:
            return sum(s.points for s in self._sealed) + self._open_points + sum(p for _, p in self._detached.values())

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return (
                sum(s.pending_bytes for s in self._sealed)
                + self._open_bytes
                + sum(b for b, _ in self._detached.values())
            )

    @property
    def sealed_count(self) -> int:
        with self._lock:
            return len(self._sealed)

    def empty(self) -> bool:
        with self._lock:
            return not self._sealed and self._open_points == 0 and not self._detached

    def close(self) -> None:
        """Seal the open segment; everything unsent stays on disk for the next start."""
        with self._lock:
            try:
                self._seal_locked()
            except OSError as e:
                log.error("spool %s: close failed: %s", self.shown, e)


def _read_nofollow(path: Path, offset: int = 0) -> bytes:
    """A spool file's bytes from ``offset``, never through a symlink (ELOOP instead)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        return f.read()
