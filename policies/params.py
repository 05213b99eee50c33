"""Policy parameters: :class:`Param` says one parameter's type, default, allowed
values and help; :func:`validate_params` coerces and checks what a policy is given
(strings from the command line included) and fills in the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from greend.errors import PolicyError

__all__ = ["Param", "validate_params"]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Param:
    """One policy parameter: its type, default, allowed range and help.

    ``kind``: ``float``, ``int``, ``bool``, ``str``, ``int_list`` (``"0,1"`` or a
    list), ``gpu_map`` (GPU index -> ``{"clock_cap_mhz": .., "power_limit_w": ..}``:
    a mapping, a TOML inline table or a JSON object string). ``default`` None with ``required=False`` means "not set".
    ``lo``/``hi`` bound numbers (``lo_open``/``hi_open``: excluded); ``choices``
    lists the allowed strings.
    """

    name: str
    kind: str
    default: Any
    help: str
    required: bool = False
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] | None = None

    def allowed(self) -> str:
        """What values are allowed, in words (for error messages and help)."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.kind in ("float", "int"):
            parts = []
            if self.lo is not None:
                parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
            if self.hi is not None:
                parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
            what = "a number" if self.kind == "float" else "an integer"
            return what + (" " + " and ".join(parts) if parts else "")
        if self.kind == "bool":
            return "true or false"
        if self.kind == "int_list":
            return "a list of integers >= 0 (e.g. 0,1)"
        if self.kind == "gpu_map":
            return (
                'GPU index -> {"clock_cap_mhz": MHz, "power_limit_w": W} '
                '(e.g. {"0": {"clock_cap_mhz": 1400}, "1": {"power_limit_w": 450}})'
            )
        return "a string"

    def coerce(self, policy: str, value: Any) -> Any:
        """``value`` (possibly a string from the command line) as this param's type."""

        def bad(why: str = "") -> PolicyError:
            extra = f" ({why})" if why else ""
            return PolicyError(
                f"policy {policy!r}: bad value {value!r} for {self.name!r}{extra}; allowed: {self.allowed()}"
            )

        if value is None:
            if self.required:
                raise PolicyError(f"policy {policy!r}: parameter {self.name!r} is required; allowed: {self.allowed()}")
            return None
        if self.kind in ("float", "int"):
            if isinstance(value, bool):
                raise bad()
            try:
                v: Any = float(value) if self.kind == "float" else _to_int(value)
            except (TypeError, ValueError, OverflowError):  # (an integer of 400 digits is no float)
                raise bad() from None
            if isinstance(v, float) and not math.isfinite(v):
                raise bad("not finite")
            if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
                raise bad()
            if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
                raise bad()
            return v
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise bad()
        if self.kind == "str":
            s = str(value).strip()
            if self.choices and s not in self.choices:
                raise bad()
            return s
        if self.kind == "int_list":
            items: Sequence[Any]
            if isinstance(value, str):
                items = [x for x in value.replace(" ", "").strip("[]").split(",") if x]
            elif isinstance(value, (list, tuple)):
                items = value
            elif isinstance(value, int) and not isinstance(value, bool):
                items = [value]
            else:
                raise bad()
            try:
                out = tuple(_to_int(x) for x in items)
            except (TypeError, ValueError):
                raise bad() from None
            if not out or any(x < 0 for x in out):
                raise bad()
            return tuple(sorted(set(out)))
        if self.kind == "gpu_map":
            return self._gpu_map(value, bad)
        raise AssertionError(f"unknown param kind {self.kind!r}")  # pragma: no cover

    def _gpu_map(self, value: Any, bad: Any) -> dict[int, dict[str, float | None]]:
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(f"not JSON: {e}") from None
        if not isinstance(value, Mapping) or not value:
            raise bad("expected a non-empty mapping")
        out: dict[int, dict[str, float | None]] = {}
        for k, caps in value.items():
            try:
                gpu = _to_int(k)
            except (TypeError, ValueError):
                raise bad(f"GPU index {k!r} is not an integer") from None
            if gpu < 0 or not isinstance(caps, Mapping) or not caps:
                raise bad(f"GPU {k!r}: expected an index >= 0 and a non-empty mapping")
            extra = set(caps) - {"clock_cap_mhz", "power_limit_w"}
            if extra:
                raise bad(f"GPU {gpu}: unknown key(s) {', '.join(sorted(map(str, extra)))}")
            entry: dict[str, float | None] = {"clock_cap_mhz": None, "power_limit_w": None}
            for key, v in caps.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v <= 0:
                    raise bad(f"GPU {gpu}: {key} = {v!r} is not a positive number")
                if v > 10_000:  # (MHz or W: no GPU comes near; a typo, not a cap)
                    raise bad(f"GPU {gpu}: {key} = {v!r} is over 10000")
                entry[key] = int(v) if key == "clock_cap_mhz" else float(v)
            out[gpu] = entry
        return out


def _to_int(x: Any) -> int:
    if isinstance(x, bool):
        raise ValueError("bool is not an int")
    if isinstance(x, float):
        if not x.is_integer():
            raise ValueError("not an integer")
        return int(x)
    return int(str(x).strip())


def validate_params(policy: str, specs: Sequence[Param], given: Mapping[str, Any]) -> dict[str, Any]:
    """All of ``specs`` with ``given`` values coerced and checked, defaults filled in.

    Raises :class:`PolicyError` for an unknown key or a bad value.
    """
    known = {p.name: p for p in specs}
    unknown = sorted(set(given) - set(known))
    if unknown:
        allowed = ", ".join(sorted(known)) or "(none)"
        raise PolicyError(f"policy {policy!r}: unknown parameter(s) {', '.join(unknown)}; allowed: {allowed}")
    for name, p in known.items():
        if name in given and given[name] is None and p.default is not None:
            raise PolicyError(
                f"policy {policy!r}: {name!r} is null; give a value ({p.allowed()}) or leave it out "
                f"for its default {p.default!r}"
            )
    try:
        return {name: p.coerce(policy, given.get(name, p.default)) for name, p in known.items()}
    except RecursionError:
        raise PolicyError(f"policy {policy!r}: a parameter's value is nested too deeply") from None


def _finite(v: float) -> bool:
    """A finite number, an integer too large for a float included (not finite)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
