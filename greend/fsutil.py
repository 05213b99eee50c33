"""Small durable-file helpers: the one atomic write, fsync of a directory, the state
dir (opened once, every file in it opened through its descriptor), its lock and the
check that a directory is greend's own."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

__all__ = [
    "LOCK_FILE",
    "StateDir",
    "StateDirLock",
    "check_private_dir",
    "check_socket_slot",
    "fsync_dir",
    "lock_holder",
    "write_atomic",
]


def fsync_dir(path: Path, dir_fd: int | None = None) -> None:
    """fsync a directory (``dir_fd``: the directory open as that descriptor, ``path``
    then only names it), so a rename or unlink in it survives a power cut.

    Best effort: a filesystem that cannot fsync directories is not an error.
    """
    if dir_fd is not None:
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(
    path: Path,
    data: bytes | str,
    *,
    mode: int = 0o666,
    exact_mode: bool = False,
    durable: bool = True,
    dir_fd: int | None = None,
) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old file or the new one,
    never a torn one: a temporary file in the same directory, then ``os.replace``.

    ``mode``: the new file's permissions, less the umask (``exact_mode``: exactly
    ``mode``). ``durable``: fsync the file before the rename and the directory after
    it, so the new file also survives a power cut (not only a crashed process).
    The temporary file is ``.<name>.<pid>.tmp``, so one thread at a time may write
    a given path (callers hold their lock); it is removed when the write fails, and
    the OSError is raised. It is created with ``O_EXCL | O_NOFOLLOW``: a file or a
    symlink someone planted at that name is removed first and never written through.
    ``dir_fd``: ``path`` is a name in the directory open as that descriptor (a
    :class:`StateDir`'s), which a later rename or symlink of the directory cannot move.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    at = {} if dir_fd is None else {"dir_fd": dir_fd}
    try:
        try:
            os.unlink(tmp, **at)  # a leftover (or a planted symlink): unlink removes the link itself
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, **at)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            if exact_mode:
                os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, **at)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent, dir_fd)


class StateDir:
    """The state dir, opened once (``O_DIRECTORY | O_NOFOLLOW``) after it was checked
    (:func:`check_private_dir`), and checked again through the descriptor: greend's
    files in it (the saved settings, the lock) are opened relative to :attr:`fd`. Its
    path is checked only at start; whoever owns a directory above it could later swap
    it for a symlink, and a write of root's by path would follow that link. Through the
    descriptor it goes on reaching the directory that was checked.

    Before :meth:`open` (and after :meth:`close`) :attr:`fd` is None and the files are
    opened by path (the one-shot tools: ``greend restore``)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.fd: int | None = None

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def open(self, *, create: bool = True) -> StateDir:
        """Create the directory (0700) if missing, check it, and open it. Raises
        PermissionError naming what is wrong (a symlink, another owner, writable by others)."""
        if create:
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            except FileExistsError:  # (exist_ok covers a directory only)
                raise PermissionError(
                    f"the state dir {self.path} exists and is not a directory: move it away, or give "
                    "--state-dir (or [daemon] state_dir) a directory of greend's own"
                ) from None
            except NotADirectoryError:
                raise PermissionError(
                    f"the state dir {self.path} cannot be made: a part of its path is a file, not a directory"
                ) from None
        check_private_dir(self.path, "the state dir")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:  # swapped between the check and the open
            raise PermissionError(f"the state dir {self.path} cannot be opened as a directory: {e}") from None
        try:
            _check_private_stat(os.fstat(fd), self.path, "the state dir")
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self.fd = fd
        return self

    def inside(self, *parts: str) -> Path:
        """A path in the opened directory for what takes only paths (the simulator's
        device files, a store's spool): through ``/proc/self/fd/<fd>`` it resolves via
        the descriptor, wherever the configured path points now. Before :meth:`open`,
        or without /proc, the configured path."""
        if self.fd is not None:
            held = Path(f"/proc/self/fd/{self.fd}")
            if held.is_dir():
                return held.joinpath(*parts)
        return self.path.joinpath(*parts)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


