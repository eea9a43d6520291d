"""What every command-line entry point shares: bad input ends in one line, not a traceback."""

import functools
import inspect
import sys
import types
import typing
from pathlib import Path

from lightning_fabric.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

from .data.sources import DataError
from .training.errors import TrainingError
from .training.resume import run_dir_for

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# hydra.run.dir: a resumed run continues in its checkpoint's run folder, and evaluation writes there too
OmegaConf.register_new_resolver("run_dir_for", run_dir_for, replace=True)


def one_line_errors(main):
    """Report a bad config or bad data as `error: ...` on stderr and exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (DataError, ValueError, FileNotFoundError, TrainingError, MisconfigurationException) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def check_overrides(config_name: str, argv: list[str]):
    """Compose the config once with the command line's overrides, so that an unknown key or group option
    fails in one line (Hydra's own report spans several); returns it, with its hydra node. Flags (-m, --cfg,
    ...) are left to Hydra (None is returned)."""
    if any(arg.startswith("-") for arg in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name, overrides=argv, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        print(f"error: {' '.join(lines)}", file=sys.stderr)
        sys.exit(2)
    missing = [key for key in cfg if OmegaConf.is_missing(cfg, key)]  # top level: resolving runs ${hydra:...}
    if missing:
        print(f"error: {missing[0]} is required: add {missing[0]}=...", file=sys.stderr)
        sys.exit(2)
    return cfg


def _accepts(annotation) -> list | None:
    """What an annotation admits: plain types and literal values, or None when this check cannot judge."""
    if annotation in (int, float, bool, str, type(None)):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_accepts(a) for a in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    if origin is typing.Literal:
        return [repr(a) for a in typing.get_args(annotation)]  # literal values, kept as their repr
    return None


def _matches(value, accepted: list) -> bool:
    for a in accepted:
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


def check_trainer_args(args: dict, trainer_class) -> None:
    """Unknown Trainer arguments and plainly wrong values (trainer.max_epochs=abc) in one line each."""
    params = inspect.signature(trainer_class.__init__).parameters
    hints = typing.get_type_hints(trainer_class.__init__)
    for name, value in args.items():
        if name not in params:
            raise ValueError(f"trainer.{name} is not an argument of Lightning's Trainer; check the spelling")
        accepted = _accepts(hints.get(name))
        if accepted is not None and not _matches(value, accepted):
            names = ", ".join(dict.fromkeys("null" if a is type(None) else a if isinstance(a, str) else a.__name__
                                            for a in accepted))  # fmt: skip
            raise ValueError(f"trainer.{name}={value!r} must be one of: {names}")
