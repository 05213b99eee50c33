"""``greenctl doctor``: what is missing on this node, and the exact fix.

Each check runs on its own (a failing one never hides the next) and says
``ok``, ``info``, ``warn`` or ``fail`` with a one-line fix.
"""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from greend.config import Config, load_config
from greend.errors import ConfigError, GreendError, NoData, NoPermission, NotSupported
from greend.ipc.client import Client

__all__ = ["Check", "run_checks"]


@dataclass
class Check:
    name: str
    level: str  # ok | info | warn | fail
    detail: str
    fix: str | None = None


def _config(path: Path | None) -> tuple[Config | None, Check]:
    try:
        cfg = load_config(path)
    except ConfigError as e:
        if path is not None and not path.is_file():
            return None, Check("config", "fail", str(e), "give --config an existing TOML file, or leave it out")
        return None, Check(
            "config", "fail", str(e), "fix the setting the message names (greenctl doctor reads it again)"
        )
    return cfg, Check("config", "ok", f"valid ({cfg.source})")


ROOT_FIX = "run greend as root, or give it CAP_SYS_ADMIN (the systemd unit runs it as root)"
PERSISTENCE_FIX = (
    "turn persistence mode on: `nvidia-smi -pm 1` (as root), or run the nvidia-persistenced "
    "daemon (systemctl enable --now nvidia-persistenced)"
)
UNRESPONSIVE_FIX = (
    "check `nvidia-smi` and `dmesg` for Xid errors; a hung driver needs a GPU reset "
    "(`nvidia-smi -r -i <index>`) or a reboot"
)


def _gpu_checks(probe: Any) -> list[Check]:
    """On each GPU: a no-op write (the power limit set to itself), persistence mode,
    MIG, and whether its calls return. One check per finding, GPUs grouped."""
    from greend.probes.nvml_device import Unresponsive

    devices = probe.devices
    wrote: list[str] = []
    refused: dict[str, list[str]] = {}  # level/fix key -> "gpuN: why"
    persistence_off: list[str] = []
    mig: list[str] = []
    hung: dict[str, str] = {}
    for i in probe.gpu_indices:
        name = f"gpu{i}"
        try:
            handle = devices.handle(i)
            mode = devices.call(name, "nvmlDeviceGetPersistenceMode", handle)
            if int(mode) == 0:
                persistence_off.append(name)
        except Unresponsive as e:
            hung[name] = str(e)
            continue
        except GreendError:
            pass  # not supported (or no such call in this driver): nothing to say
        if probe.is_mig(i):
            mig.append(name)
            continue
        try:
            limit = devices.call(name, "nvmlDeviceGetPowerManagementLimit", handle)
            devices.write(i, "nvmlDeviceSetPowerManagementLimit", int(limit))
            wrote.append(name)
        except Unresponsive as e:
            hung[name] = str(e)
        except NoPermission as e:
            refused.setdefault("permission", []).append(f"{name}: {e}")
        except NotSupported as e:
            refused.setdefault("unsupported", []).append(f"{name}: {e}")
        except GreendError as e:
            refused.setdefault("other", []).append(f"{name}: {e}")
    for what, why in devices.unresponsive.items():
        hung.setdefault(what, why)
    out: list[Check] = []
    if wrote:
        out.append(Check("gpu write", "ok", f"a no-op power-limit write took on {', '.join(wrote)}"))
    if refused.get("permission"):
        out.append(
            Check(
                "gpu write",
                "fail",
                "NVML refused a no-op power-limit write (greend could measure but not cap): "
                + "; ".join(refused["permission"]),
                ROOT_FIX,
            )
        )
    if refused.get("unsupported"):
        out.append(
            Check(
                "gpu write",
                "warn",
                "these GPUs do not allow a power limit to be set (greend measures them only): "
                + "; ".join(refused["unsupported"]),
            )
        )
    if refused.get("other"):
        out.append(Check("gpu write", "fail", "a no-op power-limit write failed: " + "; ".join(refused["other"])))
    if persistence_off:
        out.append(
            Check(
                "gpu persistence",
                "warn",
                f"persistence mode is off on {', '.join(persistence_off)}: the driver unloads between "
                "clients, so caps greend sets can be lost and every NVML start is slow",
                PERSISTENCE_FIX,
            )
        )
    elif probe.gpu_indices and not hung:
        out.append(Check("gpu persistence", "ok", "persistence mode is on"))
    if mig:
        out.append(
            Check(
                "gpu mig",
                "info",
                f"{', '.join(mig)} in MIG mode: measured as the whole GPU (NVML has no per-instance energy "
                "counter, so jobs sharing it share its energy) and never capped by greend (a cap would "
                "slow every instance's job)",
                "to cap it, turn MIG off (`nvidia-smi -i <index> -mig 0`, as root, with no processes on it)",
            )
        )
    if hung:
        out.append(
            Check(
                "gpu unresponsive",
                "fail",
                "NVML calls did not return (greend leaves these GPUs out and goes on with the others): "
                + "; ".join(f"{k}: {v}" for k, v in sorted(hung.items())),
                UNRESPONSIVE_FIX,
            )
        )
    return out


