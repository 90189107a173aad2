"""Semantic versions and the constraints units and requests use to ask for tools.

    1.2.0  =1.2.0   exact          ^1.2  ^1.2.3  same major (0.x: same minor), at least that
    ~1.2   ~1.2.3   same minor     >=1.0,<2  comparisons joined by commas (all must hold)
    1.x  1.2.x  *   wildcards      (no pre-release versions: tools declare plain X.Y.Z)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
_PARTIAL = re.compile(r"^(\d+)(?:\.(\d+|x|\*))?(?:\.(\d+|x|\*))?$")


class SemverError(ValueError):
    pass


@dataclass(frozen=True, order=True, slots=True)
class Version:
    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> "Version":
        m = _VERSION.match(text.strip())
        if not m:
            raise SemverError(f"{text!r} is not a version (MAJOR.MINOR.PATCH, e.g. 1.2.0)")
        return cls(*(int(g) for g in m.groups()))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def _partial(text: str) -> tuple[int, int | None, int | None]:
    m = _PARTIAL.match(text.strip())
    if not m:
        raise SemverError(f"{text!r} is not a version or a version range")
    major, minor, patch = m.groups()
    as_int = [None if p in (None, "x", "*") else int(p) for p in (minor, patch)]
    if as_int[0] is None and as_int[1] is not None:
        raise SemverError(f"{text!r}: a wildcard minor cannot have a patch")
    return int(major), as_int[0], as_int[1]


def _bounds(term: str) -> tuple[Version | None, Version | None, bool]:
    """(lowest allowed, first disallowed above, lowest inclusive) of one term."""
    term = term.strip()
    if term in ("*", "x", ""):
        return None, None, True
    for op in (">=", "<=", ">", "<", "="):
        if term.startswith(op):
            # a partial version is the range it names (npm): "1.2" is [1.2.0, 1.3.0), so "<=1.2"
            # admits 1.2.5 and ">1.2" starts at 1.3.0
            low, high, _ = _bounds(term[len(op):])
            if op == ">=":
                return low, None, True
            if op == ">":
                return high, None, True
            if op == "<":
                return None, low, True
            if op == "<=":
                return None, high, True
            return low, high, True
    if term[0] in "^~":
        major, minor, patch = _partial(term[1:])
        low = Version(major, minor or 0, patch or 0)
        if term[0] == "~" and minor is not None:
            return low, Version(major, minor + 1, 0), True
        if term[0] == "^" and major == 0 and minor is not None:
            return low, Version(0, minor + 1, 0), True
        return low, Version(major + 1, 0, 0), True
    major, minor, patch = _partial(term)
    if minor is None:
        return Version(major, 0, 0), Version(major + 1, 0, 0), True
    if patch is None:
        return Version(major, minor, 0), Version(major, minor + 1, 0), True
    return Version(major, minor, patch), Version(major, minor, patch + 1), True


@dataclass(frozen=True)
class Constraint:
    text: str
    terms: tuple[tuple[Version | None, Version | None, bool], ...]

    @classmethod
    def parse(cls, text: str) -> "Constraint":
        return cls(text, tuple(_bounds(t) for t in text.split(",")))

    def allows(self, v: Version) -> bool:
        for low, high, inclusive in self.terms:
            if low is not None and (v < low or (v == low and not inclusive)):
                return False
            if high is not None and v >= high:
                return False
        return True


def split_ref(ref: str) -> tuple[str, str]:
    """``"file.read@^1.2"`` -> ("file.read", "^1.2"); no ``@`` means any version."""
    name, _, constraint = ref.partition("@")
    if not re.match(r"^[a-z][a-z0-9_.-]{0,63}$", name):
        raise SemverError(f"{ref!r}: a tool id is lowercase letters, digits, '.', '_', '-'")
    return name, constraint or "*"
