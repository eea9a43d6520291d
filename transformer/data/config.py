"""The data config: which corpora, which languages, how to mix, tokenize, clean and batch them."""

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..base.typecheck import check_field_types

FORMATS = ("text", "json", "parquet", "csv", "hub")
TOKENIZER_TYPES = ("unigram", "bpe")
BAD_SHARDS = ("warn", "error")


@dataclass(frozen=True)
class CorpusConfig:
    """One parallel corpus: where it is, how to read it, and its part in the training mix."""

    path: str = ""  # a folder of files, or a hub dataset name with format=hub
    format: str = "text"  # text: {split}.{lang}[.gz] files; json/parquet/csv: {split}.{ext} files; hub
    hub_config: str | None = None  # e.g. "de-en" for wmt14
    src_column: str | None = None  # two text columns; None: a "translation" column, or columns named src/tgt
    tgt_column: str | None = None  # the target's text column (with src_column)
    train_split: str = "train"  # the split training reads
    valid_split: str | None = None  # a dev set, scored at each validation as val/{corpus name}/...
    test_split: str | None = None  # a test set: evaluate's default split (the main corpus's)
    weight: float = 1.0  # sampling weight in the mix (see DataConfig.temperature)
    tag: str | None = (
        None  # a reserved piece put before every source of this corpus, e.g. __bt__ (<bt> needs quotes in overrides)
    )
    # a file `python -m transformer.score` wrote for the training split: the pairs it ranks lowest (by its dual
    # column where it has one, else forward) are dropped, as min_score and keep_best say
    scores: str | None = None
    min_score: float | None = None  # with scores: pairs scored under this are dropped
    keep_best: float | None = None  # with scores: only this fraction of the pairs, the best scored, is kept

    def __post_init__(self):
        check_field_types(self, self._prefix())
        if not self.path:
            raise ValueError(f"{self._prefix()}.path is empty; give the corpus's folder or hub name")
        if self.format not in FORMATS:
            raise ValueError(f"{self._prefix()}.format={self.format!r} is not one of {', '.join(FORMATS)}")
        if not self.weight > 0:
            raise ValueError(f"{self._prefix()}.weight={self.weight} must be positive; leave a corpus out to skip it")
        if (self.scores is None) != (self.min_score is None and self.keep_best is None):
            raise ValueError(f"{self._prefix()}.scores filters by {self._prefix()}.min_score or .keep_best: give "
                             "the score file with one of them, or neither")  # fmt: skip
        if self.keep_best is not None and not 0 < self.keep_best <= 1:
            raise ValueError(f"{self._prefix()}.keep_best={self.keep_best} must be a fraction in (0, 1]")
        if self.tag is not None and (not self.tag.strip() or self.tag != "".join(self.tag.split())):
            raise ValueError(f"{self._prefix()}.tag={self.tag!r} must be one piece without spaces, e.g. __bt__")

    def _prefix(self) -> str:
        return "data" if isinstance(self, DataConfig) else "data.corpora.<name>"

    def corpus(self) -> "CorpusConfig":
        """This corpus's own fields alone (a DataConfig's main corpus)."""
        return CorpusConfig(**{f.name: getattr(self, f.name) for f in fields(CorpusConfig)})


