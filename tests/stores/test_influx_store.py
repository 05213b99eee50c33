"""InfluxStore against a real victoria-metrics, and against a scripted server for errors.

victoria-metrics answers 204 even to malformed lines, so the error
paths (400, 401, 404, 413, 429, 503) are tested against a small HTTP server of
our own that answers what each test scripts.
"""

from __future__ import annotations

import gzip
import http.server
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from greend.points import Point
from greend.stores.influx import InfluxStore, encode_points
from tests import vmserver
from tests.support import REPO, wait_for

FAST = {"backoff_min_s": 0.05, "backoff_max_s": 0.3, "segment_age_s": 0.1}


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vmserver.VmServer]:
    if not vmserver.available():
        pytest.skip(f"{vmserver.VM_BIN} is absent (apt-get install victoria-metrics)")
    # dedup off: a point sent twice must show up twice, so the tests can see it.
    server = vmserver.VmServer(tmp_path_factory.mktemp("vm"), dedup=False).start()
    yield server
    server.close()


def pts(run: str, a: int, b: int, t0_ms: int) -> list[Point]:
    """Points i in [a, b), 1 ms apart (victoria-metrics keeps milliseconds)."""
    return [
        Point("greend_test", {"run": run, "gpu": str(i % 2)}, {"v": float(i), "n": i}, (t0_ms + i) * 1_000_000)
        for i in range(a, b)
    ]


def now_ms() -> int:
    return time.time_ns() // 1_000_000 - 600_000  # ten minutes ago: well inside retention


# Line protocol ---------------------------------------------------------------------
def test_line_protocol_escapes_and_types() -> None:
    p = Point(
        "m x,y",
        {"zone": "a b,c=d", "empty": "", "job": "j"},
        {"f": 1.5, "i": 3, "b": True, "s": "no", "nan": float("nan"), "k y": 2.0},
        123,
    )
    line = encode_points([p], host="node-1").decode()
    assert line == r"m\ x\,y,host=node-1,job=j,zone=a\ b\,c\=d f=1.5,i=3i,b=true,k\ y=2.0 123" + "\n"
    assert encode_points([Point("m", {}, {"s": "only strings"}, 1)]) == b""
    # A line break in a tag (a job named "evil\n") is an escaped space: one valid line.
    broken = encode_points([Point("m\r", {"job": "evil\n", "run": "r1\n"}, {"v": 1.0}, 7)], host="h").decode()
    assert broken == r"m\ ,host=h,job=evil\ ,run=r1\  v=1.0 7" + "\n"
    # A backslash a reader could take for an escape is doubled (v2 line protocol: two read
    # as one); any other stays single, as every version reads it.
    slashes = encode_points([Point("m", {"job": "C:\\runs\\", "d": "a\\ b", "p": "C:\\x"}, {"v": 1.0}, 7)], host="h")
    assert slashes.decode() == r"m,d=a\\\ b,host=h,job=C:\runs\\,p=C:\x v=1.0 7" + "\n"
    assert (
        encode_points([Point("m", {"host": "mine"}, {"v": 1.0}, 5_000_000)], "other", "ms") == b"m,host=mine v=1.0 5\n"
    )


# Against victoria-metrics ----------------------------------------------------------
def test_points_land_with_their_values(vm: vmserver.VmServer, tmp_path: Path) -> None:
    run, t0, n = uuid.uuid4().hex[:8], now_ms(), 5000
    store = InfluxStore(vm.influx_url, state_dir=tmp_path, host="node-a", **FAST)
    for i in range(0, n, 500):
        store.write(pts(run, i, i + 500, t0))
    store.write(
        [Point("greend_test", {"run": run, "zone": "a b,c=d"}, {"flag": True, "note": "dropped"}, (t0 + n) * 1_000_000)]
    )
    # A policy's note: text alone, kept in SQLite by design; not counted as lost.
    store.write([Point("greend_decision", {"run": run, "kind": "note"}, {"reason": "measuring only"}, t0 * 1_000_000)])
    # A point with nothing line protocol can carry (a NaN alone): lost, counted.
    store.write([Point("greend_test", {"run": run}, {"v": math.nan}, t0 * 1_000_000)])
    assert store.flush(15)
    st = store.status()
    assert st.ok and st.written == n + 1 and st.pending == 0 and st.dropped == 1
    assert st.extra["fields_skipped"] == 3 and st.extra["spool_bytes"] == 0 and st.extra["text_only_points"] == 1
    store.close()
    got = vm.wait_samples("greend_test_v", n, run=run)
    assert got == [(t0 + i, float(i)) for i in range(n)]
    assert [v for _, v in vm.wait_samples("greend_test_n", n, run=run)] == [float(i) for i in range(n)]
    series = vm.export("greend_test_v", run=run)
    assert {m["host"] for m, _, _ in series} == {"node-a"}
    assert {m["gpu"] for m, _, _ in series} == {"0", "1"}
    flag = vm.export("greend_test_flag", run=run)
    assert flag[0][0]["zone"] == "a b,c=d" and flag[0][2] == [1]


