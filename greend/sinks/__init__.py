"""Time-series sinks: where samples, steps, decisions and job summaries go.

Every sink takes :class:`Point` batches from the tick loop through ``write()``,
which must never block on I/O: sinks queue and write from a thread of their own.
A sink that fails reports it in ``status()``; it never raises into the tick loop.

URLs (``--store``, repeatable; each sink fails on its own):

- ``sqlite:///ABS/PATH.db``  the embedded default (stdlib sqlite3, WAL)
- ``influx://HOST:PORT?org=O&bucket=B``  InfluxDB v2 write API (token from ``GREEND_INFLUX_TOKEN``)
- ``prometheus://HOST:PORT``  serves ``/metrics``

Adding a sink: a module here with a class following :class:`Sink` and a branch
in :func:`open_sink`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from greend.errors import ConfigError

__all__ = ["Point", "Sink", "check_url", "open_sink"]

SCHEMES = ("sqlite", "influx", "prometheus")


@dataclass(slots=True)
class Point:
    """One row of a measurement: InfluxDB's model, which SQLite mirrors as tables."""

    measurement: str
    tags: dict[str, str]
    fields: dict[str, float | int | str | bool]
    ts_ns: int


@dataclass
class SinkStatus:
    name: str
    url: str
    ok: bool
    written: int = 0
    pending: int = 0
    dropped: int = 0
    last_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {
            "name": self.name,
            "url": self.url,
            "ok": self.ok,
            "written": self.written,
            "pending": self.pending,
            "dropped": self.dropped,
            "last_error": self.last_error,
        }
        d.update(self.extra)
        return d


class Sink(Protocol):
    name: str
    url: str

    def write(self, points: list[Point]) -> None: ...

    def flush(self, timeout_s: float = 5.0) -> bool: ...

    def close(self, timeout_s: float = 5.0) -> None: ...

    def status(self) -> SinkStatus: ...


def check_url(url: str) -> None:
    """Refuse a malformed store URL with a message that says the allowed forms."""
    forms = (
        "sqlite:///ABSOLUTE/PATH.db, influx://HOST:PORT?org=ORG&bucket=BUCKET, "
        "prometheus://HOST:PORT"
    )
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"store URL {url!r}: unknown scheme {parts.scheme!r}; expected one of {forms}")
    if parts.scheme == "sqlite":
        if parts.netloc or not parts.path.startswith("/"):
            raise ConfigError(f"store URL {url!r}: expected sqlite:///ABSOLUTE/PATH.db (three slashes)")
        return
    if not parts.hostname or parts.port is None:
        raise ConfigError(f"store URL {url!r}: expected HOST:PORT, e.g. {parts.scheme}://127.0.0.1:8086")
    if parts.scheme == "influx":
        q = parse_qs(parts.query)
        missing = [k for k in ("org", "bucket") if not q.get(k)]
        if missing:
            raise ConfigError(
                f"store URL {url!r}: missing {' and '.join(missing)}; "
                "expected influx://HOST:PORT?org=ORG&bucket=BUCKET"
            )


def open_sink(url: str, *, state_dir: Path, host: str, retention_days: float = 30.0) -> Sink:
    check_url(url)
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        from greend.sinks.sqlite import SqliteSink

        return SqliteSink(Path(urlsplit(url).path), url=url, retention_days=retention_days)
    if scheme == "influx":
        from greend.sinks.influx import InfluxSink

        return InfluxSink(url, state_dir=state_dir, host=host)
    from greend.sinks.prometheus import PrometheusSink

    return PrometheusSink(url)
