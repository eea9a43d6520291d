"""Corpora written for a test: random sentences from two small word lists, aligned line by line (the generator is
the benchmarks', tools/common/corpus.py)."""

import random
from pathlib import Path

from common.corpus import WORDS_DE, WORDS_EN, write_text_corpus  # noqa: F401  (re-exported)
from transformer.data import DataConfig

ROOT = Path(__file__).resolve().parents[2]
MULTI30K = ROOT / "data" / "multi30k"


def write_word_for_word_corpus(folder: Path, n: int) -> None:
    """Sentences whose English is the German word for word: learnable, so a model can reach BLEU 100."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    de = [[rng.randrange(len(WORDS_EN)) for _ in range(rng.randint(3, 8))] for _ in range(n)]
    for lang, words in (("de", WORDS_DE), ("en", WORDS_EN)):
        text = "".join(" ".join(words[i] for i in s).capitalize() + ".\n" for s in de)
        for split in ("train", "val", "test"):
            (folder / f"{split}.{lang}").write_text(text)


def config(folder: Path, tmp_path: Path, **overrides) -> DataConfig:
    """A DataConfig for a small corpus written by write_text_corpus."""
    # language_id off: random words from two lists are no language (tests/test_cleaning.py judges real sentences)
    values = dict(path=str(folder), test_split="test", vocab_size=340, max_length=100, max_tokens=200,
                  cache_dir=str(tmp_path / "cache"), language_id=False)  # fmt: skip
    return DataConfig(**{**values, **overrides})
