"""Parallel corpora: sources, sentencepiece tokenizers, cached encoding, token batches, the DataModule."""

from .batching import Collate, TokenBatchSampler, TokenDataset, example_lengths, padding_fraction
from .config import DataConfig
from .datamodule import TranslationDataModule
from .prepare import PreparedData, prepare_data
from .sources import DataError, load_corpus
from .tokenizer import SentencePiece

__all__ = [
    "Collate", "DataConfig", "DataError", "PreparedData", "SentencePiece", "TokenBatchSampler", "TokenDataset",
    "TranslationDataModule", "example_lengths", "load_corpus", "padding_fraction", "prepare_data",
]  # fmt: skip
