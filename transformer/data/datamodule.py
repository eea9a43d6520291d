"""The LightningDataModule: prepared (cached) splits, token-bucketed loaders, a resumable train sampler."""

from dataclasses import asdict

import datasets
import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from ..machine.distributed import every_rank
from .batching import Collate, TokenBatchSampler, TokenDataset, example_lengths
from .config import DataConfig
from .mixing import Mixture
from .prepare import PreparedData, prepare_data
from .sources import DataError
from .streaming import StreamingBatches, StreamPosition
from .subword import NBEST_FORMAT, ResegmentedDataset, Sampling, seeded
from .tokenizer import SentencePiece


class TranslationDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DataConfig):
        super().__init__()
        self.cfg = cfg
        self.prepared: PreparedData | None = None
        self.train_sampler: TokenBatchSampler | None = None
        self.stream_position: StreamPosition | None = None  # data.streaming: the streams' place, from consumed batches
        self._sampler_state: dict | None = None
        self._stream_state: list[dict] | None = None  # one per rank
        self._resume_point: tuple[int, int] | None = None

    def prepare_data(self) -> None:  # once per node, before its other ranks set up: trains and encodes, or finds caches
        if self.prepared is None:  # already prepared in this process (train.py sets up before fit): nothing to do
            self.prepared = prepare_data(self.cfg)
        tokenizers = (self.src_tokenizer, self.tgt_tokenizer)
        if self.cfg.sampling_alpha is not None and seeded(self._sampling(), tokenizers):
            self._resegmented(self._train_pairs())  # the n-best lists into the cache once; the node's ranks load them

    def setup(self, stage: str | None = None) -> None:
        if self.prepared is None:
            self.prepared = prepare_data(self.cfg)

    @property
    def data(self) -> PreparedData:
        if self.prepared is None:
            self.setup()
        return self.prepared

    # What training and validation are given: the tokenizers, the validation pairs, what a checkpoint keeps

    @property
    def src_tokenizer(self) -> SentencePiece:
        return self.data.src_tokenizer

    @property
    def tgt_tokenizer(self) -> SentencePiece:
        return self.data.tgt_tokenizer

    @property
    def validation_sets(self) -> dict[str, datasets.Dataset]:
        """Each corpus's dev set by corpus name, the main corpus's first: its pairs by example index (the `index`
        of a validation batch): src and tgt texts, src_ids and tgt_ids without special tokens (a tag first)."""
        corpora = self.cfg.all_corpora()
        return {name: self.dataset(f"{name}/{c.valid_split}") for name, c in corpora.items() if c.valid_split}

    @property
    def validation_split(self) -> datasets.Dataset:
        """The main corpus's dev set."""
        return self.dataset(self.cfg.valid_split)

    def dataset(self, name: str) -> datasets.Dataset:
        """A split by name: one of the main corpus's splits, or corpus/split for any corpus."""
        corpus, split = self.cfg.locate(name)
        if split not in self.data.corpora.get(corpus, {}):
            others = [f"{c}/{s}" for c, splits in self.data.corpora.items() if c != self.cfg.main_name for s in splits]
            raise DataError(f"unknown split {name!r}; the corpora have {', '.join([*self.data.splits, *others])}")
        return self.data.corpora[corpus][split]

    def checkpoint_extras(self) -> dict:
        """What a checkpoint needs to translate alone: the tokenizers' bytes, and which corpus and languages
        (evaluate's defaults)."""
        src, tgt = self.src_tokenizer.path.read_bytes(), self.tgt_tokenizer.path.read_bytes()
        return {"tokenizers": {"src": src, "tgt": tgt}, "data": asdict(self.cfg)}

    # Loaders

    def _ranks(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _collate(self) -> Collate:
        tok = self.tgt_tokenizer
        return Collate(tok.pad_id, tok.bos_id, tok.eos_id, self.cfg.length_rungs)

    def _train_splits(self) -> list[datasets.Dataset]:
        """Every corpus's training split, in the mixture's order."""
        return [self.data.corpora[name][c.train_split] for name, c in self.cfg.all_corpora().items()]

    def _worker_start(self) -> str | None:
        return self.cfg.worker_start if self.cfg.num_workers > 0 else None  # a start method needs workers

    def _on_cuda(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _loader(self, ds: datasets.Dataset, shuffle: bool, num_replicas: int = 1, rank: int = 0,
                mixture: Mixture | None = None, resegmented: ResegmentedDataset | None = None) -> DataLoader:  # fmt: skip
        sampler = TokenBatchSampler(example_lengths(ds), self.cfg.max_tokens, shuffle=shuffle, seed=self.cfg.seed,
                                    num_replicas=num_replicas, rank=rank, mixture=mixture,
                                    segmentation=resegmented, length_rungs=self.cfg.length_rungs)  # fmt: skip
        return DataLoader(
            resegmented or TokenDataset(ds), batch_sampler=sampler, collate_fn=self._collate(),
            num_workers=self.cfg.num_workers, multiprocessing_context=self._worker_start(),
            # workers kept from epoch to epoch and validation to validation, unless each epoch's segmentation
            # (subword sampling) must reach them anew; batches in page-locked memory on a GPU, which Lightning then
            # copies without waiting (non_blocking)
            persistent_workers=self.cfg.num_workers > 0 and resegmented is None, pin_memory=self._on_cuda(),
            # its own generator: starting an iteration otherwise draws from the global RNG, which dropout
            # uses, and a resumed run would then see different dropout masks than an uninterrupted one
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        """Every corpus's training pairs laid end to end, each epoch drawn from by the mixture; or streamed."""
        if self.cfg.streaming:
            return self._stream_loader()
        train = self._train_pairs()
        resegmented = self._resegmented(train) if self.cfg.sampling_alpha is not None else None
        loader = self._loader(train, True, *self._ranks(), mixture=self.data.mixture, resegmented=resegmented)
        self.train_sampler = loader.batch_sampler
        self._restore_sampler()
        return loader

    def _train_pairs(self) -> datasets.Dataset:
        trains = self._train_splits()
        return trains[0] if len(trains) == 1 else datasets.concatenate_datasets(trains)

    def _sampling(self) -> Sampling:
        return Sampling(self.cfg.sampling_alpha, self.cfg.nbest_size, self.cfg.seed)

    def _resegmented(self, train: datasets.Dataset) -> ResegmentedDataset:
        """The training pairs segmented afresh each epoch (data.sampling_alpha), each corpus's tag kept first; their
        n-best lists cached beside the encoded data (they depend on it, the tokenizers, max_length and nbest_size)."""
        trains = self._train_splits()
        texts = tuple([t for ds in trains for t in ds[side]] for side in ("src", "tgt"))
        tags = [self.src_tokenizer.tag_id(c.tag) if c.tag else -1 for c in self.cfg.all_corpora().values()]
        tag_ids = np.repeat(tags, [len(ds) for ds in trains])
        cache = self.data.folder / f"nbest{self.cfg.nbest_size}.v{NBEST_FORMAT}"
        return ResegmentedDataset(train, texts, tag_ids, (self.src_tokenizer, self.tgt_tokenizer),
                                  self._sampling(), self.cfg.max_length, cache)  # fmt: skip

    def _stream_loader(self) -> "StreamLoader":
        """Training batches streamed from the training splits' Arrow shards (transformer/data/streaming.py)."""
        world, rank = self._ranks()
        shards = [[f["filename"] for f in train.cache_files] for train in self._train_splits()]
        dataset = StreamingBatches(
            shards, self.data.mixture.shares, max_tokens=self.cfg.max_tokens, buffer_pairs=self.cfg.buffer_pairs,
            batches_per_worker=-(-self._epoch_batches() // (world * max(self.cfg.num_workers, 1))),
            collate=self._collate(), seed=self.cfg.seed, num_replicas=world, rank=rank,
            bad_shard=self.cfg.bad_shards, length_rungs=self.cfg.length_rungs,
        )  # fmt: skip
        self.stream_position = StreamPosition(self.cfg.num_workers)
        self._restore_sampler()
        return StreamLoader(dataset, self.stream_position, self.cfg.num_workers, self.cfg.seed, self._worker_start(),
                            self._on_cuda())  # fmt: skip

    def _epoch_batches(self) -> int:
        """About as many batches as the in-memory sampler makes of an epoch's pairs (from prepare's mean lengths;
        a streamed epoch only counts batches)."""
        mix, corpora = self.data.mixture, self.cfg.all_corpora()
        stats = [self.data.corpus_stats[n][c.train_split] for n, c in corpora.items()]
        longest = sum(share * (max(s["src_mean"], s["tgt_mean"]) + 1) for share, s in zip(mix.shares, stats))
        return max(1, round(mix.epoch_pairs * longest / (0.95 * self.cfg.max_tokens)))  # ~5% padding in buckets

    def consumed(self, batch: dict) -> None:
        """A training batch the loop has trained on (ExactResume calls this): where the streams resume."""
        if self.stream_position is not None and "stream" in batch:
            self.stream_position.update(batch)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """One loader per dev set, in validation_sets order (one alone when there is one); each rank validates its
        share."""
        loaders = [self._loader(ds, False, *self._ranks()) for ds in self.validation_sets.values()]
        return loaders[0] if len(loaders) == 1 else loaders

    def test_dataloader(self) -> DataLoader:
        return self.split_dataloader(self.cfg.test_split)

    def split_dataloader(self, split: str) -> DataLoader:
        """Any split (see `dataset`), in length-sorted batches whose `index` maps back to input order."""
        return self._loader(self.dataset(split), False)

    # The train sampler's place, saved in checkpoints (transformer/training/exact_resume.py keeps it current)

    def set_resume_point(self, epoch: int, position: int) -> None:
        """A resumed run starts with batch `position` of `epoch`. The sampler's own position counts the
        batches it has handed out, which is more than were trained when loader workers fetch ahead."""
        self._resume_point = (epoch, position)

    def _restore_sampler(self) -> None:
        """Apply a loaded sampler (or stream) state once both it and the sampler exist, whichever came first."""
        if self._sampler_state is not None and self.train_sampler is not None:
            self.train_sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        if self._stream_state is not None and self.stream_position is not None:
            world, rank = self._ranks()
            if len(self._stream_state) != world:  # each rank streams its own part: the parts depend on the count
                raise DataError(
                    f"the checkpoint streamed on {len(self._stream_state)} rank(s), this run has {world}: resume "
                    f"on {len(self._stream_state)} devices (trainer.devices x trainer.num_nodes)"
                )
            self.stream_position.load_state_dict(self._stream_state[rank])
            self._stream_state = None

    def state_dict(self) -> dict:
        if self.stream_position is not None:  # every rank's streams: a rank resumes its own
            return {"streams": every_rank(self.stream_position.state_dict())}
        if self.train_sampler is None:
            return {}
        state = self.train_sampler.state_dict()
        if self._resume_point is not None:
            state["epoch"], state["position"] = self._resume_point
        return {"train_sampler": state}

    def load_state_dict(self, state: dict) -> None:
        self._sampler_state, self._stream_state = state.get("train_sampler"), state.get("streams")
        self._restore_sampler()


class StreamLoader(DataLoader):
    """A DataLoader over StreamingBatches that hands the streams their place before each pass (loader workers are
    new processes each epoch), and knows its epoch's length."""

    def __init__(self, dataset: StreamingBatches, position: StreamPosition, num_workers: int, seed: int,
                 worker_start: str | None = None, pin_memory: bool = False):  # fmt: skip
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(seed),
            multiprocessing_context=worker_start,
            pin_memory=pin_memory,  # workers start anew each epoch, handed their streams' places in __iter__
        )  # fmt: skip  (as _loader: not the global RNG)
        self.position = position

    def __iter__(self):
        self.dataset.resume_from(self.position.worker_states())
        return super().__iter__()

    def __len__(self) -> int:
        return self.dataset.epoch_batches(self.num_workers)
