"""One knob's failure, named: every NVML or sysfs error an actuator meets becomes a
:class:`~greend.errors.KnobError` naming the device, the knob and the fix, raised
``from`` the greend probe error (``NoPermission``, ``DeviceLost``, ``NotSupported``...).

Errors are classified by their type only, never by their text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from greend.errors import (
    ActuatorError,
    DeviceLost,
    InvalidArgument,
    KnobError,
    NoPermission,
    NotSupported,
    ProbeError,
)
from greend.probes.nvml_device import Unresponsive

__all__ = ["LOST_FIX", "NOT_SUPPORTED_FIX", "NO_PERMISSION_FIX", "UNRESPONSIVE_FIX", "guarded", "knob_error"]

T = TypeVar("T")

NO_PERMISSION_FIX = "run greend as root or with CAP_SYS_ADMIN (its systemd unit does)"
LOST_FIX = (
    "the GPU fell off the bus or the driver reset: check `nvidia-smi` and `dmesg` for Xid "
    "errors; its original setting stays in the saved-settings file and "
    "`greend restore --state-dir DIR` retries"
)
UNRESPONSIVE_FIX = (
    "the GPU's driver calls hang: check `nvidia-smi` and `dmesg` for Xid errors, reset the GPU "
    "(`nvidia-smi -r -i <index>`, no processes on it) or reboot; its original setting stays in the "
    "saved-settings file and `greend restore --state-dir DIR` retries"
)
NOT_SUPPORTED_FIX = "this GPU or driver does not support the knob; leave it to the other knobs"
INVALID_FIX = "the value is outside what this GPU accepts"
FAILED_FIX = "see the error; `greenctl doctor` checks NVML and RAPL access"


def knob_error(device: str, knob: str, action: str, exc: BaseException) -> KnobError:
    """The :class:`KnobError` for ``exc``, met while trying to ``action`` ``knob`` of
    ``device``; its ``reason`` follows the type of ``exc``."""
    if isinstance(exc, KnobError):
        return exc
    if isinstance(exc, NoPermission):
        reason, fix = "no_permission", NO_PERMISSION_FIX
    elif isinstance(exc, DeviceLost):
        reason, fix = "lost", LOST_FIX
    elif isinstance(exc, Unresponsive):
        reason, fix = "unresponsive", UNRESPONSIVE_FIX
    elif isinstance(exc, NotSupported):
        reason, fix = "not_supported", NOT_SUPPORTED_FIX
    elif isinstance(exc, ActuatorError):
        # greend.probes.rapl's write errors carry their own fix, raised from the OSError.
        denied = isinstance(exc.__cause__, PermissionError)
        return KnobError(
            f"{device} {knob}: cannot {action}: {exc}",
            device=device,
            knob=knob,
            reason="no_permission" if denied else "failed",
        )
    elif isinstance(exc, InvalidArgument):
        reason, fix = "invalid", INVALID_FIX
    else:
        reason, fix = "failed", FAILED_FIX
    return KnobError(f"{device} {knob}: cannot {action}: {exc}; fix: {fix}", device=device, knob=knob, reason=reason)


def guarded(device: str, knob: str, action: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; any greend probe/actuator error (or OSError) becomes a :class:`KnobError`."""
    try:
        return fn()
    except (ProbeError, ActuatorError) as e:
        raise knob_error(device, knob, action, e) from e
    except OSError as e:
        raise knob_error(device, knob, action, ProbeError(str(e))) from e
