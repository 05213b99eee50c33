"""Policies: pure strategies that turn a snapshot of measurements into a decision.

No I/O, no clocks, no sockets: a policy is ``decide(snapshot, state) -> Decision``
(see :mod:`greend.policies.base`) and is tested by replaying traces or the simulator
(:mod:`greend.testing.harness`).

The registry
------------

:data:`POLICIES` maps each policy's name to a :class:`PolicyInfo`: its class, a
one-line help and its parameters (:class:`Param`: type, default, allowed values,
help). :func:`get_policy` builds one from a name and keyword parameters, which
may be strings (``greenctl policy set efficient --param max_slowdown=0.1``)::

    >>> from greend.policies import get_policy
    >>> p = get_policy("efficient", max_slowdown="0.1", knob="clock")
    >>> p.params()["max_slowdown"]
    0.1

Unknown names, unknown parameters and bad values raise :class:`PolicyError` (a
``ConfigError`` and a ``ValueError``) naming the key and what is allowed. To add
a policy, copy ``none.py``, give the class ``name``, ``help`` and ``PARAMS``
(:mod:`greend.policies.params`), and list it in ``_CLASSES`` below.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Protocol

from greend.errors import PolicyError

from .budget import BudgetPolicy
from .efficient import EfficientPolicy
from .none import NonePolicy
from .params import Param, validate_params
from .precision import PrecisionPolicy
from .static import StaticPolicy

__all__ = [
    "POLICIES",
    "Param",
    "PolicyInfo",
    "describe_policies",
    "get_policy",
    "validate_params",
]

DEFAULT_POLICY = "none"


@dataclass(frozen=True)
class PolicyInfo:
    """A registry entry: what ``greenctl policy show`` lists."""

    name: str
    cls: type
    help: str
    params: tuple[Param, ...]

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}


class _PolicyClass(Protocol):
    """What the registry reads of a policy class: its name, help and parameters."""

    name: str
    help: str
    PARAMS: tuple[Param, ...]


# PrecisionPolicy only decides precision: the daemon runs it beside one of the others
# ([policy] precision = "precision").
_CLASSES: tuple[type[_PolicyClass], ...] = (NonePolicy, StaticPolicy, EfficientPolicy, BudgetPolicy, PrecisionPolicy)

POLICIES: dict[str, PolicyInfo] = {
    c.name: PolicyInfo(name=c.name, cls=c, help=c.help, params=tuple(c.PARAMS)) for c in _CLASSES
}


def get_policy(name: str, **params: Any) -> Any:
    """Build the policy ``name`` with ``params`` (validated; strings are coerced).

    Raises :class:`PolicyError` for an unknown policy, an unknown parameter or a
    bad value; the message names the key and what is allowed.
    """
    info = POLICIES.get(name)
    if info is None:
        close = difflib.get_close_matches(name, list(POLICIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PolicyError(f"unknown policy {name!r}{hint}; allowed: {', '.join(sorted(POLICIES))}")
    return info.cls(**params)


def describe_policies() -> list[dict[str, Any]]:
    """The registry as plain data (for ``greenctl policy show --json``)."""
    return [
        {
            "name": info.name,
            "help": info.help,
            "params": [
                {
                    "name": p.name,
                    "type": p.kind,
                    "default": p.default,
                    "required": p.required,
                    "allowed": p.allowed(),
                    "help": p.help,
                }
                for p in info.params
            ],
        }
        for info in POLICIES.values()
    ]
