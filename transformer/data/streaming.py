"""Training batches streamed from Arrow shards larger than memory, mixed from several corpora, resumable exactly.

Invariant: the batches a stream yields are a pure function of (seed, its global worker g = rank * workers + worker
id, the shard files), and its state after any batch is a few ints. So a run that stops and restarts from the
states of the batches it consumed yields exactly the batches the uninterrupted run would have, in the same order,
and no two streams of any rank ever see the same pair.

- Index: at construction every shard is read memory-mapped (record batch bodies are mapped, not read): the byte
  offset and row count of every record batch. A truncated or unreadable shard is found here, before any of it is
  used, and skipped with a warning or refused, as `bad_shard` says.
- Parts: a corpus's rows are numbered through its shards in the order given; g owns rows [g N / G, (g+1) N / G)
  of N, G = all loader workers of all ranks. Works with fewer shards or record batches than workers (several
  workers then read one record batch, each keeping its rows).
- Cycles: a stream walks its part's record batches in a new seeded order each cycle, forever. Cursor per corpus:
  (cycle, position in that cycle's order, row within the record batch's part). It holds one record batch per corpus.
- Chunks: chunk k of `buffer_pairs` pairs takes from each corpus in turn a count drawn by multinomial(buffer_pairs,
  probabilities) seeded by (seed, g, k); its batches are TokenBatchSampler.all_batches of it (shuffle, sort, pack
  to max_tokens, shuffle batches), yielded one by one.
- Epochs only count batches: every stream yields `batches_per_worker` per epoch and goes on where it stopped in the
  next, so the DataLoader's round robin is exact. Loader workers are new processes each epoch: their states come back
  through consumed batches (batch["stream"]) into StreamPosition, which hands them to the next iteration.
- State after a batch: {worker: g, epoch, batch: yielded this epoch, batches, chunk, in_chunk: batches of that chunk
  already yielded, cursors: each corpus's cursor at that chunk's start}. Resuming re-reads that one chunk and skips
  the yielded batches.
"""

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .batching import TokenBatchSampler
from .sources import DataError

COLUMNS = ("src_ids", "tgt_ids")
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # how an Arrow IPC stream ends: a message of length 0
_warned: set[str] = set()  # files warned about in this process


class _BadShard(Exception):
    """Why a shard cannot be read."""


def _scan(path: Path) -> tuple[pa.Schema, list[tuple[int, int]]]:
    """The schema and the (byte offset, rows) of each record batch of an Arrow stream file. The file is read
    memory-mapped, so a record batch's body is mapped, not read: this touches little more than the headers."""
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        if missing := [c for c in COLUMNS if c not in reader.schema.names]:
            raise _BadShard(f"it has no {', '.join(missing)} column")
        batches = []
        while True:
            offset = source.tell()
            try:
                batches.append((offset, reader.read_next_batch().num_rows))
            except StopIteration:
                break
        end, marker = source.tell(), len(_END_OF_STREAM)  # a stream cut between two messages has no marker
        if source.read_at(marker, max(end - marker, 0)) != _END_OF_STREAM:
            raise _BadShard("it ends before the end-of-stream marker (truncated)")
        return reader.schema, batches


def _bad(path: Path, reason: str, policy: str) -> None:
    reason = reason.splitlines()[0] if reason else "unknown error"  # one line, whatever Arrow's message holds
    if policy == "error":
        raise DataError(
            f"shard {path} cannot be read: {reason}; rerun prepare to rebuild the cache, "
            "or set data.bad_shards=warn to train without it"
        )
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(
            f"skipping shard {path}: {reason}; its pairs are left out until prepare rebuilds it", stacklevel=3
        )


@dataclass
class _Corpus:
    """Where every record batch of a corpus lies: its file, schema and byte offset, and its first row."""

    files: list[Path]
    schemas: list[pa.Schema]
    shard: np.ndarray  # (R,) file of each record batch
    offset: np.ndarray  # (R,) byte offset of its message
    start: np.ndarray  # (R + 1,) first row of each record batch, then the total

    @classmethod
    def index(cls, files: Sequence[Path], policy: str) -> "_Corpus":
        kept, schemas, shard, offset, rows = [], [], [], [], []
        for path in map(Path, files):
            try:
                schema, batches = _scan(path)
            except (_BadShard, OSError, EOFError, pa.ArrowException) as e:
                _bad(path, str(e), policy)
                continue
            shard += [len(kept)] * len(batches)
            offset += [o for o, _ in batches]
            rows += [n for _, n in batches]
            kept.append(path)
            schemas.append(schema)
        start = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
        return cls(kept, schemas, np.array(shard, np.int64), np.array(offset, np.int64), start)

    @property
    def rows(self) -> int:
        return int(self.start[-1])


