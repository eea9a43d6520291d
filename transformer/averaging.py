"""Checkpoint averaging: the mean of several checkpoints' weights, as one checkpoint that evaluates alone."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .training.resume import load_checkpoint

KEEP = ("hyper_parameters", "tokenizers", "data", "precision", "epoch", "global_step", "pytorch-lightning_version")


def checkpoints_by_step(folder: Path, read: Callable[[dict], Any] = lambda checkpoint: None) -> list[tuple]:
    """(step, path, read(checkpoint)) for each training step saved in a run's checkpoints/ folder, by step: one
    file per step (a best and an epoch checkpoint of the same step hold the same weights; last.ckpt repeats one)."""
    by_step = {}
    for path in sorted(folder.glob("*.ckpt")):
        if path.name != "last.ckpt":
            checkpoint = load_checkpoint(str(path))
            if checkpoint["global_step"] not in by_step:
                by_step[checkpoint["global_step"]] = (path, read(checkpoint))
    return [(step, *by_step[step]) for step in sorted(by_step)]


def checkpoints_in(folder: Path, last: int) -> list[Path]:
    """The `last` checkpoints of a run's checkpoints/ folder by training step, one per step."""
    steps = checkpoints_by_step(folder)
    if len(steps) < last:
        raise ValueError(f"{folder} holds checkpoints of {len(steps)} different steps; asked to average {last}")
    return [path for _, path, _ in steps[-last:]]


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Parameters averaged in float64 and cast back; everything but the weights comes from the newest checkpoint
    (by step). The result has no optimizer or loop state: it is for evaluating and translating, not resuming."""
    loaded = sorted(((load_checkpoint(str(p)), p) for p in paths), key=lambda cp: cp[0]["global_step"])
    newest = loaded[-1][0]
    for checkpoint, path in loaded:
        same = checkpoint["hyper_parameters"]["model"] == newest["hyper_parameters"]["model"]
        if not same or checkpoint["state_dict"].keys() != newest["state_dict"].keys():
            raise ValueError(f"{path} is a different model than {loaded[-1][1]}; average checkpoints of one run")
        if checkpoint.get("tokenizers") != newest.get("tokenizers"):
            raise ValueError(f"{path} has other tokenizers than {loaded[-1][1]}; average checkpoints of one run")
    averaged = {k: newest[k] for k in KEEP if k in newest}
    averaged["state_dict"] = mean_state([checkpoint["state_dict"] for checkpoint, _ in loaded])
    if all("ema_state_dict" in checkpoint for checkpoint, _ in loaded):  # the weight averages too (optim.ema_decay)
        averaged["ema_state_dict"] = mean_state([checkpoint["ema_state_dict"] for checkpoint, _ in loaded])
    averaged["averaged_from"] = [str(p) for _, p in loaded]
    return averaged


def mean_state(states: list[dict]) -> dict:
    """Floating-point tensors averaged in float64 and cast back; others as the last state has them."""
    mean = {}
    for name, value in states[-1].items():
        if value.is_floating_point():
            mean[name] = torch.stack([state[name].double() for state in states]).mean(0).to(value.dtype)
        else:
            mean[name] = value
    return mean
