"""The tick loop in-process: isolation of failing probes, the schedule, the ledger."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.config import Config
from greend.daemon.core import Daemon, ProbeStats
from greend.errors import ProbeError
from greend.points import Point
from greend.probes import CpuReading, ProbeInfo, Readings
from tests.support import wait_for
from tests.vmserver import free_port


class CountingProbe:
    """A probe whose zone burns exactly ``watts`` on the tick clock."""

    def __init__(self, name: str, watts: float) -> None:
        self.name = name
        self.watts = watts
        self.t0: float | None = None

    def open(self) -> None:
        pass

    def sample(self, now_s: float) -> Readings:
        if self.t0 is None:
            self.t0 = now_s
        e = (now_s - self.t0) * self.watts
        return Readings(cpus=[CpuReading(zone="package-0", path=self.name, source="test", energy_j=e)])

    def info(self) -> ProbeInfo:
        return ProbeInfo(self.name, True, "test")

    def close(self) -> None:
        pass


class BrokenProbe(CountingProbe):
    def sample(self, now_s: float) -> Readings:
        raise ProbeError("sensor on fire")


class ExplodingProbe(CountingProbe):
    def sample(self, now_s: float) -> Readings:
        raise ZeroDivisionError("bug in a probe")


def make_config(tmp_path: Path, *, hz: float = 50.0, sim_gpus: int = 0) -> Config:
    """An in-process daemon's config: temp socket, state dir and SQLite store, no probes
    but simulated GPUs when asked."""
    cfg = Config()
    cfg.daemon.state_dir = tmp_path / "state"
    cfg.daemon.socket = tmp_path / "g.sock"
    cfg.daemon.socket_group = ""
    cfg.daemon.hz = hz
    cfg.store.urls = [f"sqlite:///{tmp_path / 'g.db'}"]
    cfg.sim.gpus = sim_gpus
    cfg.probes.enabled = []
    return cfg


@pytest.fixture()
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(make_config(tmp_path))
    d.start()
    yield d
    d.close()


def test_failing_probes_never_stop_a_tick(daemon: Daemon) -> None:
    good = CountingProbe("good", 100.0)
    daemon.probes = [BrokenProbe("broken", 0), ExplodingProbe("exploding", 0), good]
    for p in daemon.probes:
        daemon.stats[p.name] = ProbeStats(p.name)
        daemon._try_open(p, first=True)
    daemon.run(max_ticks=20)
    st = daemon.status()
    by_name = {p["name"]: p for p in st["probes"]}
    assert by_name["good"]["success"] and by_name["good"]["samples"] == 20
    assert not by_name["broken"]["success"] and by_name["broken"]["failures"] == 20
    assert by_name["broken"]["last_error"] == "sensor on fire"
    assert "ZeroDivisionError" in by_name["exploding"]["last_error"]
    # 19 periods of 20 ms at 100 W.
    cpu = st["cpus"][0]
    assert cpu["energy_j"] == pytest.approx(100.0 * (daemon.snapshot.t_s - good.t0), rel=1e-9)


def test_schedule_is_drift_free_and_skips_overruns(daemon: Daemon) -> None:
    slow_once = {"done": False}
    starts: list[tuple[int, float]] = []  # (the tick's slot on the 20 ms grid, when it ran)

    class SlowProbe(CountingProbe):
        def sample(self, now_s: float) -> Readings:
            starts.append((daemon.ticks + daemon.ticks_skipped, now_s))
            if not slow_once["done"] and daemon.ticks == 5:
                slow_once["done"] = True
                time.sleep(0.1)  # five periods of 20 ms
            return super().sample(now_s)

    p = SlowProbe("slow", 1.0)
    daemon.probes = [p]
    daemon.stats["slow"] = ProbeStats("slow")
    daemon._try_open(p, first=True)
    daemon.run(max_ticks=30)
    assert daemon.ticks_skipped >= 4
    assert len(starts) == 30
    # Every tick runs on its slot of the grid laid at the start (never early), late only
    # by its own wake-up: no drift accumulates, so the late ticks are as close to their
    # slots as the early ones. One slow wake-up on a loaded machine is not drift: ask
    # that some of the last ten ticks ran within 10 ms of their slots.
    slot0, t_first = starts[0]
    late = [t - t_first - (slot - slot0) * 0.02 for slot, t in starts]
    assert min(late) > -0.002, late
    assert min(late[-10:]) < 0.01, late


def test_stop_event_ends_the_loop_promptly(daemon: Daemon) -> None:
    import threading

    daemon.cfg.daemon.hz = 1.0
    threading.Timer(0.2, daemon.stop).start()
    t0 = time.monotonic()
    daemon.run()
    assert time.monotonic() - t0 < 1.5


def test_samples_reach_the_sqlite_store(daemon: Daemon, tmp_path: Path) -> None:
    from greend.stores.sqlite import read_rows

    p = CountingProbe("zone", 10.0)
    daemon.probes = [p]
    daemon.stats["zone"] = ProbeStats("zone")
    daemon._try_open(p, first=True)
    daemon.cfg.store.interval_s = 0.05
    daemon.run(max_ticks=15)
    for s in daemon.stores.opened:
        assert s.flush(5.0)
    rows = read_rows(tmp_path / "g.db", "greend_cpu")
    assert len(rows) >= 4
    assert rows[-1]["energy_j"] > rows[0]["energy_j"]
    assert {r["probe"] for r in read_rows(tmp_path / "g.db", "greend_probe")} == {"zone"}


@pytest.mark.parametrize("hz, interval_s", [(10.0, 1.0), (50.0, 0.05), (10.0, 0.25)])
def test_store_points_keep_their_interval_whatever_the_jitter(daemon: Daemon, hz: float, interval_s: float) -> None:
    # Ticks wake up late by up to 40% of a period, at random: the store still gets one
    # batch per interval on average, never two within half an interval.
    import random

    rng = random.Random(3)
    daemon.cfg.daemon.hz, daemon.cfg.store.interval_s = hz, interval_s
    emitted: list[float] = []
    daemon.emit = lambda points: (
        emitted.append(now)
        if any(  # type: ignore[method-assign]
            p.measurement == "greend_probe" for p in points
        )
        else None
    )
    daemon.probes = [CountingProbe("zone", 1.0)]
    daemon.stats["zone"] = ProbeStats("zone")
    span_s = 200 * interval_s
    for k in range(int(span_s * hz)):
        now = k / hz + rng.uniform(0.0, 0.4) / hz
        daemon.tick(now)
    assert len(emitted) == pytest.approx(span_s / interval_s, abs=1)
    gaps = [b - a for a, b in zip(emitted, emitted[1:])]
    assert min(gaps) > interval_s / 2


def test_a_job_on_two_gpus_is_reported_per_gpu(tmp_path: Path) -> None:
    # One rank on GPUs 0 and 1, another job's rank on GPU 2: each GPU's joules and
    # its share of the FLOPs, summing to the job's figures.
    import threading

    from greend.ipc.client import Client
    from greend.ipc.server import encode

    def send_steps(c: Client, step: int, flops: float) -> None:  # steps get no reply
        now = time.monotonic()
        assert c._sock is not None
        c._sock.sendall(
            encode({"v": 1, "op": "steps", "steps": [{"step": step, "t0_s": now - 0.01, "t1_s": now, "flops": flops}]})
        )

    cfg = make_config(tmp_path, hz=20.0, sim_gpus=3)
    d = Daemon(cfg)
    d.start()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        assert wait_for(lambda: d.ledger.last_time("gpu2") is not None, 5)  # the GPUs' first tick
        with Client(cfg.daemon.socket) as a, Client(cfg.daemon.socket) as b:
            a.request("register", job="two", gpus=[0, 1])
            b.request("register", job="other", gpus=[2])
            t0 = time.monotonic()
            for i in range(20):
                send_steps(a, i, 4e12)
                send_steps(b, i, 1e12)
                time.sleep(0.03)
            assert time.monotonic() - t0 > 0.5  # steps over ten ticks or more
            assert wait_for(lambda: a.request("report", job="two")["steps"] == 20, 5)  # a tick after the last step
            rep = a.request("report", job="two")
        per = {g["gpu"]: g for g in rep["per_gpu"]}
        assert sorted(per) == [0, 1]
        assert per[0]["flops"] == per[1]["flops"] == pytest.approx(20 * 2e12)
        assert per[0]["energy_j"] + per[1]["energy_j"] == pytest.approx(rep["gpu_energy_j"], rel=1e-9)
        for g in (0, 1):
            e = d.ledger.energy_between(f"gpu{g}", rep["window"]["t0_s"], rep["window"]["t1_s"], clamp=True)
            assert per[g]["energy_j"] == pytest.approx(e, rel=1e-9)
            assert per[g]["gflops_per_w"] == pytest.approx(per[g]["flops"] / e / 1e9, rel=1e-9)
        assert rep["gpu_energy_per_step_j"] == pytest.approx(rep["gpu_energy_j"] / 20, rel=1e-9)
    finally:
        d.stop()
        t.join(5)
        d.close()


def test_points_written_while_a_store_has_not_opened_are_held_and_written_once_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that cannot open yet (its file read-only, its disk not mounted): the points
    of the ticks meanwhile were dropped without a count (status said dropped 0, and a job
    that ran then was in no store). They are held, shown pending, and written once it
    opens; past HOLD_POINTS the oldest are dropped and counted."""
    import sqlite3

    import greend.daemon.stores as stores_mod
    from greend.errors import StoreError

    real_open = stores_mod.open_store
    can_open = False

    def late_open(url: str, **kw: object) -> object:
        if not can_open:
            raise StoreError("disk not there yet")
        return real_open(url, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(stores_mod, "open_store", late_open)
    monkeypatch.setattr(stores_mod, "HOLD_POINTS", 40)
    db = tmp_path / "late.db"
    cfg = make_config(tmp_path)
    # (Prometheus serves the latest status, not points: nothing is held for it)
    cfg.store.urls = [f"sqlite:///{db}", f"prometheus://127.0.0.1:{free_port()}"]
    cfg.store.retry_s = 0.05
    d = Daemon(cfg)
    d.open_stores()
    try:
        now_ns = time.time_ns()
        points = [Point("greend_test", {"k": "v"}, {"i": i}, now_ns + i) for i in range(50)]
        d.stores.write(points[:30])
        row, prom = d.status()["stores"]
        assert not row["ok"] and row["pending"] == 30 and row["dropped"] == 0, row
        d.stores.write(points[30:])
        row, prom = d.status()["stores"]
        assert row["pending"] == 40 and row["dropped"] == 10, row
        assert not prom["ok"] and prom["pending"] == 0 and prom["dropped"] == 0, prom
        can_open = True
        time.sleep(0.06)
        d.stores.retry_due(d.monotonic())
        assert wait_for(lambda: len(d.stores.opened) == 2, 5)
        store = next(s for s in d.stores.opened if s.url.startswith("sqlite"))
        assert store.flush(5)  # type: ignore[attr-defined]  # (the SQLite store's own)
        row, prom = d.status()["stores"]
        assert row["ok"] and row["written"] == 40 and row["dropped"] == 10, row
        assert prom["ok"] and prom["dropped"] == 0, prom
    finally:
        d.close()
    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        table = next(t for t in tables if "test" in t)
        assert con.execute(f"SELECT COUNT(*) FROM {table}").fetchone() == (40,), tables


def test_a_store_that_failed_to_open_is_retried_off_the_tick_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first open fails; the retry, due store_retry_s later, blocks (a slow disk):
    # the ticks go on meanwhile, and the store joins the others once it opens.
    import threading

    import greend.daemon.stores as stores_mod
    from greend.errors import StoreError

    real_open = stores_mod.open_store
    calls: list[str] = []
    release = threading.Event()

    def flaky_open(url: str, **kw: object) -> object:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise StoreError("disk not there yet")
        release.wait(10)
        return real_open(url, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(stores_mod, "open_store", flaky_open)
    url = f"sqlite:///{tmp_path / 'late.db'}"
    cfg = make_config(tmp_path)
    cfg.store.urls = [url]
    cfg.store.retry_s = 0.2
    d = Daemon(cfg)
    d.open_stores()
    try:
        assert d.stores.opened == []
        (row,) = d.status()["stores"]
        assert row["url"] == url and not row["ok"] and row["open_attempts"] == 1
        assert "disk not there yet" in row["last_error"] and "retrying every 0.2 s" in row["last_error"]
        d.tick(d.monotonic())  # not due yet
        assert len(calls) == 1
        time.sleep(0.25)
        t = time.monotonic()
        for _ in range(5):
            d.tick(d.monotonic())
        assert time.monotonic() - t < 1.0, "a tick waited for a store to open"
        assert wait_for(lambda: len(calls) == 2, 2)
        assert calls[1] == "greend-store-retry" and d.stores.opened == []
        release.set()
        assert wait_for(lambda: len(d.stores.opened) == 1, 5)
        (row,) = d.status()["stores"]
        assert row["ok"] and row["name"] == "sqlite" and "open_attempts" not in row
        d.tick(d.monotonic())
        assert len(calls) == 2, "an open store is not opened again"
    finally:
        release.set()
        d.close()


def test_a_hung_tick_starves_the_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # systemd restarts a daemon whose WATCHDOG=1 pings stop: they must come from the tick
    # loop itself, so a probe stuck in a driver call stops them (no helper thread pings).
    import socket as socketlib
    import threading

    ns = tmp_path / "notify.sock"
    rx = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    rx.bind(str(ns))
    monkeypatch.setenv("NOTIFY_SOCKET", str(ns))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # pings every 0.1 s
    stuck = threading.Event()
    release = threading.Event()

    class StuckProbe(CountingProbe):
        def sample(self, now_s: float) -> Readings:
            if stuck.is_set():
                release.wait(10)  # a driver call that does not come back
            return super().sample(now_s)

    d = Daemon(make_config(tmp_path, hz=20.0))
    assert d.watchdog.enabled
    p = StuckProbe("zone", 1.0)
    d.probes = [p]
    d.stats["zone"] = ProbeStats("zone")
    d._try_open(p, first=True)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()

    def pings(seconds: float, enough: int | None = None) -> int:
        """WATCHDOG=1 pings received within ``seconds`` (sooner once ``enough`` came)."""
        rx.settimeout(0.05)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end and (enough is None or n < enough):
            try:
                n += rx.recv(4096).decode().splitlines().count("WATCHDOG=1")
            except TimeoutError:
                pass
        return n

    try:
        assert pings(1.0, enough=3) >= 3  # a healthy loop pings (every 0.1 s)
        stuck.set()
        pings(0.2)  # what was sent before the probe got stuck
        assert pings(0.8) == 0, "pings went on while the tick loop was stuck"  # 8 intervals
        stuck.clear()
        release.set()
        assert pings(1.0, enough=3) >= 3  # and resume when it comes back
    finally:
        release.set()
        d.stop()
        t.join(5)
        d.close()
        rx.close()


def test_a_stale_gpu_reading_stands_in_but_books_no_energy(daemon: Daemon) -> None:
    """A GPU whose read is still out stands in the snapshot with its last reading,
    marked stale; the ledger books nothing from it, so the late read's energy is spread
    over the ticks it spans (priced as it flowed), and counted once."""
    from greend.probes import GpuReading

    plan = [(0.0, None), (0.0, 0.1), (0.0, 0.2), (300.0, None)]  # (energy J, stale_s) per tick

    class LateGpu(CountingProbe):
        def sample(self, now_s: float) -> Readings:
            energy_j, stale_s = plan[int(now_s)]
            return Readings(gpus=[GpuReading(0, "g", "GPU-x", "nvml", energy_j, "counter", stale_s=stale_s)])

    p = LateGpu("nvml", 0.0)
    daemon.probes = [p]
    daemon.stats["nvml"] = ProbeStats("nvml")
    daemon._try_open(p, first=True)
    for t in range(3):
        daemon.tick(float(t))
    assert daemon.status()["gpus"][0]["stale_s"] == 0.2
    daemon.tick(3.0)
    assert daemon.status()["gpus"][0]["stale_s"] is None
    assert daemon.ledger.total_j("gpu0") == 300.0
    assert daemon.ledger.cumulative_at("gpu0", 1.5) == pytest.approx(150.0)  # not 0: no flat stretch


def test_a_job_that_counts_no_flops_under_efficient_never_takes_the_daemon_down(tmp_path: Path) -> None:
    """Rows with flops 0 ("not counted", as the protocol allows) gave the efficient policy
    an infinite time per FLOP, and the daemon a NaN pace to push to the job's ranks: the
    push could not be encoded and the exception ended the daemon's loop. Now such a job is
    left uncapped, no pace is pushed for it, and the daemon answers throughout."""
    import threading

    from greend.ipc.client import Client
    from greend.ipc.server import encode

    cfg = make_config(tmp_path, hz=20.0, sim_gpus=1)
    cfg.policy.name = "efficient"
    d = Daemon(cfg)
    d.start()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        assert wait_for(lambda: d.ledger.last_time("gpu0") is not None, 5)
        with Client(cfg.daemon.socket) as c:
            c.request("register", job="noflops", gpus=[0])
            assert c._sock is not None
            for i in range(10):
                now = time.monotonic()
                row = {"first_step": 10 * i, "last_step": 10 * i + 9, "steps": 10, "t0_s": now - 0.3,
                       "t1_s": now - 0.01, "busy_s": 0.29, "busy_sq_s2": 0.0085, "flops": 0.0}  # fmt: skip
                c._sock.sendall(encode({"v": 1, "op": "intervals", "rows": [row]}))
                time.sleep(0.1)
            assert wait_for(lambda: c.request("report", job="noflops")["steps"] == 100, 5)
            ticks = d.ticks
            assert wait_for(lambda: d.ticks > ticks + 5, 5)  # still ticking
            st = c.request("status")
            assert any(j.get("job") == "noflops" for j in st["jobs"])  # status answers
            # Not steered: time per FLOP, what the policy compares, is unknown (it was capped
            # at 720 MHz, a search that could not end).
            assert st["gpus"][0]["clock_cap_mhz"] is None
            assert "not steered: no FLOPs reported" in json.dumps(st["policy"])
        assert t.is_alive() and d.tick_errors == 0 and d.control.last_error is None
    finally:
        d.stop()
        t.join(5)
        d.close()


def test_a_tick_that_raises_is_logged_and_the_next_tick_runs(daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    step = daemon.control.step
    calls = {"n": 0}

    def failing_once(now_s: float) -> None:
        calls["n"] += 1
        if calls["n"] in (3, 4):
            raise RuntimeError("a bug met by one tick")
        step(now_s)

    daemon.control.step = failing_once  # type: ignore[method-assign]  # a fault in place of the real step
    with caplog.at_level("ERROR"):
        daemon.run(max_ticks=10)
    assert daemon.ticks == 10 and daemon.tick_errors == 2 and calls["n"] == 10
    # The same error twice is logged once; status and greenctl status say so.
    assert sum("a tick failed" in r.getMessage() for r in caplog.records) == 1
    st = daemon.status()
    assert st["tick_errors"] == 2 and st["last_tick_error"] == "RuntimeError: a bug met by one tick"
    from greend.cli.render import render_status

    assert "2 tick(s) failed; the last: RuntimeError: a bug met by one tick" in render_status(st)


def test_turning_the_precision_policy_off_asks_the_jobs_back_to_their_own_level(tmp_path: Path) -> None:
    """`greenctl policy set ... --precision none` takes back what the precision policy set."""
    d = Daemon(make_config(tmp_path, sim_gpus=1))
    try:
        asked: list[tuple[str, str]] = []
        d.control.ctx.jobs.back_to_own_levels = lambda reason, policy: asked.append((reason, policy)) or []  # type: ignore[method-assign]  # a recorder in the table's place
        d.control.set_precision_policy("precision", {})  # none before: nothing to take back
        state = d.control.precision_state
        d.control.set_precision_policy("precision", {})  # the same again: it goes on as it was
        assert asked == [] and d.control.precision_state is state
        d.control.set_precision_policy("none", {})
        assert d.control.precision_policy is None
        assert asked == [("precision policy changed to none: back to the job's own level", "none")]
    finally:
        d.close()


def test_a_pace_the_ranks_could_not_send_back_is_not_pushed(tmp_path: Path) -> None:
    """A simulated GPU's step can be shorter than op "pace" takes (1e-9 s): pushed anyway,
    each rank's agreed pace came back refused, with a warning on every rank. Such a pace
    is not pushed; a floor out of range goes as none."""
    from greend.policies.base import Decision

    d = Daemon(make_config(tmp_path, sim_gpus=1))
    try:
        pushed: list[tuple[str, dict]] = []
        d.control.ctx.jobs.push = lambda job, event: pushed.append((job, event)) or 1  # type: ignore[method-assign]  # a recorder in the table's place

        def decide(tpf: float, floor_tpf: float | None = None, ask: object = 0) -> None:
            details = {"baseline_time_per_flop_s": tpf, "flops_per_step": 1e3, "floor_time_per_flop_s": floor_tpf}
            d.control._push_paces(Decision(details={"jobs": {"j": details | {"recheck_at": ask}}}))

        decide(6.55e-16)  # a 6.55e-13 s step: below op "pace"'s 1e-9
        assert pushed == []
        decide(1e-6, floor_tpf=1e-16)  # a 1 ms step, a floor below the bound
        assert pushed == [("j", {"event": "local_pace", "step_s": pytest.approx(1e-3), "recheck_at": 0})]
        decide(1e-6, floor_tpf=1e-16)  # (the same again: not pushed again)
        decide(1e-6, floor_tpf=1e-16, ask=2106)  # a re-check asked: pushed, the pace the same
        decide(1e-6, floor_tpf=1e-16, ask=-3)  # (not a job step: none)
        assert [e.get("recheck_at") for _, e in pushed] == [0, 2106, 0]
    finally:
        d.close()


def test_greenctl_status_says_the_points_a_store_rejected(daemon: Daemon) -> None:
    """A store whose server refused points as malformed (InfluxDB's 400s): the text status
    says how many were set aside and the last reason; it read 'dropped 0' with nothing else."""
    from greend.cli.render import render_status

    st = daemon.status()
    influx = {"url": "http://127.0.0.1:8086", "ok": True, "written": 1536, "pending": 0, "dropped": 0}
    st["stores"] = [*st["stores"], {**influx, "rejected": 78, "last_rejected": "400 Bad Request: a field type"}]
    text = render_status(st)
    assert "(written 1536, pending 0, dropped 0, rejected 78)" in text
    assert "last rejected: 400 Bad Request: a field type" in text


def test_an_energy_span_that_ends_before_it_starts_is_refused_by_name(daemon: Daemon) -> None:
    """(it answered null, as for a span with no readings)"""
    from greend.errors import RequestRefused
    from greend.ipc.client import Client

    with Client(daemon.cfg.daemon.socket) as c:
        with pytest.raises(RequestRefused, match="t1_s is before t0_s"):
            c.request("energy", key="gpu0", t0_s=10.0, t1_s=5.0)
        assert "energy_j" in c.request("energy", key="gpu0", t0_s=5.0, t1_s=10.0)
