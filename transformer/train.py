"""python -m transformer.train [experiment=...] [key=value ...]: train a model, every knob a Hydra override."""

import errno
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

if __name__ == "__main__":  # before the imports below, which a restart would otherwise pay for twice (~4 s)
    from .machine.allocator import restart_with_jemalloc

    restart_with_jemalloc()

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .cli.command import CONFIGS, check_overrides, check_trainer_args, exit_with, one_line_errors
from .data import DataConfig, TranslationDataModule
from .data.batching import padded_length
from .machine.allocator import allocator_hint, restart_with_jemalloc
from .machine.precision import device_type, resolve_precision
from .model import ModelConfig, RuntimeConfig
from .model.compiling import compile_dynamic
from .model.kernels.rules import check_backend
from .training import OptimConfig, TranslationModule, ValidationConfig
from .training.checkpoint import AtomicCheckpointIO, RunFolderLock, check_monitors, disk_full_in_run
from .training.errors import TrainingError
from .training.initial import check_vocabulary, holds_training_state, own_run_folder_refusal, run_start
from .training.resume import check_resumable, load_checkpoint, peek_checkpoint, resolve_ckpt_path
from .training.strategy import training_strategy

# ExactResume restores the batch sampler's position itself, which Lightning cannot see.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def model_config(model: dict, data: TranslationDataModule) -> ModelConfig:
    """The named size with overrides; vocabulary sizes and pad id come from the tokenizer, nowhere else."""
    src, tgt = data.src_tokenizer, data.tgt_tokenizer
    return ModelConfig.from_choice(
        model, src_vocab_size=src.vocab_size, tgt_vocab_size=tgt.vocab_size, pad_id=src.pad_id
    )


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile(compile: bool, mode: str | None, runtime: RuntimeConfig, data: DataConfig) -> None:
    """Refuse, in one line, compile settings that cannot work or would not pay."""
    if compile and runtime.padding_free_attention:
        raise ValueError("compile=true with runtime.padding_free_attention=true breaks the graph at every attention "
                         "layer (nested tensors' lengths are read on the host); drop one of them")  # fmt: skip
    if mode is None:
        return
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={mode} is not one of {', '.join(COMPILE_MODES)} (or null)")
    if not compile:
        raise ValueError(f"compile_mode={mode} without compile=true compiles nothing; add compile=true")
    if mode in ("reduce-overhead", "max-autotune") and data.length_rungs is None:  # the modes with CUDA graphs
        raise ValueError(f"compile_mode={mode} records a CUDA graph for every batch shape, and without "
                         "data.length_rungs every batch has its own; add data.length_rungs=16")  # fmt: skip


def check_lengths(data: DataConfig, model: ModelConfig) -> None:
    """The longest sequence a batch can hold, padded (data.length_rungs), within a batch and the model's positions."""
    longest = int(padded_length(data.max_length + 1, data.length_rungs))  # with its end token
    if longest > data.max_tokens:
        raise ValueError(f"data.max_tokens={data.max_tokens} cannot hold one pair of data.max_length={data.max_length} "
                         f"tokens, padded to {longest} by data.length_rungs={data.length_rungs}; raise data.max_tokens "
                         "or lower data.max_length")  # fmt: skip
    if longest > model.max_positions:
        raise ValueError(f"data.max_length={data.max_length} makes sequences of up to {longest} positions (end token "
                         f"and data.length_rungs included) but model.max_positions={model.max_positions}; raise "
                         "model.max_positions or lower data.max_length")  # fmt: skip


def trainer_arguments(trainer: dict, runtime: RuntimeConfig, architecture: ModelConfig,
                      resumed_precision: str | None) -> tuple[dict, str | None]:  # fmt: skip
    """The Trainer's arguments as this run passes them, checked, and trainer.precision=auto's note: the precision
    resolved (a resumed run keeps its checkpoint's; every DDP rank takes rank 0's, ranks an outside launcher started
    joining their process group for it here), the attention backend judged for the device, the strategy built, and
    runtime.deterministic handed to Lightning, which sets it up and keeps it so."""
    args = dict(trainer)
    accelerator = args.get("accelerator", "auto")
    # the strategy first: refusing one costs nothing, trainer.precision=auto's probe a second or more
    strategy = training_strategy(args.get("strategy", "auto"), args.get("devices"), args.get("num_nodes", 1),
                                 accelerator)  # fmt: skip
    args["precision"], note = resolve_precision(args.get("precision"), accelerator, resumed=resumed_precision)
    check_trainer_args(args, pl.Trainer)
    check_backend(architecture, runtime, device_type(accelerator), reduced_precision="16" in str(args["precision"]))
    args["strategy"] = strategy
    if runtime.deterministic:
        args["deterministic"] = True
    return args, note


