"""Unit literals and dimensions.

Every quantity in a policy carries a dimension.  Literals are converted exactly to
their value in the base unit of their dimension: bytes, nanoseconds, bytes per second,
FLOP/s, percent; held as an integer, or where it is no whole number as a float whose
shortest decimal is the exact value (`exact_of`).  A bare number has no dimension and
adapts to whatever it is combined with.
"""
from __future__ import annotations

import re
from fractions import Fraction

from fabric_ext.runtime.machine.errors import InputError

SIZE, BANDWIDTH, TIME, FLOPS, PERCENT = "size", "bandwidth", "time", "flops", "percent"
COUNT, DEVICE, BOOL = "count", "device", "bool"

#: dimension -> human name used in messages
DIM_NAMES = {
    SIZE: "a size", BANDWIDTH: "a bandwidth", TIME: "a time", FLOPS: "a compute rate",
    PERCENT: "a percentage", COUNT: "a count", DEVICE: "a device", BOOL: "a boolean",
    None: "a plain number",
}

_SI = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

#: unit suffix -> (dimension, factor to the base unit)
UNITS: dict[str, tuple[str, float]] = {}
for _p, _f in _SI.items():
    UNITS[f"{_p}B"] = (SIZE, _f)
    UNITS[f"{_p}B/s"] = (BANDWIDTH, _f)
    UNITS[f"{_p}bps"] = (BANDWIDTH, _f / 8)
    UNITS[f"{_p}FLOPs"] = (FLOPS, _f)
for _p, _f in _IEC.items():
    UNITS[f"{_p}B"] = (SIZE, _f)
    UNITS[f"{_p}B/s"] = (BANDWIDTH, _f)
UNITS.update({"ns": (TIME, 1), "us": (TIME, 1e3), "ms": (TIME, 1e6), "s": (TIME, 1e9),
              "%": (PERCENT, 1)})

#: dimensioned products and quotients: (operator, left, right) -> (result, factor).  Values are
#: held in base units, so B/ns is 10^9 B/s, B / (B/s) is 10^9 ns, and (B/s) * ns is 10^-9 B:
#: the factor brings the plain product or quotient back to the result's base unit
DIM_ARITH = {("*", BANDWIDTH, TIME): (SIZE, Fraction(1, 10**9)), ("*", TIME, BANDWIDTH): (SIZE, Fraction(1, 10**9)),
             ("/", SIZE, TIME): (BANDWIDTH, Fraction(10**9)), ("/", SIZE, BANDWIDTH): (TIME, Fraction(10**9))}

#: the unit each dimension is printed in, for messages and reports
BASE_UNIT = {SIZE: "B", BANDWIDTH: "B/s", TIME: "ns", FLOPS: "FLOPs", PERCENT: "%"}

_QUANTITY = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>.*)$")


class UnitError(InputError):
    """An unknown unit suffix; carries a suggestion when one is close."""

    def __init__(self, unit: str, suggestion: str | None):
        self.unit, self.suggestion = unit, suggestion
        super().__init__(f"unknown unit '{unit}'")


def parse_quantity(text: str) -> tuple[float, str | None]:
    """Parse '64GB/s' into (64e9, 'bandwidth'); '12' into (12, None)."""
    m = _QUANTITY.match(text)
    if not m:
        raise UnitError(text, None)
    num, unit = m["num"], m["unit"]
    value = Fraction(num)       # exact: 8.2GB/s is 8,200,000,000 B/s (in floats 8,199,999,999.99...)
    if not unit:
        return _held(value), None
    if unit not in UNITS:
        from .diagnostics import closest
        per_second = unit[:-2] + "/s"       # 10GBps: bytes per second (Gbps would be 8x less)
        raise UnitError(unit, per_second if unit.endswith("Bps") and per_second in UNITS else closest(unit, UNITS))
    dim, factor = UNITS[unit]
    return _held(value * Fraction(factor)), dim


def _held(exact: Fraction) -> int | float:
    """A literal's exact value as a policy holds it: a whole number as an int, else a float
    (whose shortest decimal, `exact_of`, is the literal's exact value)."""
    return int(exact) if exact.denominator == 1 else float(exact)


def exact_of(value: int | float) -> Fraction:
    """The exact value a literal held as ``value`` (`_held`) was written with: a float's
    shortest decimal (0.3 is 3/10, not the binary fraction nearest it)."""
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


_EXAMPLE = {SIZE: "4KiB", BANDWIDTH: "1GB/s", TIME: "10us", FLOPS: "1TFLOPs", PERCENT: "80%"}


def quantity_as(text: str, dim: str | None, what: str, bare: bool = True) -> int | float:
    """``text`` ('1GB/s', '12') as a value of dimension ``dim``, in its base unit, for
    ``what`` (the name the message gives).  A bare number is taken where ``bare`` (else only
    0, which is every dimension's).  ValueError says why not: an unknown unit (and the likely
    one meant), or a quantity of another dimension."""
    try:
        value, got = parse_quantity(text)
    except UnitError as e:
        if e.unit == text:          # no number to start it
            raise ValueError(f"'{text}' is no quantity: write a number of 0 or more"
                             + (f" and its unit, e.g. {_EXAMPLE[dim]}" if dim in _EXAMPLE else ", e.g. 12")) from None
        raise ValueError(f"unknown unit '{e.unit}'"
                         + (f"; did you mean '{e.suggestion}'?" if e.suggestion else "")) from None
    if got != dim and not (got is None and (bare or value == 0)):
        raise ValueError(f"'{what}' is {DIM_NAMES.get(dim, dim)}, not {DIM_NAMES[got]}")
    return value


def format_quantity(value: float, dim: str | None) -> str:
    """Render a base-unit value for humans: 64000000000, bandwidth -> '64 GB/s'."""
    if dim == SIZE and value and value == int(value):
        for p, f in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
            if value % f == 0:
                return f"{int(value) // f} {p}B"
    if dim in (SIZE, BANDWIDTH, FLOPS):
        suffix = BASE_UNIT[dim]
        for p in ("T", "G", "M", "K"):
            if abs(value) >= _SI[p]:
                return f"{value / _SI[p]:g} {p}{suffix}"
        return f"{value:g} {suffix}"
    if dim == TIME:
        for u, f in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
            if abs(value) >= f:
                return f"{value / f:g} {u}"
        return f"{value:g} ns"
    if dim == PERCENT:
        return f"{value:g}%"
    return f"{value:g}"
