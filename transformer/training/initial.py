"""How a training starts: fresh, resumed from its checkpoint, or from a model (init_from: a folder
transformer.import_model wrote, or any checkpoint: its architecture, weights and tokenizers, with a fresh optimizer,
schedule and step count); and the run folder it may start in."""

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from torch import Tensor

from ..data import DataConfig
from ..data.prepare import write_tokenizer_folder
from ..data.tokenizer import SentencePiece
from ..model import ModelConfig
from .checkpoint import RunFolderLock
from .errors import TrainingError
from .resume import holds_training_state, load_checkpoint, peek_checkpoint

# what a fine-tuning may change (model.<field>=... with init_from): regularisation, not the weights' shapes or meaning
TUNABLE = ("dropout", "attention_dropout", "activation_dropout", "token_dropout")
CHECKPOINT_NAME = "model.ckpt"  # transformer.import_model's, in its output folder


def initial_checkpoint_path(init_from: str) -> str:
    """init_from's checkpoint file: the path itself, or a folder's model.ckpt."""
    path = Path(init_from)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"init_from={init_from}: no such checkpoint (a folder needs a {CHECKPOINT_NAME}); give "
                                "a folder transformer.import_model wrote, or a checkpoint file")  # fmt: skip
    return str(path)


StartKind = Literal["new", "from a model", "resumed", "resumed from a model"]


@dataclass
class Start:
    """Where a run starts: its kind, the checkpoint it resumes (if any), its data config, and, for a run started from
    a model (or resumed after starting so), that model's architecture; starting from it, its weights."""

    kind: StartKind
    ckpt_path: str | None
    checkpoint: dict | None
    data: DataConfig
    model: ModelConfig | None  # None: the `model:` group's choice, sized by the tokenizer
    weights: dict[str, Tensor] | None  # the model's, loaded before training; None when resuming (fit loads those)


def run_start(init_from: str | None, ckpt_path: str | None, checkpoint: dict | None, run_dir: Path, data: DataConfig,
              choice: dict) -> Start:  # fmt: skip
    """A new run; one from a model (init_from, or a checkpoint of weights only given as ckpt_path: start_from_weights),
    which takes the model's architecture, tokenizers and weights; a resumed run; and a resumed run that started from a
    model, whose architecture and tokenizers come from init_from given again, or from its own checkpoint, which names
    them (data.tokenizer)."""
    if checkpoint is not None and not holds_training_state(checkpoint):  # an imported or averaged model
        given = f"init_from={start_from_weights(ckpt_path, init_from, run_dir)}"
        return _from_model("from a model", None, None, checkpoint, given, run_dir, data, choice)
    if init_from:
        kind = "from a model" if checkpoint is None else "resumed from a model"
        return _from_model(kind, ckpt_path, checkpoint, load_checkpoint(initial_checkpoint_path(init_from)),
                           f"init_from={init_from}", run_dir, data, choice)  # fmt: skip
    if checkpoint is None:
        return Start("new", None, None, data, None, None)
    if checkpoint.get("data", {}).get("tokenizer") and data.tokenizer is None:
        return _from_model("resumed from a model", ckpt_path, checkpoint, checkpoint, f"ckpt_path={ckpt_path}",
                           run_dir, data, choice)  # fmt: skip
    return Start("resumed", ckpt_path, checkpoint, data, None, None)


def _from_model(kind: StartKind, ckpt_path: str | None, checkpoint: dict | None, model: dict, given: str, run_dir: Path,
                data: DataConfig, choice: dict) -> Start:  # fmt: skip
    """A start whose architecture and tokenizers are `model`'s (a checkpoint, named by `given`)."""
    data = with_checkpoint_tokenizers(data, model, run_dir / "tokenizer", given)
    weights = initial_weights(model) if checkpoint is None else None  # resumed: fit loads its own
    return Start(kind, ckpt_path, checkpoint, data, initial_model(model, choice, given), weights)


def start_from_weights(ckpt_path: str, init_from: str | None, run_dir: Path) -> str:
    """ckpt_path names a checkpoint of weights only (imported or averaged), which no run can resume: training starts
    from it as init_from would, in a run folder of its own (not the one it came from, whose checkpoints it would
    overwrite)."""
    if init_from is not None:
        raise ValueError(f"ckpt_path={ckpt_path} holds weights only and init_from={init_from} is given too; give one "
                         "of them: init_from starts from a model, ckpt_path resumes a run")  # fmt: skip
    refusal = own_run_folder_refusal(ckpt_path, run_dir)
    if refusal:
        raise ValueError(refusal)
    print(f"ckpt_path={ckpt_path} holds weights only (no optimizer state to resume): training starts from them "
          f"with a fresh optimizer, as init_from={ckpt_path} does", file=sys.stderr)  # fmt: skip
    return ckpt_path


