"""greenctl top's keys on a terminal (a pseudo-terminal, against a real daemon): q, s < >,
p, ?; the terminal given back as it was on q, Ctrl-C and an error; no keys from a pipe."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.cli.top import run_top
from greend.cli.top_keys import HELP_LINE, KEYS_LINE, TerminalKeys
from tests.support import REPO, DaemonProc, env, start_daemon, wait_for

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _default_sigint() -> None:
    """Ctrl-C's default action, as a terminal's foreground job has it: a test run started in
    the background by a shell without job control inherits SIGINT ignored, and so would
    greenctl top (Python installs no KeyboardInterrupt handler for an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Tty:
    """``greenctl top`` on a pseudo-terminal of 100x40 that is its controlling terminal."""

    def __init__(self, socket: Path) -> None:
        args = [sys.executable, "-P", "-m", "greend.ctl", "--socket", str(socket), "top", "--interval", "0.3"]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec at once
            os.chdir(REPO)
            _default_sigint()
            os.execve(sys.executable, args, env())
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
        self.out = ""

    def read_until(self, text: str, timeout_s: float = 20.0) -> str:
        """Everything shown from now until ``text`` shows (escape codes removed; spaces and
        line ends left out of the match, as the frame wraps long lines)."""
        seen, end, want = "", time.monotonic() + timeout_s, re.sub(r"\s+", "", text)
        while time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # EIO: the child is gone
                    break
                seen += ANSI.sub("", chunk)
                if want in re.sub(r"\s+", "", seen):
                    return seen
        raise AssertionError(f"{text!r} not shown within {timeout_s} s; shown:\n{seen[-3000:]}")

    def press(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def lflag(self) -> int:
        return int(termios.tcgetattr(self.fd)[3])

    def wait_exit(self, timeout_s: float = 10.0) -> int:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                select.select([self.fd], [], [], 0.05) and os.read(self.fd, 65536)
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"greenctl top did not exit within {timeout_s} s")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One daemon for the module: top only reads its status, so the tests share it."""
    d = start_daemon(tmp_path_factory.mktemp("top-keys"), "--sim", "1")
    try:
        yield d
    finally:
        d.stop()


def test_keys_sort_pause_help_and_quit_on_a_terminal(daemon: DaemonProc) -> None:
    t = Tty(daemon.socket)
    try:
        t.read_until(KEYS_LINE)
        cooked = termios.ECHO | termios.ICANON
        assert t.lflag() & cooked == 0  # cbreak while top runs: keys one at a time, unechoed
        t.press("?")
        t.read_until(HELP_LINE.split(";")[0])
        t.press(">")
        t.read_until("Jobs (by the job's energy so far)")
        t.press("s")
        t.read_until("Jobs (by GFLOPS/W over the last interval)")
        t.press("<<")
        t.read_until("Jobs (by the job's name)")
        t.press("<")  # from the first column round to the last
        t.read_until("Jobs (by steps/s over the last interval)")
        t.press("p")
        t.read_until("PAUSED (p resumes)")
        t.press("p")
        t.read_until("every 0.3 s")
        t.press("q")
        assert t.wait_exit() == 0
        assert t.lflag() & cooked == cooked  # the terminal as it was: echo, line editing
    finally:
        t.close()


def test_ctrl_c_gives_the_terminal_back(daemon: DaemonProc) -> None:
    t = Tty(daemon.socket)
    try:
        t.read_until(KEYS_LINE)
        before = t.lflag()
        assert before & termios.ICANON == 0
        t.press("\x03")  # the terminal sends SIGINT to top
        assert t.wait_exit() == 0
        assert (
            t.lflag() & (termios.ECHO | termios.ICANON | termios.ISIG) == termios.ECHO | termios.ICANON | termios.ISIG
        )
    finally:
        t.close()


def test_an_error_gives_the_terminal_back() -> None:
    """The status request fails with an unexpected error mid-run: it propagates, and the
    terminal has its settings back."""
    master, slave = pty.openpty()
    try:
        want = termios.tcgetattr(slave)
        calls = {"n": 0}

        def request() -> dict:
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("a bug")
            return {"gpus": [], "jobs": [], "policy": {}, "totals": {}}

        from rich.console import Console

        with open(os.devnull, "w") as sink, pytest.raises(RuntimeError, match="a bug"):
            run_top(request, socket="s", interval_s=0.1, console=Console(file=sink), keys=TerminalKeys(slave))
        assert termios.tcgetattr(slave) == want
    finally:
        os.close(master)
        os.close(slave)


def test_no_keys_from_a_pipe(daemon: DaemonProc, tmp_path: Path) -> None:
    """stdin not a terminal: top is as it was (the Ctrl-C line, no keys, no terminal mode).
    top talks to the daemon through a relay that counts its status requests, so the test
    waits for top's own refreshes instead of a fixed time."""
    relay = _Relay(tmp_path / "relay.sock", daemon.socket)
    args = [sys.executable, "-P", "-m", "greend.ctl", "--socket", str(relay.path), "top", "--interval", "0.3"]
    p = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
        cwd=REPO,
        preexec_fn=_default_sigint,
    )
    try:
        assert p.stdin is not None
        p.stdin.write(b"q")  # not a key here: top goes on (a top that read keys would find it)
        p.stdin.flush()
        # The first reading, then three refreshes: top's loop has run three times since the q.
        assert wait_for(lambda: relay.requests >= 4 or p.poll() is not None, 20), relay.requests
        assert p.poll() is None
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        relay.close()
    text = re.sub(r"\s+", "", ANSI.sub("", out.decode()))
    assert "(Ctrl-Ctoquit)" in text and "pause" not in text, (text[-2000:], err.decode()[-2000:])


class _Relay:
    """A Unix socket that passes each connection on to ``target`` and counts them (greenctl
    top makes one connection per status request)."""

    def __init__(self, path: Path, target: Path) -> None:
        self.path, self.target, self.requests = path, target, 0
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(str(self.target))
            self.requests += 1
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._server.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s writing side."""
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
