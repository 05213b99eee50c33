"""``/metrics`` is safe to expose: loopback unless configured, no password in a label,
a read timeout, a connection cap, a scrape rate limit, optional basic auth and TLS.
Real sockets, real HTTP (urllib), a real TLS handshake with a certificate openssl made."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from greend.errors import ConfigError, StoreError
from greend.stores import check_url, redact_url
from greend.stores.prometheus import PrometheusStore


def _status() -> dict[str, Any]:
    return {
        "host": "node-1",
        "stores": [
            {"url": "influx://alice:hunter2@db:8086?org=o&bucket=b&token=tok123", "ok": True, "written": 3},
            {"url": "sqlite:///var/lib/greend/greend.db", "ok": True, "written": 5},
        ],
    }


@pytest.fixture
def stores() -> Iterator[list[PrometheusStore]]:
    opened: list[PrometheusStore] = []
    yield opened
    for s in opened:
        s.close()


def _open(stores: list[PrometheusStore], url: str, status: Any = _status) -> PrometheusStore:
    s = PrometheusStore(url, status)
    stores.append(s)
    return s


def _get(s: PrometheusStore, path: str = "/metrics", **headers: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_an_empty_host_listens_on_loopback_only(stores: list[PrometheusStore]) -> None:
    s = _open(stores, "prometheus://:0")
    assert s.addr == "127.0.0.1" and s._server.server_address[0] == "127.0.0.1"
    assert s.status().extra["listen"] == f"http://127.0.0.1:{s.port}/metrics"
    code, body = _get(s)
    assert code == 200 and b"greend_up 1.0" in body


def test_no_password_or_token_of_a_store_url_reaches_a_label(stores: list[PrometheusStore]) -> None:
    s = _open(stores, "prometheus://127.0.0.1:0")
    code, body = _get(s)
    assert code == 200
    text = body.decode()
    assert "hunter2" not in text and "tok123" not in text
    assert 'url="influx://alice:<secret>@db:8086?org=o&bucket=b&token=<secret>"' in text
    assert 'url="sqlite:///var/lib/greend/greend.db"' in text
    assert redact_url("influx://bob@h:1") == "influx://bob@h:1"


def test_a_silent_connection_is_closed_after_the_read_timeout(stores: list[PrometheusStore]) -> None:
    s = _open(stores, "prometheus://127.0.0.1:0?read_timeout_s=0.3")
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
        t0 = time.monotonic()
        assert c.recv(1024) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - t0 < 3.0
    assert s._server.open_connections() == 0 or _settles(lambda: s._server.open_connections() == 0)


def test_a_client_that_trickles_its_request_is_closed_after_the_read_timeout_in_all(
    stores: list[PrometheusStore],
) -> None:
    """A byte every 0.2 s keeps each read under a 0.5 s read timeout: the request head
    must still be in within 0.5 s of the accept, or the connection ends."""
    s = _open(stores, "prometheus://127.0.0.1:0?read_timeout_s=0.5")
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
        t0 = time.monotonic()
        closed = False
        c.sendall(b"GET /metrics HTTP/1.0\r\n")  # the request line at once, then its headers slowly
        for b in b"X-Slow: " + b"a" * 40:
            try:
                c.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - t0 > 3.0:
                break
        took = time.monotonic() - t0
        assert closed or c.recv(1024) == b"", "the server still reads a request that trickles"
        assert took < 3.0, took
    assert _get(s)[0] == 200


def _settles(cond: Any, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def test_connections_beyond_the_cap_take_the_place_of_idle_ones_and_scrapes_resume(
    stores: list[PrometheusStore],
) -> None:
    """Past max_connections, a new connection takes the place of the oldest that has sent
    no request yet (that one is closed): never more threads than the cap."""
    s = _open(stores, "prometheus://127.0.0.1:0?max_connections=4&read_timeout_s=1")
    threads_before = threading.active_count()
    # Four clients (loopback addresses of their own: one client may hold a quarter).
    held = [
        socket.create_connection(("127.0.0.1", s.port), timeout=5, source_address=(f"127.0.0.{2 + k}", 0))
        for k in range(4)
    ]
    assert _settles(lambda: s._server.open_connections() == 4)
    extra = [
        socket.create_connection(("127.0.0.1", s.port), timeout=5, source_address=(f"127.0.1.{k}", 0))
        for k in range(1, 21)
    ]
    for c in held + extra[:16]:
        assert c.recv(1024) == b""  # each made way for a newer one: closed
    assert s._server.evicted == 20 and s._server.refused == 0
    assert _settles(lambda: s._server.open_connections() == 4 and threading.active_count() <= threads_before + 4)
    for c in held + extra:
        c.close()
    assert _settles(lambda: s._server.open_connections() == 0)
    assert _get(s)[0] == 200


def test_one_client_holding_connections_keeps_no_other_client_s_scrape_out(stores: list[PrometheusStore]) -> None:
    """One address may hold a quarter of max_connections: a client that opens all it can,
    and opens them again as they time out, leaves the rest to the scrapers."""
    s = _open(stores, "prometheus://127.0.0.1:0?read_timeout_s=5")  # max_connections 8: 2 a client
    hog = [
        socket.create_connection(("127.0.0.1", s.port), timeout=5, source_address=("127.0.0.9", 0)) for _ in range(8)
    ]
    assert _settles(lambda: s._server.open_connections() == 2 and s._server.evicted == 6)  # (as accepted)
    assert _get(s)[0] == 200  # the scraper (127.0.0.1) is served meanwhile
    for c in hog:
        c.close()


def test_idle_connections_from_the_scraper_s_own_address_keep_no_scrape_out(stores: list[PrometheusStore]) -> None:
    """prometheus://:PORT listens on loopback only, so a local scraper shares 127.0.0.1 with
    every local user: two connections that send nothing, reopened as each timed out, kept
    every scrape out (20 of 20 failed). An idle connection makes way for a new one."""
    s = _open(stores, "prometheus://127.0.0.1:0?read_timeout_s=5")  # 2 a client
    idle = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(2)]
    assert _settles(lambda: s._server.open_connections() == 2)
    try:
        assert [_get(s)[0] for _ in range(3)] == [200] * 3
    finally:
        for c in idle:
            c.close()


def test_scrapes_beyond_the_rate_are_answered_429_without_reading_status(stores: list[PrometheusStore]) -> None:
    calls = []

    def status() -> dict[str, Any]:
        calls.append(1)
        return _status()

    s = _open(stores, "prometheus://127.0.0.1:0?max_scrapes_per_s=2", status)
    codes = [_get(s)[0] for _ in range(12)]
    assert codes.count(200) >= 2 and codes.count(429) >= 8, codes
    assert len(calls) == codes.count(200)  # a refused scrape costs no status()
    assert _settles(lambda: _get(s)[0] == 200, 1.1)  # served again within 1.1 s (one token: 0.5 s)


def test_back_to_back_scrapes_are_served_while_the_answered_connections_close(
    stores: list[PrometheusStore],
) -> None:
    # A client reads its whole answer (Content-Length) before the server's thread has
    # closed the connection; on a busy node that thread may lag. The connections already
    # answered must not count against the client's share: scrapes one after another were
    # closed unanswered (RemoteDisconnected) once two such threads lagged.
    s = _open(stores, "prometheus://127.0.0.1:0?max_scrapes_per_s=0")
    slow_close = s._server.shutdown_request

    def lagging(request: Any) -> None:
        if threading.current_thread() is not s._server.thread:  # a connection's own thread
            time.sleep(0.3)
        slow_close(request)

    s._server.shutdown_request = lagging  # type: ignore[method-assign]
    assert [_get(s)[0] for _ in range(6)] == [200] * 6
    assert s._server.stats()["connections_refused"] == 0


def test_basic_auth(stores: list[PrometheusStore], tmp_path: Path) -> None:
    auth = tmp_path / "metrics.auth"
    auth.write_text("# scrapers\nprom:s3cret\nother:sha256:" + __import__("hashlib").sha256(b"pw2").hexdigest() + "\n")
    auth.chmod(0o600)
    s = _open(stores, f"prometheus://127.0.0.1:0?basic_auth_file={auth}")

    def basic(user: str, pw: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()

    assert _get(s)[0] == 401
    assert _get(s, Authorization=basic("prom", "wrong"))[0] == 401
    assert _get(s, Authorization=basic("nobody", "s3cret"))[0] == 401
    assert _get(s, Authorization="Basic !!!")[0] == 401
    code, body = _get(s, Authorization=basic("prom", "s3cret"))
    assert code == 200 and b"greend_up 1.0" in body
    assert _get(s, Authorization=basic("other", "pw2"))[0] == 200
    assert s.status().extra["unauthorized"] == 4
    auth.chmod(0o644)
    with pytest.raises(StoreError, match="chmod 600"):
        PrometheusStore(f"prometheus://127.0.0.1:0?basic_auth_file={auth}", _status)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls(stores: list[PrometheusStore], tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    os.chmod(key, 0o600)
    s = _open(stores, f"prometheus://127.0.0.1:0?tls_cert={cert}&tls_key={key}")
    assert s.status().extra["listen"].startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    with urllib.request.urlopen(f"https://127.0.0.1:{s.port}/metrics", context=ctx, timeout=5) as r:
        assert r.status == 200 and b"greend_up 1.0" in r.read()
    # Plain HTTP to a TLS port: that connection fails, the server carries on, and nothing
    # is printed (a port scanner would fill the journal with tracebacks).
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=5).read()
        time.sleep(0.3)  # (the server's thread meets the failure after the client)
    assert "Traceback" not in err.getvalue(), err.getvalue()
    with urllib.request.urlopen(f"https://127.0.0.1:{s.port}/metrics", context=ctx, timeout=5) as r:
        assert r.status == 200
    with pytest.raises(StoreError, match="both tls_cert and tls_key"):
        PrometheusStore(f"prometheus://127.0.0.1:0?tls_cert={cert}", _status)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("prometheus://127.0.0.1:9464?bind=0.0.0.0", "unknown option 'bind'"),
        ("prometheus://127.0.0.1:9464?max_connections=0", "max_connections"),
        ("prometheus://127.0.0.1:9464?max_scrapes_per_s=abc", "max_scrapes_per_s"),
        ("prometheus://127.0.0.1", "HOST:PORT"),
    ],
)
def test_bad_options_are_refused_by_name(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_url(url)