def own_run_folder_refusal(ckpt_path: str, run_dir: Path) -> str | None:
    """Why a checkpoint of weights only cannot start a run in run_dir (the run it came from, which hydra.run.dir
    follows for a checkpoint in RUN/checkpoints/, e.g. average.pt: its checkpoints would be overwritten), or None."""
    if Path(ckpt_path).resolve().parent.parent != run_dir.resolve():
        return None
    return (
        f"ckpt_path={ckpt_path} holds weights only (no optimizer state to resume), and training from it here "
        f"would overwrite {run_dir}'s checkpoints; start a new run from it with init_from={ckpt_path}"
    )


def initial_model(checkpoint: dict, choice: dict, given: str) -> ModelConfig:
    """The checkpoint's ModelConfig with the command line's regularisation (TUNABLE) over it. The `model:` group's
    other non-null fields must agree with it: they would change the weights' shapes or meaning."""
    saved = ModelConfig.from_dict(checkpoint["hyper_parameters"]["model"])
    overrides = {k: v for k, v in choice.items() if k != "size" and v is not None}
    for name, value in overrides.items():
        if name not in TUNABLE and value != getattr(saved, name):
            raise ValueError(f"model.{name}={value} but {given} has {name}={getattr(saved, name)}; drop the override "
                             f"(from a model only {', '.join(TUNABLE)} may change)")  # fmt: skip
    return replace(saved, **{k: v for k, v in overrides.items() if k in TUNABLE})


def initial_weights(checkpoint: dict) -> dict[str, Tensor]:
    """The model's weights, as EncoderDecoder.load_state_dict takes them."""
    return {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


def with_checkpoint_tokenizers(data: DataConfig, checkpoint: dict, folder: Path, given: str) -> DataConfig:
    """data with the checkpoint's sentencepiece models as its tokenizer (data.tokenizer), written into `folder` (the
    run's tokenizer/): vocabulary training is skipped and the corpus encoded as the model was trained. `given`: how
    the command line named the checkpoint (init_from=PATH), for errors."""
    trained = checkpoint.get("data", {})
    if (trained.get("src"), trained.get("tgt")) != (data.src, data.tgt):
        raise ValueError(f"{given} translates {trained.get('src')}->{trained.get('tgt')}, but data.src="
                         f"{data.src} data.tgt={data.tgt}; set data.src={trained.get('src')} "
                         f"data.tgt={trained.get('tgt')}")  # fmt: skip
    if data.tokenizer is not None:
        raise ValueError(f"data.tokenizer={data.tokenizer} and {given}: the model's own tokenizer is used; drop "
                         "data.tokenizer")  # fmt: skip
    if "tokenizers" not in checkpoint:
        raise ValueError(f"{given} holds no tokenizers (it was not written by training or "
                         "transformer.import_model); give such a checkpoint")  # fmt: skip
    write_tokenizer_folder(folder, data.src, data.tgt, (checkpoint["tokenizers"]["src"],
                                                        checkpoint["tokenizers"]["tgt"]))  # fmt: skip
    return replace(data, tokenizer=str(folder))


def check_vocabulary(model: ModelConfig, src: SentencePiece, tgt: SentencePiece) -> None:
    """The tokenizers the data module loaded fit the model's embeddings (a model's own do; data.tokenizer's may not)."""
    for name, value in (("src_vocab_size", src.vocab_size), ("tgt_vocab_size", tgt.vocab_size), ("pad_id", src.pad_id)):
        if getattr(model, name) != value:
            raise ValueError(f"the tokenizer gives {name}={value} but the model has {name}={getattr(model, name)}; "
                             "give the model's own tokenizer")  # fmt: skip


def launched_as_rank_zero() -> bool:
    """Whether this process is rank 0 before any process group exists, by the variables its launcher set: torchrun's
    RANK, srun's SLURM_PROCID, and Lightning's own LOCAL_RANK and NODE_RANK (LOCAL_RANK alone is 0 on every node)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def check_run_folder_free(cfg) -> None:
    """Raise TrainingError (the command says it in one line) before Hydra writes its .hydra/ and log into a run
    folder that a running training holds, or that a weights-only ckpt_path (an average.pt in its checkpoints/) would
    start a new run in."""
    if cfg is None or not launched_as_rank_zero():  # the other DDP ranks share rank 0's folder
        return
    run_dir = Path(cfg.hydra.run.dir)
    if (run_dir / ".lock").exists():
        RunFolderLock(run_dir).release()  # taking the lock raises while a training holds it
    if cfg.ckpt_path not in (None, "last") and Path(cfg.ckpt_path).is_file():
        refusal = own_run_folder_refusal(cfg.ckpt_path, run_dir)
        checkpoint = peek_checkpoint(cfg.ckpt_path) if refusal else {}  # {}: unreadable, which training will say
        if checkpoint and not holds_training_state(checkpoint):
            raise TrainingError(refusal)
