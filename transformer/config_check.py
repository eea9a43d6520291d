"""Type checks for the plain config dataclasses, so that a wrong override fails in one clear line."""

import types
import typing
from dataclasses import fields


def check_field_types(config, prefix: str) -> None:
    """Raise ValueError naming the first field whose value does not match its annotation.
    An int given for a float field is accepted and converted."""
    for f in fields(config):
        value = getattr(config, f.name)
        allowed = typing.get_args(f.type) if isinstance(f.type, types.UnionType) else (f.type,)
        if value is None and type(None) in allowed:
            continue
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(config, f.name, float(value))
            continue
        ok = any(
            isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in allowed if t is not type(None)
        )
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{prefix}.{f.name}={value!r} must be {names}")
