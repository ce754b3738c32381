"""Dotted keys (``algorithm.local_lr``): nested mappings flattened to them, and values and key paths written
for people. At the bottom of the import graph: it imports nothing of fedsweep."""

from __future__ import annotations

import math
from typing import Any


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted key: leaf}`` (an empty mapping is a leaf)."""
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def dotted(loc: tuple) -> str:
    """A key path as written, with invisible or unprintable characters in a key shown escaped."""
    return ".".join(k if isinstance(k, str) and k.isprintable() else ascii(k).strip("'") for k in map(str, loc))


def within(field: str, roots: tuple[str, ...]) -> bool:
    """Whether the dotted ``field`` is one of ``roots`` or a field inside one (``resources.ray_address``
    inside ``resources``; not ``resources_x``)."""
    return any(field == root or field.startswith(root + ".") for root in roots)


def format_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}" if math.isfinite(v) else str(v)
    return str(v)


def overrides_label(overrides: dict[str, Any]) -> str:
    """The values that picked a sweep's trial, as ``key=value, ...``."""
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "(base config)"
