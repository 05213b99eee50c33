"""The systemd unit and its companions: sandbox score, content, verify, install.

Needs ``systemd-analyze`` (systemd 252 here; no running systemd: ``security``
scores the file with ``--offline=true``, ``verify`` loads it without a manager).
Tests that need a tool this machine lacks are skipped with the reason.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

import greend.config
from greend.cli.install import default_greend_bin, find_systemd_dir, install_systemd, render_unit
from greend.config import load_config
from greend.errors import ConfigError
from tests.support import REPO

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "greend.service"
NETWORK_DROPIN = SYSTEMD / "greend-network.conf"
MAX_EXPOSURE = 1.7
MAX_EXPOSURE_WITH_NETWORK = 2.2  # the host's network for a remote store or Prometheus

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")


def unit_settings() -> dict[str, list[str]]:
    """Key -> every value, in order (systemd keys repeat; configparser cannot)."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def words(settings: dict[str, list[str]], key: str) -> set[str]:
    return {w for v in settings.get(key, []) for w in v.split()}


def analyze(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    env = dict(os.environ, SYSTEMD_PAGER="cat", SYSTEMD_COLORS="0")
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, env=env, timeout=120, cwd=cwd)


# The sandbox score -------------------------------------------------------------------


@needs_analyze
def test_security_exposure_is_at_most_1_7(figure: Callable[[str], None]) -> None:
    res = analyze("security", "--offline=true", str(UNIT))
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert m, f"no exposure figure (rc {res.returncode}):\n{res.stdout}\n{res.stderr}"
    exposure = float(m.group(1))
    bad = [ln.strip() for ln in res.stdout.splitlines() if ln.lstrip().startswith("✗")]
    names = [ln.lstrip("✗ ").split()[0] for ln in bad]
    figure(
        f"systemd-analyze security --offline=true {UNIT.name}: exposure {exposure} "
        f"(limit {MAX_EXPOSURE}); still exposed: {', '.join(names)}"
    )
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}; exposed items:\n" + "\n".join(bad)
    # The same limit the way CI would enforce it: --threshold is in tenths.
    gate = analyze("security", "--offline=true", f"--threshold={int(MAX_EXPOSURE * 10)}", str(UNIT))
    assert gate.returncode == 0, f"--threshold={int(MAX_EXPOSURE * 10)} refused exposure {exposure}"


@needs_analyze
def test_security_exposure_with_the_network_dropin(tmp_path: Path, figure: Callable[[str], None]) -> None:
    """The unit as installed with greend-network.conf (a remote store configured),
    scored by systemd-analyze from an OS tree holding both."""
    install_systemd(tmp_path, greend_bin=runnable_binary(), network=True, hidden_ok=True)
    res = analyze("security", "--offline=true", f"--root={tmp_path}", "greend.service")
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert m, f"no exposure figure (rc {res.returncode}):\n{res.stdout}\n{res.stderr}"
    exposure = float(m.group(1))
    exposed = [ln.lstrip("✗ ").split()[0] for ln in res.stdout.splitlines() if ln.lstrip().startswith("✗")]
    figure(
        f"systemd-analyze security --offline=true greend.service + {NETWORK_DROPIN.name}: exposure {exposure} "
        f"(limit {MAX_EXPOSURE_WITH_NETWORK})"
    )
    assert "PrivateNetwork=" in exposed, "the drop-in was not read: the figure would be the bare unit's"
    assert exposure <= MAX_EXPOSURE_WITH_NETWORK, res.stdout


