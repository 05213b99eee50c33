"""The HTTP side of the Prometheus store: a small server for ``/metrics`` that is safe to
put on a network.

It serves what prometheus-client renders, but unlike the client's own
``start_http_server`` it is bounded: at most ``max_connections`` connections awaiting their answer at once, and a
quarter of them from one client address (one more takes the place of the oldest that has sent no request yet, else it is
closed at once), a read timeout on every connection (a client that opens
one and sends nothing is dropped after ``read_timeout_s``), one request a connection,
and at most ``max_scrapes_per_s`` renders a second (more are answered ``429`` at once,
without reading the daemon's status): a flood of scrapes costs the daemon a bounded
amount of work, so its tick keeps time. Optional HTTP basic auth (users and passwords
from a file only root reads) and TLS (a certificate and key, the stdlib's ``ssl``),
after the exporter-toolkit's web config.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from greend.errors import StoreError

__all__ = ["MetricsHttpOptions", "MetricsServer", "read_basic_auth_file"]

log = logging.getLogger(__name__)
SHUTDOWN_POLL_S = 0.1  # how often the serving thread looks for a stop (a select timeout, as often as a tick)


@dataclass(frozen=True)
class MetricsHttpOptions:
    """How ``/metrics`` is served (the ``prometheus://`` URL's host, port and query)."""

    addr: str = "127.0.0.1"
    port: int = 9464
    max_connections: int = 8
    read_timeout_s: float = 5.0
    max_scrapes_per_s: float = 10.0  # 0: no limit
    basic_auth: dict[str, bytes] = field(default_factory=dict)  # user -> sha256 of the password
    tls_cert: str | None = None
    tls_key: str | None = None


def per_client(max_connections: int) -> int:
    """The connections one client address may hold at once: a quarter of the whole (2 of
    the default 8), at least 1. A Prometheus server scrapes one at a time."""
    return max(1, max_connections // 4)


def _host(client_address: Any) -> Any:
    return client_address[0] if isinstance(client_address, tuple) and client_address else client_address


def read_basic_auth_file(path: Path) -> dict[str, bytes]:
    """Users and passwords for basic auth: one ``user:password`` a line (or
    ``user:sha256:HEX``, the hex SHA-256 of the password; ``#`` starts a comment). The
    file holds secrets: one that its group or others may read is refused."""
    try:
        st = os.stat(path)
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise StoreError(f"prometheus store: cannot read basic_auth_file {path}: {e.strerror or e}") from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StoreError(
            f"prometheus store: basic_auth_file {path} is readable by its group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); it holds passwords: chmod 600 {path}"
        )
    users: dict[str, bytes] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, secret = line.partition(":")
        if not sep or not user or not secret:
            raise StoreError(f"prometheus store: {path} line {n}: expected user:password or user:sha256:HEX")
        if secret.startswith("sha256:"):
            try:
                digest = bytes.fromhex(secret[7:])
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise StoreError(f"prometheus store: {path} line {n}: sha256: takes 64 hex digits")
        else:
            digest = hashlib.sha256(secret.encode()).digest()
        users[user] = digest
    if not users:
        raise StoreError(f"prometheus store: basic_auth_file {path} names no user (one user:password a line)")
    return users


class _Bucket:
    """Renders allowed: ``rate`` a second, a burst of one second's worth (at least one)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.cap = max(1.0, rate)
        self.tokens = self.cap
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> bool:
        if self.rate <= 0:
            return True
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.cap, self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens < 1.0:
                return False
            self.tokens -= 1.0
            return True


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.0"  # one request a connection: nobody holds one open between scrapes
    server_version = "greend"
    sys_version = ""

    def setup(self) -> None:
        # (self.timeout: the server's read_timeout_s, set on its handler class, for every read)
        # The whole request head (and a TLS handshake) within read_timeout_s of the accept, not
        # only each read: a client that trickles a byte now and then would hold its slot for good.
        # (MetricsServer.service_actions ends one past its deadline.)
        self.server.head_due(self.request, float(self.timeout or 10.0), _host(self.client_address))
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()  # in this connection's thread, under its timeout
        super().setup()

    def parse_request(self) -> bool:
        ok = super().parse_request()  # (reads the headers too: the deadline covers them)
        self.server.head_in(self.request)
        return ok

    def finish(self) -> None:
        self.server.head_in(self.request)
        super().finish()

    def end_headers(self) -> None:
        # Answered: the connection leaves the count before its client can have read the
        # answer, so a scraper that asks again at once finds its place free (the thread
        # that closes this one may lag on a busy node). What is left, writing the answer,
        # is bounded by the socket timeout (read_timeout_s covers the whole send).
        self.server.answered(self.request)
        super().end_headers()

    def handle(self) -> None:
        try:
            super().handle()
        except (OSError, ssl.SSLError):
            pass  # a client gone, timed out or speaking no TLS: its connection alone

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.client_address[0], *args)

    def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8", **headers: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self) -> bool:
        users = self.server.opts.basic_auth
        if not users:
            return True
        raw = self.headers.get("Authorization", "")
        scheme, _, value = raw.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        want = users.get(user)
        got = hashlib.sha256(password.encode()).digest()
        return hmac.compare_digest(got, want if want is not None else b"\0" * 32) and want is not None

    def do_GET(self) -> None:
        srv = self.server
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self._send(404, b"greend serves /metrics\n")
            return
        if not self._authorized():
            srv.unauthorized += 1
            self._send(401, b"unauthorized\n", WWW_Authenticate='Basic realm="greend"')
            return
        if path == "/":
            self._send(200, b'<html><body><a href="/metrics">/metrics</a></body></html>\n', "text/html")
            return
        if not srv.bucket.take():
            srv.limited += 1
            self._send(429, b"too many scrapes ([max_scrapes_per_s] of the prometheus store URL)\n", Retry_After="1")
            return
        try:
            body, ctype = srv.render()
        except Exception as e:  # the collector already turns a failing status into greend_up 0
            log.warning("metrics: rendering failed: %s: %s", type(e).__name__, e)
            self._send(500, b"rendering the metrics failed\n")
            return
        srv.scrapes += 1
        self._send(200, body, ctype)

    do_HEAD = do_GET


def _peer(client_address: Any) -> str:
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else str(client_address)


class MetricsServer(ThreadingHTTPServer):
    """Serves ``render()`` at ``/metrics`` within :class:`MetricsHttpOptions`' bounds."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, opts: MetricsHttpOptions, render: Callable[[], tuple[bytes, str]]) -> None:
        self.opts = opts
        self.render = render
        self.bucket = _Bucket(opts.max_scrapes_per_s)
        self._conns: dict[Any, Any] = {}  # connection -> its host: those not answered yet
        self._by_client: dict[Any, int] = {}  # the same, counted per client address
        self._heads: dict[Any, tuple[float, Any]] = {}  # connection -> (when its request head is due, its host)
        self._open_lock = threading.Lock()
        self.scrapes = self.limited = self.unauthorized = self.refused = self.evicted = 0
        self.ssl_context: ssl.SSLContext | None = None
        if opts.tls_cert or opts.tls_key:
            if not (opts.tls_cert and opts.tls_key):
                raise StoreError("prometheus store: TLS needs both tls_cert and tls_key")
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
            except (OSError, ssl.SSLError) as e:
                raise StoreError(
                    f"prometheus store: cannot load tls_cert {opts.tls_cert} / tls_key {opts.tls_key}: {e}"
                ) from e
            self.ssl_context = ctx
        if ":" in opts.addr:
            self.address_family = socket.AF_INET6
        # Every read of a connection times out after read_timeout_s (StreamRequestHandler.timeout).
        handler = type("_TimedHandler", (_Handler,), {"timeout": opts.read_timeout_s})
        super().__init__((opts.addr, opts.port), handler)
        # Polled for shutdown every SHUTDOWN_POLL_S (serve_forever's 0.5 s default held every
        # stop of the daemon, and of each test's, for up to half a second).
        self.thread = threading.Thread(
            target=self.serve_forever, args=(SHUTDOWN_POLL_S,), name="metrics-http", daemon=True
        )

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        if self.ssl_context is not None:  # the handshake runs in the connection's thread, under its timeout
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        host = _host(client_address)
        victim = None
        with self._open_lock:
            mine = self._by_client.get(host, 0)
            over_mine = mine >= per_client(self.opts.max_connections)
            full = len(self._conns) >= max(1, self.opts.max_connections) or over_mine
            if full:
                # A connection that has sent no request head yet makes way for the new one (the
                # oldest; of the same client where that client is over its share): two idle
                # connections from 127.0.0.1, reopened as each timed out, kept every local
                # scraper out.
                idle = [(due, r) for r, (due, h) in self._heads.items() if not over_mine or h == host]
                if idle:
                    victim = min(idle, key=lambda x: x[0])[1]
                    del self._heads[victim]
                    full = False
            if not full:
                self._conns[request] = host
                self._by_client[host] = mine + 1
        if victim is not None:
            self.evicted += 1
            try:
                victim.shutdown(socket.SHUT_RDWR)  # its reads fail at once; its thread ends
            except OSError:
                pass
        if full:
            # Over max_connections, or over one client's share of them (a client that holds
            # them all, reconnecting as each times out, would keep every scrape out): closed
            # at once, no thread.
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.answered(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.answered(request)

    def answered(self, request: Any) -> None:
        """``request`` no longer counts against the bounds (its answer is being written, or
        its connection ended); once only, however often it is called."""
        with self._open_lock:
            if request not in self._conns:
                return
            host = self._conns.pop(request)
            left = self._by_client.get(host, 1) - 1
            if left > 0:
                self._by_client[host] = left
            else:
                self._by_client.pop(host, None)

    def head_due(self, request: Any, within_s: float, host: Any = None) -> None:
        """The connection ``request`` (from ``host``) must have sent its request head within
        ``within_s``; until it has, a new connection may take its place."""
        with self._open_lock:
            self._heads[request] = (time.monotonic() + within_s, host)

    def head_in(self, request: Any) -> None:
        with self._open_lock:
            self._heads.pop(request, None)

    def service_actions(self) -> None:
        """Each poll of the serving loop: connections whose request head is late are ended
        (their reads fail at once), so a client that trickles a byte now and then cannot
        hold a connection, and the scrapes behind it, for good."""
        now = time.monotonic()
        with self._open_lock:
            late = [r for r, (due, _) in self._heads.items() if due <= now]
            for r in late:
                del self._heads[r]
        for r in late:
            try:
                r.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed outside its handler's own handling (a client speaking no
        TLS to a TLS port, a handshake that timed out): that connection alone, logged at
        debug, not a traceback on the journal for every port scan."""
        log.debug("metrics %s: connection failed", _peer(client_address), exc_info=True)

    def open_connections(self) -> int:
        """Connections being served now and not answered yet."""
        return len(self._conns)

    def stats(self) -> dict[str, int]:
        return {
            "scrapes": self.scrapes,
            "scrapes_limited": self.limited,
            "unauthorized": self.unauthorized,
            "connections_refused": self.refused,
            "connections_evicted": self.evicted,
        }