# Job names as users write them: each a series of its own, its name as written but for
# what line protocol cannot hold (a line break is a space). A backslash before a
# separator once escaped it: the point was cut short, and lost without a word.
AWKWARD_JOBS = {
    "my job": "my job",
    "lr=3e-4,bs=64": "lr=3e-4,bs=64",
    'say "hi"': 'say "hi"',
    r"C:\runs\a": r"C:\runs\a",
    "ünïcödé-训练": "ünïcödé-训练",
    "two\nlines": "two lines",
    "ends\\": "ends\\",
    "=,\\ ": "=,\\ ",
    "a\\ b\\,c": "a\\ b\\,c",
}


def test_job_names_with_line_protocol_characters_land_as_written(vm: vmserver.VmServer, tmp_path: Path) -> None:
    run, t0 = uuid.uuid4().hex[:8], now_ms()
    store = InfluxStore(vm.influx_url, state_dir=tmp_path, host="node a,b", **FAST)
    names = list(AWKWARD_JOBS)
    store.write([Point("greend_test", {"run": run, "job": job}, {"v": float(i)}, (t0 + i) * 1_000_000)
                 for i, job in enumerate(names)])  # fmt: skip
    assert store.flush(15)
    st = store.status()
    assert st.written == len(names) and st.dropped == 0 and st.pending == 0, st
    store.close()
    vm.wait_samples("greend_test_v", len(names), run=run)
    got = {m["job"]: (m["host"], v) for m, _, v in vm.export("greend_test_v", run=run)}
    assert got == {AWKWARD_JOBS[job]: ("node a,b", [float(i)]) for i, job in enumerate(names)}


def test_outage_loses_nothing_and_duplicates_nothing(vm: vmserver.VmServer, tmp_path: Path) -> None:
    run, t0, n = uuid.uuid4().hex[:8], now_ms(), 3000
    store = InfluxStore(vm.influx_url, state_dir=tmp_path, host="node-b", **FAST)
    for i in range(0, 1000, 20):
        store.write(pts(run, i, i + 20, t0))
        time.sleep(0.002)
    vm.stop()  # the store goes away mid-run
    for i in range(1000, 2000, 20):
        store.write(pts(run, i, i + 20, t0))
        time.sleep(0.002)
    assert wait_for(lambda: "cannot reach" in (store.status().last_error or ""), 10)
    st = store.status()
    assert not st.ok and st.pending > 0 and "cannot reach" in (st.last_error or "")
    vm.start()  # same port, same data dir
    for i in range(2000, n, 20):
        store.write(pts(run, i, i + 20, t0))
        time.sleep(0.002)
    assert store.flush(20)
    st = store.status()
    assert st.ok and st.written == n and st.pending == 0 and st.dropped == 0
    store.close()
    got = vm.wait_samples("greend_test_v", n, run=run)
    assert len(got) == n  # no duplicates
    assert got == [(t0 + i, float(i)) for i in range(n)]


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from greend.points import Point
    from greend.stores.influx import InfluxStore
    url, state, run, t0 = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    store = InfluxStore(url, state_dir=state, host="node-c", backoff_min_s=0.05, backoff_max_s=0.3,
                      segment_age_s=0.1)
    def pts(a, b):
        return [Point("greend_test", {"run": run}, {"v": float(i)}, (t0 + i) * 1_000_000) for i in range(a, b)]
    store.write(pts(0, 500))
    assert store.flush(15)
    print("A", flush=True)
    sys.stdin.readline()          # the test stops the store now
    for i in range(500, 1500, 10):
        store.write(pts(i, i + 10))
    print("B", flush=True)        # every point above was acknowledged by write()
    time.sleep(60)
    """
)


def test_sigkilled_writer_during_outage_is_replayed(vm: vmserver.VmServer, tmp_path: Path) -> None:
    run, t0 = uuid.uuid4().hex[:8], now_ms()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, vm.influx_url, str(tmp_path), run, str(t0)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "A"
        vm.stop()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "B"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    vm.start()
    store = InfluxStore(vm.influx_url, state_dir=tmp_path, host="node-c", **FAST)
    assert store.status().extra["recovered"] == 1000
    assert store.flush(20)
    assert store.status().written == 1000
    store.close()
    got = vm.wait_samples("greend_test_v", 1500, run=run)
    assert got == [(t0 + i, float(i)) for i in range(1500)]


# Against a scripted server ---------------------------------------------------------
class Scripted:
    """An HTTP server answering a scripted list of (status, headers), then 204s."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str]]] = []
        self.max_lines: int | None = None  # answer 413 to bigger bodies
        self.bodies: dict[int, bytes] = {}  # a status's own body (plain text), else the v2 API's JSON
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                body = raw.decode().splitlines()
                with outer.lock:
                    if outer.max_lines is not None and len(body) > outer.max_lines:
                        status, headers = 413, {}
                    elif outer.script:
                        status, headers = outer.script.pop(0)
                    else:
                        status, headers = 204, {}
                    outer.requests.append(
                        {
                            "t": time.monotonic(),
                            "status": status,
                            "lines": body,
                            "path": self.path,
                            "auth": self.headers.get("Authorization"),
                        }
                    )
                payload = b"" if status == 204 else outer.bodies.get(status, b'{"code":"x","message":"scripted"}')
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "text/plain" if status in outer.bodies else "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        # A short poll: shutdown() returns within it, not within the default 0.5 s.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"influx://127.0.0.1:{self.port}?org=o1&bucket=b1"

    def delivered(self) -> list[str]:
        return [ln for r in self.requests if 200 <= r["status"] < 300 for ln in r["lines"]]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    s = Scripted()
    yield s
    s.close()


