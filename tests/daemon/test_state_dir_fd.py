"""The state dir stays the one checked at start: greend opens it once and writes its
files through that descriptor, so a state dir swapped for a symlink afterwards (by
whoever owns a directory above it) never has a root write go through the link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from greend.actuators.state import CLOCK_KNOB, GpuEntry, KnobState, SavedState, StateFile
from greend.fsutil import StateDir, StateDirLock
from tests.support import DaemonProc, start_daemon


def _swap(state: Path, elsewhere: Path) -> Path:
    """Move ``state`` aside and put a symlink to ``elsewhere`` in its place."""
    moved = state.with_name(state.name + ".moved")
    os.rename(state, moved)
    elsewhere.mkdir(exist_ok=True)
    os.symlink(elsewhere, state)
    return moved


def _state() -> SavedState:
    return SavedState(
        gpus=[
            GpuEntry(
                backend="sim", sim_dir="/sim", uuid="GPU-x", index=0, knobs={CLOCK_KNOB: KnobState(None, 1500, "node")}
            )
        ]
    )


def test_saved_settings_follow_the_opened_dir_not_a_swapped_symlink(tmp_path: Path) -> None:
    state = tmp_path / "parent" / "state"
    sd = StateDir(state).open()
    sf = StateFile(sd)
    sf.save(_state())
    moved = _swap(state, tmp_path / "attacker")
    sf.save(_state())  # a later write, after the swap
    sf.remove()
    sf.save(_state())
    assert sorted(os.listdir(tmp_path / "attacker")) == []
    assert sorted(os.listdir(moved)) == ["saved-settings.json"]
    assert sf.exists() and sf.load().gpus[0].index == 0
    assert sf.move_aside() is not None and not sf.exists()
    assert os.listdir(tmp_path / "attacker") == []
    sd.close()


def test_the_lock_is_taken_in_the_opened_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    sd = StateDir(state).open()
    moved = _swap(state, tmp_path / "attacker")
    lock = StateDirLock(sd)
    lock.acquire()
    assert os.listdir(tmp_path / "attacker") == [] and os.listdir(moved) == ["greend.lock"]
    lock.release()
    sd.close()


def test_a_symlinked_or_shared_state_dir_is_refused_at_open(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(PermissionError, match="not a directory"):
        StateDir(tmp_path / "link").open()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by its group or by others"):
        StateDir(shared).open()


def test_a_state_dir_that_is_a_file_is_refused_saying_so(tmp_path: Path) -> None:
    """Not "[Errno 17] File exists": what the path is, and what to do."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PermissionError, match="exists and is not a directory: move it away"):
        StateDir(tmp_path / "afile").open()
    with pytest.raises(PermissionError, match="a part of its path is a file"):
        StateDir(tmp_path / "afile" / "state").open()


@pytest.mark.e2e
def test_a_running_daemon_never_writes_through_a_swapped_state_dir(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    # The attack: the state dir inside a parent the attacker owns, swapped for
    # a symlink after start; root's cap set then saved the originals into the target.
    parent = tmp_path / "attacker-owned"
    parent.mkdir()
    state = parent / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--sim-dir", str(tmp_path / "sim"), "--hz", "20", state_dir=state)
    daemons.append(d)
    target = tmp_path / "where-the-link-points"
    moved = _swap(state, target)
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1200")
    assert os.listdir(target) == [], os.listdir(target)
    assert "saved-settings.json" in os.listdir(moved)
    d.ctl("cap", "reset", "--gpu", "0")
    assert os.listdir(target) == []
    assert "saved-settings.json" not in os.listdir(moved)  # removed there: nothing left to restore


@pytest.mark.e2e
def test_the_default_sim_dir_is_reached_through_the_opened_dir(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    state = tmp_path / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", state_dir=state)
    daemons.append(d)
    target = tmp_path / "where-the-link-points"
    moved = _swap(state, target)
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1200")  # the simulated GPU is still there
    assert os.listdir(target) == []
    assert {"saved-settings.json", "sim"} <= set(os.listdir(moved))


def test_the_sqlite_store_in_the_state_dir_opens_through_the_held_dir(tmp_path: Path) -> None:
    # The daemon's default store, sqlite:///<state_dir>/greend.db, opened (or opened
    # again, after a corrupt file was moved aside) once the state dir was swapped.
    from greend.stores import open_store

    state = tmp_path / "parent" / "state"
    sd = StateDir(state).open()
    moved = _swap(state, tmp_path / "attacker")
    store = open_store(f"sqlite:///{state}/greend.db", state_dir=sd.inside(), state_dir_path=state, host="n")
    try:
        assert os.listdir(tmp_path / "attacker") == []
        assert {"greend.db", "greend.db-wal"} <= set(os.listdir(moved))
        assert str(store.url).endswith(f"{state}/greend.db")  # named as configured
    finally:
        store.close(timeout_s=2.0)  # type: ignore[attr-defined]  # SqliteStore.close, not on the Store protocol
    sd.close()


def test_a_store_file_sqlite_opened_elsewhere_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The race left after SQLite resolves /proc/self/fd/N to the directory's name: the
    # directory moved and a link put there between the resolution and the open. Here
    # SQLite is made to open a file of the same name elsewhere; the check refuses it.
    import sqlite3

    from greend.errors import StoreError
    from greend.stores import sqlite as sqlite_store

    state = tmp_path / "state"
    sd = StateDir(state).open()
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    real_connect = sqlite3.connect

    def connect_elsewhere(name: str, **kw: object) -> sqlite3.Connection:
        return real_connect(str(elsewhere / Path(name).name), **kw)  # type: ignore[arg-type]  # the test's redirect

    monkeypatch.setattr(sqlite_store.sqlite3, "connect", connect_elsewhere)
    with pytest.raises(StoreError, match="not the file in the state dir greend holds open"):
        sqlite_store.SqliteStore(state / "greend.db", held_dir=sd.inside())
    sd.close()
