"""What every translator offers, and the search settings and checks they share."""

from dataclasses import dataclass, fields
from typing import Protocol

from ..data.tokenizer import SentencePiece
from ..decoding import MAX_LEN_A, MAX_LEN_B

PRECISIONS = ("32", "bf16")


@dataclass(frozen=True)
class SearchConfig:
    beam_size: int = 5  # hypotheses kept per sentence; 1 is greedy search
    length_penalty: float = 1.0  # scores are log-probabilities / length**length_penalty
    max_len_a: float = MAX_LEN_A  # hypotheses stop at a * source length + b tokens
    max_len_b: int = MAX_LEN_B  # b of that limit
    early_stopping: bool = False  # True: a sentence is done at beam_size finished hypotheses (as CTranslate2)
    max_tokens: int = 8192  # tokens per batch the decoder holds: source tokens x beam_size (its rows per sentence)
    use_cache: bool = True  # False: each step re-reads the whole prefix (for checks and benchmarks)
    sampling_topk: int = 0  # 0: search; k: sample each token from the k most likely (-1: from all), beam_size=1
    temperature: float = 1.0  # sampling's: logits / temperature (below 1 sharper, above 1 flatter)
    seed: int = 0  # sampling's: the same seed, input and batches draw the same translations

    def __post_init__(self):
        if self.beam_size < 1:
            raise ValueError(f"beam_size={self.beam_size} must be at least 1 (1 is greedy search)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be positive")
        if self.sampling_topk and self.beam_size != 1:
            raise ValueError(f"sampling_topk={self.sampling_topk} samples one translation: set beam_size=1")
        if self.temperature != 1.0 and not self.sampling_topk:
            raise ValueError(f"temperature={self.temperature} applies to sampling: add sampling_topk=-1 (all tokens) "
                             "or sampling_topk=K")  # fmt: skip
        if self.sampling_topk < -1 or not self.temperature > 0:
            raise ValueError(f"sampling_topk={self.sampling_topk}, temperature={self.temperature}: sampling_topk "
                             "is -1 (all tokens), 0 (no sampling) or k > 0, and temperature is positive")  # fmt: skip

    @classmethod
    def pick(cls, values: dict, **changes) -> "SearchConfig":
        """The search settings among a command's config values (evaluate's, translate's), by keyword."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values} | changes)


def check_nbest(nbest: int, search: SearchConfig) -> None:
    if not 1 <= nbest <= search.beam_size:
        raise ValueError(f"nbest={nbest} must be between 1 and beam_size={search.beam_size}; raise beam_size")


def decoded_nbest(tokenizer: SentencePiece, texts: list[str], found: list[list[tuple[float, list[int]]]]):
    """Each text's (score, token ids) hypotheses as (score, translation), best first; an empty text gives
    [(0.0, "")] whatever was found for it (none: non-finite scores)."""
    decoded = iter(tokenizer.decode([ids for hyps in found for _, ids in hyps]))
    translated = [[(score, next(decoded)) for score, _ in hyps] for hyps in found]
    return [[(0.0, "")] if not text.strip() else hyps for text, hyps in zip(texts, translated)]


@dataclass(frozen=True)
class Decoding:
    """How sentences are searched: the search, how many hypotheses each keeps, and the corpus tag put before each
    source. The server batches requests together only when these are equal."""

    search: SearchConfig
    nbest: int = 1
    tag: str | None = None


class Translator(Protocol):
    """A trained model with its own tokenizers, whichever engine runs it."""

    src_tokenizer: SentencePiece
    tgt_tokenizer: SentencePiece
    data: dict  # the data config (corpus and languages) it was trained with
    trained_precision: str  # "32" or "bf16": what it was trained in
    max_source_tokens: int  # a longer source is translated up to these (model.max_positions, less one for EOS)

    def translate(self, texts: list[str], search: SearchConfig, precision: str = "32", target_lengths=None,
                  tag: str | None = None) -> list[str]:  # fmt: skip
        """One translation per text, in order; empty texts give empty translations."""

    def translate_nbest(self, texts: list[str], search: SearchConfig, nbest: int, precision: str = "32",
                        target_lengths=None, tag: str | None = None) -> list[list[tuple[float, str]]]:  # fmt: skip
        """Up to nbest (score, translation) per text, best first; an empty text gives [(0.0, "")]."""
