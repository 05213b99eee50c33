"""Configuration: a TOML file, then command-line flags on top.

The file (``/etc/greend/greend.toml`` unless ``--config`` names another) has one
table per concern; every key has a default, so an empty file is valid::

    [daemon]
    hz = 10.0                          # probe sampling rate
    socket = "/run/greend/greend.sock"
    socket_group = "greend"            # members may read status and register jobs
    socket_mode = "0660"
    state_dir = "/var/lib/greend"      # saved settings, sim devices, spool, default store
    dry_run = false                    # record what would be set, touch nothing
    heartbeat_timeout_s = 15.0
    admin_group = "greend-admin"       # besides root: may set caps and policy
    root_is_admin = true               # false: uid 0 is no admin by itself (containers: a pod's root)
    log_level = "info"
    hostname = ""                      # the node's name in every point and report (default: the
                                       # machine's; under Kubernetes the node's, not the pod's)
    max_connections = 256              # all clients together
    reserved_admin_connections = 16    # of those, kept for root and admin_group
    max_connections_per_uid = 64       # one user's open connections
    idle_timeout_s = 60.0              # a connection that never registered, silent this long, is closed
    max_jobs_per_uid = 16              # one user's running jobs
    max_messages_per_s_per_uid = 2000.0  # one user's requests (+1 a KiB past the first); beyond it read slower
    max_events_per_min_per_uid = 120   # precision_event messages; beyond it they are refused
    max_log_entries = 256              # a job's precision and cap-change logs (oldest dropped, counted)
    max_recent_steps = 4096            # steps a job keeps for its sliding window

    [probes]
    enabled = ["nvml", "rapl", "host"] # any of: nvml, rapl, host, sim
    sysfs_root = "/sys"
    cpu_tdp_w = 0.0                    # >0: estimate CPU power where RAPL is absent
    nvml_fake_dir = ""                 # development: drive the NVML probe with the fake

    [sim]
    gpus = 0                           # >0 replaces nvml with N simulated GPUs
    dir = ""                           # default <state_dir>/sim
    load = 0.0                         # background load 0..1 when no job runs
    mem_share = 0.3                    # memory-bound share of a simulated step
    speed_factor = 1.0                 # > 1: slower GPUs (a straggler node, in tests)
    gpu_speed_factors = {}             # one GPU's own, in place of speed_factor: { 1 = 1.3 }
                                       # (a straggler GPU within the node)
    trace = ""                         # a measured power-limit profile the GPUs follow (greend.probes.trace)

    [store]
    urls = []                          # default ["sqlite:///<state_dir>/greend.db"]
    interval_s = 1.0                   # how often samples go to the stores
    retention_days = 30.0
    retry_s = 30.0                     # how often a store that failed to open is tried again
    step_detail = false                # also one row per reported step (greend_job_step); by
                                       # default a row per rank per interval (greend_job_steps)
    raw_hours = 24.0                   # SQLite: rows older than this are rolled up to one per
    rollup_s = 300.0                   # series per rollup_s (0 hours: every row kept to the end)

    [policy]
    name = "none"                      # none, static, efficient, budget (greenctl policy show)
    period_s = 1.0                     # how often the policy decides
    settle_s = 0.5                     # steps this soon after a change are not measured
    precision = "none"                 # beside it: "precision" downgrades jobs' precision
    [policy.params]                    # the policy's own parameters, e.g. max_slowdown = 0.05
    [policy.precision_params]          # the precision policy's, e.g. tolerance = 0.05

    [report]
    grid_gco2_per_kwh = 400.0          # grid carbon intensity for the CO2 estimate
    window_s = 10.0                    # the sliding window of job efficiency figures

Unknown keys and bad values are refused at start with a message that names the
key, the value and what is allowed; nothing is silently defaulted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greend.errors import ConfigError
from greend.protocol import DEFAULT_SOCKET

__all__ = [
    "Config",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_STATE_DIR",
    "DaemonConfig",
    "ProbesConfig",
    "SimConfig",
    "StoreConfig",
    "load_config",
    "default_socket_path",
]

DEFAULT_CONFIG_PATH = Path("/etc/greend/greend.toml")
SECTIONS = ("daemon", "probes", "sim", "store", "policy", "report")


# Saved settings, simulated devices, the spool and the default store live here (the
# systemd unit's StateDirectory=).
DEFAULT_STATE_DIR = Path("/var/lib/greend")


def default_socket_path() -> Path:
    """``$GREEND_SOCKET``, else the system path the systemd unit uses."""
    env = os.environ.get("GREEND_SOCKET")
    return Path(env) if env else DEFAULT_SOCKET


@dataclass
class DaemonConfig:
    hz: float = 10.0
    socket: Path = field(default_factory=default_socket_path)
    socket_group: str = "greend"
    socket_mode: str = "0660"
    state_dir: Path = DEFAULT_STATE_DIR
    dry_run: bool = False
    heartbeat_timeout_s: float = 15.0
    admin_group: str = "greend-admin"
    root_is_admin: bool = True
    log_level: str = "info"
    hostname: str = ""
    max_connections: int = 256
    reserved_admin_connections: int = 16
    max_connections_per_uid: int = 64
    idle_timeout_s: float = 60.0
    max_jobs_per_uid: int = 16
    max_messages_per_s_per_uid: float = 2000.0
    max_events_per_min_per_uid: int = 120
    max_log_entries: int = 256
    max_recent_steps: int = 4096


@dataclass
class ProbesConfig:
    enabled: list[str] = field(default_factory=lambda: ["nvml", "rapl", "host"])
    sysfs_root: Path = Path("/sys")
    cpu_tdp_w: float = 0.0
    nvml_fake_dir: str = ""


@dataclass
class SimConfig:
    gpus: int = 0
    dir: str = ""
    load: float = 0.0
    mem_share: float = 0.3
    speed_factor: float = 1.0
    gpu_speed_factors: dict[str, Any] = field(default_factory=dict)  # GPU index -> its factor
    trace: str = ""

    def speed_factors(self, n: int) -> list[float]:
        """The speed factor of each of ``n`` simulated GPUs (0..n-1)."""
        own = {int(k): float(v) for k, v in self.gpu_speed_factors.items()}
        return [own.get(i, self.speed_factor) for i in range(n)]


@dataclass
class StoreConfig:
    urls: list[str] = field(default_factory=list)
    interval_s: float = 1.0
    retention_days: float = 30.0
    retry_s: float = 30.0
    step_detail: bool = False
    raw_hours: float = 24.0
    rollup_s: float = 300.0


@dataclass
class PolicyConfig:
    name: str = "none"
    period_s: float = 1.0
    settle_s: float = 0.5
    precision: str = "none"
    params: dict[str, Any] = field(default_factory=dict)
    precision_params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReportConfig:
    grid_gco2_per_kwh: float = 400.0
    window_s: float = 10.0


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    source: str = "defaults"  # where it came from, for greenctl doctor and logs

    # Derived views -----------------------------------------------------------------
    @property
    def sim_dir(self) -> Path:
        return Path(self.sim.dir) if self.sim.dir else self.daemon.state_dir / "sim"

    @property
    def store_urls(self) -> list[str]:
        if self.store.urls:
            return list(self.store.urls)
        # sqlite:// + an absolute path: three slashes in all (sqlite:///var/lib/greend/greend.db)
        return [f"sqlite://{(self.daemon.state_dir / 'greend.db').absolute()}"]

    @property
    def enabled_probes(self) -> list[str]:
        """With simulated GPUs the sim probe stands in for NVML."""
        names = list(self.probes.enabled)
        if self.sim.gpus > 0:
            names = [n for n in names if n != "nvml"]
            if "sim" not in names:
                names.insert(0, "sim")
        return names

    def to_json(self) -> dict[str, Any]:
        def conv(v: Any) -> Any:
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, list):
                return [conv(x) for x in v]
            return v

        return {sec: {k: conv(v) for k, v in dataclasses.asdict(getattr(self, sec)).items()} for sec in SECTIONS}


# Validation ------------------------------------------------------------------------


def _check(section: str, key: str, value: Any, expect: type | tuple[type, ...], allowed: str) -> None:
    types = expect if isinstance(expect, tuple) else (expect,)
    # bool is an int in Python: refuse `true` where a number is wanted.
    wrong_bool = isinstance(value, bool) and bool not in types
    if wrong_bool or not isinstance(value, types):
        raise ConfigError(f"[{section}] {key} = {value!r}: expected {allowed}")


def _positive(section: str, key: str, value: float, *, zero_ok: bool = False) -> None:
    if not math.isfinite(value):  # a flag (--hz nan) as the file: TOML's nan and inf are refused too
        raise ConfigError(f"[{section}] {key} = {value!r}: expected a finite number {'>= 0' if zero_ok else '> 0'}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"[{section}] {key} = {value!r}: must be {'>= 0' if zero_ok else '> 0'}")


def _apply_section(section: str, obj: Any, values: dict[str, Any]) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"[{section}] unknown key {key!r}; allowed keys: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if isinstance(current, bool):
            _check(section, key, value, bool, "true or false")
        elif isinstance(current, float):
            _check(section, key, value, (int, float), "a number")
            value = float(value)
            if not math.isfinite(value):  # TOML has nan and inf; no key here means either
                raise ConfigError(f"[{section}] {key} = {value!r}: expected a finite number")
        elif isinstance(current, int):
            _check(section, key, value, int, "a whole number")
        elif isinstance(current, Path):
            _check(section, key, value, str, "a path string")
            value = Path(value)
        elif isinstance(current, dict):
            _check(section, key, value, dict, f"a table ([{section}.{key}])")
            for k, v in value.items():
                # (a table too: a policy's map, such as static's per_gpu = { 0 = { clock_cap_mhz = 1400 } })
                _check(section, f"{key}.{k}", v, (int, float, str, bool, list, dict),
                       "a number, string, boolean, list or table")  # fmt: skip
            value = dict(value)
        elif isinstance(current, list):
            _check(section, key, value, list, "a list of strings")
            for item in value:
                _check(section, key, item, str, "a list of strings")
            value = list(value)
        else:
            _check(section, key, value, str, "a string")
        setattr(obj, key, value)


def _check_policies(cfg: Config) -> None:
    """[policy] name is a clock policy; [policy] precision is "none" or a precision policy."""
    from greend.policies import POLICIES  # the policy registry: the one list of policies

    precision_kinds = sorted(n for n in POLICIES if n == "precision")
    clock_kinds = [n for n in POLICIES if n not in precision_kinds]
    if cfg.policy.name not in clock_kinds:
        hint = " (the precision policy goes in [policy] precision)" if cfg.policy.name in precision_kinds else ""
        raise ConfigError(f"[policy] name = {cfg.policy.name!r}: expected one of {', '.join(clock_kinds)}{hint}")
    if cfg.policy.precision not in ("", "none", *precision_kinds):
        hint = " (a clock policy goes in [policy] name)" if cfg.policy.precision in clock_kinds else ""
        raise ConfigError(
            f"[policy] precision = {cfg.policy.precision!r}: expected "
            f"{' or '.join(repr(n) for n in ['none', *precision_kinds])}{hint}"
        )
    # The parameters as the daemon will take them (a misspelled one, one out of range, one
    # missing): said here, where `greend run` and `greenctl doctor --config` both read the
    # file, before any probe opens.
    from greend.policies import get_policy

    for table, name, params in (
        ("params", cfg.policy.name, cfg.policy.params),
        # (checked while precision is "none" too: a table kept for when it is turned on)
        ("precision_params", "precision", cfg.policy.precision_params),
    ):
        try:
            get_policy(name, **params)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"[policy.{table}]: {e}") from None


def _check_gpu_speed_factors(s: SimConfig) -> None:
    """[sim] gpu_speed_factors: GPU indices (of the simulated ones, when their number is
    known) to factors in the range speed_factor allows."""
    for key, value in s.gpu_speed_factors.items():
        where = f"[sim] gpu_speed_factors.{key} = {value!r}"
        if not key.isdigit():
            raise ConfigError(
                f"{where}: the key must be a GPU index (0, 1, ...), e.g. gpu_speed_factors = {{ 1 = 1.3 }}"
            )
        if s.gpus > 0 and int(key) >= s.gpus:
            raise ConfigError(
                f"{where}: there are {s.gpus} simulated GPUs (0 to {s.gpus - 1}); "
                f"drop GPU {key} or simulate more ([sim] gpus or --sim)"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.1 <= value <= 10.0:
            raise ConfigError(f"{where}: expected a number from 0.1 to 10 (1 = an H100, > 1 slower)")


_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")


def validate(cfg: Config) -> Config:
    d, p, s, st = cfg.daemon, cfg.probes, cfg.sim, cfg.store
    _positive("daemon", "hz", d.hz)
    if d.hz > 1000:
        raise ConfigError(f"[daemon] hz = {d.hz!r}: at most 1000 (NVML power updates every 20-100 ms)")
    _positive("daemon", "heartbeat_timeout_s", d.heartbeat_timeout_s)
    for key in (
        "max_connections",
        "max_connections_per_uid",
        "idle_timeout_s",
        "max_jobs_per_uid",
        "max_messages_per_s_per_uid",
        "max_events_per_min_per_uid",
        "max_log_entries",
        "max_recent_steps",
    ):
        _positive("daemon", key, getattr(d, key))
    if not 0 <= d.reserved_admin_connections < d.max_connections:
        raise ConfigError(
            f"[daemon] reserved_admin_connections = {d.reserved_admin_connections!r}: "
            f"expected 0 up to max_connections - 1 ({d.max_connections - 1})"
        )
    n = len(os.fsencode(str(d.socket)))
    if n > 107:  # (sun_path holds 108 bytes with its NUL)
        raise ConfigError(
            f"[daemon] socket = {str(d.socket)!r}: {n} bytes, over the 107 a Unix socket's path may have; "
            "choose a shorter path (--socket)"
        )
    try:
        mode = int(d.socket_mode, 8)
    except ValueError:
        raise ConfigError(f'[daemon] socket_mode = {d.socket_mode!r}: expected an octal mode like "0660"') from None
    if mode & ~0o777:
        raise ConfigError(f"[daemon] socket_mode = {d.socket_mode!r}: permission bits only (0000-0777)")
    if mode & 0o006 and d.socket_group:
        # Others' bits make the group moot: every local user reaches the socket.
        raise ConfigError(
            f"[daemon] socket_mode = {d.socket_mode!r} lets every local user use the socket, beside "
            f"socket_group {d.socket_group!r}: give 0660 (the group's members only), or set "
            'socket_group = "" to open it to everyone on purpose'
        )
    if d.hostname and not _HOSTNAME_RE.match(d.hostname):
        raise ConfigError(
            f"[daemon] hostname = {d.hostname!r}: expected a host name (letters, digits, '.', '-', '_'; "
            "at most 253), or empty for the machine's own"
        )
    if d.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"[daemon] log_level = {d.log_level!r}: expected one of debug, info, warning, error")
    from greend.probes import available_names  # the probe registry: the one list of probes

    known = available_names()
    for name in p.enabled:
        if name not in known:
            raise ConfigError(f"[probes] enabled contains {name!r}: known probes are {', '.join(known)}")
    _positive("probes", "cpu_tdp_w", p.cpu_tdp_w, zero_ok=True)
    if s.gpus < 0 or s.gpus > 64:
        raise ConfigError(f"[sim] gpus = {s.gpus!r}: expected 0 (off) to 64")
    if not 0.0 <= s.load <= 1.0:
        raise ConfigError(f"[sim] load = {s.load!r}: expected a fraction from 0.0 to 1.0")
    if not 0.1 <= s.speed_factor <= 10.0:
        raise ConfigError(f"[sim] speed_factor = {s.speed_factor!r}: expected 0.1 to 10 (1 = an H100)")
    _check_gpu_speed_factors(s)
    if not 0.0 <= s.mem_share <= 0.95:
        raise ConfigError(f"[sim] mem_share = {s.mem_share!r}: expected a fraction from 0.0 to 0.95")
    if s.trace:
        from greend.probes.trace import bundled_trace, load_trace

        try:
            load_trace(bundled_trace(s.trace))
        except ConfigError as e:
            raise ConfigError(f"[sim] trace = {s.trace!r}: {e}") from None
    _positive("store", "interval_s", st.interval_s)
    _positive("store", "retention_days", st.retention_days, zero_ok=True)
    if st.retention_days > 36500.0:
        raise ConfigError(
            f"[store] retention_days = {st.retention_days!r}: expected at most 36500 (100 years); 0 keeps every row"
        )
    _positive("store", "raw_hours", st.raw_hours, zero_ok=True)
    if not st.interval_s <= st.rollup_s <= 86400.0:
        raise ConfigError(
            f"[store] rollup_s = {st.rollup_s!r}: expected from interval_s ({st.interval_s:g}) to 86400 seconds"
        )
    if not 0.1 <= st.retry_s <= 86400.0:
        raise ConfigError(f"[store] retry_s = {st.retry_s!r}: expected 0.1 to 86400 seconds")
    _check_policies(cfg)
    _positive("policy", "period_s", cfg.policy.period_s)
    _positive("policy", "settle_s", cfg.policy.settle_s, zero_ok=True)
    _positive("report", "grid_gco2_per_kwh", cfg.report.grid_gco2_per_kwh, zero_ok=True)
    _positive("report", "window_s", cfg.report.window_s)
    from greend.stores import check_url  # late: stores import config types

    seen: set[str] = set()
    for url in st.urls:
        check_url(url)
        if url in seen:
            # Two writers on one store: each batch written twice (a SQLite file's second
            # schema check failed on every batch, and logged points lost that were not).
            raise ConfigError(f"store {url!r} is given twice ([store] urls or --store): give each store once")
        seen.add(url)
    return cfg


def load_config(path: Path | None, *, required: bool | None = None) -> Config:
    """Read ``path`` (default: the system file, if it exists) into a validated Config.

    ``required``: whether a missing file is an error; by default it is when the
    path was given explicitly and not when falling back to the system file.
    """
    explicit = path is not None
    path = path or DEFAULT_CONFIG_PATH
    if required is None:
        required = explicit
    cfg = Config()
    if not path.exists():
        if required:
            raise ConfigError(f"config file {path} does not exist (give an existing file to --config)")
        return validate(cfg)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from e
    except UnicodeDecodeError as e:  # (TOML is UTF-8: a Latin-1 comment, or not a text file)
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
            "save it as UTF-8 (TOML files are)"
        ) from None
    sections = {name: getattr(cfg, name) for name in SECTIONS}
    for key, value in raw.items():
        if key not in sections:
            raise ConfigError(f"{path}: unknown table [{key}]; allowed tables: {', '.join(sections)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {key!r} must be a table ([{key}]), not a {type(value).__name__}")
        try:
            _apply_section(key, sections[key], value)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    cfg.source = str(path)
    try:
        return validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def apply_overrides(cfg: Config, **flags: Any) -> Config:
    """Command-line flags win over the file. ``None`` means "not given"."""
    mapping = {
        "sim": ("sim", "gpus"),
        "sim_dir": ("sim", "dir"),
        "sim_trace": ("sim", "trace"),
        "sysfs_root": ("probes", "sysfs_root"),
        "socket": ("daemon", "socket"),
        "state_dir": ("daemon", "state_dir"),
        "hz": ("daemon", "hz"),
        "dry_run": ("daemon", "dry_run"),
        "store": ("store", "urls"),
    }
    for flag, value in flags.items():
        if value is None or (flag == "store" and not value):
            continue
        section, key = mapping[flag]
        obj = getattr(cfg, section)
        current = getattr(obj, key)
        if isinstance(current, Path):
            value = Path(value)
        elif key in ("dir", "trace"):
            value = str(value)
        setattr(obj, key, value)
    return validate(cfg)
