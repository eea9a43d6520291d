"""python -m transformer.train [experiment=...] [key=value ...]: train a model, every knob a Hydra override."""

import os
import shlex
import shutil
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":  # before the imports below, which a restart would otherwise pay for twice (~4 s)
    from .machine.allocator import restart_with_jemalloc

    restart_with_jemalloc()

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .base.overrides import flag_name, laid_over, override_key, split_flags
from .cli.command import CONFIGS, check_overrides, exit_with, one_line_errors
from .data import DataConfig, TranslationDataModule
from .machine.allocator import allocator_hint, restart_with_jemalloc
from .model import ModelConfig, RuntimeConfig
from .model.compiling import compile_dynamic
from .training import OptimConfig, TranslationModule, ValidationConfig
from .training.checkpoint import (
    AtomicCheckpointIO,
    RunFolderLock,
    check_monitors,
    disk_full_in_run,
    quiet_full_disk_in_threads,
)
from .training.errors import TrainingError
from .training.initial import check_run_folder_free, check_vocabulary, launched_as_rank_zero, run_start
from .training.resume import RecordOverrides, check_resumable, launch_overrides, load_checkpoint, resolve_ckpt_path
from .training.schedule import check_schedule
from .training.setup import check_compile, check_lengths, checked_trainer_args, model_config

