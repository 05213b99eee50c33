"""The disk spool: order, sealing, recovery after a crash, the byte bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from greend.stores.spool import Spool
from tests.support import REPO


def lines(a: int, b: int) -> bytes:
    return b"".join(b"m,host=h v=%di %d\n" % (i, i) for i in range(a, b))


def drain(sp: Spool) -> list[bytes]:
    """What a sender would send, in order, acking each segment."""
    out: list[bytes] = []
    while (seg := sp.oldest()) is not None:
        out.extend(sp.read(seg).splitlines())
        sp.ack(seg)
    return out


def test_append_seal_and_send_oldest_first(tmp_path: Path) -> None:
    sp = Spool(tmp_path, segment_bytes=200)
    for i in range(0, 100, 10):
        assert sp.append(lines(i, i + 10)) == 10
        sp.maintain()  # (the sender thread's part: it seals a full segment)
    assert sp.sealed_count >= 4  # sealed by size
    assert sp.pending_points == 100
    sp.seal()  # the open rest
    got = drain(sp)
    assert got == lines(0, 100).splitlines()
    assert sp.empty() and sp.pending_points == 0
    assert not list(tmp_path.glob("*.lp"))  # acked segments are deleted


def test_open_segment_sealed_by_age_and_nothing_sent_before_seal(tmp_path: Path) -> None:
    now = [0.0]
    sp = Spool(tmp_path, segment_age_s=1.0, clock=lambda: now[0])
    sp.append(lines(0, 3))
    assert sp.oldest() is None  # still open
    now[0] = 0.5
    sp.maintain()
    assert sp.oldest() is None
    now[0] = 1.1
    sp.maintain()
    seg = sp.oldest()
    assert seg is not None and seg.points == 3


def test_leftovers_replay_in_order_before_new_points(tmp_path: Path) -> None:
    sp = Spool(tmp_path, segment_bytes=150)
    sp.append(lines(0, 20))
    sp.append(lines(20, 25))  # stays in the open segment: simulate a crash (no close)
    del sp
    sp2 = Spool(tmp_path, segment_bytes=150)
    assert sp2.recovered == 25
    sp2.append(lines(25, 30))
    sp2.seal()
    assert drain(sp2) == lines(0, 30).splitlines()


def test_torn_last_line_is_dropped_and_counted(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append(lines(0, 5))
    path = next(tmp_path.glob("*.open"))
    with open(path, "ab") as f:
        f.write(b"m,host=h v=99i 9")  # the writer died mid-line
    sp2 = Spool(tmp_path)
    assert sp2.dropped == 1 and sp2.recovered == 5
    assert drain(sp2) == lines(0, 5).splitlines()


def test_nul_garbage_from_a_power_loss_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "0000000000000007.lp.open").write_bytes(lines(0, 2) + b"\x00" * 40 + b"\n" + lines(2, 3))
    sp = Spool(tmp_path)
    assert drain(sp) == lines(0, 3).splitlines()
    assert sp.dropped == 1


def test_bound_drops_oldest_segments_and_counts_points(tmp_path: Path) -> None:
    sp = Spool(tmp_path, segment_bytes=100, max_bytes=1000)
    for i in range(0, 500, 5):
        sp.append(lines(i, i + 5))
    sp.seal()
    assert sp.pending_bytes <= 1000
    assert sp.dropped > 0
    got = drain(sp)
    assert len(got) + sp.dropped == 500
    # What is left is the newest, still in order.
    assert got == lines(500 - len(got), 500).splitlines()


def test_bound_is_enforced_again_at_start(tmp_path: Path) -> None:
    sp = Spool(tmp_path, segment_bytes=100)
    for i in range(0, 200, 5):
        sp.append(lines(i, i + 5))
    sp.close()
    sp2 = Spool(tmp_path, segment_bytes=100, max_bytes=500)
    assert sp2.pending_bytes <= 500 and sp2.dropped > 0
    assert sp2.dropped + sp2.pending_points == 200


def test_in_flight_segment_is_never_dropped(tmp_path: Path) -> None:
    sp = Spool(tmp_path, segment_bytes=100, max_bytes=300)
    sp.append(lines(0, 5))
    sp.seal()
    seg = sp.oldest()
    assert seg is not None
    for i in range(5, 100, 5):
        sp.append(lines(i, i + 5))
        sp.maintain()
    assert sp.dropped > 0  # the bound was reached...
    assert seg.path.exists()  # ...but the segment the sender holds was kept
    sp.ack(seg)


def test_progress_after_partial_delivery_survives_a_restart(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append(lines(0, 10))
    sp.seal()
    seg = sp.oldest()
    assert seg is not None
    first = b"".join(sp.read(seg).splitlines(keepends=True)[:4])
    sp.advance(seg, len(first), 4)
    sp2 = Spool(tmp_path)
    assert sp2.pending_points == 6
    assert drain(sp2) == lines(4, 10).splitlines()


def test_a_progress_file_that_points_inside_a_line_sends_the_segment_again_whole(tmp_path: Path) -> None:
    """A .progress offset in the middle of a line (a damaged file) would send a torn line,
    which the server refuses with the valid rest: the segment goes again from its start."""
    sp = Spool(tmp_path)
    sp.append(lines(0, 8))
    sp.seal()
    seg = sp.oldest()
    assert seg is not None
    (tmp_path / f"{seg.seq:016d}.{seg.tag}.progress").write_text(f"{len(lines(0, 3)) + 5}\n")
    del sp
    assert drain(Spool(tmp_path)) == lines(0, 8).splitlines()


def test_a_disk_that_fills_mid_append_leaves_no_part_of_a_line(tmp_path: Path, monkeypatch: Any) -> None:
    """os.write takes half the lines, then the disk is full: those points are counted lost,
    the segment keeps only whole lines (nothing torn is sent), and once the disk takes
    points again the error is cleared."""
    import greend.stores.spool as spool_mod

    sp = Spool(tmp_path)
    sp.append(lines(0, 5))
    real_write, calls = os.write, {"n": 0}

    def full_disk(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[: len(data) // 2 + 3]))  # (mid-line)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "write", full_disk)
    assert sp.append(lines(5, 10)) == 0
    monkeypatch.setattr(spool_mod.os, "write", real_write)
    assert sp.dropped == 5 and "No space" in (sp.last_error or "")
    assert sp.append(lines(10, 12)) == 2 and sp.last_error is None
    sp.seal()
    sent = drain(sp)
    assert sent == lines(0, 5).splitlines() + lines(10, 12).splitlines()


def test_an_append_never_waits_for_a_slow_fsync(tmp_path: Path, monkeypatch: Any) -> None:
    """The sender thread's fsync (1 s here: NFS, a saturated disk) runs without the spool's
    lock: appends on the tick path go on meanwhile."""
    import threading

    import greend.stores.spool as spool_mod

    now = [0.0]
    sp = Spool(tmp_path, segment_age_s=1.0, clock=lambda: now[0])
    sp.append(lines(0, 3))
    real_fsync = os.fsync
    monkeypatch.setattr(spool_mod.os, "fsync", lambda fd: (time.sleep(1.0), real_fsync(fd))[1])
    now[0] = 2.0
    t = threading.Thread(target=sp.maintain)  # seals the aged segment: fsync, rename
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    for i in range(3, 30):
        sp.append(lines(i, i + 1))
    took = time.monotonic() - t0
    t.join()
    assert took < 0.5, took
    monkeypatch.setattr(spool_mod.os, "fsync", real_fsync)
    sp.seal()
    assert drain(sp) == lines(0, 30).splitlines()


def test_reject_moves_the_segment_aside(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append(lines(0, 3))
    sp.seal()
    seg = sp.oldest()
    assert seg is not None
    assert sp.reject(seg, "HTTP 400 bad line") == 3
    assert sp.rejected == 3 and sp.empty()
    kept = list((tmp_path / "rejected").glob("*.lp"))
    assert len(kept) == 1 and kept[0].read_bytes() == lines(0, 3)


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from greend.stores.spool import Spool
    sp = Spool(Path(sys.argv[1]), segment_bytes=4096)
    i = 0
    while True:
        sp.append(b"m,host=h v=%di %d\\n" % (i, i))
        print(i, flush=True)   # acknowledged: append() returned
        i += 1
    """
)


