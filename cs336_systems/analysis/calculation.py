"""One calculated quantity with its formula: what every calculator returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Calculation:
    """`name` = `formula` (with `inputs` substituted) = `value` `unit`."""

    name: str
    formula: str
    value: float
    unit: str
    inputs: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.name} = {self.formula} = {format_value(self.value, self.unit)}"

    def as_dict(self) -> dict:
        return asdict(self)


def format_value(value: float, unit: str) -> str:
    """Readable magnitudes: bytes in GB (10^9), seconds in s/ms/us, the rest with 4 significant digits."""
    if unit == "B":
        return f"{value / 1e9:.4g} GB" if abs(value) >= 1e6 else f"{value:.4g} B"
    if unit == "s":
        if abs(value) >= 1:
            return f"{value:.4g} s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.4g} ms"
        return f"{value * 1e6:.4g} us"
    return f"{value:.4g} {unit}".rstrip()


def positive(name: str, value: float) -> float:
    """Validate a calculator input (clear error naming it) and return it."""
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return value
