"""greenctl doctor: each check on its own, with the exact fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from greend.cli.doctor import run_checks
from greend.probes.fake_nvml import FakeNvml
from greend.probes.fake_sysfs import make_standard_tree
from tests.support import DaemonProc, start_daemon


def by_name(checks: list) -> dict:
    return {c.name: c for c in checks}


def test_a_bare_vm_without_a_daemon(tmp_path: Path) -> None:
    checks = by_name(run_checks(config=None, socket=tmp_path / "none.sock", sysfs_root=tmp_path / "nosys"))
    assert checks["config"].level == "ok"
    assert checks["nvml"].level == "warn" and "no NVML on this node" in checks["nvml"].detail
    assert checks["rapl"].level == "warn" and "cpu_tdp_w" in checks["rapl"].detail
    assert checks["rapl"].fix is None, "the probe's hint, printed once"
    assert checks["socket"].level == "fail" and "systemctl start greend" in (checks["socket"].fix or "")


def test_a_node_with_gpus_rapl_and_a_running_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    sysfs = tmp_path / "sys"
    make_standard_tree(sysfs)
    fake = FakeNvml(tmp_path / "gpus", n=2)
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    checks = by_name(run_checks(config=None, socket=d.socket, sysfs_root=sysfs, nvml_module=fake))
    assert checks["nvml"].level == "ok" and "2 GPU(s)" in checks["nvml"].detail
    assert checks["rapl"].level == "ok" and "package-0" in checks["rapl"].detail
    assert checks["socket"].level == "ok" and "1 GPUs" in checks["socket"].detail
    assert checks["store"].level == "ok"


def test_unreadable_energy_counters_are_a_failure_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from greend.probes import rapl

    sysfs = tmp_path / "sys"
    make_standard_tree(sysfs)
    if os.getuid() == 0:
        # root reads a 0400 file anyway (tests/test_rapl.py drops to another uid for the
        # real thing): here the probe's injected reader answers EACCES, as the kernel would.
        def deny(path: Path) -> str:
            if path.name == "energy_uj":
                raise PermissionError(13, "Permission denied", str(path))
            return rapl.read_text(path)

        orig = rapl.RaplProbe.__init__
        monkeypatch.setattr(rapl.RaplProbe, "__init__", lambda self, root, read=None: orig(self, root, read=deny))
    else:
        for f in sysfs.rglob("energy_uj"):
            f.chmod(0o000)
    c = by_name(run_checks(config=None, socket=tmp_path / "s", sysfs_root=sysfs))["rapl"]
    assert c.level == "fail"
    assert "CAP_DAC_READ_SEARCH" in (c.fix or "") and "5.10" in c.detail


def test_a_sim_daemon_needs_no_nvml_and_its_own_state_dir_is_checked(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """On a machine without NVML, a --sim daemon lacks nothing: no NVML is info, not a
    warning, and the state dir checked is the daemon's, not the config's default."""
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    checks = by_name(run_checks(config=None, socket=d.socket, sysfs_root=tmp_path / "nosys"))
    if checks["nvml"].level == "ok":
        pytest.skip("this machine has NVML")
    assert checks["socket"].level == "ok"
    assert checks["nvml"].level == "info" and "simulated GPUs, which need no NVML" in checks["nvml"].detail
    assert checks["state dir"].level == "ok" and str(tmp_path) in checks["state dir"].detail
    assert "//" not in checks["store"].detail.removeprefix("sqlite://"), checks["store"].detail


def test_a_missing_config_file_is_named_with_its_fix(tmp_path: Path) -> None:
    checks = by_name(run_checks(config=tmp_path / "nope.toml", socket=tmp_path / "s", sysfs_root=tmp_path))
    assert checks["config"].level == "fail" and "nope.toml" in checks["config"].detail
    assert "existing TOML file" in (checks["config"].fix or "")


def test_a_bad_config_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "g.toml"
    cfg.write_text("[daemon]\nhz = -3\n")
    checks = by_name(run_checks(config=cfg, socket=tmp_path / "s", sysfs_root=tmp_path))
    assert checks["config"].level == "fail" and "hz = -3.0" in checks["config"].detail


def test_the_configs_socket_and_its_stores_are_checked(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    import socket as socketlib

    from tests import vmserver

    busy = socketlib.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    dead = vmserver.free_port()
    sock = tmp_path / "from-config.sock"
    cfg = tmp_path / "g.toml"
    cfg.write_text(
        f'[daemon]\nsocket = "{sock}"\nsocket_group = ""\n[store]\nurls = '
        f'["sqlite:///{tmp_path}/new/dir/g.db", "influx://127.0.0.1:{dead}?org=o&bucket=b", '
        f'"prometheus://127.0.0.1:{busy.getsockname()[1]}"]\n'
    )
    try:
        # No daemon: the config's socket is the one reported missing, and each store is
        # checked from here.
        checks = run_checks(config=cfg, socket=None, sysfs_root=tmp_path)
        sockets = [c for c in checks if c.name == "socket"]
        assert sockets[0].level == "fail" and str(sock) in sockets[0].detail
        stores = {c.detail.split(":", 1)[0]: c for c in checks if c.name == "store"}
        assert stores["sqlite"].level == "ok" and str(tmp_path) in stores["sqlite"].detail
        influx = next(c for c in checks if c.name == "store" and c.detail.startswith("influx"))
        assert influx.level == "warn" and "cannot reach" in influx.detail and "spools" in (influx.fix or "")
        prom = next(c for c in checks if c.name == "store" and c.detail.startswith("prometheus"))
        assert prom.level == "warn" and "cannot listen" in prom.detail
    finally:
        busy.close()
    # A daemon on the config's socket: found without --socket.
    d = start_daemon(tmp_path, "--sim", "1", socket=sock)
    daemons.append(d)
    checks = by_name(run_checks(config=cfg, socket=None, sysfs_root=tmp_path))
    assert checks["socket"].level == "ok" and str(sock) in checks["socket"].detail


# --------------------------------------------------------------------------- GPU writes, persistence, MIG, hangs


def test_gpu_checks_on_the_fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from greend.probes.fake_nvml import fake_reset_process_init

    fake_reset_process_init()
    monkeypatch.setenv("GREEND_NVML_DEADLINE_S", "0.5")
    fake = FakeNvml(tmp_path / "gpus", n=4)
    fake.inject(1, no_permission=True, persistence_off=True)
    fake.inject(2, mig=True)
    fake.set_hang("nvmlDeviceGetPersistenceMode", gpu=3)
    try:
        checks = run_checks(config=None, socket=tmp_path / "none.sock", sysfs_root=tmp_path / "nosys", nvml_module=fake)
    finally:
        fake.set_hang(None)
    gpu = {(c.name, c.level): c for c in checks if c.name.startswith("gpu")}
    assert "gpu0" in gpu[("gpu write", "ok")].detail
    refused = gpu[("gpu write", "fail")]
    assert "gpu1" in refused.detail and "CAP_SYS_ADMIN" in (refused.fix or "")
    pm = gpu[("gpu persistence", "warn")]
    assert "gpu1" in pm.detail and "nvidia-smi -pm 1" in (pm.fix or "") and "nvidia-persistenced" in (pm.fix or "")
    assert "gpu2" in gpu[("gpu mig", "info")].detail and "never capped" in gpu[("gpu mig", "info")].detail
    hung = gpu[("gpu unresponsive", "fail")]
    assert "gpu3" in hung.detail and "reset" in (hung.fix or "")
    assert fake.sim_gpu(0).power_limit_w() == 700.0  # the no-op write changed nothing


def test_gpu_checks_on_real_pynvml_over_the_stand_in(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.nvml_stub import REPO, stub_env

    script = (
        "import json, sys; from pathlib import Path; from greend.cli.doctor import run_checks\n"
        "cs = run_checks(config=None, socket=Path(sys.argv[1]), sysfs_root=Path(sys.argv[2]))\n"
        "print(json.dumps([c.__dict__ for c in cs]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "none.sock"), str(tmp_path / "nosys")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=stub_env(gpus=2, persistence_off=1, no_permission="1", state=tmp_path / "gpus.txt"),
    )
    assert r.returncode == 0, r.stderr
    checks = {(c["name"], c["level"]): c for c in json.loads(r.stdout.strip().splitlines()[-1])}
    assert checks[("nvml", "ok")]["detail"].startswith("2 GPU(s)")
    assert "gpu0" in checks[("gpu write", "ok")]["detail"]
    refused = checks[("gpu write", "fail")]
    assert "gpu1" in refused["detail"] and "NO_PERMISSION" in refused["detail"]
    assert "CAP_SYS_ADMIN" in refused["fix"]
    pm = checks[("gpu persistence", "warn")]
    assert "gpu0, gpu1" in pm["detail"] and "nvidia-smi -pm 1" in pm["fix"]
