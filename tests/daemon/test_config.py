from __future__ import annotations

from pathlib import Path

import pytest

from greend.config import apply_overrides, load_config
from greend.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "greend.toml"
    p.write_text(text)
    return p


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""))
    assert cfg.daemon.hz == 10.0
    assert cfg.enabled_probes == ["nvml", "rapl", "host"]
    assert cfg.store_urls == ["sqlite:///var/lib/greend/greend.db"]  # three slashes, then the path


def test_every_section_is_read(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            """
[daemon]
hz = 5
socket = "/tmp/x.sock"
state_dir = "/tmp/state"
dry_run = true
[probes]
enabled = ["rapl", "host"]
sysfs_root = "/tmp/sys"
cpu_tdp_w = 205
[sim]
gpus = 4
load = 0.5
[store]
urls = ["sqlite:///tmp/a.db", "prometheus://127.0.0.1:9464"]
interval_s = 2
""",
        )
    )
    assert cfg.daemon.hz == 5.0 and isinstance(cfg.daemon.hz, float)
    assert cfg.daemon.socket == Path("/tmp/x.sock")
    assert cfg.daemon.dry_run is True
    assert cfg.probes.cpu_tdp_w == 205.0
    assert cfg.sim_dir == Path("/tmp/state/sim")
    assert cfg.enabled_probes == ["sim", "rapl", "host"]  # sim stands in for nvml
    assert cfg.store_urls == ["sqlite:///tmp/a.db", "prometheus://127.0.0.1:9464"]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[daemon]\nhzz = 3\n", "unknown key 'hzz'"),
        ("[deamon]\nhz = 3\n", "unknown table [deamon]"),
        ("[daemon]\nhz = -1\n", "hz = -1.0: must be > 0"),
        ("[daemon]\nhz = nan\n", "hz = nan: expected a finite number"),
        ("[store]\ninterval_s = nan\n", "interval_s = nan: expected a finite number"),
        ("[store]\nraw_hours = -1\n", "raw_hours = -1.0"),
        ("[store]\nretention_days = 1e6\n", "retention_days = 1000000.0: expected at most 36500 (100 years); 0 keeps"),
        ('[daemon]\nhostname = "node 1"\n', "hostname = 'node 1': expected a host name"),
        ("[store]\nrollup_s = 0.5\n", "rollup_s = 0.5: expected from interval_s (1) to 86400 seconds"),
        ("[daemon]\nheartbeat_timeout_s = inf\n", "heartbeat_timeout_s = inf: expected a finite number"),
        ('[daemon]\nhz = "fast"\n', "hz = 'fast': expected a number"),
        ("[daemon]\ndry_run = 1\n", "dry_run = 1: expected true or false"),
        ("[sim]\ngpus = true\n", "gpus = True: expected a whole number"),
        ("[sim]\nload = 1.5\n", "load = 1.5: expected a fraction"),
        ('[probes]\nenabled = ["nvml", "gpu"]\n', "enabled contains 'gpu'"),
        ('[daemon]\nsocket_mode = "rw"\n', "socket_mode = 'rw'"),
        ('[store]\nurls = ["mysql://x"]\n', "unknown scheme 'mysql'"),
        ('[store]\nurls = ["influx://h:8086?org=o"]\n', "missing bucket"),
        ('[store]\nurls = ["sqlite://relative.db"]\n', "three slashes"),
        ("daemon = 3\n", "must be a table"),
        ("[daemon\n", "not valid TOML"),
    ],
)
def test_bad_values_are_refused_with_the_key_and_what_is_allowed(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert needle in str(e.value)
    assert str(tmp_path / "greend.toml") in str(e.value)


def test_probe_names_and_store_schemes_come_from_the_registries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from greend import probes, stores

    # A probe registered anywhere is a known probe: no second list to keep.
    monkeypatch.setitem(probes.REGISTRY, "extra", probes.Registration("extra", lambda ctx: None, False, ""))  # type: ignore[arg-type, return-value]
    assert load_config(write(tmp_path, '[probes]\nenabled = ["extra"]\n')).probes.enabled == ["extra"]
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, '[probes]\nenabled = ["gpu"]\n'))
    for name in ("nvml", "rapl", "host", "sim", "extra"):
        assert name in str(e.value).split("known probes are ")[1]
    # An unknown store scheme's error lists every registered one.
    assert stores.registered_schemes() == ["sqlite", "influx", "prometheus"]
    with pytest.raises(ConfigError) as e:
        stores.check_url("mysql://x")
    for kind in stores.REGISTRY.values():
        assert kind.form in str(e.value)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[daemon]\nhz = 5\n[sim]\ngpus = 1\n"))
    cfg = apply_overrides(cfg, sim=3, hz=20.0, state_dir=tmp_path, store=["sqlite:///x/y.db"], socket=None)
    assert cfg.sim.gpus == 3 and cfg.daemon.hz == 20.0
    assert cfg.daemon.state_dir == tmp_path
    assert cfg.store_urls == ["sqlite:///x/y.db"]
    with pytest.raises(ConfigError):
        apply_overrides(cfg, hz=0.0)