def test_network_dropin_gives_back_inet_and_nothing_else() -> None:
    settings = [ln.strip() for ln in NETWORK_DROPIN.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert settings == [
        "[Service]",
        "PrivateNetwork=no",
        "IPAddressDeny=",
        "RestrictAddressFamilies=",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    ]


# What the unit must say ---------------------------------------------------------------


def test_unit_service_contract() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["WatchdogSec"] and s["WatchdogSec"][0] not in ("0", "infinity")
    assert s["Restart"] == ["on-failure"]
    assert s["EnvironmentFile"] == ["-/etc/default/greend"]
    (start,) = s["ExecStart"]
    assert start.split()[:4] == ["/usr/bin/greend", "run", "--config", "/etc/greend/greend.toml"]
    assert "$GREEND_OPTS" in start.split()  # unbraced: split into words
    assert any(
        v.split()[:2] == ["/usr/bin/greend", "restore"] and "--state-dir" in v and "/var/lib/greend" in v
        for v in s["ExecStopPost"]
    ), s["ExecStopPost"]
    assert s["RuntimeDirectory"] == ["greend"] and s["RuntimeDirectoryMode"] == ["0750"]
    assert s["StateDirectory"] == ["greend"]
    assert s["ConfigurationDirectory"] == ["greend"]
    # The socket's directory belongs to the group the socket is for.
    assert s["Group"] == [greend.config.DaemonConfig().socket_group]
    assert str(greend.config.DaemonConfig().state_dir) == "/var/lib/greend"
    assert "[Install]" in UNIT.read_text() and s["WantedBy"] == ["multi-user.target"]


def test_unit_keeps_nvml_and_rapl_reachable() -> None:
    s = unit_settings()
    caps = words(s, "CapabilityBoundingSet")
    assert caps == {"CAP_SYS_ADMIN"}  # NVML's setters; root owns what it reads and writes
    assert not {c for c in caps if c.startswith("~")}, "an allow list, not a deny list"
    assert "CAP_SYS_PTRACE" not in caps and "CAP_NET_ADMIN" not in caps
    # PrivateDevices=yes hides /dev/nvidia*: a closed device policy with NVIDIA entries instead.
    assert s.get("PrivateDevices", ["no"])[-1] in ("no", "false", "0")
    assert s["DevicePolicy"] == ["closed"]
    allowed = [v.split()[0] for v in s["DeviceAllow"]]
    assert "char-nvidia-frontend" in allowed and "/dev/nvidiactl" in allowed
    assert "char-nvidia-uvm" in allowed and "char-nvidia-caps" in allowed
    assert all(v.split()[1] == "rw" for v in s["DeviceAllow"])
    # /sys is read-only under ProtectKernelTunables=: the powercap trees are excepted.
    rw = words(s, "ReadWritePaths")
    assert {"-/sys/class/powercap/", "-/sys/devices/virtual/powercap/"} <= rw
    assert s["ProtectSystem"] == ["strict"]
    # Training processes of other users stay visible (per-job CPU time via psutil).
    assert s.get("ProtectProc", ["default"]) == ["default"]
    assert s.get("ProcSubset", ["all"]) == ["all"]
    # A user namespace would strip root's capabilities on host devices.
    assert s.get("PrivateUsers", ["no"])[-1] in ("no", "false", "0")


def test_unit_network_and_syscalls() -> None:
    s = unit_settings()
    # No network unless greend-network.conf is installed (a remote store, Prometheus).
    assert s["PrivateNetwork"] == ["yes"] and s["IPAddressDeny"] == ["any"]
    assert words(s, "RestrictAddressFamilies") == {"AF_UNIX"}
    assert s["SystemCallFilter"][0] == "@system-service"
    assert words(s, "SystemCallFilter") >= {"~@privileged", "@resources"}
    assert s["SystemCallErrorNumber"] == ["EPERM"]
    assert s["SystemCallArchitectures"] == ["native"]
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "LockPersonality",
        "MemoryDenyWriteExecute",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "RemoveIPC",
        "PrivateIPC",
        "ProtectKernelTunables",
    ):
        assert s.get(key) == ["yes"], key
    assert s["UMask"] == ["0077"] and s["KeyringMode"] == ["private"]
    assert "SecureBits" not in s, "noroot would strip the capabilities of root's exec"


