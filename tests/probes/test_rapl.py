"""RaplProbe against the checked-in fake /sys and small trees built per test."""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from greend.errors import ActuatorError, DeviceLost, NoData, NoPermission, NotSupported
from greend.probes import ProbeContext
from greend.probes.base import Probe
from greend.probes.fake_sysfs import DEFAULT_MAX_ENERGY_RANGE_UJ, FakePowercap, make_standard_tree
from greend.probes.rapl import (
    ENERGY_PERMISSION_FIX,
    RaplProbe,
    read_power_limit_uw,
    read_text,
    wrap_delta_uj,
    write_power_limit_uw,
)
from tests.support import REPO

FIXTURE = REPO / "tests" / "fixtures" / "sys"

# (zone, path, counted, parent, power_limit_w) for tests/fixtures/sys.
FIXTURE_ZONES = [
    ("package-0", "intel-rapl:0", True, None, 205.0),
    ("core", "intel-rapl:0:0", False, "intel-rapl:0", None),
    ("uncore", "intel-rapl:0:1", False, "intel-rapl:0", None),
    ("dram", "intel-rapl:0:2", True, "intel-rapl:0", None),
    ("package-1", "intel-rapl:1", True, None, 205.0),
    ("core", "intel-rapl:1:0", False, "intel-rapl:1", None),
    ("uncore", "intel-rapl:1:1", False, "intel-rapl:1", None),
    ("dram", "intel-rapl:1:2", True, "intel-rapl:1", None),
    ("psys", "intel-rapl:a", False, None, 500.0),
]


def opened(root: Path, **kw: object) -> RaplProbe:
    probe = RaplProbe(root, **kw)  # type: ignore[arg-type]
    probe.open()
    return probe


# -- the checked-in fixture -------------------------------------------------------


def test_fixture_zones_flags_and_limits() -> None:
    probe = opened(FIXTURE)
    assert isinstance(probe, Probe)
    cpus = probe.sample(1.0).cpus
    got = [(c.zone, c.path, c.counted, c.parent, c.power_limit_w) for c in cpus]
    assert got == FIXTURE_ZONES
    assert all(c.source == "rapl" and c.energy_j == 0.0 and c.power_w is None for c in cpus)
    info = probe.info()
    assert info.available and info.fix is None
    assert any("intel-rapl-mmio:0" in d and "skipped" in d for d in info.devices)
    assert "package-0 (intel-rapl:0)" in info.detail


def test_fixture_uses_real_layout() -> None:
    link = FIXTURE / "class" / "powercap" / "intel-rapl:0:1"
    assert link.is_symlink()
    assert os.readlink(link) == "../../devices/virtual/powercap/intel-rapl/intel-rapl:0/intel-rapl:0:1"
    assert (FIXTURE / "devices/virtual/powercap/intel-rapl/intel-rapl:0/intel-rapl:0:1/name").is_file()
    assert read_text(link / "name") == "uncore\n"


