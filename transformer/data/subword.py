"""Subword regularisation: every epoch, each training source and target is segmented afresh by sentencepiece
sampling (Kudo 2018 for unigram models, BPE-dropout for BPE ones). Dev and test sets keep their one segmentation."""

import itertools
import shutil
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .batching import TokenDataset
from .prepare import written_whole
from .tokenizer import SentencePiece

Flat = tuple[np.ndarray, np.ndarray]  # (ids end to end, each row's offset into them), as TokenDataset holds them
NBEST_FORMAT = 1  # bump when nbest_table's output changes, so cached lists are not reused
SIDES = ("src", "tgt")


@dataclass(frozen=True)
class Sampling:
    alpha: float  # unigram: the smoothing exponent (lower: more varied segmentations); bpe: the dropout probability
    nbest_size: int  # unigram: sample among the N best segmentations; -1: among all of them
    seed: int


@dataclass(frozen=True)
class NBest:
    """Each text's n best segmentations, end to end: text i's h-th is values[offsets[first[i] + h] : offsets[...+1]]."""

    values: np.ndarray  # ids, every hypothesis of every text end to end
    offsets: np.ndarray  # (H + 1,) each hypothesis's start in values
    first: np.ndarray  # (N,) each text's first hypothesis
    scores: np.ndarray  # (N, K) each text's hypotheses' log-probabilities under the model; -inf past its last

    def draw(self, alpha: float, rng: np.random.Generator) -> Flat:
        """One hypothesis per text with p ∝ exp(alpha * score), as sentencepiece samples an n-best list
        (Gumbel-max: the argmax of perturbed log-weights is such a draw)."""
        choice = np.argmax(alpha * self.scores + rng.gumbel(size=self.scores.shape), axis=1)
        hyp = self.first + choice
        starts, lengths = self.offsets[hyp], np.diff(self.offsets)[hyp]
        ends = np.cumsum(lengths)
        index = np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)
        return self.values[index].astype(np.int32), np.concatenate([[0], ends])

    def check(self, texts: int, n: int) -> None:
        """ValueError unless the arrays are those of `texts` texts' n-best lists (what a cut or stale file breaks)."""
        hyps = len(self.offsets) - 1
        fits = self.scores.shape == (texts, n) and self.first.shape == (texts,) and hyps >= texts
        if not (fits and self.offsets[-1] == len(self.values) and (texts == 0 or self.first[-1] < hyps)):
            raise ValueError(f"{hyps} hypotheses, scores {self.scores.shape}: not {texts} texts' {n}-best lists")


def seeded(sampling: Sampling, tokenizers: tuple[SentencePiece, ...]) -> bool:
    """Whether the draws come from our seeded n-best tables (unigram models, nbest_size > 1), not sentencepiece."""
    return sampling.nbest_size > 1 and all(tok.model_type == "unigram" for tok in tokenizers)


def save_tables(tables: tuple[NBest, NBest], folder: Path) -> None:
    """Both sides' n-best lists as .npy files in `folder`, written whole or not at all (a rename). A cache that
    cannot be written (read-only, full) costs the next run the computation again, not this one its training."""
    try:
        with written_whole(folder) as tmp:
            for side, table in zip(SIDES, tables):
                for field in fields(NBest):
                    np.save(tmp / f"{side}.{field.name}.npy", getattr(table, field.name))
    except OSError as e:
        warnings.warn(f"the n-best lists could not be cached in {folder} ({e}); each run computes them again",
                      stacklevel=3)  # fmt: skip


def load_tables(folder: Path, texts: int, n: int) -> tuple[NBest, NBest] | None:
    """The n-best lists save_tables wrote, memory-mapped (a node's ranks share one copy in the page cache); None,
    with a warning naming the folder, when any file is missing or damaged: the caller rebuilds them."""
    try:
        tables = tuple(
            NBest(*(np.load(folder / f"{side}.{field.name}.npy", mmap_mode="r") for field in fields(NBest)))
            for side in SIDES
        )
        for table in tables:
            table.check(texts, n)
    except Exception as e:  # any damage: the cache is ours to rebuild from the texts
        warnings.warn(f"the n-best cache {folder} is damaged ({type(e).__name__}: {str(e)[:200]}); rebuilding it",
                      stacklevel=3)  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return tables


def nbest_table(texts: list[str], tok: SentencePiece, n: int, stored: Flat, max_length: int,
                tag_ids: np.ndarray | None = None) -> NBest:  # fmt: skip
    """The n-best lists of `texts`, a tag id put first where tag_ids >= 0. Hypotheses longer than max_length are
    left out; a text with none left keeps its stored row, alone. Computed once: the lists do not change by epoch."""
    piece_scores, (values, offsets) = tok.piece_scores, stored
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.int32  # the table is kept all run: half the memory
    chunks, lengths, first = [], [], np.zeros(len(texts) + 1, np.int64)
    scores = np.full((len(texts), n), -np.inf, np.float32)
    for i, text in enumerate(texts):
        hyps = tok.nbest(text, n)
        hyp_lengths = np.fromiter(map(len, hyps), np.int64, len(hyps))
        flat = np.concatenate(hyps) if hyps else np.zeros(0, np.int32)
        starts = np.cumsum(hyp_lengths) - hyp_lengths
        if tag_ids is not None and tag_ids[i] >= 0:
            flat, hyp_lengths = np.insert(flat, starts, tag_ids[i]), hyp_lengths + 1
            starts = starts + np.arange(len(starts))
        kept = (hyp_lengths <= max_length) & (hyp_lengths > 0)
        if not kept.any():  # none fits (or the text is empty): the stored row alone
            flat = values[offsets[i] : offsets[i + 1]]
            hyp_lengths, hyp_scores = np.array([len(flat)]), np.zeros(1)
        else:
            # a byte-fallback character costs every path the same unknown penalty, so it drops out of the draw
            hyp_scores = np.add.reduceat(piece_scores[flat], starts)
            if not kept.all():
                flat = np.concatenate([flat[s : s + k] for s, k in zip(starts[kept], hyp_lengths[kept])])
                hyp_lengths, hyp_scores = hyp_lengths[kept], hyp_scores[kept]
        scores[i, : len(hyp_lengths)] = hyp_scores
        chunks.append(flat.astype(dtype, copy=False))
        lengths.append(hyp_lengths)
        first[i + 1] = first[i] + len(hyp_lengths)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    return NBest(flat, np.concatenate([[0], np.cumsum(lengths)]), first[:-1], scores)