def test_unit_explains_itself() -> None:
    text = UNIT.read_text()
    for topic in (
        "ProtectKernelTunables",
        "PrivateDevices",
        "ProtectProc",
        "MemoryDenyWriteExecute",
        "PrivateUsers",
        "PrivateNetwork",
        "ExecStopPost",
    ):
        assert re.search(rf"^#.*{topic}", text, re.MULTILINE), f"no comment on {topic}"


# systemd-analyze verify ---------------------------------------------------------------


def runnable_copy(tmp_path: Path) -> Path:
    """The unit with its Exec paths pointing at a greend that exists here.

    verify refuses ``/usr/bin/greend`` when it is missing ("Command ... is not
    executable"), so the copy names the greend script next to this Python (the
    venv's), or, failing that, the interpreter itself.
    """
    copy = tmp_path / "greend.service"
    copy.write_text(render_unit(UNIT.read_text(), runnable_binary()))
    return copy


def runnable_binary() -> str:
    """The greend script next to this Python (the venv's), or the interpreter itself."""
    exe = Path(sys.executable).parent / "greend"
    return str(exe) if exe.exists() else sys.executable


@needs_analyze
def test_verify_accepts_the_unit(tmp_path: Path) -> None:
    copy = runnable_copy(tmp_path)
    res = analyze("verify", str(copy), cwd=tmp_path)
    out = (res.stdout + res.stderr).strip()
    print(
        f"\nsystemd-analyze verify (copy with ExecStart={copy.read_text().split('ExecStart=')[1].split()[0]}):"
        f" rc {res.returncode}; output: {out or '(none)'}"
    )
    if res.returncode != 0 and re.search(
        r"(?i)not booted|failed to connect|no such file.*bus|"
        r"failed to initialize manager",
        out,
    ):
        pytest.skip(f"verify cannot run without a booted systemd here: {out}")
    assert res.returncode == 0, out
    # verify warns (exit 0) about unknown keys and bad values: none may name our unit.
    ours = [ln for ln in out.splitlines() if copy.name in ln]
    assert not ours, "\n".join(ours)


@needs_analyze
def test_verify_would_catch_a_mistake(tmp_path: Path) -> None:
    """Control: the verify above is not vacuous on this machine."""
    copy = runnable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("Type=notify", "Type=notfy\nProtectSytem=strict"))
    res = analyze("verify", str(copy), cwd=tmp_path)
    out = res.stdout + res.stderr
    if "not booted" in out:
        pytest.skip(out)
    assert "Unknown key" in out and "ProtectSytem" in out, out
    assert "Failed to parse service type" in out, out
    missing = tmp_path / "missing.service"
    missing.write_text(UNIT.read_text().replace("/usr/bin/greend", str(tmp_path / "no-such-greend")))
    res = analyze("verify", str(missing), cwd=tmp_path)
    assert res.returncode != 0 and "not executable" in res.stdout + res.stderr


# sysusers, tmpfiles, the environment file --------------------------------------------


