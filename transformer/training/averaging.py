"""Checkpoint averaging: the mean of several checkpoints' weights, as one checkpoint that evaluates alone."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .resume import load_checkpoint

AVERAGE_NAME = "average.pt"  # what `python -m transformer.average` writes into a checkpoints/ folder by default
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
    if last < 1:
        raise ValueError(f"--last {last} must be at least 1")
    steps = checkpoints_by_step(folder)
    if not steps:
        raise ValueError(f"{folder} holds no checkpoints to average (*.ckpt besides last.ckpt); give a run's "
                         "checkpoints/ folder, or checkpoint files")  # fmt: skip
    if len(steps) < last:
        raise ValueError(
            f"{folder} holds checkpoints of {len(steps)} different steps ({kept_kinds(folder)}; last.ckpt is not "
            f"averaged), fewer than --last {last}: average those with --last {len(steps)}, or train with "
            f"callbacks.epoch_checkpoints.save_top_k={last} to keep the newest {last} epochs' checkpoints too "
            "(experiment=multi30k_de_en_gpu keeps them every 500 steps)"
        )
    return [path for _, path, _ in steps[-last:]]


def kept_kinds(folder: Path) -> str:
    """What training kept in a checkpoints/ folder, by the callbacks' file names (configs/callbacks/default.yaml):
    the best by a metric (epoch{E}-step{S}-{metric}{score}.ckpt), others (epoch{E}-step{S}.ckpt)."""
    best = {}
    others = 0
    for path in folder.glob("*.ckpt"):
        if found := re.fullmatch(r".*-step\d+-([a-z]+)-?[\d.]+\.ckpt", path.name):
            best[found[1]] = best.get(found[1], 0) + 1
        elif path.name != "last.ckpt":
            others += 1
    kinds = [f"the best {n} by val/{metric}" for metric, n in best.items()]
    return ", ".join(kinds + ([f"{others} kept by epoch or step"] if others else []))


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Parameters averaged in float64 and cast back; everything but the weights comes from the newest checkpoint
    (by step). The result has no optimizer or loop state: it is for evaluating and translating, not resuming."""
    loaded = sorted(((load_checkpoint(str(p)), p) for p in paths), key=lambda cp: cp[0]["global_step"])
    for (earlier, first), (later, second) in zip(loaded, loaded[1:]):  # a glob of a folder takes both
        if earlier["global_step"] == later["global_step"] and Path(first).parent == Path(second).parent:
            raise ValueError(f"{first} and {second} hold the same step ({later['global_step']}) of one run, as its "
                             "best and epoch checkpoints do: averaged, it would count twice; give one of them, or "
                             "the checkpoints/ folder with --last N")  # fmt: skip
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