def train(cfg: DictConfig, run_dir: Path) -> pl.Trainer:
    """Everything before trainer.fit is checked first, so that bad input fails before any training."""
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
    check_lengths(data_config, architecture)
    trainer_args, precision_note = trainer_arguments(plain["trainer"], runtime, architecture,
                                                     checkpoint.get("precision") if checkpoint else None)  # fmt: skip
    pl.seed_everything(cfg.seed, workers=True)
    data = TranslationDataModule(data_config)
    data.setup()
    model = model_config(plain["model"], data) if start.model is None else start.model
    check_vocabulary(model, data.src_tokenizer, data.tgt_tokenizer)
    module = TranslationModule(**TranslationModule.hyperparameters(model, optim, validation, runtime))
    del start
    if initial_weights is not None:
        module.model.load_state_dict(initial_weights)  # a resumed run's checkpoint replaces them in fit
        del initial_weights
    if checkpoint is not None:
        tokenizers = data.checkpoint_extras()["tokenizers"]  # as this run's checkpoints will hold them
        check_resumable(checkpoint, ckpt_path, model, tokenizers)
        del checkpoint  # trainer.fit loads it again; do not hold two copies
    if cfg.compile:
        compile_dynamic(module.model, **({"mode": cfg.compile_mode} if cfg.compile_mode else {}))
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
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
        train(cfg, run_dir)
    except Exception as e:  # a full disk under any writer into the run folder (TensorBoard's, ...): one line too
        full = disk_full_in_run(e, run_dir)
        if full is None:
            raise
        raise full from None


def launched_as_rank_zero() -> bool:
    """Whether this process is rank 0 before any process group exists, by the variables its launcher set: torchrun's
    RANK, srun's SLURM_PROCID, and Lightning's own LOCAL_RANK and NODE_RANK (LOCAL_RANK alone is 0 on every node)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def check_run_folder_free(cfg) -> None:
    """Refuse before Hydra writes its .hydra/ and log into a run folder that a running training holds, or that a
    weights-only ckpt_path (an average.pt in its checkpoints/) would start a new run in."""
    if cfg is None or not launched_as_rank_zero():  # the other DDP ranks share rank 0's folder
        return
    run_dir = Path(cfg.hydra.run.dir)
    if (run_dir / ".lock").exists():
        try:
            RunFolderLock(run_dir).release()
        except TrainingError as e:
            exit_with(e)
    if cfg.ckpt_path not in (None, "last") and Path(cfg.ckpt_path).is_file():
        refusal = own_run_folder_refusal(cfg.ckpt_path, run_dir)
        checkpoint = peek_checkpoint(cfg.ckpt_path) if refusal else {}  # {}: unreadable, which training will say
        if checkpoint and not holds_training_state(checkpoint):
            exit_with(refusal)


def quiet_full_disk_in_threads(hook):
    """threading.excepthook less full disks: TensorBoard's writer thread meets one first, and main, where the
    training loop meets it at its next write, reports it in one line."""

    def excepthook(args) -> None:
        if not (isinstance(args.exc_value, OSError) and args.exc_value.errno == errno.ENOSPC):
            hook(args)

    return excepthook


def console_script() -> None:
    """`transformer-train`: restarted under jemalloc as `python -m transformer.train` is (here after the imports,
    which that restarts before), then the command."""
    restart_with_jemalloc()
    cli()


def cli() -> None:
    """The command. A full disk met while Hydra writes the run's .hydra record, before main runs, ends in one line
    too: Hydra is asked to raise its errors (HYDRA_FULL_ERROR) rather than print their tracebacks itself."""
    cfg = check_overrides("train", sys.argv[1:])
    check_run_folder_free(cfg)
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
