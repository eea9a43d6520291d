"""The one type check for config values, against a dataclass field's or a function argument's annotation, so that a
wrong value fails in one line: `error: trainer.max_epochs='abc' must be one of: int, null`."""

import inspect
import types
import typing
from dataclasses import fields


def accepted(annotation) -> list | None:
    """What an annotation admits: plain types and literal values (kept as their repr), or None when this check
    cannot judge it (anything else passes)."""
    if annotation in (int, float, bool, str, type(None)):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [accepted(a) for a in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    if origin is typing.Literal:
        return [repr(a) for a in typing.get_args(annotation)]
    return None


def matches(value, allowed: list) -> bool:
    for a in allowed:
        if isinstance(a, str):
            if repr(value) == a:
                return True
        elif a is type(None):
            if value is None:
                return True
        elif a is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        elif isinstance(value, a) and not (a is int and isinstance(value, bool)):
            return True
    return False


def type_error(name: str, value, allowed: list) -> ValueError:
    names = dict.fromkeys("null" if a is type(None) else a if isinstance(a, str) else a.__name__ for a in allowed)
    return ValueError(f"{name}={value!r} must be one of: {', '.join(names)}")


def check_value(name: str, value, annotation) -> None:
    allowed = accepted(annotation)
    if allowed is not None and not matches(value, allowed):
        raise type_error(name, value, allowed)


def check_field_types(config, prefix: str) -> None:
    """Raise ValueError naming the first field whose value does not match its annotation; an int given for a
    float field is converted (frozen dataclasses too: this runs in __post_init__)."""
    for f in fields(config):
        value = getattr(config, f.name)
        check_value(f"{prefix}.{f.name}", value, f.type)
        if isinstance(value, int) and not isinstance(value, bool) and float in (accepted(f.type) or []):
            object.__setattr__(config, f.name, float(value))


def check_trainer_args(args: dict, trainer_class) -> None:
    """Unknown Trainer arguments and plainly wrong values (trainer.max_epochs=abc) in one line each."""
    params = inspect.signature(trainer_class.__init__).parameters
    hints = typing.get_type_hints(trainer_class.__init__)
    for name, value in args.items():
        if name not in params:
            raise ValueError(f"trainer.{name} is not an argument of Lightning's Trainer; check the spelling")
        check_value(f"trainer.{name}", value, hints.get(name))