def _snapshot(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_text()
    return out


def test_fixture_matches_make_standard_tree(tmp_path: Path) -> None:
    """The checked-in tree is make_standard_tree's output; rebuild it if this fails."""
    make_standard_tree(tmp_path)
    assert _snapshot(tmp_path) == _snapshot(FIXTURE)


def test_fixture_copy_counts_energy(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root, symlinks=True)
    probe = opened(root)
    energy = root / "class/powercap/intel-rapl:1/energy_uj"
    energy.write_text(str(int(energy.read_text()) + 7_500_000))
    by_path = {c.path: c for c in probe.sample(2.0).cpus}
    assert by_path["intel-rapl:1"].energy_j == pytest.approx(7.5)
    assert by_path["intel-rapl:0"].energy_j == 0.0


# -- energy, wraps, power ---------------------------------------------------------


@given(
    st.integers(0, DEFAULT_MAX_ENERGY_RANGE_UJ),
    st.integers(0, DEFAULT_MAX_ENERGY_RANGE_UJ),
)
def test_wrap_delta_is_modular(prev: int, delta: int) -> None:
    cur = (prev + delta) % (DEFAULT_MAX_ENERGY_RANGE_UJ + 1)
    assert wrap_delta_uj(prev, cur, DEFAULT_MAX_ENERGY_RANGE_UJ) == delta


def test_wrap_delta_edges() -> None:
    assert wrap_delta_uj(10, 25, 100) == 15
    assert wrap_delta_uj(100, 0, 100) == 1  # max -> 0 is one µJ
    assert wrap_delta_uj(90, 5, 100) == 16
    assert wrap_delta_uj(90, 5, 0) == 0  # unknown range: a backwards step is not guessed


def test_wrap_mid_run_total_exact(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    max_uj = 10_000_000  # 10 J range: wraps every few ticks
    zid = fake.add_zone("package-0", max_energy_range_uj=max_uj, energy_uj=max_uj - 1_500_000, long_term_w=95)
    probe = opened(tmp_path)
    truth_uj = 0
    for tick in range(1, 40):
        step_uj = 3_000_000 + tick * 1_001  # whole µJ: the total must be exact
        fake.advance(zid, step_uj / 1e6)
        truth_uj += step_uj
        (reading,) = probe.sample(float(tick)).cpus
    assert fake.energy_uj(zid) < max_uj  # it did wrap, many times
    assert reading.energy_j == truth_uj / 1e6
    assert probe.zones[0].total_uj == truth_uj


def test_standard_tree_energy_within_0_1_percent(tmp_path: Path) -> None:
    fake = make_standard_tree(tmp_path)
    rng = random.Random(7)
    probe = opened(tmp_path)
    zones = [z for z in fake.zones if not z.startswith("intel-rapl-mmio")]
    now_s = 0.0
    for _ in range(60):
        now_s += 1.0
        for zid in zones:
            fake.advance(zid, rng.uniform(0.0, 300.0))
        cpus = probe.sample(now_s).cpus
    for c in cpus:
        truth = fake.true_energy_j(c.path)
        assert c.energy_j == pytest.approx(truth, rel=1e-3)
        assert abs(c.energy_j - truth) < 1e-3 * truth
    counted = sum(c.energy_j for c in cpus if c.counted)
    truth_counted = sum(
        fake.true_energy_j(z) for z in ("intel-rapl:0", "intel-rapl:0:2", "intel-rapl:1", "intel-rapl:1:2")
    )
    assert counted == pytest.approx(truth_counted, rel=1e-3)


def test_power_from_delta_and_injected_now(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    ids = fake.add_package(0, dram=True)
    probe = opened(tmp_path)
    first = {c.path: c for c in probe.sample(100.0).cpus}
    assert first["intel-rapl:0"].power_w is None  # no interval yet
    fake.advance(ids["package-0"], 50.0)
    fake.advance(ids["dram"], 4.0)
    second = {c.path: c for c in probe.sample(100.5).cpus}
    assert second["intel-rapl:0"].power_w == pytest.approx(100.0)
    assert second["intel-rapl:0:0"].power_w == pytest.approx(8.0)
    assert second["intel-rapl:0"].energy_j == pytest.approx(50.0)
    fake.advance(ids["package-0"], 30.0)
    third = {c.path: c for c in probe.sample(102.5).cpus}
    assert third["intel-rapl:0"].power_w == pytest.approx(15.0)
    assert third["intel-rapl:0:0"].power_w == 0.0
    # A tick at the same instant adds energy but keeps the last power.
    fake.advance(ids["package-0"], 1.0)
    fourth = {c.path: c for c in probe.sample(102.5).cpus}
    assert fourth["intel-rapl:0"].power_w == pytest.approx(15.0)
    assert fourth["intel-rapl:0"].energy_j == pytest.approx(81.0)


def test_energy_counted_since_open(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    ids = fake.add_package(0)
    fake.advance(ids["package-0"], 1000.0)  # before open: not ours
    probe = opened(tmp_path)
    fake.advance(ids["package-0"], 2.0)  # between open and the first tick: ours
    (c,) = probe.sample(1.0).cpus
    assert c.energy_j == pytest.approx(2.0)


# -- layout variants --------------------------------------------------------------


def test_hex_ids_sort_numerically(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    for n in (0x2, 0xA, 0x10):
        fake.add_zone(f"package-{n}", zone_id=n)
    fake.add_zone("core", parent="intel-rapl:a", zone_id=0xB)
    probe = opened(tmp_path)
    paths = [c.path for c in probe.sample(0.0).cpus]
    assert paths == ["intel-rapl:2", "intel-rapl:a", "intel-rapl:a:b", "intel-rapl:10"]
    assert probe.zones[2].parent == "intel-rapl:a"


def test_amd_zen_without_dram(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    fake.add_package(0, core=True)
    fake.add_package(1, core=True)
    got = [(c.zone, c.counted, c.parent) for c in opened(tmp_path).sample(0.0).cpus]
    assert got == [
        ("package-0", True, None),
        ("core", False, "intel-rapl:0"),
        ("package-1", True, None),
        ("core", False, "intel-rapl:1"),
    ]


def test_mmio_only_is_used(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    fake.add_package(0, control="intel-rapl-mmio")
    (c,) = opened(tmp_path).sample(0.0).cpus
    assert (c.zone, c.path, c.counted) == ("package-0", "intel-rapl-mmio:0", True)


def test_subzone_found_as_subdirectory_without_class_link(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    fake.add_package(0, dram=True)
    (tmp_path / "class/powercap/intel-rapl:0:0").unlink()
    paths = [c.path for c in opened(tmp_path).sample(0.0).cpus]
    assert paths == ["intel-rapl:0", "intel-rapl:0:0"]


# -- absent, unreadable, failing --------------------------------------------------


def test_missing_powercap_is_nodata(tmp_path: Path) -> None:
    probe = RaplProbe(tmp_path)
    with pytest.raises(NoData) as exc:
        probe.open()
    assert f"no RAPL powercap zones under {tmp_path}/class/powercap (a VM or container?)" in str(exc.value)
    info = probe.info()
    assert not info.available and info.fix and "cpu_tdp_w" in info.fix


def test_empty_powercap_is_nodata(tmp_path: Path) -> None:
    (tmp_path / "class/powercap").mkdir(parents=True)
    os.symlink("../../devices/virtual/powercap/intel-rapl", tmp_path / "class/powercap/intel-rapl")
    with pytest.raises(NoData, match="no RAPL powercap zones"):
        RaplProbe(tmp_path).open()


def _read_denying(names: set[str]):  # type: ignore[no-untyped-def]
    def read(path: Path) -> str:
        if path.name == "energy_uj" and path.parent.name in names:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return read_text(path)

    return read


def test_injected_permission_error_everywhere_is_nopermission() -> None:
    everything = {p.name for p in (FIXTURE / "class/powercap").iterdir()}
    probe = RaplProbe(FIXTURE, read=_read_denying(everything))
    with pytest.raises(NoPermission) as exc:
        probe.open()
    assert ENERGY_PERMISSION_FIX in str(exc.value)
    assert "CVE-2020-8694" in str(exc.value) and "CAP_DAC_READ_SEARCH" in str(exc.value)
    assert probe.info().fix == ENERGY_PERMISSION_FIX


def test_one_unreadable_zone_the_others_go_on() -> None:
    probe = opened(FIXTURE, read=_read_denying({"intel-rapl:a"}))
    paths = [c.path for c in probe.sample(1.0).cpus]
    assert "intel-rapl:a" not in paths and "intel-rapl:0" in paths
    info = probe.info()
    assert info.available and "intel-rapl:a" in info.detail and info.fix == ENERGY_PERMISSION_FIX


def _open_as_nobody(root: Path) -> str:
    """Fork; the child drops to uid/gid 65534 and opens the probe. Returns what it saw."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                RaplProbe(root).open()
                msg = "OPENED"
            except NoPermission as e:
                msg = "NoPermission: " + str(e)
            except Exception as e:  # report anything else to the parent
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def test_energy_uj_really_unreadable() -> None:
    """A real permission denial, not an injected one (energy_uj is 0400 root since 5.10)."""
    base = Path(tempfile.mkdtemp(prefix="greend-rapl-"))
    try:
        os.chmod(base, 0o755)  # the unprivileged child must reach the tree
        fake = FakePowercap(base / "sys")  # energy_uj mode 0400, owned by us
        fake.add_package(0, dram=True)
        if os.geteuid() == 0:
            try:
                seen = _open_as_nobody(base / "sys")
            except PermissionError:
                pytest.skip("cannot fork an unprivileged child here")
            if seen.startswith("PermissionError") and "setuid" in seen:
                pytest.skip("setuid not permitted in this container")
        else:
            for zid in fake.zones:
                fake.chmod(zid, "energy_uj", 0o000)
            try:
                read_text(fake.dir_of("intel-rapl:0") / "energy_uj")
                pytest.skip("chmod does not stop reads here")
            except PermissionError:
                pass
            try:
                RaplProbe(base / "sys").open()
                seen = "OPENED"
            except NoPermission as e:
                seen = "NoPermission: " + str(e)
        assert seen.startswith("NoPermission: "), seen
        assert "energy_uj is readable by root only since Linux 5.10 (CVE-2020-8694)" in seen
        assert "run greend as root (its systemd unit does) or grant CAP_DAC_READ_SEARCH" in seen
    finally:
        shutil.rmtree(base)


def test_zone_disappears_mid_run(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    ids = fake.add_package(0, dram=True)
    probe = opened(tmp_path)
    fake.advance(ids["package-0"], 10.0)
    fake.advance(ids["dram"], 1.0)
    probe.sample(1.0)
    fake.remove(ids["dram"])
    fake.advance(ids["package-0"], 10.0)
    cpus = probe.sample(2.0).cpus
    assert [c.path for c in cpus] == ["intel-rapl:0"]
    assert cpus[0].energy_j == pytest.approx(20.0)
    info = probe.info()
    assert info.available and "intel-rapl:0:0" in info.detail and "failing" in info.detail
    assert any("FAILING" in d for d in info.devices)
    fake.remove(ids["package-0"])
    with pytest.raises(DeviceLost, match="every RAPL zone failed"):
        probe.sample(3.0)


@pytest.mark.parametrize(
    ("err", "back_j", "back_w"),
    [
        # A read that failed while the counter ran on: the gap is booked (5 J in 2 s is what
        # a zone can draw), not lost.
        (OSError(errno.EIO, "Input/output error"), 6.0, 2.5),
        # A zone whose files were gone (the module unloaded) may come back counting from 0:
        # it starts again from its first read, the gap not counted.
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), 1.0, None),
    ],
)
def test_a_zone_that_fails_and_comes_back(tmp_path: Path, err: OSError, back_j: float, back_w: float | None) -> None:
    fake = FakePowercap(tmp_path)
    ids = fake.add_package(0, dram=True)
    flaky = {"down": False}

    def read(path: Path) -> str:
        if flaky["down"] and path.parent.name == "intel-rapl:0:0" and path.name == "energy_uj":
            raise err
        return read_text(path)

    probe = opened(tmp_path, read=read)
    fake.advance(ids["dram"], 1.0)
    assert {c.path: c.energy_j for c in probe.sample(1.0).cpus}["intel-rapl:0:0"] == pytest.approx(1.0)
    flaky["down"] = True
    fake.advance(ids["dram"], 5.0)
    assert "intel-rapl:0:0" not in {c.path for c in probe.sample(2.0).cpus}
    flaky["down"] = False
    back = {c.path: c for c in probe.sample(3.0).cpus}["intel-rapl:0:0"]
    assert back.energy_j == pytest.approx(back_j)
    assert back.power_w == (None if back_w is None else pytest.approx(back_w))
    fake.advance(ids["dram"], 2.0)
    again = {c.path: c for c in probe.sample(4.0).cpus}["intel-rapl:0:0"]
    assert again.energy_j == pytest.approx(back_j + 2.0) and again.power_w == pytest.approx(2.0)
    assert "failing" not in probe.info().detail


def test_a_counter_that_steps_back_is_a_new_baseline_not_a_wrap(tmp_path: Path) -> None:
    """energy_uj lower than before in less time than a wrap takes (a reset, a resume, a
    migrated VM): a new baseline, not a wrap (a 1 J step back read as 262 kJ)."""
    fake = FakePowercap(tmp_path)
    ids = fake.add_package(0, dram=True)
    probe = opened(tmp_path)
    fake.advance(ids["dram"], 100.0)
    assert {c.path: c.energy_j for c in probe.sample(1.0).cpus}["intel-rapl:0:0"] == pytest.approx(100.0)
    fake.set_energy_uj(ids["dram"], fake.energy_uj(ids["dram"]) - 1_000_000)  # 1 J back
    back = {c.path: c for c in probe.sample(1.5).cpus}["intel-rapl:0:0"]
    assert back.energy_j == pytest.approx(100.0) and back.power_w is None
    fake.advance(ids["dram"], 3.0)
    on = {c.path: c for c in probe.sample(2.5).cpus}["intel-rapl:0:0"]
    assert on.energy_j == pytest.approx(103.0) and on.power_w == pytest.approx(3.0)


def test_info_before_open() -> None:
    info = RaplProbe(FIXTURE).info()
    assert not info.available


def test_registered_factory_uses_sysfs_root() -> None:
    from greend.probes import REGISTRY

    reg = REGISTRY["rapl"]
    assert reg.default is True and "RAPL" in reg.help
    probe = reg.factory(ProbeContext(sysfs_root=FIXTURE))
    assert isinstance(probe, RaplProbe) and probe.sysfs_root == FIXTURE


# -- power-limit helpers ----------------------------------------------------------


def test_power_limit_read_write_clamped(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    pkg = fake.dir_of(fake.add_package(0, tdp_w=125.0)["package-0"])
    assert read_power_limit_uw(pkg, 0) == 125_000_000
    assert write_power_limit_uw(pkg, 0, 90_000_000) == 90_000_000
    assert (pkg / "constraint_0_power_limit_uw").read_text().strip() == "90000000"
    assert write_power_limit_uw(pkg, 0, 999_000_000) == 125_000_000  # clamped to max
    assert read_power_limit_uw(pkg, 0) == 125_000_000
    with pytest.raises(ValueError):
        write_power_limit_uw(pkg, 0, 0)
    with pytest.raises(NotSupported):
        read_power_limit_uw(pkg, 5)


def test_power_limit_write_is_idempotent(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    pkg = fake.dir_of(fake.add_package(0, tdp_w=125.0)["package-0"])
    writes: list[tuple[Path, str]] = []
    assert write_power_limit_uw(pkg, 0, 125_000_000, write=lambda p, t: writes.append((p, t))) == 125_000_000
    assert writes == []
    write_power_limit_uw(pkg, 0, 100_000_000, write=lambda p, t: writes.append((p, t)))
    assert writes == [(pkg / "constraint_0_power_limit_uw", "100000000")]


@pytest.mark.parametrize(
    ("err", "uid", "needle"),
    [
        (PermissionError(errno.EACCES, "Permission denied"), 1000, "run greend as root"),
        (PermissionError(errno.EACCES, "Permission denied"), 0, "even as root: the limit is locked"),
        (OSError(errno.EROFS, "Read-only file system"), 0, "ProtectKernelTunables"),
        (OSError(errno.EINVAL, "Invalid argument"), 0, "Invalid argument"),
    ],
)
def test_power_limit_write_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: OSError, uid: int, needle: str
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: uid)
    fake = FakePowercap(tmp_path)
    pkg = fake.dir_of(fake.add_package(0)["package-0"])

    def write(path: Path, text: str) -> None:
        raise err

    with pytest.raises(ActuatorError, match=needle):
        write_power_limit_uw(pkg, 0, 50_000_000, write=write)


# -- the fake itself --------------------------------------------------------------


def test_fake_counter_wraps_like_hardware(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path)
    zid = fake.add_zone("package-0", max_energy_range_uj=1_000_000, energy_uj=900_000)
    assert fake.advance(zid, 0.1) == 1_000_000
    assert fake.advance(zid, 0.000001) == 0
    assert fake.true_energy_j(zid) == pytest.approx(0.100001)
    assert oct(os.stat(fake.dir_of(zid) / "energy_uj").st_mode & 0o777) == "0o400"
    with pytest.raises(ValueError):
        fake.advance(zid, -1.0)