def test_one_simulated_gpu_may_run_slower(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[sim]\ngpus = 3\nspeed_factor = 1.1\ngpu_speed_factors = { 1 = 1.3 }\n"))
    assert cfg.sim.speed_factors(3) == [1.1, 1.3, 1.1]  # GPU 1's own, the node's for the others
    # A table works as well; the count may come from --sim after the file is read.
    cfg = load_config(write(tmp_path, "[sim.gpu_speed_factors]\n3 = 2.0\n"))
    assert apply_overrides(cfg, sim=4).sim.speed_factors(4) == [1.0, 1.0, 1.0, 2.0]
    with pytest.raises(ConfigError, match=r"gpu_speed_factors.3 = 2.0: there are 2 simulated GPUs \(0 to 1\)"):
        apply_overrides(cfg, sim=2)


@pytest.mark.parametrize(
    "table, needle",
    [
        ("{ gpu1 = 1.3 }", "gpu_speed_factors.gpu1 = 1.3: the key must be a GPU index"),
        ("{ 1 = 0 }", "gpu_speed_factors.1 = 0: expected a number from 0.1 to 10"),
        ("{ 1 = nan }", "gpu_speed_factors.1 = nan: expected a number from 0.1 to 10"),
        ('{ 1 = "slow" }', "gpu_speed_factors.1 = 'slow': expected a number from 0.1 to 10"),
        ("[1.0, 1.3]", "gpu_speed_factors = [1.0, 1.3]: expected a table ([sim.gpu_speed_factors])"),
    ],
)
def test_bad_gpu_speed_factors_are_refused_naming_the_gpu(tmp_path: Path, table: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"[sim]\ngpu_speed_factors = {table}\n"))
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "url, says",
    [
        ("influx://127.0.0.1:99999?org=a&bucket=b", "Port out of range"),
        ("influx://127.0.0.1:abc?org=a&bucket=b", "could not be cast to integer"),
        ("prometheus://127.0.0.1:70000", "Port out of range"),
        ("prometheus://[::1:9100", "Invalid IPv6 URL"),
    ],
)
def test_a_store_url_that_urllib_cannot_read_is_a_config_error(url: str, says: str) -> None:
    """(It was a ValueError: a traceback from `greend run`, exit 1, instead of the message.)"""
    from greend.stores import check_url

    with pytest.raises(ConfigError, match=says) as e:
        check_url(url)
    assert "expected" in str(e.value)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "greend.toml"
    p.write_bytes(b"# owner: J\xfcrgen\n[daemon]\nhz = 10\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xfc at offset 10\)"):
        load_config(p)


def test_a_socket_path_too_long_for_a_unix_socket_is_a_config_error(tmp_path: Path) -> None:
    cfg = load_config(None, required=False)
    cfg.daemon.socket = tmp_path / ("s" * 120 + ".sock")
    from greend.config import validate

    with pytest.raises(ConfigError, match=r"over the 107 a Unix socket's path may have"):
        validate(cfg)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[policy]\nname = "efficient"\n[policy.params]\nmax_slowdwn = 0.1\n',
         "[policy.params]: policy 'efficient': unknown parameter(s) max_slowdwn; allowed: eta, knob, max_slowdown"),
        ('[policy]\nname = "budget"\n', "[policy.params]: policy 'budget': parameter 'node_budget_w' is required"),
        ('[policy]\nprecision = "precision"\n[policy.precision_params]\ntolerence = 0.1\n',
         "[policy.precision_params]: policy 'precision': unknown parameter(s) tolerence"),
        ('[policy.precision_params]\ntolerence = 0.1\n',  # (precision "none": kept for later, checked now)
         "[policy.precision_params]: policy 'precision': unknown parameter(s) tolerence"),
    ],
)  # fmt: skip
def test_policy_parameters_are_checked_where_the_file_is_read(tmp_path: Path, text: str, needle: str) -> None:
    """`greenctl doctor --config` said "valid" for files `greend run` then refused (after
    opening the probes): the policies' parameters are checked where both read the file."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert needle in str(e.value) and str(tmp_path) in str(e.value)


def test_a_policy_s_map_is_a_toml_table(tmp_path: Path) -> None:
    """static's per_gpu as the README gives it, a TOML table (only a JSON string was taken)."""
    cfg = load_config(
        write(tmp_path, '[policy]\nname = "static"\n[policy.params]\nper_gpu = { 0 = { clock_cap_mhz = 1400 } }\n')
    )
    from greend.policies import get_policy

    assert get_policy("static", **cfg.policy.params).params()["per_gpu"]["0"]["clock_cap_mhz"] == 1400


def test_a_store_given_twice_is_named(tmp_path: Path) -> None:
    """Two writers on one SQLite file logged "points lost" every second for points the
    other had written."""
    url = f"sqlite:///{tmp_path}/one.db"
    with pytest.raises(ConfigError, match="is given twice"):
        apply_overrides(load_config(write(tmp_path, "")), store=[url, url])
