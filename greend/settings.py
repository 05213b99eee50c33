"""A GPU setting: the value the policies decide and the actuators apply.

It sits at the bottom of the package, beside ``units`` and ``errors``, so that the
actuators and the policies share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UNCAPPED", "Setting"]


@dataclass(frozen=True)
class Setting:
    """A GPU setting: a locked max SM clock and/or a power limit. None = default/uncapped."""

    clock_cap_mhz: int | None = None
    power_limit_w: float | None = None

    @property
    def uncapped(self) -> bool:
        return self.clock_cap_mhz is None and self.power_limit_w is None

    @property
    def label(self) -> str:
        """How a person reads it: "1410 MHz", "250 W" or "uncapped"."""
        if self.clock_cap_mhz is not None:
            return f"{self.clock_cap_mhz} MHz"
        return "uncapped" if self.power_limit_w is None else f"{self.power_limit_w:g} W"

    @property
    def level(self) -> float | None:
        """The clock (MHz) or power limit (W) of a capped setting; None uncapped."""
        level = self.clock_cap_mhz if self.clock_cap_mhz is not None else self.power_limit_w
        return None if level is None else float(level)


UNCAPPED = Setting()
