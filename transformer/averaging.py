"""Checkpoint averaging: the mean of several checkpoints' weights, as one checkpoint that evaluates alone."""

from pathlib import Path

import torch

from .training.resume import load_checkpoint

KEEP = ("hyper_parameters", "tokenizers", "data", "precision", "epoch", "global_step", "pytorch-lightning_version")


def checkpoints_in(folder: Path, last: int) -> list[Path]:
    """The `last` checkpoints of a run's checkpoints/ folder by training step (last.ckpt excluded: it repeats one)."""
    found = [(load_checkpoint(str(p))["global_step"], p) for p in folder.glob("*.ckpt") if p.name != "last.ckpt"]
    if len(found) < last:
        raise ValueError(f"{folder} holds {len(found)} checkpoints besides last.ckpt; asked to average {last}")
    return [p for _, p in sorted(found)[-last:]]


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Parameters averaged in float64 and cast back; everything but the weights comes from the newest checkpoint
    (by step). The result has no optimizer or loop state: it is for evaluating and translating, not resuming."""
    checkpoints = sorted((load_checkpoint(str(p)) for p in paths), key=lambda c: c["global_step"])
    newest = checkpoints[-1]
    names = newest["state_dict"].keys()
    for path, checkpoint in zip(paths, checkpoints):
        if (
            checkpoint["hyper_parameters"]["model"] != newest["hyper_parameters"]["model"]
            or checkpoint["state_dict"].keys() != names
        ):
            raise ValueError(f"{path} is a different model than the others; average checkpoints of one run")
    state = {}
    for name in names:
        tensors = [c["state_dict"][name] for c in checkpoints]
        if tensors[0].is_floating_point():
            state[name] = torch.stack([t.double() for t in tensors]).mean(0).to(tensors[0].dtype)
        else:
            state[name] = tensors[-1]
    averaged = {k: newest[k] for k in KEEP if k in newest}
    averaged["state_dict"] = state
    averaged["averaged_from"] = [str(p) for p in paths]
    return averaged
