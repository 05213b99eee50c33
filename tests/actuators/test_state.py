"""The saved-settings file: atomic round trips and strict loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from greend.actuators.controller import Controller
from greend.actuators.state import (
    STATE_FILE,
    STATE_VERSION,
    CpuConstraintState,
    CpuEntry,
    GpuEntry,
    KnobState,
    SavedState,
    StateFile,
)
from greend.errors import StateError


def sample_state() -> SavedState:
    return SavedState(
        gpus=[
            GpuEntry(
                backend="sim",
                sim_dir="/tmp/sim",
                uuid="GPU-abc",
                index=1,
                knobs={
                    "clock_cap_mhz": KnobState(original=None, set=1500, owner="job-7", updated_at=1.0),
                    "power_limit_w": KnobState(original=700.0, set=400.0, owner="node", updated_at=2.0),
                },
            )
        ],
        cpus=[
            CpuEntry(
                sysfs_root="/sys",
                zone_path="class/powercap/intel-rapl:0",
                zone_id="intel-rapl:0",
                name="package-0",
                owner="node",
                set_w=150.0,
                constraints=[
                    CpuConstraintState(0, "long_term", 205_000_000, 150_000_000),
                    CpuConstraintState(1, "short_term", 246_000_000, None),
                ],
            )
        ],
    )


def test_round_trip_atomic_and_removed_when_empty(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "state")
    assert sf.load().empty  # no file: nothing saved
    sf.save(sample_state())
    data = json.loads(sf.path.read_text())
    assert data["format"] == "greend-saved-settings" and data["version"] == STATE_VERSION
    assert sf.load() == sample_state()
    assert sorted(p.name for p in sf.state_dir.iterdir()) == [STATE_FILE]  # no temp files left
    sf.save(SavedState())
    assert not sf.path.exists()


def _expect_refusal(tmp_path: Path, content: bytes, what: str) -> None:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    path = state / STATE_FILE
    path.write_bytes(content)
    with pytest.raises(StateError) as ei:
        StateFile(state).load()
    msg = str(ei.value)
    assert str(path) in msg and what in msg
    assert "--force-defaults" in msg and "Inspect it" in msg
    with pytest.raises(StateError):
        Controller(state)  # a daemon refuses too: it would lose the originals
    assert path.read_bytes() == content  # left in place, untouched
    assert sorted(p.name for p in state.iterdir()) == [STATE_FILE]


def test_corrupt_file_is_refused(tmp_path: Path) -> None:
    _expect_refusal(tmp_path, b"\x00\x17garbage{", "not")


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "good")
    sf.save(sample_state())
    whole = sf.path.read_bytes()
    _expect_refusal(tmp_path, whole[: len(whole) // 2], "not valid JSON")


def test_empty_file_is_refused(tmp_path: Path) -> None:
    _expect_refusal(tmp_path, b"", "empty")


def test_wrong_version_is_refused(tmp_path: Path) -> None:
    data = sample_state().to_json()
    data["version"] = 99
    _expect_refusal(tmp_path, json.dumps(data).encode(), "version is 99")


def test_wrong_format_and_bad_fields_are_refused(tmp_path: Path) -> None:
    _expect_refusal(tmp_path, b'{"hello": 1}', "format")
    data = sample_state().to_json()
    data["gpus"][0]["knobs"]["power_limit_w"]["original"] = None
    _expect_refusal(tmp_path, json.dumps(data).encode(), "original power limit is unknown")
    data = sample_state().to_json()
    data["cpus"][0]["constraints"][0]["original_uw"] = "205000000"
    _expect_refusal(tmp_path, json.dumps(data).encode(), "cpus[0].constraints[0].original_uw")


def test_move_aside_only_when_asked(tmp_path: Path) -> None:
    sf = StateFile(tmp_path)
    assert sf.move_aside() is None
    sf.path.write_text("{broken")
    moved = sf.move_aside()
    assert moved is not None and moved.name.startswith(f"{STATE_FILE}.corrupt-")
    assert moved.read_text() == "{broken" and not sf.path.exists()


@pytest.mark.parametrize(
    "content",
    [
        b'{"format": "greend-saved-settings", "version": 1, "gpus": [' + b"9" * 5000 + b"]}",  # over 4300 digits
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
    ],
    ids=["huge-number", "deep-nesting"],
)
def test_a_file_python_cannot_parse_as_plain_json_is_refused_like_any_corrupt_one(
    tmp_path: Path, content: bytes
) -> None:
    _expect_refusal(tmp_path, content, "is not a saved-settings file greend wrote")
