"""A generated parallel corpus of short sentences over two small word lists, their lines paired in length: enough
for the tiny model to learn in minutes, with no download."""

import gzip
import random
from pathlib import Path

WORDS_DE = "ein mann eine frau hund katze läuft springt über den die das grüne rote haus straße ball".split()
WORDS_EN = "a man woman dog cat runs jumps over the green red house street ball with and".split()


def sentences(n: int, words: list[str], seed: int) -> list[str]:
    """n sentences whose word counts depend on seed alone, so two languages' lines pair up in length."""
    lengths, rng = random.Random(seed), random.Random(f"{seed}-{words[0]}")
    return [" ".join(rng.choice(words) for _ in range(lengths.randint(2, 9))).capitalize() + "." for _ in range(n)]


def write_text_corpus(folder: Path, sizes=None, gz=False) -> dict[str, tuple[list[str], list[str]]]:
    """{split}.de and {split}.en (gzipped with gz) in folder, lines per split from sizes (default train 300,
    val 20, test 20); returns the (de, en) lines of each split."""
    sizes = sizes or {"train": 300, "val": 20, "test": 20}
    folder.mkdir(parents=True, exist_ok=True)
    corpus = {}
    for i, (split, n) in enumerate(sizes.items()):
        de, en = sentences(n, WORDS_DE, i), sentences(n, WORDS_EN, i)
        corpus[split] = (de, en)
        for lang, lines in (("de", de), ("en", en)):
            data = ("\n".join(lines) + "\n").encode()
            path = folder / (f"{split}.{lang}.gz" if gz else f"{split}.{lang}")
            path.write_bytes(gzip.compress(data) if gz else data)
    return corpus