def _flat(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    return column.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False), column.offsets.to_numpy()


class _Stream:
    """One global worker's endless walk over its part of one corpus. The next pair is row `row` of piece
    order(cycle)[pos], a piece being the part of one record batch that this worker owns."""

    def __init__(self, corpus: _Corpus, key: list[int], part: tuple[int, int], first_index: int,
                 cursor: list[int] | None, policy: str):  # fmt: skip
        self.corpus, self.key, self.first_index, self.policy = corpus, key, first_index, policy
        lo, hi = part
        start = corpus.start
        units = np.arange(np.searchsorted(start, lo, "right") - 1, np.searchsorted(start, hi, "left"))
        units = units[start[units + 1] > start[units]]  # record batches with rows
        self.units, self.lo, self.hi = units, np.maximum(start[units], lo), np.minimum(start[units + 1], hi)
        self.cycle, self.pos, self.row = cursor or (0, 0, 0)
        self._order: tuple[int, np.ndarray] | None = None
        self._loaded: tuple[int, tuple | None] | None = None  # (record batch, its columns): one at a time

    def cursor(self) -> list[int]:
        return [self.cycle, self.pos, self.row]

    def _piece(self) -> int:
        if self._order is None or self._order[0] != self.cycle:
            self._order = (self.cycle, np.random.default_rng([*self.key, self.cycle]).permutation(len(self.units)))
        return int(self._order[1][self.pos])

    def _load(self, unit: int) -> tuple | None:
        """The src/tgt columns of a record batch as (values, offsets) pairs; None if it cannot be read (warned)."""
        if self._loaded is None or self._loaded[0] != unit:
            self._loaded, c = None, self.corpus
            path = c.files[c.shard[unit]]
            try:
                with pa.OSFile(str(path)) as f:  # into memory: unlike a map's views, safe from a later cut
                    f.seek(int(c.offset[unit]))
                    batch = pa.ipc.read_record_batch(pa.ipc.read_message(f), c.schemas[c.shard[unit]])
                if batch.num_rows != c.start[unit + 1] - c.start[unit]:
                    raise _BadShard(
                        f"a record batch at byte {c.offset[unit]} has {batch.num_rows} rows, its header more"
                    )
                self._loaded = (unit, tuple(_flat(batch.column(name)) for name in COLUMNS))
            except (_BadShard, OSError, EOFError, pa.ArrowException) as e:
                _bad(path, str(e), self.policy)
                self._loaded = (unit, None)
        return self._loaded[1]

    def _advance(self) -> None:
        self.pos, self.row = self.pos + 1, 0
        if self.pos == len(self.units):
            self.cycle, self.pos = self.cycle + 1, 0

    def take(self, n: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """The next n pairs, copied out of their record batches, as (src_ids, tgt_ids, index in all corpora)."""
        out, unreadable = [], 0
        while len(out) < n:
            piece = self._piece()
            unit, lo, hi = self.units[piece], int(self.lo[piece]), int(self.hi[piece])
            columns = self._load(unit)
            if columns is None:
                unreadable += 1
                if unreadable > len(self.units):  # a whole cycle without a readable record batch
                    raise DataError(f"no record batch of {self.corpus.files[0].parent} can be read; rerun prepare")
                self._advance()
                continue
            unreadable = 0
            a = lo + self.row
            b = min(hi, a + n - len(out))
            (sv, so), (tv, to) = columns
            first = int(self.corpus.start[unit])
            i, j = a - first, b - first
            src, tgt = sv[so[i] : so[j]].copy(), tv[to[i] : to[j]].copy()  # a copy: views would pin the record batch
            src_off, tgt_off = so[i : j + 1] - so[i], to[i : j + 1] - to[i]
            out += [
                (src[src_off[r] : src_off[r + 1]], tgt[tgt_off[r] : tgt_off[r + 1]], self.first_index + a + r)
                for r in range(b - a)
            ]
            self.row += b - a
            if lo + self.row == hi:
                self._advance()
        return out


class StreamingBatches(torch.utils.data.IterableDataset):
    """Token-bucketed training batches of several corpora mixed by probability, streamed from their Arrow shards
    (see the module docstring). Each batch is `collate(examples)` plus "stream": its stream's state after it.

    No __len__: the loader's workers are unknown here; an epoch is `epoch_batches(num_workers)` batches. Before each
    iteration but the first, call `resume_from(position.worker_states())` (with persistent workers, or none, the
    streams also go on by themselves)."""

    def __init__(self, corpora: Sequence[Sequence[Path]], probabilities: Sequence[float], *, max_tokens: int,
                 buffer_pairs: int, batches_per_worker: int, collate: Callable, seed: int,
                 num_replicas: int = 1, rank: int = 0, bad_shard: str = "warn",
                 length_rungs: int | None = None):  # fmt: skip
        p = np.asarray(probabilities, dtype=np.float64)
        if len(corpora) == 0 or p.shape != (len(corpora),) or (p < 0).any() or p.sum() <= 0:
            raise ValueError(
                f"probabilities {list(probabilities)} must be one non-negative weight per corpus, not all 0"
            )
        if min(max_tokens, buffer_pairs, batches_per_worker) < 1:
            raise ValueError("max_tokens, buffer_pairs and batches_per_worker must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is outside num_replicas={num_replicas}")
        if bad_shard not in ("warn", "error"):
            raise ValueError(f"bad_shard={bad_shard!r}: use 'warn' or 'error'")
        self.corpora = [_Corpus.index(files, bad_shard) for files in corpora]
        for c, (files, corpus) in enumerate(zip(corpora, self.corpora)):
            if corpus.rows == 0:
                raise DataError(
                    f"training corpus {c} ({', '.join(map(str, files)) or 'no files'}) has no pairs; run prepare"
                )
        self.first_index = np.concatenate([[0], np.cumsum([c.rows for c in self.corpora])])
        self.probabilities = p / p.sum()
        self.max_tokens, self.buffer_pairs, self.batches_per_worker = max_tokens, buffer_pairs, batches_per_worker
        self.collate, self.seed, self.bad_shard, self.length_rungs = collate, seed, bad_shard, length_rungs
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self._resume: list[dict | None] | None = None
        self._live: tuple[int, int, dict] | None = None  # (process, worker, state after its last batch)

    def epoch_batches(self, num_workers: int) -> int:
        """Batches per epoch on this rank from a DataLoader with num_workers workers."""
        return self.batches_per_worker * max(num_workers, 1)

    def set_epoch(self, epoch: int) -> None:
        """The epoch label of the next iteration; streams go on where they are. A state from an earlier epoch
        (one left unfinished, e.g. by limit_train_batches) starts this epoch afresh."""
        self.epoch = epoch

    def resume_from(self, states: list[dict | None]) -> None:
        """Where each loader worker of the next iteration starts: StreamPosition.worker_states()."""
        self._resume, self._live = list(states), None

    def _start(self, workers: int, worker: int) -> dict:
        state = None
        if self._live is not None and self._live[:2] == (os.getpid(), worker):  # this process iterated before
            state = self._live[2]
            if state["batch"] >= self.batches_per_worker:
                state = {**state, "epoch": state["epoch"] + 1, "batch": 0}
        elif self._resume is not None:
            if len(self._resume) != workers:
                raise ValueError(
                    f"{len(self._resume)} stream states for {workers} loader workers: exact resume needs the "
                    f"data.num_workers of the saved run ({len(self._resume)})"
                )
            state = self._resume[worker]
        if state is None:
            return {"worker": self.rank * workers + worker, "epoch": self.epoch, "batch": 0, "chunk": 0,
                    "in_chunk": 0, "cursors": None}  # fmt: skip
        if state["worker"] // workers != self.rank or len(state["cursors"] or self.corpora) != len(self.corpora):
            raise ValueError(
                f"stream state of worker {state['worker']} does not fit rank {self.rank} with {workers} workers and "
                f"{len(self.corpora)} corpora: restore each rank's own StreamPosition, with the same data settings"
            )
        return {**state, "epoch": self.epoch, "batch": 0} if self.epoch > state["epoch"] else state

    def _chunk(self, streams: list[_Stream], g: int, chunk: int) -> list[list]:
        counts = np.random.default_rng([self.seed, g, chunk]).multinomial(self.buffer_pairs, self.probabilities)
        examples = [ex for stream, n in zip(streams, counts) for ex in stream.take(int(n))]
        lengths = np.array([(len(s) + 1, len(t) + 1) for s, t, _ in examples])  # as example_lengths: + EOS / BOS
        # the in-memory sampler's batching; its "epoch" is only a key for its rng, here (g, chunk)
        batches = TokenBatchSampler(lengths, self.max_tokens, seed=self.seed,
                                    length_rungs=self.length_rungs).all_batches((g << 32) + chunk)  # fmt: skip
        return [[examples[i] for i in b] for b in batches]

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        state = self._start(workers, worker)
        g, total = state["worker"], self.num_replicas * workers
        for c, corpus in enumerate(self.corpora):
            if corpus.rows < total:
                raise DataError(
                    f"training corpus {c} has {corpus.rows} pairs, fewer than the {total} loader workers of all "
                    "ranks: lower data.num_workers"
                )
        streams = [
            _Stream(corpus, [self.seed, c, g], (g * corpus.rows // total, (g + 1) * corpus.rows // total),
                    int(self.first_index[c]), (state["cursors"] or [None] * len(self.corpora))[c], self.bad_shard)
            for c, corpus in enumerate(self.corpora)
        ]  # fmt: skip
        chunk, skip, done, epoch = state["chunk"], state["in_chunk"], state["batch"], state["epoch"]
        limit = self.batches_per_worker
        while done < limit:
            start = [s.cursor() for s in streams]
            batches = self._chunk(streams, g, chunk)
            after = [s.cursor() for s in streams]
            for i in range(skip, min(len(batches), skip + limit - done)):
                done += 1
                last = i + 1 == len(batches)
                stream = {"worker": g, "epoch": epoch, "batch": done, "batches": limit, "chunk": chunk + last,
                          "in_chunk": 0 if last else i + 1, "cursors": after if last else start}  # fmt: skip
                self._live = (os.getpid(), worker, stream)
                yield {**self.collate(batches[i]), "stream": stream}
            chunk, skip, batches = chunk + 1, 0, None  # None: the next chunk is read without this one held


class StreamPosition:
    """Each stream's state as of the batches the training loop consumed (kept in the main process: a loader
    worker's own state is lost with it, and is ahead of the loop by its prefetched batches)."""

    def __init__(self, num_workers: int):
        self.num_workers = max(num_workers, 1)  # 0 workers: one stream, in the main process
        self.states: list[dict | None] = [None] * self.num_workers  # by original worker
        self.last: int | None = None  # original worker of the last consumed batch

    def update(self, batch: dict) -> None:
        state = batch["stream"]
        self.last = state["worker"] % self.num_workers
        self.states[self.last] = state

    def state_dict(self) -> dict:
        return {"num_workers": self.num_workers, "states": list(self.states), "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"the stream position was saved with {state['num_workers']} loader workers, this run has "
                f"{self.num_workers}: resume with data.num_workers={state['num_workers']}"
            )
        self.states, self.last = list(state["states"]), state["last"]

    def worker_states(self) -> list[dict | None]:
        """One state per loader worker of the next iteration. The DataLoader's round robin starts at worker 0, so
        new worker w carries the stream that is w places after the one that made the last consumed batch: that
        is the uninterrupted order, also near an epoch's end, where the streams that are one batch ahead (and so
        finish first) come last. After a finished epoch every stream starts the next one."""
        known = [s for s in self.states if s is not None]
        if not known:
            return [None] * self.num_workers
        rank, epoch = known[0]["worker"] // self.num_workers, max(s["epoch"] for s in known)
        fresh = {"epoch": epoch, "batch": 0, "batches": known[0]["batches"], "chunk": 0, "in_chunk": 0, "cursors": None}
        # a stream behind `epoch` finished the last one (or left it unfinished) and has no batch of this one consumed
        states = [
            {**fresh, "worker": rank * self.num_workers + w} if s is None
            else {**s, "epoch": epoch, "batch": 0} if s["epoch"] < epoch
            else s
            for w, s in enumerate(self.states)
        ]  # fmt: skip
        if all(s["batch"] >= s["batches"] for s in states):
            states = [{**s, "epoch": epoch + 1, "batch": 0} for s in states]
        first = self.last + 1
        return [states[(first + w) % self.num_workers] for w in range(self.num_workers)]
