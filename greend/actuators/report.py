"""What a restore did: the knobs restored, those that failed (they stay in the
saved-settings file), a corrupt state file, and the exit code ``greend restore`` gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RestoreFailure", "RestoreReport"]


@dataclass
class RestoreFailure:
    """A knob that could not be restored (it stays in the saved-settings file)."""

    device: str
    knob: str
    message: str
    reason: str = "failed"  # "unresponsive": the GPU (or NVML) did not answer in time

    def to_json(self) -> dict[str, str]:
        return {"device": self.device, "knob": self.knob, "message": self.message, "reason": self.reason}


@dataclass
class RestoreReport:
    """What a restore did. ``exit_code``: 0 nothing to do or all restored, 1 some
    device failed (listed in ``failed``), 2 the state file is corrupt (``state_error``),
    3 some GPU (or NVML itself) did not answer within its deadline (a hung driver: the
    GPUs that answered are restored, the others listed and kept for the next try)."""

    restored: list[str] = field(default_factory=list)
    failed: list[RestoreFailure] = field(default_factory=list)
    state_error: str | None = None
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and self.state_error is None

    @property
    def exit_code(self) -> int:
        if self.state_error is not None:
            return 2
        if any(f.reason == "unresponsive" for f in self.failed):
            return 3
        return 1 if self.failed else 0

    @property
    def unanswered(self) -> list[str]:
        """The devices not restored because they (or NVML) did not answer in time."""
        return sorted({f.device for f in self.failed if f.reason == "unresponsive"})

    def extend(self, other: RestoreReport) -> None:
        self.restored += other.restored
        self.failed += other.failed
        self.notes += other.notes
        if other.state_error and not self.state_error:
            self.state_error = other.state_error

    def lines(self) -> list[str]:
        """Human-readable lines (what ``greend restore`` prints)."""
        if self.state_error:
            return [f"error: {self.state_error}"]
        verb = "would restore" if self.dry_run else "restored"
        out = [f"{verb} {r}" for r in self.restored]
        out += [f"FAILED {f.device} {f.knob}: {f.message}" for f in self.failed]
        out += self.notes
        if not self.restored and not self.failed:
            out.append("nothing to restore")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "restored": list(self.restored),
            "failed": [f.to_json() for f in self.failed],
            "state_error": self.state_error,
            "notes": list(self.notes),
            "dry_run": self.dry_run,
            "exit_code": self.exit_code,
        }
