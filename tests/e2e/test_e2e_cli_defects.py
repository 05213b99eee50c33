"""Small things the command line got wrong, each as it is now said."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from greend.cli.greend_cmd import daemon_app
from greend.config import Config, ConfigError, validate
from tests.support import DaemonProc, start_daemon


@pytest.mark.parametrize("hz", ["nan", "inf", "-inf"])
def test_greend_run_refuses_a_non_finite_hz(hz: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    r = CliRunner().invoke(daemon_app, ["run", "--config", str(cfg), "--hz", hz, "--state-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "[daemon] hz" in r.output and "finite" in r.output and "Traceback" not in r.output


def test_policy_keys_hold_their_own_kind() -> None:
    cfg = Config()
    cfg.policy.precision = "efficient"
    with pytest.raises(ConfigError, match=r"\[policy\] precision = 'efficient': expected 'none' or 'precision'"):
        validate(cfg)
    cfg = Config()
    cfg.policy.precision = "bogus"
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "budget" not in str(e.value)  # only what the key takes
    cfg = Config()
    cfg.policy.name = "precision"
    with pytest.raises(ConfigError, match=r"\[policy\] name = 'precision': expected one of none, static"):
        validate(cfg)


@pytest.mark.e2e
def test_cap_texts_against_a_sim_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2")
    daemons.append(d)
    r = d.ctl("cap", "reset", "--gpu", "9", check=False)
    assert r.returncode == 2 and "no GPU 9 on this node (GPUs: 0, 1)" in r.stderr
    r = d.ctl("cap", "set", "--gpu", "0", "--power-limit", "5000")
    assert "power limit 700.0 W" in r.stdout and "clock cap none" in r.stdout
    assert "clamped to 700.0 W" in r.stderr
    out = d.ctl("policy", "show").stdout
    assert "available: budget, efficient, none, static; beside them ([policy] precision): precision" in out
    help_text = " ".join(d.ctl("policy", "set", "--help").stdout.replace("│", " ").split())
    assert "none, static, efficient, budget (the precision policy runs beside it" in help_text


def test_messages_name_things_once_and_sim_gpus_as_simulated(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    r = d.ctl("policy", "set", "efficient", "--param", "max_slowdown=2", check=False)
    assert r.returncode != 0
    assert "policy 'efficient': bad value 2 for 'max_slowdown'" in r.stderr
    assert r.stderr.count("policy 'efficient'") == 1, r.stderr
    out = d.ctl("probes").stdout
    assert "1 simulated GPU(s)" in out and "via NVML" not in out and "driver" not in out.split("\n")[0], out


def test_policy_set_takes_a_clock_policy_and_the_precision_policy_together(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    r = d.ctl(
        "policy", "set", "efficient", "--param", "max_slowdown=0.08",
        "--precision", "precision", "--precision-param", "tolerance=0.03",
    )  # fmt: skip
    assert "policy efficient" in r.stdout and 'precision precision {"' in r.stdout and '"tolerance": 0.03' in r.stdout
    show = d.ctl("policy", "show").stdout
    assert "policy efficient" in show and "precision precision" in show and '"tolerance": 0.03' in show
    st = d.status()["policy"]
    assert st["name"] == "efficient" and st["precision"]["name"] == "precision"
    # A bad half changes neither half.
    static = ["policy", "set", "static", "--param", "clock_cap_mhz=1500"]
    bad = d.ctl(*static, "--precision", "precision", "--precision-param", "bogus=1", check=False)
    assert bad.returncode == 2 and "bogus" in bad.stderr
    bad = d.ctl(*static, "--precision", "efficient", check=False)
    assert bad.returncode == 2 and "expected 'none' or 'precision' (a clock policy" in bad.stderr
    st = d.status()["policy"]
    assert st["name"] == "efficient" and st["precision"]["params"]["tolerance"] == 0.03
    # Off again; the clock policy stays.
    r = d.ctl("policy", "set", "efficient", "--precision", "none")
    assert "precision none" in r.stdout and d.status()["policy"]["precision"] is None
    assert "precision none" in d.ctl("policy", "show").stdout