def values(lines: list[str]) -> list[int]:
    return [int(float(ln.split(" ")[1].split(",")[0].split("=")[1])) for ln in lines]


def test_retry_on_503_and_429_honours_retry_after_and_keeps_order(
    scripted: Scripted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GREEND_INFLUX_TOKEN", "s3cret")
    scripted.script = [(503, {}), (503, {}), (429, {"Retry-After": "1"})]
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    for i in range(0, 300, 100):
        store.write(pts("r", i, i + 100, 0))
        store._spool.seal()  # one segment per batch
    assert store.flush(10)
    store.close()
    assert [r["status"] for r in scripted.requests] == [503, 503, 429, 204, 204, 204]
    gap = scripted.requests[3]["t"] - scripted.requests[2]["t"]
    assert gap >= 0.9, f"Retry-After: 1 not honoured (retried after {gap:.2f} s)"
    assert values(scripted.delivered()) == list(range(300))
    r = scripted.requests[0]
    assert r["auth"] == "Token s3cret"
    q = parse_qs(urlsplit(r["path"]).query)
    assert urlsplit(r["path"]).path == "/api/v2/write"
    assert q["org"] == ["o1"] and q["bucket"] == ["b1"] and q["precision"] == ["ns"]


def test_400_sets_the_segment_aside_and_goes_on(scripted: Scripted, tmp_path: Path) -> None:
    scripted.script = [(400, {})]
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    store.write(pts("r", 0, 10, 0))
    store._spool.seal()
    store.write(pts("r", 10, 20, 0))
    assert store.flush(5)
    st = store.status()
    assert st.extra["rejected"] == 10 and st.written == 10 and st.pending == 0
    assert st.ok and "400" in (st.extra["last_rejected"] or "")  # remembered after the next success
    assert values(scripted.delivered()) == list(range(10, 20))
    kept = list((store.spool_dir / "rejected").glob("*.lp"))
    assert len(kept) == 1 and len(kept[0].read_text().splitlines()) == 10
    assert len(scripted.requests) == 2  # not retried
    store.close()


def test_a_server_refusing_a_backlog_is_logged_once_a_minute(
    scripted: Scripted, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server answering 400 to a backlog of segments logged one ERROR per segment (12
    lines in 2 s): one line now, the count since in the next one a minute later."""
    scripted.script = [(400, {})] * 6
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    with caplog.at_level(logging.ERROR, logger="greend.stores.influx"):
        for i in range(0, 60, 10):
            store.write(pts("r", i, i + 10, 0))
            store._spool.seal()
        assert store.flush(5)
        said = [r.getMessage() for r in caplog.records if "refused a segment" in r.getMessage()]
        assert store.status().extra["rejected"] == 60 and len(said) == 1, said
        store._reject_said_at -= 60.0  # a minute on
        scripted.script = [(400, {})]
        store.write(pts("r", 60, 70, 0))
        assert store.flush(5)
    said = [r.getMessage() for r in caplog.records if "refused a segment" in r.getMessage()]
    assert len(said) == 2 and "(5 more segment(s), 50 points, refused since the last line)" in said[1], said
    store.close()


def test_a_server_without_the_v2_write_api_is_named_as_such(scripted: Scripted, tmp_path: Path) -> None:
    """InfluxDB 1.6 (Debian's) answers /api/v2/write with Go's "404 page not found": the
    status blamed the token, org and bucket. It now says the server has no v2 write API."""
    scripted.script = [(404, {})] * 3
    scripted.bodies[404] = b"404 page not found\n"
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    store.write(pts("r", 0, 5, 0))
    deadline = time.monotonic() + 5
    while store.status().ok and time.monotonic() < deadline:
        time.sleep(0.01)
    error = store.status().last_error or ""
    assert "no InfluxDB v2 write API" in error and "token" not in error, error
    assert store.status().pending == 5
    store.close()


@pytest.mark.parametrize("code", [401, 403, 404])
def test_auth_errors_alert_and_keep_spooling(scripted: Scripted, tmp_path: Path, code: int) -> None:
    scripted.script = [(code, {})] * 3
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    store.write(pts("r", 0, 50, 0))
    deadline = time.monotonic() + 5
    while store.status().ok and time.monotonic() < deadline:
        time.sleep(0.01)
    st = store.status()
    assert not st.ok and "token/org/bucket wrong" in (st.last_error or "") and str(code) in (st.last_error or "")
    assert st.pending == 50 and st.dropped == 0
    store.write(pts("r", 50, 60, 0))  # still accepted into the spool
    assert store.flush(10)  # the operator fixed it: the script ran out, 204s now
    st = store.status()
    assert st.ok and st.last_error is None and st.written == 60
    assert values(scripted.delivered()) == list(range(60))
    store.close()


def test_413_splits_the_segment(scripted: Scripted, tmp_path: Path) -> None:
    scripted.max_lines = 64
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    store.write(pts("r", 0, 1000, 0))
    assert store.flush(10)
    store.close()
    ok = [r for r in scripted.requests if r["status"] == 204]
    assert all(len(r["lines"]) <= 64 for r in ok)
    assert values(scripted.delivered()) == list(range(1000))  # each once, in order
    assert store.status().written == 1000


def test_413_split_progress_survives_a_restart(scripted: Scripted, tmp_path: Path) -> None:
    scripted.max_lines = 100
    scripted.script = [(204, {}), (204, {}), (503, {})]  # the store dies after 2 pieces
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", backoff_min_s=30, segment_age_s=0.1)
    store.write(pts("r", 0, 400, 0))
    deadline = time.monotonic() + 5
    while not any(r["status"] == 503 for r in scripted.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    store.close(0.5)
    store2 = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    assert store2.flush(10)
    store2.close()
    assert values(scripted.delivered()) == list(range(400))


def test_no_server_spools_and_reports(tmp_path: Path) -> None:
    url = f"influx://127.0.0.1:{vmserver.free_port()}?org=o&bucket=b"
    store = InfluxStore(url, state_dir=tmp_path, host="h", **FAST)
    t = time.perf_counter()
    store.write(pts("r", 0, 100, 0))
    assert time.perf_counter() - t < 0.5  # never blocks on the network (nor waits for a connect)
    assert not store.flush(0.5)
    assert wait_for(lambda: "cannot reach" in (store.status().last_error or ""), 10)
    st = store.status()
    assert not st.ok and st.pending == 100 and "cannot reach" in (st.last_error or "")
    assert st.extra["spool_bytes"] > 0
    store.close(0.5)
    assert list(store.spool_dir.glob("*.lp"))  # left for the next start


def test_the_docs_whole_job_query_sums_the_nodes(vm: vmserver.VmServer, tmp_path: Path) -> None:
    """docs/stores.md's MetricsQL for a job across nodes, run as written on the rows two
    nodes' stores wrote: summed FLOPs over summed joules, not the mean of the nodes'."""
    import json as _json
    import re
    import urllib.parse
    import urllib.request

    from greend.points import job_point

    job = "whole-" + uuid.uuid4().hex[:8]
    ts = now_ms() * 1_000_000
    # Run r1 on two nodes; an earlier run r0 of the same id on node-a must not be summed in.
    shares = {("node-a", "r1"): (3e12, 100.0), ("node-b", "r1"): (3e12, 200.0), ("node-a", "r0"): (9e12, 50.0)}
    for (host, run), (flops, joules) in shares.items():
        store = InfluxStore(vm.influx_url, state_dir=tmp_path / f"{host}-{run}", host=host, **FAST)
        summary = {"flops": flops, "gpu_energy_j": joules, "steps": 50, "world_size": 2, "ranks_here": 1}
        point = job_point(ts, host, job=job, precision="bf16", end_reason="finished", summary=summary)
        point.tags["run"] = run  # as the daemon tags a job's points when it writes them
        store.write([point])
        assert store.flush(15)
        store.close()
    vm.wait_samples("greend_job_flops", 3, job=job)
    doc = (REPO / "docs" / "stores.md").read_text()
    block = doc.split("MetricsQL (VictoriaMetrics", 1)[1].split("```", 2)[1]
    query = re.sub(r"\s+", " ", block).strip().replace('"JOB"', f'"{job}"').replace('"RUN"', '"r1"')
    url = vm.http + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        result = _json.load(r)["data"]["result"]
    got = float(result[0]["value"][1])
    assert got == pytest.approx(6e12 / 300.0 / 1e9)  # 20 GFLOPS/W
    assert got != pytest.approx((3e12 / 100 + 3e12 / 200) / 2 / 1e9)  # the nodes' mean, 22.5: wrong


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("influx://h:8086?org=o&bucket=b&tsl=1", "unknown option tsl; expected org, bucket, tls"),
        ("influx://h:8086?org=o&bucket=b&precison=s", "unknown option precison"),
        ("influx://h:8086?org=o&bucket=b&token=SECRET", "give the token in $GREEND_INFLUX_TOKEN"),
        ("influx://alice:SECRET@h:8086?org=o&bucket=b", "credentials in the URL are not used"),
        ("influx://h:8086?org=o&bucket=b&tls=ture", "tls='ture'; expected 1 or 0"),
        ("influx://h:8086?org=o&bucket=b&verify=flase", "verify='flase'"),
        ("influx://h:8086?org=&bucket=b", "missing org"),
    ],
)
def test_a_url_option_greend_would_not_use_is_refused_and_no_secret_is_shown(url: str, needle: str) -> None:
    """A misspelt option (tsl=1: plain HTTP), a boolean that is none, a token or a password
    in the URL: refused, naming what is wrong, and the message shows no secret."""
    from greend.errors import ConfigError
    from greend.stores import check_url

    with pytest.raises(ConfigError) as e:
        check_url(url)
    assert needle in str(e.value) and "SECRET" not in str(e.value)


def test_an_auth_alert_gives_way_to_the_error_that_follows(scripted: Scripted, tmp_path: Path) -> None:
    """A 401 and then 500s: the status says what happens now (HTTP 500), not the token."""
    scripted.script = [(401, {})] + [(500, {})] * 200
    store = InfluxStore(scripted.url, state_dir=tmp_path, host="h", **FAST)
    store.write(pts("r", 0, 5, 0))
    deadline = time.monotonic() + 10
    # (the status, not the server's log: the server has answered a 500 a moment before the
    # store has read the answer)
    while time.monotonic() < deadline and "500" not in (store.status().last_error or ""):
        time.sleep(0.01)
    st = store.status()
    assert any(r["status"] == 500 for r in scripted.requests)
    assert not st.ok and "500" in (st.last_error or "") and "token" not in (st.last_error or ""), st.last_error
    scripted.script = []
    assert store.flush(10) and store.status().ok
    store.close()


def test_a_request_that_never_finishes_is_no_answer_in_status(tmp_path: Path) -> None:
    """A server that trickles its reply keeps each read under the timeout: a request in
    flight for over twice the timeout shows in status as not ok, saying so."""
    release = threading.Event()
    store = InfluxStore("influx://127.0.0.1:9?org=o&bucket=b", state_dir=tmp_path, host="h", timeout_s=0.2,
                        segment_age_s=0.01, post=lambda body, precision: release.wait(10))  # fmt: skip
    try:
        store.write(pts("r", 0, 5, 0))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and store.status().ok:
            time.sleep(0.02)
        st = store.status()
        assert not st.ok and "has not finished answering a request" in (st.last_error or "")
    finally:
        release.set()
        store.close()
    assert store.status().ok


def test_the_spool_is_shown_where_the_operator_configured_the_state_dir(tmp_path: Path) -> None:
    """The daemon reaches its state dir through a held descriptor (/proc/self/fd/N): the
    status names the directory as configured."""
    store = InfluxStore("influx://127.0.0.1:9?org=o&bucket=b", state_dir=tmp_path, host="h",
                        shown_state_dir=Path("/var/lib/greend"), post=lambda body, precision: None)  # fmt: skip
    try:
        assert store.status().extra["spool_dir"].startswith("/var/lib/greend/spool/influx-")
        assert store.spool_dir.is_relative_to(tmp_path)
    finally:
        store.close()