def _nvml(nvml_module: object | None = None, *, sim_daemon: bool = False) -> list[Check]:
    from greend.probes.nvml import NvmlProbe

    probe = NvmlProbe(nvml=nvml_module)
    try:
        probe.open()
    except NoData as e:
        if sim_daemon:  # nothing is missing for what runs here
            return [Check("nvml", "info", f"{e}; the daemon that answers runs simulated GPUs, which need no NVML")]
        return [Check("nvml", "warn", str(e))]  # the probe's message carries the fix
    except NoPermission as e:
        return [Check("nvml", "fail", str(e), "run greend as root (the systemd unit does)")]
    except GreendError as e:
        return [Check("nvml", "fail", str(e))]
    try:
        checks = _gpu_checks(probe)
        info = probe.info()
        return [Check("nvml", "ok", info.detail), *checks]
    finally:
        probe.close()


def _rapl(sysfs_root: Path) -> Check:
    from greend.probes.rapl import RaplProbe

    probe = RaplProbe(sysfs_root)
    try:
        probe.open()
        probe.sample(0.0)
        detail = probe.info().detail
    except NoData as e:
        return Check("rapl", "warn", str(e))  # the probe's message carries the fix
    except NoPermission as e:
        return Check(
            "rapl", "fail", str(e), "run greend as root, or give it CAP_DAC_READ_SEARCH (the systemd unit does)"
        )
    except GreendError as e:
        return Check("rapl", "fail", str(e))
    finally:
        probe.close()
    return Check("rapl", "ok", detail)


def _socket(path: Path, timeout_s: float, seen: dict[str, Any]) -> list[Check]:
    """``seen``: filled with the daemon's status document when it answers."""
    out: list[Check] = []
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [
            Check(
                "socket",
                "fail",
                f"no socket at {path}: the daemon is not running there",
                "systemctl start greend (or greend run --socket PATH), or point greenctl at it "
                "with --socket / $GREEND_SOCKET",
            )
        ]
    except PermissionError:
        return [
            Check(
                "socket",
                "fail",
                f"cannot reach {path}: permission denied on a parent directory",
                "join the greend group: sudo usermod -aG greend $USER (then log in again)",
            )
        ]
    if not stat.S_ISSOCK(st.st_mode):
        return [Check("socket", "fail", f"{path} is not a socket", "remove it and restart greend")]
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007:
        out.append(
            Check("socket", "warn", f"{path} is world-accessible (mode {mode:o})", 'set [daemon] socket_mode = "0660"')
        )
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    try:
        with Client(path, timeout_s=timeout_s) as c:
            status = c.request("status")
    except GreendError as e:
        out.append(Check("socket", "fail", str(e)))
        return out
    seen.update(status)
    out.append(
        Check(
            "socket",
            "ok",
            f"{path} (mode {mode:o}, group {group}): greend {status['version']}, "
            f"{len(status['gpus'])} GPUs, {len(status['cpus'])} CPU zones",
        )
    )
    for s in status.get("stores", []):
        if s.get("ok"):
            out.append(Check("store", "ok", f"{s['url']}: {s.get('written', 0)} points written"))
        else:
            out.append(
                Check(
                    "store",
                    "fail",
                    f"{s['url']}: {s.get('last_error')}",
                    "check the URL, that the server is up, and the token in GREEND_INFLUX_TOKEN",
                )
            )
    for p in status.get("probes", []):
        if p.get("open") and not p.get("success"):
            out.append(Check(f"probe {p['name']}", "warn", f"failing: {p.get('last_error')}"))
    return out