# ExactResume restores the batch sampler's position itself, which Lightning cannot see.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def train(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> pl.Trainer:
    """Everything before trainer.fit is checked first, so that bad input fails before any training. `overrides`, the
    command line's, are recorded in every checkpoint."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    optim, validation = OptimConfig(**plain["optim"]), ValidationConfig(**plain["validation"])
    runtime, data_config = RuntimeConfig(**plain["runtime"]), DataConfig.from_dict(plain["data"])
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, run_dir)
    start = run_start(cfg.init_from, ckpt_path, load_checkpoint(ckpt_path) if ckpt_path else None, run_dir,
                      data_config, plain["model"])  # fmt: skip
    ckpt_path, checkpoint, data_config, initial_weights = start.ckpt_path, start.checkpoint, start.data, start.weights
    # Checked before the precision probe and the data, whose tokenizer and encoding can take minutes: the vocabulary
    # is a placeholder here, the tokenizer's below (or the model's the run starts from)
    architecture = start.model or ModelConfig.from_choice(plain["model"], src_vocab_size=2, tgt_vocab_size=2, pad_id=0)
    check_compile(cfg.compile, cfg.compile_mode, runtime, data_config)
    check_schedule(optim.schedule, plain["trainer"])
    check_lengths(data_config, architecture)
    trainer_args, precision_note = checked_trainer_args(plain["trainer"], runtime, architecture,
                                                        checkpoint.get("precision") if checkpoint else None)  # fmt: skip
    pl.seed_everything(cfg.seed, workers=True)
    data = TranslationDataModule(data_config)
    data.setup()
    model = model_config(plain["model"], data) if start.model is None else start.model
    check_vocabulary(model, data.src_tokenizer, data.tgt_tokenizer)
    module = TranslationModule(**TranslationModule.hyperparameters(model, optim, validation, runtime))
    del start
    if initial_weights is not None:
        module.model.load_state_dict(initial_weights)
        del initial_weights
    if checkpoint is not None:
        tokenizers = data.checkpoint_extras()["tokenizers"]  # as this run's checkpoints will hold them
        check_resumable(checkpoint, ckpt_path, model, tokenizers)
        del checkpoint  # trainer.fit loads it again; do not hold two copies
    if cfg.compile:
        compile_dynamic(module.model, **({"mode": cfg.compile_mode} if cfg.compile_mode else {}))
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    callbacks.append(RecordOverrides(overrides))
    check_monitors(callbacks, TranslationModule.validation_metrics(list(data.validation_sets)))
    trainer = pl.Trainer(
        **trainer_args,
        default_root_dir=str(run_dir),
        callbacks=callbacks,
        logger=[hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values()],  # ~logger: none
        plugins=[AtomicCheckpointIO()],
    )
    if trainer.is_global_zero:
        for note in filter(None, (precision_note, allocator_hint(trainer.strategy.root_device.type))):
            print(note, file=sys.stderr)
    lock = RunFolderLock(run_dir) if trainer.is_global_zero else None  # other ranks share rank 0's folder
    try:
        for stale in (run_dir / "checkpoints").glob(".*.tmp"):  # a checkpoint write cut short by a kill
            stale.unlink()
        tokenizer_dir = run_dir / "tokenizer"
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        for tok in {data.src_tokenizer.path, data.tgt_tokenizer.path}:
            if tok.resolve() != (tokenizer_dir / tok.name).resolve():  # init_from's are written there already
                shutil.copy2(tok, tokenizer_dir / tok.name)  # the run folder holds the tokenizer it was trained with
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    finally:
        if lock is not None:
            lock.release()
    return trainer


@hydra.main(config_path=str(CONFIGS), config_name="train", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        train(cfg, run_dir, list(HydraConfig.get().overrides.task))
    except Exception as e:  # a full disk under any writer into the run folder (TensorBoard's, ...): one line too
        full = disk_full_in_run(e, run_dir)
        if full is None:
            raise
        raise full from None


def console_script() -> None:
    """`transformer-train`: restarted under jemalloc as `python -m transformer.train` is (here after the imports,
    which that restarts before), then the command."""
    restart_with_jemalloc()
    cli()


def as_launched(argv: list[str]) -> list[str]:
    """A resume's overrides: those its checkpoint's run was launched with, the command line's on top, Hydra's flags
    kept after them (`--cfg job` shows the configuration the resume runs with; after, so that a bare `--info` takes
    no override for its value). A multirun is left as it is: its jobs' folders are not the run folder
    `ckpt_path=last` looks in."""
    flags, overrides = split_flags(argv)
    multirun = {"-m", "--multirun"} & {flag_name(f) for f in flags} or "hydra.mode=MULTIRUN" in overrides
    if multirun or not any(override_key(o) == "ckpt_path" for o in overrides):
        return argv
    # ckpt_path and the run folder alone: the rest may need the recorded overrides to compose (~ of a recorded +)
    where = check_overrides("train", [o for o in overrides if override_key(o) == "ckpt_path" or o.startswith("hydra")])
    recorded = launch_overrides(where.ckpt_path, Path(where.hydra.run.dir)) if where.ckpt_path else []
    if recorded is None and launched_as_rank_zero():
        print(f"ckpt_path={where.ckpt_path} records no overrides (written before checkpoints did): it resumes with "
              "the command line's alone", file=sys.stderr)  # fmt: skip
    if not recorded:
        return argv
    argv = [*laid_over(recorded, overrides), *flags]
    if launched_as_rank_zero():
        print(f"resuming as launched: {shlex.join(argv)}", file=sys.stderr)
    return argv


def cli() -> None:
    """The command. A resume takes the overrides its run was launched with (as_launched): sys.argv becomes them,
    which Hydra composes and DDP's ranks are launched with. A full disk met while Hydra writes the run's .hydra
    record, before main runs, ends in one line too: Hydra is asked to raise its errors (HYDRA_FULL_ERROR) rather
    than print their tracebacks itself."""
    sys.argv[1:] = as_launched(sys.argv[1:])
    cfg = check_overrides("train", sys.argv[1:])
    try:
        check_run_folder_free(cfg)
    except TrainingError as e:
        exit_with(e)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    threading.excepthook = quiet_full_disk_in_threads(threading.excepthook)
    try:
        main()
    except OSError as e:
        full = disk_full_in_run(e, Path(cfg.hydra.run.dir) if cfg is not None else Path.cwd())
        if full is None:
            raise
        exit_with(full)


if __name__ == "__main__":
    cli()
