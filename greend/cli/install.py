"""Install greend as a systemd service: ``greenctl install-systemd``.

Copies the files of the repository's ``systemd/`` folder into an OS tree
(``prefix``, ``/`` for the running system, a staging directory for an image)::

    systemd/greend.service   -> etc/systemd/system/greend.service   (ExecStart= rewritten)
    systemd/greend.sysusers  -> etc/sysusers.d/greend.conf
    systemd/greend.tmpfiles  -> etc/tmpfiles.d/greend.conf
    systemd/greend.default   -> etc/default/greend                  (0600; never overwritten)
    systemd/greend.toml      -> etc/greend/greend.toml              (never overwritten)

    systemd/greend-network.conf -> etc/systemd/system/greend.service.d/network.conf
                             (only when a store needs the network; removed otherwise)

The unit has no network (PrivateNetwork=yes): the default SQLite store and the Unix
socket need none. The drop-in gives the host's network back when the installed
config's ``[store] urls`` or ``GREEND_OPTS``' ``--store`` in the environment file name
a store that is not SQLite (``influx://``, ``prometheus://``), or when ``network`` says
so; a config that cannot be read counts as needing it.

The unit names ``/usr/bin/greend``; its ``ExecStart=`` and ``ExecStopPost=`` are
rewritten to the greend that is really installed (a venv's, ``/usr/local/bin``'s).
The unit, sysusers and tmpfiles snippets are ours and are replaced on every
install (an upgrade); the environment file and the config are the operator's
and are kept when present.

On the running system (``prefix`` is ``/``) it then applies them:
``systemd-sysusers``, ``systemd-tmpfiles --create``, ``systemctl daemon-reload``
and, with ``enable``, ``systemctl enable --now greend.service``. The systemctl
steps need a booted systemd (``/run/systemd/system`` exists, as in
``sd_booted(3)``) and are skipped with the reason otherwise.

``dry_run`` returns the same list of actions and touches nothing.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from greend.errors import ConfigError, GreendError

__all__ = [
    "UNIT_BIN",
    "default_greend_bin",
    "find_systemd_dir",
    "hidden_from_unit",
    "install_systemd",
    "render_unit",
]

log = logging.getLogger(__name__)

UNIT_BIN = "/usr/bin/greend"  # what the shipped unit names; rewritten on install
UNIT_NAME = "greend.service"
NETWORK_DROPIN = "etc/systemd/system/greend.service.d/network.conf"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class _File:
    source: str  # name in systemd/
    target: str  # path under prefix
    mode: int
    keep_existing: bool


_FILES = (
    _File("greend.service", "etc/systemd/system/greend.service", 0o644, False),
    _File("greend.sysusers", "etc/sysusers.d/greend.conf", 0o644, False),
    _File("greend.tmpfiles", "etc/tmpfiles.d/greend.conf", 0o644, False),
    # May hold GREEND_INFLUX_TOKEN: root only.
    _File("greend.default", "etc/default/greend", 0o600, True),
    _File("greend.toml", "etc/greend/greend.toml", 0o644, True),
)


def find_systemd_dir(explicit: Path | None = None) -> Path:
    """Where the shipped unit files are.

    In order: ``explicit``; ``$GREEND_SYSTEMD_DIR``; the ``systemd/`` folder of the
    source tree this module runs from (a checkout or an editable install);
    ``<sys.prefix>/share/greend/systemd`` (where a wheel's data files land).
    """
    if explicit is not None:
        if (explicit / "greend.service").is_file():
            return explicit
        raise ConfigError(f"{explicit}: no greend.service there (give the repository's systemd/ folder)")
    candidates: list[Path] = []
    env = os.environ.get("GREEND_SYSTEMD_DIR")
    if env:
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[2] / "systemd")
    candidates.append(Path(sys.prefix) / "share" / "greend" / "systemd")
    for c in candidates:
        if (c / "greend.service").is_file():
            return c
    raise ConfigError(
        "cannot find greend's systemd files (looked in: "
        + ", ".join(str(c) for c in candidates)
        + "); set GREEND_SYSTEMD_DIR to the repository's systemd/ folder"
    )


def default_greend_bin() -> str | None:
    """The greend to name in ExecStart=: the one installed beside this Python
    (a venv's ``bin/``, ``/usr/bin``), else the first on ``$PATH``; absolute."""
    beside = Path(sys.executable).parent / "greend"  # not resolved: keep the venv's path
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("greend")
    return str(Path(found).absolute()) if found else None


_EXEC_RE = re.compile(
    r"^(Exec(?:Start|StartPre|StartPost|Stop|StopPost|Reload)=[-@:+!]*)" + re.escape(UNIT_BIN) + r"(?=\s|$)",
    re.MULTILINE,
)


def render_unit(text: str, greend_bin: str) -> str:
    """The unit with every ``Exec*=/usr/bin/greend`` pointing at ``greend_bin``."""
    if not greend_bin.startswith("/"):
        raise ConfigError(f"greend binary {greend_bin!r}: systemd needs an absolute path")
    if any(ch.isspace() for ch in greend_bin) or "%" in greend_bin or "$" in greend_bin:
        raise ConfigError(
            f"greend binary {greend_bin!r}: no whitespace, % or $ (systemd would split or expand it);"
            " install greend under a plain path or link it there"
        )
    out, n = _EXEC_RE.subn(lambda m: m.group(1) + greend_bin, text)
    if n == 0:
        raise ConfigError(f"the unit has no Exec line naming {UNIT_BIN}: nothing to rewrite")
    return out


def _write_atomic(path: Path, data: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _network_stores(prefix: Path) -> list[str] | None:
    """The store URLs under ``prefix`` that need the network: the config's
    ``[store] urls`` and ``--store`` in GREEND_OPTS, other than ``sqlite:``; None
    when the config cannot be read (then the network is kept, to be safe)."""
    import shlex
    import tomllib

    urls: list[str] = []
    cfg = prefix / _FILES[4].target
    try:
        if cfg.exists():
            with open(cfg, "rb") as fh:
                urls += [str(u) for u in (tomllib.load(fh).get("store", {}).get("urls") or [])]
        env = prefix / _FILES[3].target
        if env.exists():
            for line in env.read_text().splitlines():
                key, _, value = line.strip().partition("=")
                if key.strip() != "GREEND_OPTS":
                    continue
                # the value (quotes removed, as systemd reads the file), split into words
                # as the unit's unbraced $GREEND_OPTS is
                words = [w for part in shlex.split(value) for w in part.split()]
                for i, w in enumerate(words):
                    if w == "--store" and i + 1 < len(words):
                        urls.append(words[i + 1])
                    elif w.startswith("--store="):
                        urls.append(w.split("=", 1)[1])
    except (OSError, ValueError, AttributeError) as e:
        log.warning("install-systemd: cannot read the stores from %s (%s): keeping the network", cfg, e)
        return None
    return [u for u in urls if not u.startswith("sqlite:")]


def _default_runner(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def _booted(root: Path) -> bool:
    """sd_booted(3): a running systemd is PID 1 (not a container without it)."""
    return (root / "run" / "systemd" / "system").is_dir()


def _is_live(prefix: Path) -> bool:
    """Whether ``prefix`` is this machine's own root (so the tools may be run)."""
    try:
        return prefix.resolve() == Path("/").resolve()
    except OSError:
        return False


# What the unit's sandbox hides from the service (greend.service: ProtectHome=yes makes
# these inaccessible; PrivateTmp=yes gives the service empty /tmp and /var/tmp of its own).
_HIDDEN_BY_UNIT = {
    "/home": "ProtectHome=yes",
    "/root": "ProtectHome=yes",
    "/run/user": "ProtectHome=yes",
    "/tmp": "PrivateTmp=yes",
    "/var/tmp": "PrivateTmp=yes",
}


def hidden_from_unit(greend_bin: str) -> list[str]:
    """Why the unit could not run ``greend_bin``: each path it needs (the script, where
    its links lead, its interpreter from the ``#!`` line) that the unit's sandbox hides,
    as ``PATH (under DIR, hidden by SETTING)``. Empty when the service can reach them."""
    needed: list[str] = [greend_bin]
    try:
        needed.append(os.path.realpath(greend_bin))
        with open(greend_bin, "rb") as fh:
            first = fh.readline(512)
        if first.startswith(b"#!"):
            interp = first[2:].decode("utf-8", "replace").split()
            if interp:
                needed += [interp[0], os.path.realpath(interp[0])]
    except OSError:
        pass  # not readable here (another prefix): judge the path alone
    out: list[str] = []
    for p in dict.fromkeys(needed):
        for top, setting in _HIDDEN_BY_UNIT.items():
            if p == top or p.startswith(top + "/"):
                out.append(f"{p} (under {top}, hidden by {setting})")
    return out


def install_systemd(
    prefix: Path = Path("/"),
    *,
    greend_bin: str,
    hidden_ok: bool = False,
    enable: bool = False,
    dry_run: bool = False,
    source_dir: Path | None = None,
    runner: Runner | None = None,
    network: bool | None = None,
) -> list[str]:
    """Install the unit and its companions under ``prefix``; the actions, in order.

    Each action is one line: ``write PATH``, ``keep PATH (exists)``,
    ``run CMD ...`` or ``skip CMD ...: why``. With ``dry_run`` nothing is written
    or run and the lines say what would be done. ``network``: install the network
    drop-in (True), remove it (False), or decide from the stores configured (None).
    ``hidden_ok``: install even when the unit's sandbox hides ``greend_bin`` or its
    interpreter (:func:`hidden_from_unit`; refused otherwise). Raises :class:`ConfigError` for
    bad arguments and :class:`GreendError` when a file cannot be written or a
    command fails (the message says which, and what it printed).
    """
    src = find_systemd_dir(source_dir)
    unit = render_unit((src / "greend.service").read_text(), greend_bin)
    missing_bin = None
    if Path(prefix) == Path("/") and not (os.path.isfile(greend_bin) and os.access(greend_bin, os.X_OK)):
        # (under another --prefix, an image being built, the binary is that system's)
        missing_bin = (
            f"greend binary {greend_bin}: not there, or not executable; the unit would fail at its first start "
            "(give --greend-bin the path `command -v greend` prints)"
        )
        if not dry_run:
            raise ConfigError(missing_bin)
    hidden = hidden_from_unit(greend_bin)
    if hidden and not hidden_ok:
        raise ConfigError(
            f"ExecStart={greend_bin} would not start: the unit's sandbox hides "
            + "; ".join(hidden)
            + ". Install greend where the service can reach it, e.g. "
            "sudo python3 -m venv /opt/greend && sudo /opt/greend/bin/pip install . && "
            "sudo /opt/greend/bin/greenctl install-systemd (or give --greend-bin /usr/local/bin/greend); "
            "--force installs the unit anyway"
        )
    run = runner or _default_runner
    prefix = Path(prefix)
    actions: list[str] = [f"note {missing_bin}"] if missing_bin else []

    for f in _FILES:
        target = prefix / f.target
        if f.keep_existing and (target.exists() or target.is_symlink()):
            actions.append(f"keep {target} (exists)")
            continue
        data = unit if f.source == "greend.service" else (src / f.source).read_text()
        actions.append(f"write {target}")
        if dry_run:
            continue
        try:
            _write_atomic(target, data, f.mode)
        except OSError as e:
            hint = " (run as root)" if isinstance(e, PermissionError) else ""
            raise GreendError(f"cannot write {target}: {e.strerror or e}{hint}") from e

    # The network drop-in: after the config and the environment file are in place.
    dropin = prefix / NETWORK_DROPIN
    if network is None:
        remote = _network_stores(prefix)
        network = remote is None or bool(remote)
    if network:
        actions.append(f"write {dropin}")
        if not dry_run:
            try:
                _write_atomic(dropin, (src / "greend-network.conf").read_text(), 0o644)
            except OSError as e:
                raise GreendError(f"cannot write {dropin}: {e.strerror or e}") from e
    elif dropin.exists():
        actions.append(f"remove {dropin} (no store needs the network)")
        if not dry_run:
            dropin.unlink()

    live = _is_live(prefix)
    commands: list[tuple[list[str], str | None]] = []
    sysusers = "/" + _FILES[1].target
    tmpfiles = "/" + _FILES[2].target
    if not live:
        why = f"prefix {prefix} is not /"
        commands += [
            (["systemd-sysusers", sysusers], why),
            (["systemd-tmpfiles", "--create", tmpfiles], why),
            (["systemctl", "daemon-reload"], why),
        ]
        if enable:
            commands.append((["systemctl", "enable", "--now", UNIT_NAME], why))
    else:
        for argv in (["systemd-sysusers", sysusers], ["systemd-tmpfiles", "--create", tmpfiles]):
            commands.append((argv, None if shutil.which(argv[0]) else f"{argv[0]} not found"))
        if shutil.which("systemctl") is None:
            ctl_why: str | None = "systemctl not found"
        elif not _booted(prefix):
            ctl_why = "systemd is not running here (no /run/systemd/system)"
        else:
            ctl_why = None
        commands.append((["systemctl", "daemon-reload"], ctl_why))
        if enable:
            commands.append((["systemctl", "enable", "--now", UNIT_NAME], ctl_why))

    for argv, skip_why in commands:
        cmd = " ".join(argv)
        if skip_why is not None:
            actions.append(f"skip {cmd}: {skip_why}")
            continue
        actions.append(f"run {cmd}")
        if dry_run:
            continue
        try:
            res = run(argv)
        except OSError as e:
            raise GreendError(f"{cmd}: {e.strerror or e}") from e
        if res.returncode != 0:
            out = ((res.stderr or "") + (res.stdout or "")).strip()
            raise GreendError(f"{cmd} failed (exit {res.returncode}){': ' + out if out else ''}")
    for a in actions:
        log.info("install-systemd: %s%s", "(dry run) " if dry_run else "", a)
    return actions
