"""Subword regularisation: every epoch, each training source and target is segmented afresh by sentencepiece
sampling (Kudo 2018 for unigram models, BPE-dropout for BPE ones). Dev and test sets keep their one segmentation."""

import itertools
from dataclasses import dataclass

import numpy as np

from .batching import TokenDataset
from .tokenizer import SentencePiece

Flat = tuple[np.ndarray, np.ndarray]  # (ids end to end, each row's offset into them), as TokenDataset holds them


@dataclass(frozen=True)
class Sampling:
    alpha: float  # unigram: the smoothing exponent (lower: more varied segmentations); bpe: the dropout probability
    nbest_size: int  # unigram: sample among the N best segmentations; -1: among all of them
    seed: int


class ResegmentedDataset(TokenDataset):
    """Training pairs whose ids are an epoch's sampled segmentations: a pure function of (seed, epoch, example), so an
    epoch reads the same whatever the loader workers and wherever a run resumed. The sampler asks for an epoch's
    lengths (to pack batches) and sets the epoch before the loader starts its workers (which copy the dataset).
    A segmentation longer than max_length falls back to the stored one: no pair is dropped or cut."""

    def __init__(self, ds, texts: tuple[list[str], list[str]], tag_ids: np.ndarray, tokenizers: tuple[SentencePiece,
                 SentencePiece], sampling: Sampling, max_length: int):  # fmt: skip
        """ds: the stored (fixed) ids; texts: the same pairs' source and target texts; tag_ids: per pair, the id put
        before its source (its corpus's tag), or -1."""
        super().__init__(ds)
        if not len(texts[0]) == len(texts[1]) == len(tag_ids) == len(self):
            raise ValueError(f"{len(self)} pairs but {len(texts[0])}/{len(texts[1])} texts and {len(tag_ids)} tags")
        self.stored = (self.src, self.tgt)
        self.texts, self.tag_ids, self.tokenizers = texts, np.asarray(tag_ids), tokenizers
        self.sampling, self.max_length = sampling, max_length
        self._segmented: dict[int, tuple[Flat, Flat]] = {}  # the last two epochs asked for
        self.epoch = -1
        self.set_epoch(0)

    def segmentation(self, epoch: int) -> tuple[Flat, Flat]:
        if epoch not in self._segmented:
            seeds = np.random.default_rng([self.sampling.seed, epoch, 7]).integers(0, 2**31, size=(len(self), 2))
            sides = []
            for side, (texts, tok, stored) in enumerate(zip(self.texts, self.tokenizers, self.stored)):
                ids = tok.sample(texts, self.sampling.alpha, self.sampling.nbest_size, seeds[:, side])
                if side == 0:
                    ids = [x if tag < 0 else [tag, *x] for x, tag in zip(ids, self.tag_ids.tolist())]
                sides.append(_flat(ids, stored, self.max_length))
            self._segmented = {e: s for e, s in self._segmented.items() if e == self.epoch}  # keep the current one
            self._segmented[epoch] = tuple(sides)
        return self._segmented[epoch]

    def lengths(self, epoch: int) -> np.ndarray:
        """(N, 2) tokens per example in `epoch`, as batched (example_lengths)."""
        (_, src), (_, tgt) = self.segmentation(epoch)
        return np.stack([np.diff(src) + 1, np.diff(tgt) + 1], axis=1)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.src, self.tgt = self.segmentation(epoch)
            self.epoch = epoch


def _flat(ids: list[list[int]], stored: Flat, max_length: int) -> Flat:
    """Rows end to end; a row longer than max_length is the stored row instead."""
    values, offsets = stored
    rows = [x if len(x) <= max_length else values[offsets[i] : offsets[i + 1]].tolist() for i, x in enumerate(ids)]
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(lengths.sum()))
    return flat, np.concatenate([[0], np.cumsum(lengths)])
