"""The data config: where the corpus is, which languages, how to tokenize, clean and batch it."""

from dataclasses import dataclass, fields

from ..config_check import check_field_types

FORMATS = ("text", "json", "parquet", "csv", "hub")
TOKENIZER_TYPES = ("unigram", "bpe")


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/multi30k"  # a folder of files, or a hub dataset name with format=hub
    format: str = "text"  # text: {split}.{lang}[.gz] files; json/parquet/csv: {split}.{ext} files; hub
    src: str = "de"
    tgt: str = "en"
    hub_config: str | None = None  # e.g. "de-en" for wmt14
    src_column: str | None = None  # two text columns; None: a "translation" column, or columns named src/tgt
    tgt_column: str | None = None
    train_split: str = "train"
    valid_split: str = "val"
    test_split: str = "test_2016_flickr"
    vocab_size: int = 8000
    joint_vocab: bool = True  # one sentencepiece model for both languages
    tokenizer_type: str = "unigram"
    max_length: int = 250  # training pairs with more tokens on either side are dropped
    max_length_ratio: float = 3.0  # training pairs whose token counts differ by more than this factor are dropped
    max_tokens: int = 4096  # padded tokens per batch (batch size x longest sequence)
    seed: int = 1
    cache_dir: str = "data/cache"
    num_workers: int = 0

    def __post_init__(self):
        check_field_types(self, "data")
        for name, value, choices in (
            ("format", self.format, FORMATS),
            ("tokenizer_type", self.tokenizer_type, TOKENIZER_TYPES),
        ):
            if value not in choices:
                raise ValueError(f"data.{name}={value!r} is not one of {', '.join(choices)}")
        if self.src == self.tgt:
            raise ValueError(f"data.src and data.tgt are both {self.src!r}; choose two languages")
        for name in ("vocab_size", "max_length", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name}={getattr(self, name)} must be positive")
        if self.max_tokens < self.max_length + 1:
            raise ValueError(
                f"data.max_tokens={self.max_tokens} cannot hold one pair of data.max_length={self.max_length} tokens "
                f"(plus its end token); raise data.max_tokens or lower data.max_length"
            )

    @classmethod
    def from_dict(cls, values: dict) -> "DataConfig":
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown data config field(s): {', '.join(sorted(unknown))}")
        return cls(**values)
