"""Token-bucketed batches: length-sorted, packed up to max_tokens, shuffled by (seed, epoch), resumable."""

from typing import Protocol

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset

from .mixing import Mixture


def padded_length(n, rungs: int | None):
    """A batch's padded length for its longest sequence `n` (an int, or an array of them): with `rungs`, the next rung
    of a ladder of that many rungs per octave (16: every length up to 16, even lengths to 32, multiples of 4 to 64,
    ...; at most 1/16 more), so that batches take a bounded set of shapes; None: n itself."""
    if rungs is None:
        return n
    n = np.asarray(n)
    step = np.ones_like(n)
    while np.any(n > rungs * step):  # past each octave the rungs stand twice as far apart
        step = np.where(n > rungs * step, step * 2, step)
    padded = -(-n // step) * step
    return int(padded) if padded.ndim == 0 else padded


def padded_widths(src_longest: int, tgt_longest: int, rungs: int | None) -> tuple[int, int]:
    """(S, T) of a batch whose longest source and target have these lengths, as Collate pads it: each side to its
    longest, or with `rungs` both to padded_length of the longer."""
    if rungs is None:
        return src_longest, tgt_longest
    width = padded_length(max(src_longest, tgt_longest), rungs)
    return width, width


class Segmentation(Protocol):
    """Training examples whose lengths change by epoch (subword.ResegmentedDataset): the sampler packs each epoch's."""

    def lengths(self, epoch: int) -> np.ndarray:
        """(N, 2) tokens per example in `epoch`, as example_lengths counts them."""

    def set_epoch(self, epoch: int) -> None:
        """Serve `epoch`'s examples from now on."""


class TokenBatchSampler:
    """Yields batches of example indices whose padded size (batch size x longest side) fits max_tokens.

    The batches of an epoch are a pure function of (seed, epoch): examples are shuffled, stably
    sorted by length, packed greedily, and the batches shuffled. Under distributed training every
    rank builds the same list and takes every world_size-th batch, after dropping the remainder, so
    ranks get disjoint batches of equal number. `state_dict` / `load_state_dict` save and restore
    the position inside an epoch. With shuffle=False (validation, test) batches are in length order;
    each batch carries its examples' indices so results map back to the input order. With a Mixture (several
    corpora laid end to end), an epoch holds the examples it draws instead of each example once. With a
    segmentation (subword regularisation: a Segmentation), each epoch packs its own segmentation's lengths,
    and the segmentation is told the epoch before a pass starts. With length_rungs, batches are packed by the padded
    length the collator gives them (padded_length).
    """

    def __init__(self, lengths: np.ndarray, max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, mixture: Mixture | None = None,
                 segmentation: Segmentation | None = None, length_rungs: int | None = None):  # fmt: skip
        """lengths: (N, 2) tokens per example, source and target, special tokens included."""
        self.lengths = np.asarray(lengths).reshape(-1, 2)
        longest = int(padded_length(self.lengths.max(initial=0), length_rungs))
        if longest > max_tokens:
            raise ValueError(f"an example has {longest} tokens (padded) but max_tokens={max_tokens}; raise "
                             "data.max_tokens")  # fmt: skip
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is outside num_replicas={num_replicas}")
        if mixture is not None and sum(mixture.sizes) != len(self.lengths):
            raise ValueError(f"the mixture's corpora hold {sum(mixture.sizes)} examples, lengths {len(self.lengths)}")
        self.max_tokens, self.shuffle, self.seed, self.mixture = max_tokens, shuffle, seed, mixture
        self.length_rungs = length_rungs
        self.segmentation = segmentation if shuffle else None
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.position = 0, 0  # position: batches of this epoch handed out
        self._resume_at = 0  # where the next pass starts: 0, or a restored position
        self._cache: tuple[int, list[np.ndarray]] | None = None
        self._epoch_length: int | None = None  # batches in every epoch that varies (mixture, segmentation): the first's

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, before the split between ranks. Each epoch of a mixture or of sampled
        segmentations has as many as the first: Lightning takes an epoch's length (when to validate, where it ends)
        from the first epoch's, and another draw packs into a few more or fewer batches. A surplus is left out, a
        shortfall repeats some of the epoch's own batches: each is a random sample of the data either way."""
        batches = self._packed(epoch)
        if (self.mixture is None and self.segmentation is None) or not self.shuffle:
            return batches
        if self._epoch_length is None:
            self._epoch_length = len(batches) if epoch == 0 else len(self._packed(0))
        extra = np.random.default_rng([self.seed, epoch, 1]).choice(
            len(batches), max(self._epoch_length - len(batches), 0)
        )
        return batches[: self._epoch_length] + [batches[i] for i in extra]  # batches are in random order already

    def _packed(self, epoch: int) -> list[np.ndarray]:
        lengths = self.lengths if self.segmentation is None else self.segmentation.lengths(epoch)
        rng = np.random.default_rng([self.seed, epoch])
        if self.mixture is not None and self.shuffle:
            drawn = self.mixture.draw(rng)
            order = drawn[rng.permutation(len(drawn))]
        else:
            order = rng.permutation(len(lengths)) if self.shuffle else np.arange(len(lengths))
        n = len(order)
        longest = lengths.max(axis=1)
        size = padded_length(longest, self.length_rungs)  # what a batch of each example is padded to
        order = order[np.lexsort((lengths[order].sum(axis=1), longest[order]))]  # by longest side, then total
        batches, start = [], 0
        for i, length in enumerate(size[order]):  # ascending, so the newest example is the longest
            if (i - start + 1) * length > self.max_tokens:
                batches.append(order[start:i])
                start = i
        if start < n:
            batches.append(order[start:])
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of `epoch`."""
        if self._cache is None or self._cache[0] != epoch:
            every = self.all_batches(epoch)
            # training ranks need equal batch counts (gradients are synchronised every step); evaluation keeps all
            usable = len(every) // self.num_replicas * self.num_replicas if self.shuffle else len(every)
            self._cache = (epoch, every[self.rank : usable : self.num_replicas])
        return self._cache[1]

    @property
    def sampler(self) -> "TokenBatchSampler":
        """Lightning calls set_epoch on `loader.batch_sampler.sampler`; here that is this object."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position, self._resume_at = epoch, 0, 0
        if self.segmentation is not None:  # now, before the loader's workers copy the dataset
            self.segmentation.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def __iter__(self):
        """A pass over the epoch's batches: from the start, or from a restored position once. A pass
        abandoned early (validation's sanity check) does not shift the next one."""
        batches = self.batches(self.epoch)
        self.position, self._resume_at = self._resume_at, 0
        while self.position < len(batches):
            self.position += 1
            yield batches[self.position - 1].tolist()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"sampler state has seed {state['seed']}, this run seed {self.seed}; resume with data.seed={state['seed']}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._resume_at = self.position
        if self.segmentation is not None:
            self.segmentation.set_epoch(self.epoch)


def example_lengths(ds: Dataset) -> np.ndarray:
    """(N, 2) tokens per example as batched: source + EOS, BOS/EOS + target."""
    src = pc.list_value_length(ds.data.column("src_ids")).to_numpy() + 1
    tgt = pc.list_value_length(ds.data.column("tgt_ids")).to_numpy() + 1
    return np.stack([src, tgt], axis=1)


class TokenDataset(torch.utils.data.Dataset):
    """An encoded split held as flat int32 arrays; fetching a batch is slicing, not per-row lookups."""

    def __init__(self, ds: Dataset):
        self.src = self._flat(ds, "src_ids")
        self.tgt = self._flat(ds, "tgt_ids")

    @staticmethod
    def _flat(ds: Dataset, column: str) -> tuple[np.ndarray, np.ndarray]:
        """The column's ids end to end and each row's offset into them: one copy out of the memory-mapped table."""
        if not len(ds):
            return np.zeros(0, np.int32), np.zeros(1, np.int64)
        col = ds.data.column(column) if ds._indices is None else ds.with_format("arrow")[column]  # rows as selected
        values = pc.list_flatten(col).to_numpy().astype(np.int32, copy=False)
        offsets = np.concatenate([[0], np.cumsum(pc.list_value_length(col).to_numpy())])
        return values, offsets

    def __len__(self) -> int:
        return len(self.src[1]) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        (sv, so), (tv, to) = self.src, self.tgt
        return sv[so[i] : so[i + 1]], tv[to[i] : to[i + 1]], i


class Collate:
    """Pads a list of examples into a batch dict:
    src (B, S) = ids + EOS; tgt_in (B, T) = BOS + ids; tgt_out (B, T) = ids + EOS; index (B,) of examples;
    src_lengths (B,) real source tokens per row; tgt_positions (N,) the flat positions b * T + t of the N real target
    tokens and tgt_labels (N,) their ids, where the loss is computed. And, as Python values that stay on the host
    (Lightning moves only tensors) so that the training step never waits on the device for them: src_tokens and
    tgt_tokens, the real tokens of src and tgt_out, and src_padded, whether some source is shorter than the longest.

    With length_rungs, both sides are padded to padded_length of the longer and the loss is computed at every target
    position (tgt_positions all of them, tgt_labels pad where there is no token): batch shapes are (B, L, L) for a
    bounded set of L, and no dimension follows the number of real tokens."""

    def __init__(self, pad_id: int, bos_id: int, eos_id: int, length_rungs: int | None = None):
        self.pad_id, self.bos_id, self.eos_id, self.length_rungs = pad_id, bos_id, eos_id, length_rungs

    def _pad(self, seqs: list[np.ndarray], before: int | None, after: int | None, width: int) -> np.ndarray:
        out = np.full((len(seqs), width), self.pad_id, dtype=np.int64)
        for row, s in enumerate(seqs):
            start = 0
            if before is not None:
                out[row, 0], start = before, 1
            out[row, start : start + len(s)] = s
            if after is not None:
                out[row, start + len(s)] = after
        return out

    def __call__(self, examples: list[tuple[np.ndarray, np.ndarray, int]]) -> dict:
        src, tgt, index = zip(*examples)
        src_lengths = np.array([len(s) + 1 for s in src])  # with EOS
        S, T = padded_widths(int(src_lengths.max()), max(len(t) for t in tgt) + 1, self.length_rungs)  # EOS, BOS
        tgt_out = self._pad(tgt, None, self.eos_id, T)
        # the loss at the real target tokens; with length rungs at every position, so that their number is no shape
        positions = np.flatnonzero(tgt_out != self.pad_id) if self.length_rungs is None else np.arange(tgt_out.size)
        return {
            "src": torch.from_numpy(self._pad(src, None, self.eos_id, S)),
            "tgt_in": torch.from_numpy(self._pad(tgt, self.bos_id, None, T)),
            "tgt_out": torch.from_numpy(tgt_out),
            "tgt_positions": torch.from_numpy(positions),
            "tgt_labels": torch.from_numpy(tgt_out.ravel()[positions]),
            "index": torch.tensor(index),
            "src_lengths": torch.from_numpy(src_lengths),
            "src_tokens": int(src_lengths.sum()),
            "tgt_tokens": sum(len(t) + 1 for t in tgt),  # with EOS
            "src_padded": bool(src_lengths.min() < S),
        }


def padding_fraction(batches: list[np.ndarray], lengths: np.ndarray, length_rungs: int | None = None) -> float:
    """Share of padding in the source and target tensors of these batches (as Collate pads them)."""
    real = padded = 0
    for b in batches:
        sizes = lengths[b]
        real += int(sizes.sum())
        padded += len(b) * sum(padded_widths(*map(int, sizes.max(axis=0)), length_rungs))
    return 1 - real / max(padded, 1)
