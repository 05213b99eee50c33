"""Time-series stores: where samples, steps, decisions and job summaries go.

Every store takes :class:`~greend.points.Point` batches from the tick loop through ``write()``,
which must never block on I/O: stores queue and write from a thread of their own.
A store that fails reports it in ``status()``; it never raises into the tick loop.

URLs (``--store``, repeatable; each store fails on its own):

- ``sqlite:///ABS/PATH.db``  the embedded default (stdlib sqlite3, WAL)
- ``influx://HOST:PORT?org=O&bucket=B``  InfluxDB v2 write API (token from ``GREEND_INFLUX_TOKEN``)
- ``prometheus://HOST:PORT``  serves ``/metrics``

The scheme registry (:data:`REGISTRY`) is the one list of the stores there are.
Adding a store: a module here with a class following :class:`Store` and a factory
decorated with ``@register_store("scheme", form=..., check=...)``, and the module's
name in ``_BUILTIN_STORE_MODULES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

from greend.errors import ConfigError
from greend.points import Point

__all__ = [
    "REGISTRY",
    "Store",
    "StoreKind",
    "StoreOptions",
    "StoreStatus",
    "check_url",
    "open_store",
    "redact_url",
    "register_store",
    "registered_schemes",
    "require_host_port",
]


@dataclass
class StoreStatus:
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


class Store(Protocol):
    name: str
    url: str

    def write(self, points: list[Point]) -> None: ...

    def flush(self, timeout_s: float = 5.0) -> bool: ...

    def close(self, timeout_s: float = 5.0) -> None: ...

    def status(self) -> StoreStatus: ...


@dataclass(frozen=True)
class StoreOptions:
    """What a store may need besides its URL."""

    state_dir: Path
    host: str
    retention_days: float = 30.0
    raw_hours: float = 24.0  # SQLite: rows older than this are rolled up ...
    rollup_s: float = 300.0  # ... to one per series per rollup_s
    # The state dir as configured, where ``state_dir`` reaches it through the daemon's
    # held descriptor (``/proc/self/fd/N``): a store file configured inside it (the
    # default ``sqlite:///<state_dir>/greend.db``) is opened through the descriptor too.
    state_dir_path: Path | None = None


StoreFactory = Callable[[str, StoreOptions], Store]
UrlCheck = Callable[[str, SplitResult], None]


@dataclass(frozen=True)
class StoreKind:
    """One registered scheme: the URL ``form`` error messages show, the ``check``
    that refuses a malformed URL (raises ConfigError) and the ``factory``."""

    scheme: str
    form: str
    check: UrlCheck
    factory: StoreFactory


REGISTRY: dict[str, StoreKind] = {}


def register_store(scheme: str, *, form: str, check: UrlCheck) -> Callable[[StoreFactory], StoreFactory]:
    """Register the factory of the store for ``scheme://`` URLs."""

    def deco(factory: StoreFactory) -> StoreFactory:
        if scheme in REGISTRY:
            raise ValueError(f"store scheme {scheme!r} registered twice")
        REGISTRY[scheme] = StoreKind(scheme, form, check, factory)
        return factory

    return deco


# The modules of the stores greend ships, imported for their registrations (in the
# order messages list the schemes).
_BUILTIN_STORE_MODULES = ("sqlite", "influx", "prometheus")


def _load_builtin_stores() -> None:
    for name in _BUILTIN_STORE_MODULES:
        importlib.import_module(f"greend.stores.{name}")


def registered_schemes() -> list[str]:
    """Every registered scheme: the built-in ones in their fixed order (whatever module
    happened to be imported first), then any other in registration order."""
    _load_builtin_stores()
    builtin = [s for s in _BUILTIN_STORE_MODULES if s in REGISTRY]
    return builtin + [s for s in REGISTRY if s not in builtin]


def require_host_port(url: str, parts: SplitResult) -> None:
    """A URL check for stores that connect to or serve on ``HOST:PORT``."""
    if not parts.hostname or parts.port is None:
        raise ConfigError(f"store URL {redact_url(url)!r}: expected HOST:PORT, e.g. {parts.scheme}://127.0.0.1:8086")


_SECRET_PARAMS = ("token", "password", "passwd", "secret", "apikey", "api_key")


def redact_url(url: str) -> str:
    """``url`` as it may be shown (status, labels, logs): a password in it
    (``influx://alice:pw@host``) and query values that look secret (``token=``,
    ``password=``, ...) become ``<secret>``; the rest is kept."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, sep, _ = userinfo.partition(":")
            netloc = f"{user}:<secret>@{hostport}" if sep else f"{user}@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in _SECRET_PARAMS or k.lower().endswith(_SECRET_PARAMS) for k, _ in pairs):
                query = urlencode(
                    [
                        (k, "<secret>" if k.lower() in _SECRET_PARAMS or k.lower().endswith(_SECRET_PARAMS) else v)
                        for k, v in pairs
                    ],
                    safe="<>/",
                )
        if netloc == parts.netloc and query == parts.query:
            return url
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<an unreadable URL>"


def check_url(url: str) -> None:
    """Refuse a malformed store URL with a message that says the allowed forms."""
    _load_builtin_stores()
    try:
        parts = urlsplit(url)
        kind = REGISTRY.get(parts.scheme)
        if kind is None:
            forms = ", ".join(REGISTRY[s].form for s in registered_schemes())
            shown = redact_url(url)
            raise ConfigError(f"store URL {shown!r}: unknown scheme {parts.scheme!r}; expected one of {forms}")
        kind.check(url, parts)
    except ValueError as e:  # (urllib's: a port that is no number or out of range, a broken [IPv6])
        scheme = url.partition("://")[0] if "://" in url else ""
        form = REGISTRY[scheme].form if scheme in REGISTRY else f"{scheme or 'SCHEME'}://HOST:PORT"
        raise ConfigError(f"store URL {redact_url(url)!r}: {e}; expected {form}") from None


def open_store(
    url: str,
    *,
    state_dir: Path,
    host: str,
    retention_days: float = 30.0,
    raw_hours: float = 24.0,
    rollup_s: float = 300.0,
    state_dir_path: Path | None = None,
) -> Store:
    """The store for ``url``, by its scheme's registered factory."""
    check_url(url)
    options = StoreOptions(
        state_dir=Path(state_dir),
        host=host,
        retention_days=retention_days,
        raw_hours=raw_hours,
        rollup_s=rollup_s,
        state_dir_path=state_dir_path,
    )
    return REGISTRY[urlsplit(url).scheme].factory(url, options)