class ResegmentedDataset(TokenDataset):
    """Training pairs whose ids are an epoch's sampled segmentations: a pure function of (seed, epoch), so an
    epoch reads the same whatever the loader workers, the process and wherever a run resumed. The n-best lists are
    computed once per prepared data and cached; each epoch draws from them with a generator seeded by (seed,
    epoch). The sampler asks for an epoch's lengths (to pack batches) and sets the epoch before the loader starts its
    workers (which copy the dataset). No pair is dropped or cut: a text whose every segmentation is longer than
    max_length keeps the stored one. BPE-dropout and nbest_size=-1 sample with sentencepiece's own (unseeded) generator instead."""

    def __init__(self, ds, texts: tuple[list[str], list[str]], tag_ids: np.ndarray, tokenizers: tuple[SentencePiece,
                 SentencePiece], sampling: Sampling, max_length: int, cache: Path | None = None):  # fmt: skip
        """ds: the stored (fixed) ids; texts: the same pairs' source and target texts; tag_ids: per pair, the id put
        before its source (its corpus's tag), or -1; cache: a folder the n-best lists are loaded from, or computed
        into when it does not exist (one per prepared data, nbest_size and NBEST_FORMAT)."""
        super().__init__(ds)
        if not len(texts[0]) == len(texts[1]) == len(tag_ids) == len(self):
            raise ValueError(f"{len(self)} pairs but {len(texts[0])}/{len(texts[1])} texts and {len(tag_ids)} tags")
        self.stored = (self.src, self.tgt)
        self.texts, self.tag_ids, self.tokenizers = texts, np.asarray(tag_ids), tokenizers
        self.sampling, self.max_length = sampling, max_length
        self.tables = None
        if seeded(sampling, tokenizers):
            if cache is not None and cache.exists():
                self.tables = load_tables(cache, len(self), sampling.nbest_size)
            if self.tables is None:
                sides = zip(self.texts, self.tokenizers, self.stored, (self.tag_ids, None))
                self.tables = tuple(
                    nbest_table(x, tok, sampling.nbest_size, s, max_length, t) for x, tok, s, t in sides
                )
                if cache is not None:
                    save_tables(self.tables, cache)
        else:
            warnings.warn(
                "subword sampling with BPE-dropout or data.nbest_size=-1 draws from sentencepiece's own generator, "
                "which takes no seed: a resumed run segments its epochs differently; for exact resume use a unigram "
                "tokenizer and data.nbest_size=N (e.g. 64)",
                stacklevel=2,
            )
        self._segmented: dict[int, tuple[Flat, Flat]] = {}  # the last two epochs asked for
        self.epoch = -1
        self.set_epoch(0)

    def segmentation(self, epoch: int) -> tuple[Flat, Flat]:
        if epoch not in self._segmented:
            if self.tables is not None:
                rng = np.random.default_rng([self.sampling.seed, epoch, 7])
                sides = tuple(table.draw(self.sampling.alpha, rng) for table in self.tables)
            else:
                sides = tuple(self._sample_unseeded(side) for side in (0, 1))
            self._segmented = {e: s for e, s in self._segmented.items() if e == self.epoch}  # keep the current one
            self._segmented[epoch] = sides
        return self._segmented[epoch]

    def _sample_unseeded(self, side: int) -> Flat:
        ids = self.tokenizers[side].sample(self.texts[side], self.sampling.alpha, self.sampling.nbest_size)
        if side == 0:
            ids = [x if tag < 0 else [tag, *x] for x, tag in zip(ids, self.tag_ids.tolist())]
        return _flat(ids, self.stored[side], self.max_length)

    def lengths(self, epoch: int) -> np.ndarray:
        """(N, 2) tokens per example in `epoch`, as batched (example_lengths)."""
        (_, src), (_, tgt) = self.segmentation(epoch)
        return np.stack([np.diff(src) + 1, np.diff(tgt) + 1], axis=1)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.src, self.tgt = self.segmentation(epoch)
            self.epoch = epoch

    def __getstate__(self) -> dict:
        """What a loader worker started by spawn or forkserver needs: the epoch's ids, not the n-best lists."""
        return {**self.__dict__, "tables": None, "_segmented": {}, "texts": None}


def _flat(ids: list[list[int]], stored: Flat, max_length: int) -> Flat:
    """Rows end to end; a row longer than max_length is the stored row instead."""
    values, offsets = stored
    rows = [x if len(x) <= max_length else values[offsets[i] : offsets[i + 1]].tolist() for i, x in enumerate(ids)]
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(lengths.sum()))
    return flat, np.concatenate([[0], np.cumsum(lengths)])
