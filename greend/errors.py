"""greend's error tree.

Every boundary (NVML, sysfs, sqlite, sockets, config files) translates foreign
errors into one of these, raised ``from`` the original, so callers catch greend
errors and never a vendor's::

    GreendError
    ├── ConfigError            bad config file, flag or value (names key, value, what is allowed)
    │   └── PolicyError        a policy name, parameter or value is wrong
    ├── ProbeError             a source of readings failed
    │   ├── NoData             hardware or interface absent on this node (quiet, expected)
    │   ├── NoPermission       present but not readable/writable by this process
    │   ├── NotSupported       this device does not implement the call
    │   ├── InvalidArgument    the device refused a value (outside what it accepts)
    │   └── DeviceLost         the device vanished mid-run (GPU fell off the bus)
    ├── ActuatorError          a setting could not be applied or restored
    │   └── KnobError          one knob of one device; ``reason`` says why (no_permission, lost, ...)
    ├── StateError             the saved-state file is corrupt or unreadable
    ├── StoreError             a time-series store failed (the point is spooled, not lost)
    ├── ProtocolError          a malformed IPC message (names the field and the problem)
    ├── DaemonUnavailable      greenctl/callback cannot reach the daemon's socket
    └── RequestRefused         the daemon answered a request with an error reply (``code``)

    GreendWarning (a UserWarning, not an error): the training callback could not do its
    job (no daemon, a lost daemon); training goes on unchanged.

``NoData`` is the node_exporter ``ErrNoData`` idea: "no RAPL in this VM" is not
an error worth a log line above debug; ``NoPermission`` and ``DeviceLost`` are.
"""

from __future__ import annotations

__all__ = [
    "ActuatorError",
    "ConfigError",
    "DaemonUnavailable",
    "DeviceLost",
    "GreendError",
    "GreendWarning",
    "InvalidArgument",
    "KnobError",
    "NoData",
    "NoPermission",
    "NotSupported",
    "PolicyError",
    "ProbeError",
    "ProtocolError",
    "RequestRefused",
    "StateError",
    "StoreError",
]


class GreendError(Exception):
    """Base of every error greend raises on purpose."""


class ConfigError(GreendError):
    """A config key, flag or value is wrong; the message says which and what is allowed."""


class PolicyError(ConfigError, ValueError):
    """A policy name, parameter or value is wrong; the message says which and what is allowed."""


class ProbeError(GreendError):
    """A probe could not read its source."""


class NoData(ProbeError):
    """The source does not exist on this node (no driver, no powercap, a VM)."""


class NoPermission(ProbeError):
    """The source exists but this process may not read or write it."""


class NotSupported(ProbeError):
    """The device does not implement this call (e.g. no energy counter before Volta)."""


class InvalidArgument(ProbeError):
    """The device refused a value it was given (e.g. a power limit outside its range)."""


class DeviceLost(ProbeError):
    """The device disappeared while greend was using it."""


class ActuatorError(GreendError):
    """Applying or restoring a device setting failed."""


class KnobError(ActuatorError):
    """A knob could not be read, set or restored.

    ``device`` ("gpu1 (GPU-...)", "package-0 (intel-rapl:0)"), ``knob``
    ("clock_cap_mhz", "power_limit_w"), ``reason``: ``no_permission``, ``lost``,
    ``not_supported``, ``invalid`` or ``failed``. ``__cause__`` is the greend
    probe error (``NoPermission``, ``DeviceLost``...).
    """

    def __init__(self, message: str, *, device: str, knob: str, reason: str) -> None:
        super().__init__(message)
        self.device = device
        self.knob = knob
        self.reason = reason


class StateError(GreendError):
    """The saved-settings file cannot be trusted; greend refuses to guess."""


class StoreError(GreendError):
    """A store could not store points."""


class ProtocolError(GreendError):
    """An IPC message is malformed. ``field`` names the offending field, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class DaemonUnavailable(GreendError):
    """The daemon's socket is absent, refuses, or does not answer in time."""


class RequestRefused(GreendError):
    """The daemon answered with an error reply: ``code`` is the protocol's error code
    (``bad_request``, ``forbidden``, ...), ``field`` the field it names, if any."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class GreendWarning(UserWarning):
    """greend could not do its job (no daemon, a lost daemon); training goes on unchanged."""