LOCK_FILE = "greend.lock"


class StateDirLock:
    """``<state_dir>/greend.lock``, held (``flock``) for the daemon's life: one daemon
    per state dir. The file holds the owner's pid; the kernel drops the lock when the
    process dies, so a crash never leaves a stale lock behind."""

    def __init__(self, state_dir: Path | StateDir) -> None:
        self.state_dir = state_dir
        self.path = Path(state_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``BlockingIOError`` naming the running daemon's pid."""
        dir_fd = self.state_dir.fd if isinstance(self.state_dir, StateDir) else None
        name = LOCK_FILE if dir_fd is not None else self.path
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = lock_holder(self.path.parent)
            raise BlockingIOError(
                f"another greend (pid {pid if pid else 'unknown'}) owns the state dir {self.path.parent} "
                f"(it holds {self.path}); stop it first, or give this one another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def lock_holder(state_dir: Path) -> int | None:
    """The pid of the live daemon that owns ``state_dir`` (it holds the lock), else None."""
    try:
        fd = os.open(Path(state_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.read(fd, 32).decode("ascii", "replace").strip()
            return int(raw) if raw.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_private_dir(path: Path, what: str, *, shared_sticky: bool = False) -> None:
    """Refuse a directory that is not owned by this process's uid or that others may
    write to (anyone who can write there could plant symlinks or files greend trusts).

    ``shared_sticky``: also accept a sticky directory (mode ``+t``, as ``/tmp`` is 1777)
    owned by root or by greend's uid, for the socket's directory only. It is safe there
    because of what greend puts in it and how: one socket file, which it binds itself
    (``bind`` never follows a symlink and fails on any name that exists), after refusing
    any file already at the path that another uid owns (:func:`check_socket_slot`). In a
    sticky directory only the file's owner, the directory's owner and root may unlink or
    rename a file, so once bound, nobody else can swap the socket for a link that the
    following ``chmod`` would follow, or remove it under the daemon. What a sticky
    directory cannot give is a name nobody else may take first: someone may bind the
    path while no greend runs (greend then refuses to start: the path is theirs), and
    clients cannot tell an impostor there; so a shared directory is for trying greend,
    and a service keeps its socket in a directory of its own (``/run/greend``). The
    state dir is never shared: greend writes many files there and reads them back.
    """
    _check_private_stat(os.lstat(path), path, what, shared_sticky=shared_sticky)


def _check_private_stat(st: os.stat_result, path: Path, what: str, *, shared_sticky: bool = False) -> None:
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{what} {path} is not a directory (a symlink?); greend refuses it")
    sticky_ok = shared_sticky and bool(st.st_mode & stat.S_ISVTX) and st.st_uid in (0, os.geteuid())
    if sticky_ok:
        return
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{what} {path} is owned by uid {st.st_uid}, not by greend's uid {os.geteuid()}: "
            f"greend refuses it (anyone who owns it could plant files there); chown it or choose another"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        hint = (
            "use a directory of greend's own (mkdir -m 700 DIR)"
            if not shared_sticky
            else "use a directory of greend's own (mkdir -m 755 DIR), or a sticky one such as /tmp"
        )
        raise PermissionError(
            f"{what} {path} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"greend refuses it; {hint}"
        )


def check_socket_slot(path: Path) -> None:
    """Refuse a file at the socket's path that another uid owns: in a shared directory
    it is someone else's name, and greend neither replaces it nor listens in its place.
    (A leftover socket of greend's own uid is for the server to judge: live or stale.)"""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} exists and belongs to uid {st.st_uid}, not to greend's uid {os.geteuid()}: greend leaves it "
            f"alone; choose another --socket (e.g. in a directory of your own)"
        )
