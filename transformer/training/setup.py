"""What `python -m transformer.train` checks and builds before any training: the model's config from the tokenizer,
the compile settings, the lengths a batch can hold, and the Trainer's arguments as the run passes them."""

import pytorch_lightning as pl

from ..base.typecheck import check_trainer_args
from ..data import DataConfig, TranslationDataModule
from ..data.batching import padded_length
from ..machine.precision import device_type, resolve_precision
from ..model import ModelConfig, RuntimeConfig
from ..model.kernels.rules import check_backend
from .strategy import training_strategy


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


def checked_trainer_args(trainer: dict, runtime: RuntimeConfig, architecture: ModelConfig,
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