def test_sigkilled_writer_loses_no_acknowledged_point(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    acked = -1
    deadline = time.monotonic() + 10
    while acked < 3000 and time.monotonic() < deadline:
        acked = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    sp = Spool(tmp_path, segment_bytes=4096)
    got = [int(ln.split()[-1]) for ln in drain_after_seal(sp)]
    # Every acknowledged point is there, in order, no gaps, no duplicates.
    assert got[: acked + 1] == list(range(acked + 1))
    assert got == list(range(len(got)))


def drain_after_seal(sp: Spool) -> list[bytes]:
    sp.seal()
    return drain(sp)


def test_a_segment_being_sealed_is_pending_and_nothing_later_goes_out_before_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """seal() (a flush, on another thread) is slow on segment N while the sender seals N+1:
    N is still counted as pending, and N+1 is not handed out before N (order kept)."""
    import threading

    import greend.stores.spool as spool_mod

    now = [0.0]
    sp = Spool(tmp_path, segment_age_s=1.0, clock=lambda: now[0])
    sp.append(lines(0, 3))
    real_fsync, calls = os.fsync, {"n": 0}

    def first_slow(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(1.0)
        real_fsync(fd)

    monkeypatch.setattr(spool_mod.os, "fsync", first_slow)
    t = threading.Thread(target=sp.seal)  # segment N: its fsync takes a second
    t.start()
    time.sleep(0.2)
    sp.append(lines(3, 5))
    now[0] = 2.0
    sp.maintain()  # segment N+1, sealed at once
    assert not sp.empty() and sp.pending_points == 5
    assert sp.oldest() is None  # N+1 is listed, N not yet: nothing goes out of order
    t.join()
    assert drain(sp) == lines(0, 5).splitlines()
