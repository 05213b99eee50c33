"""The InfluxDB store: line protocol over the v2 write API, through a disk spool.

URL: ``influx://HOST:PORT?org=ORG&bucket=BUCKET`` with optional ``&tls=1``
(https), ``&ca=/path/ca.pem`` (a private CA), ``&verify=0`` (no certificate
check) and ``&precision=s|ms|us|ns`` (default ns). The token comes from the
``token=`` argument or ``$GREEND_INFLUX_TOKEN``; it never appears in a URL.
Works against InfluxDB 2.x/3.x and anything that speaks ``/api/v2/write``
(victoria-metrics, which answers 204 even to malformed lines and stores string
fields as 0).

How a point travels::

    write(points) --encode--> Spool.append  (tick thread: one os.write, no network)
                                   |
    sender thread: oldest sealed segment --> write_api.write(SYNCHRONOUS, gzip)
                                   |-- 2xx           -> delete the segment
                                   |-- 429, 5xx, no connection -> back off (Retry-After), retry
                                   |-- 400, 422      -> move to rejected/, count, go on
                                   |-- 401, 403, 404 -> alert "token/org/bucket wrong", keep spooling
                                   `-- 413           -> send it in halves

influxdb-client's own batching ``WriteApi`` is not used: it drops a batch after
an error, keeps its buffer in memory without bound, and ``flush()`` does nothing.

Points: tags are escaped, a ``host`` tag is added when missing, empty tag values
are left out; fields are float, int (``i`` suffix) or bool. String fields,
NaN and infinities are left out (victoria-metrics stores strings as 0), counted
in ``status().extra["fields_skipped"]``; a point left with no field is counted as
dropped, unless all it had was text (a policy's note: ``text_only_points``, kept in
SQLite by design). Points the server refuses (400, 422) are set aside in ``rejected/``
and counted in ``extra["rejected"]`` (Prometheus: ``greend_store_points_rejected_total``).
"""

from __future__ import annotations

import email.utils
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast
from urllib.parse import SplitResult, parse_qs, urlsplit

from greend.errors import ConfigError, StoreError
from greend.points import Point
from greend.stores import StoreOptions, StoreStatus, check_url, redact_url, register_store, require_host_port
from greend.stores.spool import Segment, Spool

__all__ = ["InfluxStore", "encode_points", "parse_influx_url"]

log = logging.getLogger(__name__)

TOKEN_ENV = "GREEND_INFLUX_TOKEN"
TIMESTAMP_UNITS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
REJECT_LOG_EVERY_S = 60.0  # a server refusing segments: one log line a minute, with the count since
_INT64 = (-(2**63), 2**63 - 1)
_SLOW = object()  # template marker: this shape of point needs the checking encoder

# Line protocol escaping ------------------------------------------------------------
# A line break cannot be written in a key: it becomes an escaped space (a bare space
# would end the key, and the server would refuse the whole batch). A backslash that a
# reader could take for an escape (before a comma, an equals sign, a space, another
# backslash or the end: a job named C:\runs\ or a\ b) is written doubled, which the v2
# write API (InfluxDB 2.x, VictoriaMetrics) reads as one backslash; written single it
# escaped the separator after it and the point was cut short. Any other backslash
# stays single, read as itself by every version (InfluxDB 1.x has no escape for a
# backslash at all).
_MEASUREMENT_ESCAPES = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\ ", "\r": r"\ "})
_KEY_ESCAPES = str.maketrans({",": r"\,", "=": r"\=", " ": r"\ ", "\n": r"\ ", "\r": r"\ "})
_NEEDS_ESCAPING = re.compile(r"[,= \n\r\\]")
_AMBIGUOUS_BACKSLASH = re.compile(r"\\(?=[,= \n\r\\]|$)")


def _escape_key(s: str) -> str:
    if not _NEEDS_ESCAPING.search(s):
        return s
    return _AMBIGUOUS_BACKSLASH.sub(r"\\\\", s).translate(_KEY_ESCAPES)


def _escape_measurement(s: str) -> str:
    return _AMBIGUOUS_BACKSLASH.sub(r"\\\\", s).translate(_MEASUREMENT_ESCAPES)


