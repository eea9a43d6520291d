"""Translators: a trained model with its tokenizers behind one interface (interface.py), run by PyTorch from a
training checkpoint (checkpoint.py) or by CTranslate2 from an exported folder (ctranslate2.py)."""

import os

from ..model import RuntimeConfig
from .checkpoint import CheckpointTranslator
from .ctranslate2 import CTranslate2Translator, is_export
from .interface import PRECISIONS, Decoding, SearchConfig, Translator, check_nbest

__all__ = [
    "PRECISIONS",
    "CTranslate2Translator",
    "CheckpointTranslator",
    "Decoding",
    "SearchConfig",
    "Translator",
    "check_nbest",
    "checkpoint_paths",
    "is_export",
    "open_translator",
]


def open_translator(path: str | list[str], device: str = "cpu", runtime: RuntimeConfig | None = None, ema: bool = False,
                    threads: int = 0, workers: int = 1) -> Translator:  # fmt: skip
    """Several training checkpoints (a list of paths) as one CheckpointTranslator decoding them as an ensemble; a
    training checkpoint as a CheckpointTranslator (`ema`: with its weights' moving average), or a folder
    `python -m transformer.export` wrote as a CTranslate2Translator (the same translate() and tokenizers;
    `runtime` does not apply to it; `threads` and `workers` only to it: CTranslate2's intra-op threads, 0 its
    default, and how many calls may run at once, from as many threads). A checkpoint takes calls from several
    threads as it is: each call keeps its own caches."""
    paths = checkpoint_paths(path)
    if len(paths) > 1:
        if exported := [p for p in paths if is_export(p)]:
            raise ValueError(
                f"ckpt_path: {exported[0]} is an exported folder; an ensemble decodes training checkpoints"
            )
        return CheckpointTranslator.ensemble(paths, device, runtime, ema)
    path = paths[0]
    if not is_export(path):
        return CheckpointTranslator.from_path(path, device, runtime, ema)
    if ema:
        raise ValueError(f"ema=true reads a training checkpoint's weight average; {path} is an exported folder")
    return CTranslate2Translator(path, device, threads, workers)


def checkpoint_paths(path) -> list[str]:
    """ckpt_path as a list of paths: one path, or a non-empty list of them (ckpt_path=[a.ckpt,b.ckpt])."""
    paths = [path] if isinstance(path, str | os.PathLike) else list(path) if isinstance(path, list | tuple) else None
    paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in paths or []]
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"ckpt_path={path!r} must be a checkpoint's path, or a list of them for an ensemble: [a,b]")
    return paths