@dataclass(frozen=True)
class DataConfig(CorpusConfig):
    """The main corpus (the fields it shares with CorpusConfig: its dev and test sets are validation's and
    evaluate's defaults), more corpora to mix in, and what applies to all of them."""

    path: str = "data/multi30k"
    valid_split: str | None = "val"
    test_split: str | None = "test_2016_flickr"
    name: str | None = None  # the main corpus's name in the mix and in metrics; null: its folder's name
    corpora: dict[str, CorpusConfig] = field(default_factory=dict)  # more corpora, by name, mixed into training
    temperature: float | None = None  # null: each corpus's share of an epoch is weight / sum of weights;
    # T: share ~ weight x pairs^(1/T) (T=1 in proportion to size, larger T flatter, as in multilingual MT)
    epoch_pairs: int | None = None  # pairs drawn per epoch; null: all corpora's kept pairs (when mixing)
    src: str = "de"  # the source language: a file suffix ({split}.de.gz) or a column name
    tgt: str = "en"  # the target language
    vocab_size: int = 8000  # sentencepiece pieces (of the joint model, or of each language's)
    joint_vocab: bool = True  # one sentencepiece model for both languages
    # a folder of sentencepiece models to encode with instead of training them (vocab_size, joint_vocab and
    # tokenizer_type then do not apply): spm.model for both languages, or spm.{src}.model and spm.{tgt}.model, as a
    # run folder's tokenizer/ or transformer.import_model's output holds them; train's init_from sets it
    tokenizer: str | None = None
    tokenizer_type: str = "unigram"  # the sentencepiece model: unigram or bpe
    tokenizer_sentences: int = 500_000  # the tokenizer trains on at most this many sentences, sampled by the mix
    max_length: int = 250  # training pairs with more tokens on either side are dropped
    max_length_ratio: float = 3.0  # training pairs whose token counts differ by more than this factor are dropped
    # training pairs with a side in another language than data.src / data.tgt are dropped (fastText's identifier,
    # docs/data.md#cleaning); null: where the identifier knows both codes; true: an unknown code is an error
    language_id: bool | None = None
    language_threshold: float = 0.1  # a side is in another language when its own gets a probability under this
    language_min_chars: int = 15  # sides shorter than this many characters are not judged (short ones fool it)
    dedupe: bool = True  # training pairs identical to an earlier one (case and runs of whitespace aside) are dropped
    max_targets_per_source: int | None = 10  # a source's training pairs past this many are dropped; null: none
    drop_copies: bool = True  # training pairs whose target is the source untranslated (its letters, case aside)
    max_tokens: int = 4096  # padded tokens per batch (batch size x longest sequence)
    # batches padded to a ladder of lengths, this many rungs per octave (16: at most 1/16 more), both sides to one,
    # and the loss computed at every target position: a bounded set of batch shapes, which compiled graphs and CUDA
    # graphs reuse (compile=true); null: each side as long as its longest sequence, the loss at real tokens only
    length_rungs: int | None = None
    # subword regularisation: each epoch, training sources and targets are segmented afresh by sentencepiece sampling
    # with this alpha (unigram: lower samples more varied segmentations, e.g. 0.1-0.5; bpe: BPE-dropout's
    # probability, e.g. 0.1); null: one fixed segmentation. Dev and test sets are never sampled.
    sampling_alpha: float | None = None
    # unigram sampling among the N best segmentations, drawn with data.seed; -1: among all, by sentencepiece's
    # unseeded generator (bpe ignores it)
    nbest_size: int = 64
    streaming: bool = False  # read training pairs from prepare's shards in a bounded buffer, not all in memory
    buffer_pairs: int = 100_000  # streaming: pairs length-bucketed and shuffled together
    bad_shards: str = "warn"  # streaming: a shard that cannot be read is skipped with a warning, or stops (error)
    seed: int = 1  # batch order, the mix's draws and subword samples: each epoch's follow from (seed, epoch)
    cache_dir: str = "data/cache"  # tokenizers and encoded splits, keyed by the corpus files and settings
    num_workers: int = 0  # DataLoader worker processes per rank; 0: batches are made in the training process
    # how loader workers start: fork (Linux's default), forkserver or spawn; forkserver avoids forking a process
    # whose other threads (DDP's, the intra-op pool) may hold a lock, which can leave a worker waiting forever
    worker_start: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.worker_start not in (None, "fork", "forkserver", "spawn"):
            raise ValueError(f"data.worker_start={self.worker_start!r} is not one of fork, forkserver, spawn (or null)")
        corpora = {k: v if isinstance(v, CorpusConfig) else _corpus(k, v) for k, v in self.corpora.items()}
        object.__setattr__(self, "corpora", corpora)
        for name, value, choices in (
            ("tokenizer_type", self.tokenizer_type, TOKENIZER_TYPES),
            ("bad_shards", self.bad_shards, BAD_SHARDS),
        ):
            if value not in choices:
                raise ValueError(f"data.{name}={value!r} is not one of {', '.join(choices)}")
        if self.src == self.tgt:
            raise ValueError(f"data.src and data.tgt are both {self.src!r}; choose two languages")
        for name in ("vocab_size", "max_length", "max_tokens", "tokenizer_sentences", "buffer_pairs",
                     "temperature", "epoch_pairs", "length_rungs", "max_targets_per_source"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"data.{name}={getattr(self, name)} must be positive")
        if not 0 <= self.language_threshold <= 1:
            raise ValueError(f"data.language_threshold={self.language_threshold} must be a probability in [0, 1]")
        if self.language_min_chars < 0:
            raise ValueError(f"data.language_min_chars={self.language_min_chars} must be 0 or more")
        if self.max_tokens < self.max_length + 1:
            raise ValueError(
                f"data.max_tokens={self.max_tokens} cannot hold one pair of data.max_length={self.max_length} tokens "
                f"(plus its end token); raise data.max_tokens or lower data.max_length"
            )
        if self.sampling_alpha is not None:
            if not 0 < self.sampling_alpha <= (1 if self.tokenizer_type == "bpe" else math.inf):
                raise ValueError(
                    f"data.sampling_alpha={self.sampling_alpha} must be positive (at most 1 for bpe, a dropout "
                    "probability), or null for no subword sampling"
                )
            if self.streaming:
                raise ValueError(
                    "data.sampling_alpha needs the training pairs in memory (each epoch resegments them all); "
                    "set data.streaming=false or data.sampling_alpha=null"
                )
        if self.nbest_size == 0 or self.nbest_size == 1 or self.nbest_size < -1:
            raise ValueError(f"data.nbest_size={self.nbest_size} must be -1 (all segmentations) or at least 2")
        if self.main_name in corpora:
            raise ValueError(f"data.corpora.{self.main_name} has the main corpus's name; rename it or set data.name")

    @property
    def main_name(self) -> str:
        return self.name or Path(self.path).name or "corpus"

    def all_corpora(self) -> dict[str, CorpusConfig]:
        """Every corpus by name, the main one first."""
        return {self.main_name: self.corpus(), **self.corpora}

    def locate(self, split: str) -> tuple[str, str]:
        """(corpus name, split) of a split's name: corpus/split, or a split of the main corpus."""
        return tuple(split.split("/", 1)) if "/" in split else (self.main_name, split)

    def tags(self) -> list[str]:
        return sorted({c.tag for c in self.all_corpora().values() if c.tag})

    @classmethod
    def from_dict(cls, values: dict) -> "DataConfig":
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown data config field(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    @classmethod
    def from_checkpoint(cls, checkpoint_data: dict, overrides: dict) -> "DataConfig":
        """The checkpoint's data config with the non-null overrides applied."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in checkpoint_data.items() if k in names}
        config = cls(**{**values, **{k: v for k, v in overrides.items() if v is not None}})
        trained = (checkpoint_data.get("src"), checkpoint_data.get("tgt"))
        if None not in trained and trained != (config.src, config.tgt):
            raise ValueError(
                f"the checkpoint translates {trained[0]}->{trained[1]}, but data.src={config.src} "
                f"data.tgt={config.tgt}; drop those overrides or use a checkpoint trained for that direction"
            )
        return config


def _corpus(name: str, values) -> CorpusConfig:
    if not isinstance(values, dict):
        raise ValueError(f"data.corpora.{name}={values!r} must be a mapping with at least a path")
    unknown = set(values) - {f.name for f in fields(CorpusConfig)}
    if unknown:
        raise ValueError(f"unknown field(s) in data.corpora.{name}: {', '.join(sorted(unknown))}")
    try:
        return CorpusConfig(**values)
    except ValueError as e:
        raise ValueError(str(e).replace("data.corpora.<name>", f"data.corpora.{name}")) from None
