"""What every command-line entry point shares: bad input ends in one line, not a traceback."""

import dataclasses
import functools
import sys
import typing
from pathlib import Path

import yaml
from lightning_fabric.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

from ..base.overrides import override_key
from ..base.typecheck import check_value
from ..config.schema import register_configs
from ..data.sources import DataError
from ..data.sources import read_lines as read_corpus_lines
from ..training.errors import TrainingError
from .console import quiet_console

CONFIGS = Path(__file__).parents[1] / "configs"  # configs/ of a checkout (a link), or the wheel's copy


def exit_with(error: Exception | str, status: int = 2) -> typing.NoReturn:
    """What every command prints for a failure it can name: one line, `error: ...` on stderr, then the exit status
    (2: bad input; 1: a check the input failed, as export's parity gate)."""
    print(f"error: {error}", file=sys.stderr)
    sys.exit(status)


def one_line_errors(main):
    """Report a bad config or bad data through exit_with; keep library notices off the console."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        quiet_console()
        try:
            return main(*args, **kwargs)
        except (DataError, ValueError, FileNotFoundError, TrainingError, MisconfigurationException) as e:
            exit_with(e)

    return wrapper


def read_lines(path: str, key: str) -> list[str]:
    """A command's text-file input (`key=path`, plain or gzipped), one sentence per line, read as corpora are; a
    one-line error if it is not a file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{key}={path} is not a file; give a text file with one sentence per line")
    return read_corpus_lines(Path(path))


def check_overrides(config_name: str, argv: list[str]):
    """Compose the config once with the command line's overrides, so that an unknown key or group option
    fails in one line (Hydra's own report spans several); returns it, with its hydra node. Flags (-m, --cfg,
    ...) are left to Hydra (None is returned). Registers the config schema first, which Hydra needs either way."""
    register_configs()
    if any(arg.startswith("-") for arg in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name, overrides=argv, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        exit_with(_composition_error(e, argv))
    missing = [key for key in cfg if OmegaConf.is_missing(cfg, key)]  # top level: resolving runs ${hydra:...}
    if missing:
        exit_with(f"{missing[0]} is required: add {missing[0]}=...")
    return cfg


def _composition_error(error: Exception, argv: list[str]) -> str:
    """A wrong type in an override as the type check words it (`data.vocab_size='abc' must be one of: int`);
    anything else as Hydra says it, on one line."""
    from omegaconf.errors import ValidationError

    cause = error.__cause__
    if isinstance(cause, ValidationError) and cause.full_key and dataclasses.is_dataclass(cause.object_type):
        key = cause.full_key
        annotation = {f.name: f.type for f in dataclasses.fields(cause.object_type)}.get(key.rsplit(".", 1)[-1])
        given = next((a.split("=", 1)[1] for a in argv if override_key(a) == key), None)
        if annotation is not None and given is not None:
            try:
                check_value(key, yaml.safe_load(given), annotation)
            except ValueError as e:
                return str(e)
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())
