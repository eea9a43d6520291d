"""The LightningDataModule: prepared (cached) splits, token-bucketed loaders, a resumable train sampler."""

from dataclasses import asdict

import datasets
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from .batching import Collate, TokenBatchSampler, TokenDataset, example_lengths
from .config import DataConfig
from .prepare import PreparedData, prepare_data
from .sources import DataError
from .tokenizer import SentencePiece


class TranslationDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DataConfig):
        super().__init__()
        self.cfg = cfg
        self.prepared: PreparedData | None = None
        self.train_sampler: TokenBatchSampler | None = None
        self._sampler_state: dict | None = None
        self._resume_point: tuple[int, int] | None = None

    def prepare_data(self) -> None:  # once per node: trains and encodes, or finds the cache
        if self.prepared is None:  # already prepared in this process (train.py sets up before fit): nothing to do
            self.prepared = prepare_data(self.cfg)

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
    def validation_split(self) -> datasets.Dataset:
        """The validation pairs by example index (the `index` of a validation batch): src and tgt texts,
        src_ids and tgt_ids without special tokens."""
        return self.data.splits[self.cfg.valid_split]

    def checkpoint_extras(self) -> dict:
        """What a checkpoint needs to translate alone: the tokenizers' bytes, and which corpus and languages
        (evaluate's defaults)."""
        src, tgt = self.src_tokenizer.path.read_bytes(), self.tgt_tokenizer.path.read_bytes()
        return {"tokenizers": {"src": src, "tgt": tgt}, "data": asdict(self.cfg)}

    # Loaders

    def _ranks(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _loader(self, split: str, shuffle: bool, num_replicas: int = 1, rank: int = 0) -> DataLoader:
        if split not in self.data.splits:
            raise DataError(f"unknown split {split!r}; {self.cfg.path} has {', '.join(self.data.splits)}")
        ds = self.data.splits[split]
        sampler = TokenBatchSampler(example_lengths(ds), self.cfg.max_tokens, shuffle=shuffle, seed=self.cfg.seed,
                                    num_replicas=num_replicas, rank=rank)  # fmt: skip
        tok = self.tgt_tokenizer
        return DataLoader(
            TokenDataset(ds), batch_sampler=sampler, collate_fn=Collate(tok.pad_id, tok.bos_id, tok.eos_id),
            num_workers=self.cfg.num_workers,
            # its own generator: starting an iteration otherwise draws from the global RNG, which dropout
            # uses, and a resumed run would then see different dropout masks than an uninterrupted one
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        loader = self._loader(self.cfg.train_split, True, *self._ranks())
        self.train_sampler = loader.batch_sampler
        self._restore_sampler()
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.cfg.valid_split, False, *self._ranks())  # each rank validates its share

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.cfg.test_split, False)

    def split_dataloader(self, split: str) -> DataLoader:
        """Any split of the corpus, in length-sorted batches whose `index` maps back to input order."""
        return self._loader(split, False)

    # The train sampler's place, saved in checkpoints (transformer/training/exact_resume.py keeps it current)

    def set_resume_point(self, epoch: int, position: int) -> None:
        """A resumed run starts with batch `position` of `epoch`. The sampler's own position counts the
        batches it has handed out, which is more than were trained when loader workers fetch ahead."""
        self._resume_point = (epoch, position)

    def _restore_sampler(self) -> None:
        """Apply a loaded sampler state once both it and the sampler exist, whichever came first."""
        if self._sampler_state is not None and self.train_sampler is not None:
            self.train_sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None

    def state_dict(self) -> dict:
        if self.train_sampler is None:
            return {}
        state = self.train_sampler.state_dict()
        if self._resume_point is not None:
            state["epoch"], state["position"] = self._resume_point
        return {"train_sampler": state}

    def load_state_dict(self, state: dict) -> None:
        self._sampler_state = state.get("train_sampler")
        self._restore_sampler()
