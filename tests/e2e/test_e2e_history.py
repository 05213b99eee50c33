"""History: an ended job's report, its decisions with their reasons and its saving, come
back from the SQLite store after the daemon restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_e2e_jobs import wait_ended
from tests.e2e.test_e2e_precision import CONFIG, run_trainer
from tests.support import DaemonProc, start_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.torch, pytest.mark.slow]
torch = pytest.importorskip("torch")


def test_a_daemon_restart_keeps_old_reports(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    state = tmp_path / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=CONFIG, state_dir=state)
    daemons.append(d)
    run_trainer(d.socket, "old-job", "--steps", "450", "--step-sleep", "0.01", "--precisions", "fp32,bf16")
    live = wait_ended(d, "old-job")
    live_text = d.ctl("report", "old-job").stdout
    assert "switch: fp32 -> bf16" in live_text
    # The saving must come back from the store as it was; its sign is not this test's
    # business: this MLP's simulated steps are so small that bf16 saves ~0.05 J over 150
    # steps, within the simulated card's drift (CI once measured -0.007 J).
    # tests/cli/test_report_savings.py checks a saving's size.
    assert live["savings"]["saved_j"] is not None
    d.stop()

    d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=CONFIG, state_dir=state, name="d2")
    daemons.append(d2)
    # The new daemon serves the ended run it kept (its history), and --all the store too.
    assert "old-job" in d2.ctl("jobs").stdout
    listed = d2.ctl("jobs", "--all").stdout
    assert listed.count("old-job") == 1, listed
    r = d2.ctl("report", "old-job")
    assert "from the daemon's history" in r.stderr
    text = r.stdout
    assert "job old-job  [ended, finished]" in text
    # Every decision with its reason, and the saving, as the live report had them.
    switch = [ln for ln in live_text.splitlines() if "switch: fp32 -> bf16" in ln][0]
    reason = switch.split("(", 1)[1]
    assert reason.rstrip(")") in text
    rep = json.loads(d2.ctl("report", "old-job", "--json").stdout)
    assert rep["steps"] == live["steps"] and rep["flops"] == pytest.approx(live["flops"])
    assert rep["gpu_energy_j"] == pytest.approx(live["gpu_energy_j"])
    assert rep["savings"]["saved_j"] == pytest.approx(live["savings"]["saved_j"])
    assert [e["kind"] for e in rep["precision_log"]] == [e["kind"] for e in live["precision_log"]]

    # A second run under the same id: both runs kept, and the report says so.
    run_trainer(d2.socket, "old-job", "--steps", "40", "--step-sleep", "0.01")
    wait_ended(d2, "old-job")
    r = d2.ctl("report", "old-job")
    assert "ran 1 time(s) before this run" in r.stderr
    listed = d2.ctl("jobs", "--all").stdout
    assert listed.count("old-job") == 2, listed

    # Without a daemon, from the store file alone.
    d2.stop()
    r = d2.ctl("report", "old-job", "--store", str(state / "greend.db"))
    assert r.returncode == 0 and "old-job" in r.stdout
    # `jobs --store FILE` reads that file (it listed the daemon's jobs and ignored it), by
    # path or by URL; a file that is not there, a directory or an unknown URL is named.
    for given in (str(state / "greend.db"), f"sqlite:///{state / 'greend.db'}"):
        listed = d2.ctl("jobs", "--store", given).stdout
        assert listed.count("old-job") == 2, listed
    for given, says in (
        (str(tmp_path / "none.db"), "no SQLite store at"),
        (str(state), "is a directory: give the store's file"),
        ("sqlit:///x", "not a store greenctl reads"),
    ):
        r = d2.ctl("jobs", "--store", given, check=False)
        assert r.returncode == 2 and says in r.stderr, (given, r.stderr)


def test_a_job_that_was_never_switched_says_why_after_its_end_and_a_restart(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """Each policy's last word on a job (here: the loss never had a window to be judged
    stable, and the clock policy only measures) is in its report once it has ended, and
    still there when the report comes from the store after a restart."""
    state = tmp_path / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=CONFIG, state_dir=state)
    daemons.append(d)
    r = run_trainer(d.socket, "short-job", "--steps", "12", "--step-sleep", "0.05", "--precisions", "fp32,bf16")
    assert set(r["levels"]) == {"fp32"}
    live = wait_ended(d, "short-job")
    notes = {n["policy"]: n["reason"] for n in live["notes"]}
    assert set(notes) == {"none", "precision"}, live["notes"]
    assert "measuring only" in notes["none"]
    # Too few steps for the stability test (window 16): it says what it was waiting for.
    assert "job short-job:" in notes["precision"] and "fp32" in notes["precision"], notes
    text = d.ctl("report", "short-job").stdout
    assert "why  (each policy's last word on the job)" in text
    assert f"precision: {notes['precision']}" in text
    d.stop()

    d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=CONFIG, state_dir=state, name="d2")
    daemons.append(d2)
    stored = json.loads(d2.ctl("report", "short-job", "--json").stdout)
    assert {n["policy"]: n["reason"] for n in stored["notes"]} == notes
    assert f"precision: {notes['precision']}" in d2.ctl("report", "short-job").stdout