def _stores_offline(cfg: Config, timeout_s: float) -> list[Check]:
    """The configured stores, checked from here while no daemon answers (a running one
    reports its own stores in the socket check)."""
    import socket as socketlib
    from urllib.parse import urlsplit

    out: list[Check] = []
    for raw_url in cfg.store_urls:
        parts = urlsplit(raw_url)
        # As printed: without a password or query (a token there would reach the terminal).
        url = f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
        if parts.scheme == "sqlite":
            path = Path(parts.path)
            d = path.parent
            while not d.exists() and d != d.parent:
                d = d.parent  # the nearest existing parent: greend creates the rest
            where = path if path.exists() else d
            if os.access(where, os.W_OK):
                out.append(Check("store", "ok", f"{url}: {where} is writable"))
            else:
                out.append(
                    Check(
                        "store",
                        "warn",
                        f"{url}: {where} is not writable by this user",
                        "fine if greend runs as root; else choose a writable path",
                    )
                )
            continue
        host, port = parts.hostname or "127.0.0.1", parts.port
        if parts.scheme == "influx":
            try:
                with socketlib.create_connection((host, port or 8086), timeout=min(timeout_s, 2.0)):
                    pass
            except OSError as e:
                out.append(
                    Check(
                        "store",
                        "warn",
                        f"{url}: cannot reach {host}:{port} ({e.strerror or e})",
                        "start the InfluxDB server, or fix HOST:PORT; greend spools points meanwhile and loses none",
                    )
                )
                continue
            if not os.environ.get("GREEND_INFLUX_TOKEN"):
                out.append(
                    Check(
                        "store",
                        "info",
                        f"{url}: {host}:{port} answers; GREEND_INFLUX_TOKEN is not set here",
                        "set it in /etc/default/greend for the service",
                    )
                )
            else:
                out.append(Check("store", "ok", f"{url}: {host}:{port} answers"))
        elif parts.scheme == "prometheus":
            probe = socketlib.socket(socketlib.AF_INET6 if ":" in host else socketlib.AF_INET)
            try:
                probe.bind((host, port or 9464))
                out.append(Check("store", "ok", f"{url}: {host}:{port} is free for greend's /metrics"))
            except OSError as e:
                out.append(
                    Check(
                        "store",
                        "warn",
                        f"{url}: cannot listen on {host}:{port} ({e.strerror or e})",
                        "another process holds the port: choose another, or stop it",
                    )
                )
            finally:
                probe.close()
    return out


def _state_dir(cfg: Config, status: dict[str, Any]) -> Check:
    """The state dir of the daemon that answers (else the config's)."""
    d = Path(status["state_dir"]) if status.get("state_dir") else cfg.daemon.state_dir
    if not d.exists():
        return Check("state dir", "info", f"{d} does not exist yet (greend creates it at start)")
    if not os.access(d, os.W_OK):
        return Check(
            "state dir",
            "warn",
            f"{d} is not writable by this user",
            "fine for greenctl; the daemon's user (root under systemd) must be able to write it",
        )
    return Check("state dir", "ok", f"{d} writable")


def _groups(cfg: Config) -> Check:
    name = cfg.daemon.socket_group
    if not name:
        return Check(
            "group", "info", "no socket group configured: only root and the daemon's own user can use the socket"
        )
    try:
        grp.getgrnam(name)
    except KeyError:
        return Check(
            "group",
            "warn",
            f"group {name!r} does not exist: only root and the daemon's own user can use the socket",
            f"groupadd --system {name} (systemd-sysusers does it from systemd/greend.sysusers)",
        )
    return Check("group", "ok", f"group {name!r} exists")


def run_checks(
    *,
    config: Path | None,
    socket: Path | None,
    sysfs_root: Path,
    timeout_s: float = 5.0,
    nvml_module: object | None = None,
) -> list[Check]:
    """``socket``: the one the user named; None: the config's (else the default)."""
    from greend.config import default_socket_path

    cfg, c = _config(config)
    checks = [c]
    sock = socket if socket is not None else cfg.daemon.socket if cfg is not None else default_socket_path()
    socket_checks: list[Check] = []
    status: dict[str, Any] = {}  # the answering daemon's status document

    def check_socket() -> list[Check]:
        socket_checks[:] = _socket(sock, timeout_s, status)
        return socket_checks

    def sim_daemon() -> bool:
        return any(g.get("source") == "sim" for g in status.get("gpus", []))

    # The socket first: what the daemon that answers runs decides what is missing here.
    steps: list[Callable[[], list[Check] | Check]] = [
        check_socket,
        lambda: _nvml(nvml_module, sim_daemon=sim_daemon()),
        lambda: _rapl(sysfs_root if cfg is None or sysfs_root != Path("/sys") else cfg.probes.sysfs_root),
    ]
    if cfg is not None:
        steps += [lambda: _state_dir(cfg, status), lambda: _groups(cfg)]
        # No daemon answering: check the stores from here instead.
        steps.append(
            lambda: (
                _stores_offline(cfg, timeout_s)
                if any(x.name == "socket" and x.level == "fail" for x in socket_checks)
                else []
            )
        )
    for step in steps:
        try:
            r = step()
        except Exception as e:
            r = Check("doctor", "fail", f"check crashed: {type(e).__name__}: {e}")
        checks.extend(r if isinstance(r, list) else [r])
    return checks
