"""Resuming: which checkpoint `ckpt_path` means, the overrides its run was launched with (recorded in it), and
whether it fits this run, checked before training starts."""

import pickle
from collections.abc import Sequence
from pathlib import Path

import torch
from pytorch_lightning import Callback, LightningModule, Trainer

from ..base.errors import first_line
from ..base.overrides import override_key
from ..data.tokenizer import vocabulary_fingerprint
from ..model import ModelConfig


def run_dir_for(ckpt_path, default: str, outputs: str = "outputs") -> str:
    """The run folder of a checkpoint in it (`RUN/checkpoints/x.ckpt`, or average.pt), where a resumed run
    continues and evaluate writes (RUN/evaluate/); an ensemble's: its first checkpoint's; `last`: the newest run
    under `outputs/` that has a last.ckpt; otherwise `default`."""
    if not isinstance(ckpt_path, str | None):  # a list of checkpoints (an ensemble), or a wrong value
        first = list(ckpt_path)[:1] if hasattr(ckpt_path, "__iter__") else [ckpt_path]
        ckpt_path = str(first[0]) if first else None
    if not ckpt_path:
        return default
    if ckpt_path == "last":
        runs = sorted(Path(outputs).glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        return str(runs[-1].parent.parent) if runs else default
    path = Path(ckpt_path)
    return str(path.parent.parent) if path.parent.name == "checkpoints" else default


def launch_record(output_dir: str, now: str) -> str:
    """hydra.output_subdir: .hydra/ for a run folder's first launch; a later launch (a resume, refused or not) records
    its config in .hydra/<now>/, never over the config the run was launched with."""
    return f".hydra/{now}" if (Path(output_dir) / ".hydra").is_dir() else ".hydra"


def checkpoint_file(ckpt_path: str, run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    if not ckpt_path:
        return None
    path = checkpoint_file(ckpt_path, run_dir)
    if not path.is_file():
        where = f"no checkpoints/last.ckpt in {run_dir}" if ckpt_path == "last" else "no such file"
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path}: {where}; give a checkpoint file, or ckpt_path=last with hydra.run.dir=<run folder>"
        )
    return str(path)


def load_checkpoint(path: str) -> dict:
    """A checkpoint's contents, loaded without executing code from it; a one-line error if unreadable."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"ckpt_path={path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            raise ValueError(
                f"ckpt_path={path} is refused: it holds code or objects other than weights and plain values, "
                "which loading would execute; use checkpoints written by training, from sources you trust"
            ) from None
        reason = first_line(e)
        raise ValueError(f"ckpt_path={path} cannot be loaded ({reason}); it is truncated, corrupt or not a "
                         "checkpoint: use another one, e.g. the run's checkpoints/last.ckpt") from None  # fmt: skip
    if not isinstance(checkpoint, dict) or "model" not in checkpoint.get("hyper_parameters", {}):
        raise ValueError(f"ckpt_path={path} is not a checkpoint of this project (no model hyperparameters)")
    return checkpoint


def peek_checkpoint(path: str) -> dict:
    """A checkpoint's top-level contents, its tensors memory-mapped rather than read (cheap for its keys); {} if
    load_checkpoint would refuse it, which then says why."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}
    return checkpoint if isinstance(checkpoint, dict) else {}


class RecordOverrides(Callback):
    """Writes the command line's overrides into every checkpoint a run can resume from, so that resuming with
    `ckpt_path` alone continues its run as it was launched (launch_overrides)."""

    def __init__(self, overrides: Sequence[str]):
        self.overrides = list(overrides)

    def on_save_checkpoint(self, trainer: Trainer, module: LightningModule, checkpoint: dict) -> None:
        checkpoint["overrides"] = self.overrides


def holds_training_state(checkpoint: dict) -> bool:
    """Whether a run can resume from it (a training's checkpoint), or only start from its weights (an imported or
    averaged model)."""
    return "optimizer_states" in checkpoint


def launch_overrides(ckpt_path: str, run_dir: Path) -> list[str] | None:
    """The overrides the checkpoint's run was launched with, less its ckpt_path and init_from (a resumed run's
    checkpoint names its model's architecture and tokenizers itself); [] for a checkpoint no run resumes (weights
    only, or unreadable, which training then says); None for one that records none (written before they were)."""
    checkpoint = peek_checkpoint(str(checkpoint_file(ckpt_path, run_dir)))
    if not holds_training_state(checkpoint):
        return []
    if "overrides" not in checkpoint:
        return None
    return [o for o in checkpoint["overrides"] if override_key(o) not in ("ckpt_path", "init_from")]


def check_resumable(checkpoint: dict, path: str, model: ModelConfig, tokenizers: dict[str, bytes]) -> None:
    """Raise a one-line ValueError if the checkpoint's vocabulary or model differs from this run's."""
    for side, spm_bytes in tokenizers.items():
        saved = checkpoint.get("tokenizers", {}).get(side)
        if saved is not None and vocabulary_fingerprint(saved) != vocabulary_fingerprint(spm_bytes):
            raise ValueError(
                f"ckpt_path={path} was trained with another {side} vocabulary than this run's data config "
                "builds; resume with the data.* settings it was trained with"
            )
    saved_model = checkpoint["hyper_parameters"]["model"]
    for name, value in vars(model).items():
        if name in saved_model and saved_model[name] != value:  # runtime settings are not ModelConfig's: free
            what = "vocabulary" if name in ("src_vocab_size", "tgt_vocab_size", "pad_id") else "model"
            raise ValueError(
                f"ckpt_path={path} has {what} model.{name}={saved_model[name]}, this run has {value}; "
                "resume with the settings it was trained with"
            )
