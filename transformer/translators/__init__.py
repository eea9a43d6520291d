"""Translators: a trained model with its tokenizers behind one interface (interface.py), run by PyTorch from a
training checkpoint (checkpoint.py) or by CTranslate2 from an exported folder (ctranslate2.py)."""

from ..model import RuntimeConfig
from .checkpoint import CheckpointTranslator
from .ctranslate2 import CTranslate2Translator, is_export
from .interface import PRECISIONS, SearchConfig, Translator, check_nbest

__all__ = [
    "PRECISIONS",
    "CTranslate2Translator",
    "CheckpointTranslator",
    "SearchConfig",
    "Translator",
    "check_nbest",
    "is_export",
    "open_translator",
]


def open_translator(path: str, device: str = "cpu", runtime: RuntimeConfig | None = None, ema: bool = False,
                    threads: int = 0, workers: int = 1) -> Translator:  # fmt: skip
    """A training checkpoint as a CheckpointTranslator (`ema`: with its weights' moving average), or a folder
    `python -m transformer.export` wrote as a CTranslate2Translator (the same translate() and tokenizers;
    `runtime` does not apply to it; `threads` and `workers` only to it: CTranslate2's intra-op threads, 0 its
    default, and how many calls may run at once, from as many threads). A checkpoint takes calls from several
    threads as it is: each call keeps its own caches."""
    if not is_export(path):
        return CheckpointTranslator.from_path(path, device, runtime, ema)
    if ema:
        raise ValueError(f"ema=true reads a training checkpoint's weight average; {path} is an exported folder")
    return CTranslate2Translator(path, device, threads, workers)