class _Encoder:
    """Point -> one line of line protocol, with caches for the repeating parts.

    Tag sets repeat on every tick (the same GPUs, zones, probes), so the escaped
    ``measurement,tag=v,...`` prefix is computed once per tag set.
    """

    def __init__(self, host: str, divisor: int) -> None:
        self.host = host
        self.divisor = divisor
        self._prefix: dict[tuple[Any, ...], str] = {}
        self._fkey: dict[str, str] = {}
        self._tpl: dict[tuple[Any, ...], Any] = {}
        self.fields_skipped = 0
        self.points_skipped = 0  # points with nothing line protocol can carry: lost (counted in dropped)
        self.text_only = 0  # points of text fields alone (a note): kept in SQLite only, by design
        self._warned: set[str] = set()

    def prefix(self, p: Point) -> str:
        key = (p.measurement, *p.tags.items())
        pre = self._prefix.get(key)
        if pre is None:
            tags = dict(p.tags)
            tags.setdefault("host", self.host)
            parts = [_escape_measurement(p.measurement)]
            for k in sorted(tags):
                v = tags[k]
                if v is None or str(v) == "":
                    continue
                parts.append(f"{_escape_key(str(k))}={_escape_key(str(v))}")
            pre = ",".join(parts)
            if len(self._prefix) > 8192:
                self._prefix.clear()
            self._prefix[key] = pre
        return pre

    def fkey(self, k: str) -> str:
        e = self._fkey.get(k)
        if e is None:
            e = self._fkey[k] = _escape_key(k)
        return e

    def line(self, p: Point) -> str | None:
        """The fast path: a ``str.format`` template per (tag set, field names, field types).

        Valid when every field is an exact float, int or bool, all finite and ints
        within int64; anything else goes through :meth:`slow_line`.
        """
        vals = tuple(p.fields.values())
        key = (p.measurement, *p.tags.items(), "\x00", *p.fields, *map(type, vals))
        tpl = self._tpl.get(key)
        if tpl is None:
            tpl = self._template(p, vals)
            if len(self._tpl) > 8192:
                self._tpl.clear()
            self._tpl[key] = tpl
        if tpl is _SLOW:
            return self.slow_line(p)
        fmt, int_idx = cast("tuple[str, tuple[int, ...]]", tpl)
        try:
            # A template exists only for all-numeric fields (strings take the slow path).
            total = sum(cast("tuple[float, ...]", vals))
        except OverflowError:
            return self.slow_line(p)
        if not math.isfinite(total):
            return self.slow_line(p)
        numbers = cast("tuple[float, ...]", vals)
        for i in int_idx:
            if not _INT64[0] <= numbers[i] <= _INT64[1]:
                return self.slow_line(p)
        return fmt.format(*vals, p.ts_ns // self.divisor)

    def _template(self, p: Point, vals: tuple[Any, ...]) -> tuple[str, tuple[int, ...]] | object:
        if not vals:
            return _SLOW
        parts, int_idx = [], []
        for i, (k, v) in enumerate(zip(p.fields, vals)):
            t = type(v)
            k2 = self.fkey(k).replace("{", "{{").replace("}", "}}")
            if t is float:
                parts.append(f"{k2}={{!r}}")
            elif t is bool:
                parts.append(f"{k2}={{}}")  # True/False are valid line-protocol booleans
            elif t is int:
                parts.append(f"{k2}={{}}i")
                int_idx.append(i)
            else:
                return _SLOW
        pre = self.prefix(p).replace("{", "{{").replace("}", "}}")
        return f"{pre} {','.join(parts)} {{}}\n", tuple(int_idx)

    def slow_line(self, p: Point) -> str | None:
        """Any field values: checks each, leaves out what line protocol cannot carry."""
        out = []
        unsendable = False  # a value left out that is not text (NaN, an object): counted as lost
        for k, v in p.fields.items():
            if isinstance(v, bool):
                out.append(f"{self.fkey(k)}={'true' if v else 'false'}")
                continue
            if isinstance(v, int):
                iv = int(v)
                if _INT64[0] <= iv <= _INT64[1]:
                    out.append(f"{self.fkey(k)}={iv}i")
                else:
                    out.append(f"{self.fkey(k)}={float(iv)!r}")
                continue
            if isinstance(v, float) and math.isfinite(v):
                out.append(f"{self.fkey(k)}={float(v)!r}")
                continue
            self.fields_skipped += 1
            if isinstance(v, str):
                continue  # by design (docs/stores.md): text, a decision's reason, stays in SQLite
            unsendable = True
            if k not in self._warned:
                self._warned.add(k)
                log.warning(
                    "influx: field %s.%s = %r left out (only finite float, int and bool fields are sent)",
                    p.measurement,
                    k,
                    v,
                )
        if not out:
            # A point of text alone (a policy's note) stays in SQLite by design: not lost.
            if unsendable:
                self.points_skipped += 1
            else:
                self.text_only += 1
            return None
        return f"{self.prefix(p)} {','.join(out)} {p.ts_ns // self.divisor}\n"

    def encode(self, points: list[Point]) -> tuple[bytes, int]:
        lines = [ln for ln in map(self.line, points) if ln is not None]
        return "".join(lines).encode(), len(lines)


def encode_points(points: list[Point], host: str = "", precision: str = "ns") -> bytes:
    """Line protocol for ``points`` (one line each, ``\\n``-terminated); for tests and tools."""
    return _Encoder(host, TIMESTAMP_UNITS[precision]).encode(points)[0]


# The URL ---------------------------------------------------------------------------
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")  # a URL flag's words


def parse_influx_url(url: str) -> dict[str, Any]:
    """``influx://H:P?org=O&bucket=B[&tls=1][&ca=F][&verify=0][&precision=P]`` -> settings."""
    check_url(url)
    parts = urlsplit(url)
    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    precision = q.get("precision", "ns")
    if precision not in TIMESTAMP_UNITS:
        raise ConfigError(f"store URL {redact_url(url)!r}: precision={precision!r}; expected one of s, ms, us, ns")
    tls = q.get("tls", "0").lower() in _TRUE
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return {
        "http_url": f"{'https' if tls else 'http'}://{host}:{parts.port}",
        "org": q["org"],
        "bucket": q["bucket"],
        "precision": precision,
        "ca": q.get("ca"),
        "verify": q.get("verify", "1").lower() not in _FALSE,
    }


def _spool_name(cfg: dict[str, Any]) -> str:
    raw = f"influx-{urlsplit(cfg['http_url']).netloc}-{cfg['org']}-{cfg['bucket']}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)


def _retry_after_s(value: Any) -> float | None:
    """Retry-After as seconds: ``"120"`` or an HTTP date."""
    if value is None:
        return None
    s = str(value).strip()
    try:
        return max(0.0, float(s))
    except ValueError:
        pass
    try:
        dt = email.utils.parsedate_to_datetime(s)
    except (TypeError, ValueError):
        return None
    return max(0.0, dt.timestamp() - time.time())


# The outcome of one request --------------------------------------------------------
OK, RETRY, REJECT, AUTH, TOO_LARGE = "ok", "retry", "reject", "auth", "too_large"


class InfluxStore:
    """Spooled, ordered, at-least-once writes to an InfluxDB v2 write endpoint.

    ``state_dir``: the spool goes to ``<state_dir>/spool/<influx-host_port-org-bucket>``
    (or ``spool_dir``). ``host``: the ``host`` tag added to points that lack one.
    ``post``: inject the transport (``post(body, precision) -> None`` raising like
    influxdb-client's write) for tests; by default influxdb-client's SYNCHRONOUS
    ``write_api`` with gzip.
    """

    name = "influx"

    def __init__(
        self,
        url: str,
        *,
        state_dir: Path,
        host: str,
        token: str | None = None,
        spool_dir: Path | None = None,
        shown_state_dir: Path | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        segment_bytes: int = 1024 * 1024,
        segment_age_s: float = 1.0,
        max_body_bytes: int = 8 * 1024 * 1024,
        timeout_s: float = 10.0,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 60.0,
        retry_after_max_s: float = 300.0,
        gzip: bool = True,
        post: Callable[[bytes, str], None] | None = None,
    ) -> None:
        self.url = url
        self.cfg = parse_influx_url(url)
        self.host = host
        self.precision: str = self.cfg["precision"]
        self.spool_dir = Path(spool_dir) if spool_dir else Path(state_dir) / "spool" / _spool_name(self.cfg)
        # As a person knows it (status, logs): the configured state dir, not the daemon's
        # descriptor of it (/proc/self/fd/N) through which it is reached.
        shown = Path(shown_state_dir) / "spool" / _spool_name(self.cfg) if shown_state_dir and not spool_dir else None
        self.spool_dir_shown = shown or self.spool_dir
        self._spool = Spool(
            self.spool_dir,
            tag=self.precision,
            max_bytes=spool_max_bytes,
            segment_bytes=segment_bytes,
            segment_age_s=segment_age_s,
            shown=self.spool_dir_shown,
        )
        self._enc = _Encoder(host, TIMESTAMP_UNITS[self.precision])
        self._enc_lock = threading.Lock()
        self._max_body = max_body_bytes
        self._timeout_s = timeout_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._retry_after_max_s = retry_after_max_s
        self._attempts = 0
        self._next_try = 0.0
        self._written = 0
        self._requests = 0
        self._last_error: str | None = None
        self._alert: str | None = None
        self._last_rejected: str | None = None
        self._reject_said_at = -REJECT_LOG_EVERY_S  # (monotonic: the first refusal is said at once)
        self._rejects_unsaid = 0
        self._points_unsaid = 0
        self._ok = True
        # ok, alert and the last error change together on the sender thread and are read
        # together by status(): one lock, so a reader never sees "not ok" without its reason.
        self._health = threading.Lock()
        self._client: Any = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sending = threading.Event()  # set while a segment is being sent
        self._sending_since = 0.0  # (monotonic) when the segment in flight went out
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if post is None:
            post = self._make_client_post(token, gzip)
        self._post = post
        self._thread = threading.Thread(target=self._run, name=f"store-{_spool_name(self.cfg)}", daemon=True)
        self._thread.start()

    def _make_client_post(self, token: str, gzip: bool) -> Callable[[bytes, str], None]:
        try:
            from influxdb_client import InfluxDBClient
            from influxdb_client.client.write_api import SYNCHRONOUS
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise StoreError("influx store: the influxdb-client package is not installed") from e
        self._client = InfluxDBClient(
            url=self.cfg["http_url"],
            token=token,
            org=self.cfg["org"],
            timeout=int(self._timeout_s * 1000),
            enable_gzip=gzip,
            verify_ssl=self.cfg["verify"],
            ssl_ca_cert=self.cfg["ca"],
            retries=False,  # back-off is ours, over the spool
        )
        if gzip:
            self._fast_gzip(self._client)
        write_api = self._client.write_api(write_options=SYNCHRONOUS)
        bucket, org = self.cfg["bucket"], self.cfg["org"]

        def post(body: bytes, precision: str) -> None:
            write_api.write(bucket=bucket, org=org, record=body, write_precision=precision)

        return post

    @staticmethod
    def _fast_gzip(client: Any, level: int = 1) -> None:
        """Make the client gzip writes at ``level`` 1 instead of 9.

        influxdb-client compresses with ``gzip.compress`` at its default level 9
        (about 30 MB/s here, the slowest step of a replay); level 1 runs ~280 MB/s
        and line protocol still shrinks about 10x. The hook is the client's own
        per-request body hook; if a future client lacks it, level 9 stays.
        """
        import gzip as _gzip

        conf = getattr(client, "conf", None)
        base = getattr(type(conf), "update_request_body", None)
        if conf is None or base is None:
            return

        def update_request_body(path: str, body: Any) -> Any:
            if path == "/api/v2/write" and isinstance(body, (bytes, str)):
                raw = body.encode() if isinstance(body, str) else body
                return _gzip.compress(raw, compresslevel=level)
            return base(conf, path, body)

        conf.update_request_body = update_request_body

    # Public API ----------------------------------------------------------------------
    def write(self, points: list[Point]) -> None:
        """Append ``points`` to the spool; never touches the network, never raises."""
        if not points:
            return
        try:
            with self._enc_lock:
                data, _ = self._enc.encode(points)
        except Exception as e:
            self._enc.points_skipped += len(points)
            with self._health:
                self._last_error = f"cannot encode points: {type(e).__name__}: {e}"
            log.error("influx: %s", self._last_error)
            return
        self._spool.append(data)
        if self._spool.segment_full:
            self._wake.set()  # the sender seals it (the disk is never waited for here) and sends it

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Seal what is buffered and wait until the spool is empty (True) or ``timeout_s``."""
        self._spool.seal()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._spool.empty() and not self._sending.is_set():
                return True
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return self._spool.empty()
            time.sleep(0.005)

    def close(self, timeout_s: float = 5.0) -> None:
        """Seal, try briefly to drain while the store answers, then stop the sender.

        Unsent segments stay on disk and are replayed by the next InfluxStore on
        the same spool directory.
        """
        self._spool.seal()
        if self._ok and self._alert is None and time.monotonic() >= self._next_try:
            self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self._spool.close()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass

    def status(self) -> StoreStatus:
        retry_in = max(0.0, self._next_try - time.monotonic())
        with self._health:
            ok = self._ok and self._alert is None
            last_error = self._alert or self._last_error or self._spool.last_error
            last_rejected = self._last_rejected
        # A server that answers a byte now and then never trips the per-read timeout: a
        # request in flight for longer than twice the timeout is no answer.
        stuck_s = time.monotonic() - self._sending_since if self._sending.is_set() else 0.0
        if stuck_s > 2 * self._timeout_s:
            ok, last_error = False, f"the store has not finished answering a request for {stuck_s:.0f} s"
        return StoreStatus(
            name=self.name,
            url=self.url,
            ok=ok,
            written=self._written,
            pending=self._spool.pending_points,
            dropped=self._spool.dropped + self._enc.points_skipped,
            last_error=last_error,
            extra={
                "spool_dir": str(self.spool_dir_shown),
                "spool_bytes": self._spool.pending_bytes,
                "rejected": self._spool.rejected,
                "last_rejected": last_rejected,
                "recovered": self._spool.recovered,
                "fields_skipped": self._enc.fields_skipped,
                "text_only_points": self._enc.text_only,
                "requests": self._requests,
                "retry_in_s": round(retry_in, 3),
            },
        )

    # Sender thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._spool.maintain()
                now = time.monotonic()
                if now < self._next_try:
                    self._stop.wait(min(self._next_try - now, 0.25))
                    continue
                seg = self._spool.oldest()
                if seg is None:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._sending_since = time.monotonic()
                self._sending.set()
                try:
                    self._send_segment(seg)
                finally:
                    self._sending.clear()
            except Exception as e:
                with self._health:
                    self._last_error = f"sender: {type(e).__name__}: {e}"
                log.exception("influx sender")
                self._backoff(None)
                self._spool.release()

    def _send_segment(self, seg: Segment) -> None:
        data = self._spool.read(seg)
        while data and not self._stop.is_set():
            chunk = data
            if len(chunk) > self._max_body:
                cut = data.rfind(b"\n", 0, self._max_body) + 1
                if cut <= 0:
                    cut = data.find(b"\n") + 1 or len(data)
                chunk = data[:cut]
            outcome, detail, retry_after = self._request(chunk, seg.tag)
            if outcome == OK:
                n = chunk.count(b"\n")
                self._written += n
                if len(chunk) >= len(data):
                    self._spool.ack(seg)
                else:
                    self._spool.advance(seg, len(chunk), n)
                data = data[len(chunk) :]
                self._attempts = 0
                with self._health:
                    self._ok, self._alert, self._last_error = True, None, None
                continue
            if outcome == TOO_LARGE:
                if chunk.count(b"\n") <= 1:
                    n = self._spool.reject(seg, f"413 for a single line: {detail}", chunk)
                    log.error("influx: a %d-byte line is too large for the server; set aside", len(chunk))
                    data = data[len(chunk) :]
                    continue
                self._max_body = max(len(chunk) // 2, 1)
                log.warning(
                    "influx: 413 Request Entity Too Large; sending at most %d bytes a request now", self._max_body
                )
                continue
            if outcome == REJECT:
                n = self._spool.reject(seg, detail)
                # The directory by the name an operator can open (the spool itself is reached
                # through the held state dir's /proc/self/fd path).
                aside = self.spool_dir_shown / self._spool.rejected_dir.name
                with self._health:
                    self._last_error = self._last_rejected = f"{detail} ({n} points set aside in {aside})"
                # One line a minute: a server refusing everything (a backlog of segments after
                # an outage) logged one ERROR per segment, a dozen lines a second.
                now = time.monotonic()
                self._rejects_unsaid += 1
                self._points_unsaid += n
                if now - self._reject_said_at >= REJECT_LOG_EVERY_S:
                    more = self._rejects_unsaid - 1
                    log.error(
                        "influx: the server refused a segment of %d points as malformed: %s; set aside in %s%s",
                        n,
                        detail,
                        aside,
                        f" ({more} more segment(s), {self._points_unsaid - n} points, refused since the last line)"
                        if more
                        else "",
                    )
                    self._reject_said_at, self._rejects_unsaid, self._points_unsaid = now, 0, 0
                return
            # RETRY or AUTH: keep everything, try again later.
            if outcome == AUTH:
                msg = (
                    f"{detail}: token/org/bucket wrong (check ${TOKEN_ENV} and "
                    f"org={self.cfg['org']!r} bucket={self.cfg['bucket']!r}); points keep spooling"
                )
                if "page not found" in detail.lower():  # (a server without /api/v2/write: no org or bucket said)
                    msg = (
                        f"{detail}: this server has no InfluxDB v2 write API (/api/v2/write): InfluxDB 1.x before "
                        "1.8? greend writes InfluxDB 2.x/3.x, 1.8+ (its v2 compatibility API) and VictoriaMetrics; "
                        "points keep spooling"
                    )
                if msg != self._alert:
                    log.error("influx %s: %s", self.cfg["http_url"], msg)
                with self._health:
                    self._ok, self._alert = False, msg
            else:
                if detail != self._last_error:
                    log.warning("influx %s: %s; points keep spooling, retrying", self.cfg["http_url"], detail)
                with self._health:  # (an earlier 401's alert is no longer what happens)
                    self._ok, self._last_error, self._alert = False, detail, None
            self._backoff(retry_after)
            self._spool.release()
            return
        if not data:
            self._spool.ack(seg)  # fully delivered (e.g. the last piece was set aside)
        else:
            self._spool.release()

    def _request(self, body: bytes, precision: str) -> tuple[str, str, float | None]:
        """POST one body; sort the result into OK, RETRY, REJECT, AUTH or TOO_LARGE."""
        self._requests += 1
        try:
            self._post(body, precision)
            return OK, "", None
        except Exception as e:
            status = getattr(e, "status", None)
            if not isinstance(status, int):
                return RETRY, f"cannot reach the store: {type(e).__name__}: {_short(e)}", None
            headers = getattr(e, "headers", None) or {}
            retry_after = getattr(e, "retry_after", None)
            if retry_after is None and hasattr(headers, "get"):
                retry_after = headers.get("Retry-After")
            reason = getattr(e, "message", None) or getattr(e, "reason", None) or ""
            detail = f"HTTP {status} {_short(reason)}".strip()
            if status in (400, 422):
                return REJECT, detail, None
            if status in (401, 403, 404):
                return AUTH, detail, None
            if status == 413:
                return TOO_LARGE, detail, None
            if 200 <= status < 300:
                return OK, "", None
            return RETRY, detail, _retry_after_s(retry_after)

    def _backoff(self, retry_after: float | None) -> None:
        delay = min(self._backoff_max_s, self._backoff_min_s * (2**self._attempts))
        delay *= random.uniform(0.8, 1.0)
        self._attempts = min(self._attempts + 1, 30)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self._retry_after_max_s))
        self._next_try = time.monotonic() + delay


def _short(x: Any, n: int = 200) -> str:
    s = x.decode(errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


_URL_OPTIONS = ("org", "bucket", "tls", "ca", "verify", "precision")


def _check_influx_url(url: str, parts: SplitResult) -> None:
    shown = redact_url(url)
    require_host_port(shown, parts)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"store URL {shown!r}: credentials in the URL are not used (and would be logged): "
            f"give the InfluxDB token in ${TOKEN_ENV} (the systemd unit reads it from /etc/default/greend)"
        )
    q = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(k for k in q if k not in _URL_OPTIONS)
    if unknown:
        hint = f"; give the token in ${TOKEN_ENV}, not in the URL" if any("token" in k.lower() for k in unknown) else ""
        raise ConfigError(
            f"store URL {shown!r}: unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
            f"expected {', '.join(_URL_OPTIONS)}{hint}"
        )
    for flag in ("tls", "verify"):
        value = q.get(flag, ["1"])[-1].lower()
        if value not in _TRUE + _FALSE:
            raise ConfigError(f"store URL {shown!r}: {flag}={value!r}; expected 1 or 0 (true/false, yes/no, on/off)")
    missing = [k for k in ("org", "bucket") if not q.get(k) or not q[k][-1]]
    if missing:
        raise ConfigError(
            f"store URL {shown!r}: missing {' and '.join(missing)}; expected influx://HOST:PORT?org=ORG&bucket=BUCKET"
        )


@register_store("influx", form="influx://HOST:PORT?org=ORG&bucket=BUCKET", check=_check_influx_url)
def _open_influx(url: str, options: StoreOptions) -> InfluxStore:
    return InfluxStore(url, state_dir=options.state_dir, host=options.host, shown_state_dir=options.state_dir_path)