def test_sysusers_declares_both_groups() -> None:
    lines = [
        ln.split()
        for ln in (SYSTEMD / "greend.sysusers").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    groups = {ln[1] for ln in lines if ln[0] == "g"}
    d = greend.config.DaemonConfig()
    assert groups == {d.socket_group, d.admin_group} == {"greend", "greend-admin"}
    assert not [ln for ln in lines if ln[0] == "u"], "the daemon runs as root: no user"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_creates_the_groups_in_a_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    res = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "greend.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    names = {ln.split(":")[0] for ln in (tmp_path / "etc" / "group").read_text().splitlines()}
    assert {"greend", "greend-admin"} <= names


@pytest.mark.skipif(
    shutil.which("systemd-tmpfiles") is None or os.geteuid() != 0,
    reason="needs systemd-tmpfiles and root (it sets owners)",
)
def test_tmpfiles_creates_the_directories(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "greend.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    res = subprocess.run(
        ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(SYSTEMD / "greend.tmpfiles")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    st = (tmp_path / "var/lib/greend").stat()
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert (tmp_path / "etc/greend").is_dir()


def test_default_env_file() -> None:
    text = (SYSTEMD / "greend.default").read_text()
    assigned = dict(re.findall(r"^([A-Z_]+)=(.*)$", text, re.MULTILINE))
    assert "GREEND_OPTS" in assigned
    assert "GREEND_INFLUX_TOKEN" in text  # documented, not set


# The example config ---------------------------------------------------------------------


def docstring_block() -> list[str]:
    doc = greend.config.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\nUnknown keys", 1)[0]
    return [ln[4:] if ln.startswith("    ") else ln for ln in block.splitlines()]


def uncommented_example() -> str:
    out = []
    for ln in (SYSTEMD / "greend.toml").read_text().splitlines():
        if ln.startswith("# ") and re.match(r"# [a-z0-9_]+ = ", ln):
            out.append(ln[2:])
        elif ln.startswith("#"):
            continue
        else:
            out.append(ln)
    return "\n".join(out).strip()


def test_example_config_matches_the_docstring() -> None:
    assert uncommented_example() == "\n".join(docstring_block()).strip()


def test_example_config_as_shipped_is_all_defaults(tmp_path: Path) -> None:
    cfg = load_config(SYSTEMD / "greend.toml")
    default = load_config(tmp_path / "absent.toml", required=False)
    assert cfg.to_json() == default.to_json()


def test_every_key_in_the_example_is_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GREEND_SOCKET", raising=False)
    full = tmp_path / "full.toml"
    full.write_text(uncommented_example() + "\n")
    raw = tomllib.loads(full.read_text())
    cfg = load_config(full)  # refuses any unknown key or bad value
    # Every key of every section is shown, with its default value.
    for section, values in cfg.to_json().items():
        assert set(raw[section]) == set(values), section
        assert raw[section] == values, section


# install_systemd ------------------------------------------------------------------------


def test_install_into_a_prefix(tmp_path: Path) -> None:
    actions = install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend")
    unit = (tmp_path / "etc/systemd/system/greend.service").read_text()
    assert "ExecStart=/opt/greend/bin/greend run --config /etc/greend/greend.toml $GREEND_OPTS" in unit
    assert "ExecStopPost=/opt/greend/bin/greend restore --state-dir /var/lib/greend" in unit
    assert "/usr/bin/greend" not in [
        w for ln in unit.splitlines() if ln.startswith("Exec") for w in ln.split("=", 1)[1].split()
    ]
    assert (tmp_path / "etc/sysusers.d/greend.conf").read_text() == (SYSTEMD / "greend.sysusers").read_text()
    assert (tmp_path / "etc/tmpfiles.d/greend.conf").read_text() == (SYSTEMD / "greend.tmpfiles").read_text()
    env = tmp_path / "etc/default/greend"
    assert env.read_text() == (SYSTEMD / "greend.default").read_text()
    assert stat.S_IMODE(env.stat().st_mode) == 0o600  # may hold the InfluxDB token
    assert (tmp_path / "etc/greend/greend.toml").read_text() == (SYSTEMD / "greend.toml").read_text()
    assert stat.S_IMODE((tmp_path / "etc/systemd/system/greend.service").stat().st_mode) == 0o644
    writes = [a for a in actions if a.startswith("write ")]
    assert len(writes) == 5
    # Not the live system: nothing is run, and the list says so.
    assert not [a for a in actions if a.startswith("run ")]
    assert any(a.startswith("skip systemctl daemon-reload") for a in actions), actions
    print("\n" + "\n".join(actions))


def test_install_adds_the_network_dropin_only_for_a_network_store(tmp_path: Path) -> None:
    dropin = tmp_path / "etc/systemd/system/greend.service.d/network.conf"
    install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend")
    assert not dropin.exists()  # the shipped config: SQLite only
    cfg = tmp_path / "etc/greend/greend.toml"
    cfg.write_text('[store]\nurls = ["sqlite:///var/lib/greend/greend.db", "influx://db:8086?org=o&bucket=b"]\n')
    actions = install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend")
    assert f"write {dropin}" in actions
    assert dropin.read_text() == NETWORK_DROPIN.read_text()
    cfg.write_text('[store]\nurls = ["sqlite:///var/lib/greend/greend.db"]\n')
    env = tmp_path / "etc/default/greend"
    env.write_text('GREEND_OPTS="--store prometheus://0.0.0.0:9464"\n')
    install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend")
    assert dropin.exists()  # the environment file's --store counts too
    env.write_text('GREEND_OPTS=""\n')
    actions = install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend")
    assert not dropin.exists() and any(a.startswith(f"remove {dropin}") for a in actions)
    cfg.write_text("[store\n")  # unreadable: the network is kept
    install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend")
    assert dropin.exists()


def test_install_keeps_the_operators_files(tmp_path: Path) -> None:
    env = tmp_path / "etc/default/greend"
    cfg = tmp_path / "etc/greend/greend.toml"
    env.parent.mkdir(parents=True)
    cfg.parent.mkdir(parents=True)
    env.write_text('GREEND_OPTS="--hz 2"\n')
    cfg.write_text("[daemon]\nhz = 2.0\n")
    old_unit = tmp_path / "etc/systemd/system/greend.service"
    old_unit.parent.mkdir(parents=True)
    old_unit.write_text("[Service]\nExecStart=/old\n")
    actions = install_systemd(tmp_path, greend_bin="/usr/local/bin/greend", enable=True)
    assert env.read_text() == 'GREEND_OPTS="--hz 2"\n'
    assert cfg.read_text() == "[daemon]\nhz = 2.0\n"
    assert f"keep {env} (exists)" in actions and f"keep {cfg} (exists)" in actions
    assert "ExecStart=/usr/local/bin/greend run" in old_unit.read_text()  # ours: upgraded
    assert any(a.startswith("skip systemctl enable --now greend.service") for a in actions)


def test_install_dry_run_touches_nothing(tmp_path: Path) -> None:
    dry, real = tmp_path / "dry", tmp_path / "real"
    dry.mkdir()
    planned = install_systemd(dry, greend_bin="/usr/bin/greend", dry_run=True)
    assert list(dry.iterdir()) == []
    done = install_systemd(real, greend_bin="/usr/bin/greend")
    assert planned == [a.replace(str(real), str(dry)) for a in done]
    assert [a.split()[0] for a in planned][:5] == ["write"] * 5


def test_install_on_the_live_system_runs_the_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """prefix "/" with a dry run: which commands would run, in order, and nothing written."""
    import greend.cli.install as inst

    monkeypatch.setattr(inst.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(inst, "_booted", lambda root: True)
    ran: list[list[str]] = []
    actions = install_systemd(
        Path("/"), greend_bin="/usr/bin/greend", enable=True, dry_run=True, runner=lambda argv: ran.append(list(argv))
    )  # type: ignore[arg-type,func-returns-value]
    assert ran == []  # dry run
    assert [a for a in actions if a.startswith("run ")] == [
        "run systemd-sysusers /etc/sysusers.d/greend.conf",
        "run systemd-tmpfiles --create /etc/tmpfiles.d/greend.conf",
        "run systemctl daemon-reload",
        "run systemctl enable --now greend.service",
    ]


def test_install_runs_commands_and_reports_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import greend.cli.install as inst
    from greend.errors import GreendError

    # tmp_path plays the live root: the tools "exist", systemd "runs".
    monkeypatch.setattr(inst.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(inst, "_is_live", lambda prefix: prefix == tmp_path)
    monkeypatch.setattr(inst, "_booted", lambda root: root == tmp_path)
    ran: list[list[str]] = []

    def runner(argv: list[str]) -> subprocess.CompletedProcess[str]:
        ran.append(list(argv))
        rc = 1 if argv[:2] == ["systemctl", "enable"] else 0
        return subprocess.CompletedProcess(argv, rc, "", "Failed to enable unit: boom" if rc else "")

    actions = install_systemd(tmp_path, greend_bin="/usr/bin/greend", runner=runner)  # type: ignore[arg-type]
    assert ran == [
        ["systemd-sysusers", "/etc/sysusers.d/greend.conf"],
        ["systemd-tmpfiles", "--create", "/etc/tmpfiles.d/greend.conf"],
        ["systemctl", "daemon-reload"],
    ]
    assert actions[-1] == "run systemctl daemon-reload"
    ran.clear()
    with pytest.raises(GreendError, match="systemctl enable --now greend.service failed.*boom"):
        install_systemd(tmp_path, greend_bin="/usr/bin/greend", enable=True, runner=runner)  # type: ignore[arg-type]
    assert ran[-1] == ["systemctl", "enable", "--now", "greend.service"]


def test_install_skips_systemctl_without_a_running_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import greend.cli.install as inst

    monkeypatch.setattr(inst.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(inst, "_is_live", lambda prefix: True)
    monkeypatch.setattr(inst, "_booted", lambda root: False)
    actions = install_systemd(tmp_path, greend_bin="/usr/bin/greend", enable=True, dry_run=True)
    assert "run systemd-sysusers /etc/sysusers.d/greend.conf" in actions
    assert any(a.startswith("skip systemctl daemon-reload: systemd is not running") for a in actions)
    assert any(a.startswith("skip systemctl enable --now greend.service: systemd is not running") for a in actions)


def test_install_refuses_bad_binaries(tmp_path: Path) -> None:
    for bad in ("greend", "/opt/my tools/greend", "/opt/$X/greend"):
        with pytest.raises(ConfigError):
            install_systemd(tmp_path, greend_bin=bad)
    assert not (tmp_path / "etc").exists()


def test_systemd_dir_is_found() -> None:
    assert find_systemd_dir() == SYSTEMD
    with pytest.raises(ConfigError, match="no greend.service"):
        find_systemd_dir(REPO / "tests")


def test_installed_unit_still_parses_as_ini(tmp_path: Path) -> None:
    install_systemd(tmp_path, greend_bin="/usr/bin/greend")
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string((tmp_path / "etc/systemd/system/greend.service").read_text())
    assert set(cp.sections()) == {"Unit", "Service", "Install"}


def test_default_greend_bin_is_absolute() -> None:
    found = default_greend_bin()
    if found is None:
        pytest.skip("no greend script installed beside this Python or on PATH")
    assert Path(found).is_absolute() and Path(found).name == "greend"
    render_unit(UNIT.read_text(), found)  # acceptable to systemd


def test_a_greend_binary_that_is_not_there_is_named_before_the_unit_is_written(tmp_path: Path) -> None:
    """`install-systemd --greend-bin /opt/nonexistent/greend` wrote a unit that could never
    start, rc 0. On the live system it is refused (a dry run says it); under another
    --prefix (an image being built) the binary is that system's, and not checked here."""
    from greend.errors import ConfigError

    with pytest.raises(ConfigError, match="not there, or not executable"):
        install_systemd(Path("/"), greend_bin="/opt/nonexistent/greend")
    actions = install_systemd(Path("/"), greend_bin="/opt/nonexistent/greend", dry_run=True)
    assert actions[0].startswith("note greend binary /opt/nonexistent/greend: not there")
    assert any(a.startswith("write ") for a in install_systemd(tmp_path, greend_bin="/opt/greend/bin/greend",
                                                               hidden_ok=True))  # fmt: skip
