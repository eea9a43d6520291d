"""Reading and cleaning at corpus scale: text streamed to a memory-mapped Arrow file, cleaning computed by Arrow;
both give exactly what the in-memory Python definitions give."""

import gzip
import random
import re
import sys
import tracemalloc
import unicodedata
from collections import Counter

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from transformer.data import DataError, cleaning, load_corpus, sources

from .helpers import config, write_text_corpus

TRICKY = ["a", "A", "Ä", "1", ".", "ß", " ", "\t", "\r", "\x00", "\x1c", "\x1f", "\x7f", "\x80", "\x85", "\x9f", "\xa0", "\u2028",
          "\u3000", "\u200b", "\ufeff", "\ufffd", "😀"]  # fmt: skip
TRICKY_BYTES = [b"\n", b"\r", b"\r\n", b"\xe2", b"\x80", b"\xa8", b"\xc3", b"\xff", b"A", b"\xf0\x9f", b"\xed\xa0"]


def pairs(ds) -> list[tuple[str, str]]:
    return list(zip(ds["src"], ds["tgt"]))


def tricky_bytes(rng: random.Random, n: int) -> bytes:
    """Text with \\r\\n, lone \\r, separators str.splitlines would split on, and bytes that are not UTF-8."""
    parts = [rng.choice(TRICKY_BYTES) if rng.random() < 0.3 else rng.choice(TRICKY).encode() for _ in range(n)]
    return b"".join(parts)


def write_tricky_pair(folder, split: str, rng: random.Random, lines: int, gz: bool = False):
    """{split}.de and {split}.en (gzipped with gz) of `lines` tricky lines each; the last line of .de has no '\\n'."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for lang in ("de", "en"):
        body = [tricky_bytes(rng, rng.randint(0, 6)).replace(b"\n", b" ") for _ in range(lines - 1)] + [b"end\r"]
        data = b"\n".join(body) + (b"" if lang == "de" else b"\n")
        path = folder / (f"{split}.{lang}.gz" if gz else f"{split}.{lang}")
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(path)
    return paths


# --- reading text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("read_bytes", [1, 7, 1 << 20])
def test_streamed_lines_equal_read_lines(tmp_path, monkeypatch, read_bytes):
    monkeypatch.setattr(sources, "READ_BYTES", read_bytes)  # small chunks cut lines, "\r\n" and UTF-8 anywhere
    rng = random.Random(read_bytes)
    cases = [b"", b"\n", b"\r", b"\r\n", b"a\r", b"\n\n", b"\xe2\x80\n\xa8", b"eins\xe2\x80\xa8zwei\x1c\r\r\n"]
    cases += [tricky_bytes(rng, rng.randint(0, 40)) for _ in range(200 if read_bytes > 1 else 40)]
    for i, data in enumerate(cases):
        for gz in (False, True):
            path = tmp_path / (f"{i}.txt.gz" if gz else f"{i}.txt")
            path.write_bytes(gzip.compress(data) if gz else data)
            streamed = [line for block in sources.stream_lines(path) for line in block]
            assert streamed == sources.read_lines(path), data


@pytest.mark.parametrize("gz", [False, True])
def test_text_corpus_loads_the_pairs_read_lines_gives(tmp_path, monkeypatch, gz):
    monkeypatch.setattr(sources, "BLOCK_LINES", 7)  # many Arrow batches, a partial one at the end
    rng = random.Random(int(gz))
    files = {split: write_tricky_pair(tmp_path / "c", split, rng, n, gz) for split, n in (("train", 50), ("val", 7))}
    loaded, _ = load_corpus(config(tmp_path / "c", tmp_path))
    for split, (de, en) in files.items():
        assert pairs(loaded[split]) == list(zip(sources.read_lines(de), sources.read_lines(en)))
        assert loaded[split].cache_files  # memory-mapped from disk, not held in memory


def test_misaligned_files_name_both_counts_and_leave_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BLOCK_LINES", 4)  # the shorter side ends blocks before the longer one
    folder = tmp_path / "c"
    write_text_corpus(folder)
    with open(folder / "train.en", "a") as f:
        f.write("".join(f"extra line {i}.\n" for i in range(9)))
    with pytest.raises(DataError, match=r"train.de has 300 lines but .*train.en has 309; the two sides must align"):
        load_corpus(config(folder, tmp_path))
    written = [p.name for p in (tmp_path / "cache" / "text").rglob("*") if p.is_file()]
    assert written == ["test.arrow"]  # the splits before it, complete; nothing of train


def test_arrow_copy_is_reused_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    folder = tmp_path / "c"
    write_text_corpus(folder)
    cfg = config(folder, tmp_path)
    first, fingerprint = load_corpus(cfg)
    (arrow_file,) = {f["filename"] for f in first["train"].cache_files}

    def must_not_write(*args):
        raise AssertionError("the Arrow copy was written again")

    with monkeypatch.context() as m:
        m.setattr(sources, "_write_text_split", must_not_write)
        again, same = load_corpus(cfg)
    assert same == fingerprint and {f["filename"] for f in again["train"].cache_files} == {arrow_file}

    with open(folder / "train.de", "a") as f, open(folder / "train.en", "a") as g:
        f.write("ein neuer hund.\n"), g.write("a new dog.\n")
    changed, other = load_corpus(cfg)
    assert other != fingerprint and {f["filename"] for f in changed["train"].cache_files} != {arrow_file}
    assert pairs(changed["train"])[-1] == ("ein neuer hund.", "a new dog.") and len(changed["train"]) == 301


def test_table_cells_become_text_only_when_needed(tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    table = pa.table({"de": ["eins", None, "drei"], "en": [1, 2, None]})
    pq.write_table(table, folder / "train.parquet")
    loaded, _ = load_corpus(config(folder, tmp_path, format="parquet"))
    assert pairs(loaded["train"]) == [("eins", "1"), ("", "2"), ("drei", "")]
    text = datasets.Dataset.from_dict({"src": ["a"], "tgt": ["b"]})
    assert sources._as_text(text) is text


def test_reading_a_large_corpus_does_not_hold_the_text_in_memory(tmp_path):
    """Not timed: the limit is on memory, for a corpus of 200k lines (about 30 MB)."""
    folder, rng, n = tmp_path / "big", random.Random(0), 200_000
    folder.mkdir()
    words = ["hund", "katze", "läuft", "über", "die", "grüne", "straße", "ein", "haus", "ball"]
    line = lambda: " ".join(rng.choices(words, k=12))  # noqa: E731
    text_bytes = 0
    for lang in ("de", "en"):
        data = "".join(line() + "\n" for _ in range(n)).encode()
        (folder / f"train.{lang}").write_bytes(data)
        text_bytes += len(data)
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        loaded, _ = load_corpus(config(folder, tmp_path))
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(loaded["train"]) == n
    assert python_peak < text_bytes / 4, (python_peak, text_bytes)  # a block of lines at a time, not the text
    assert pa.total_allocated_bytes() - arrow_before < text_bytes / 10  # the Arrow table is memory-mapped


# --- cleaning ------------------------------------------------------------------------------------------
# The Python definitions cleaning.py computes with Arrow (what prepare computed before, row by row).


def reference_repairs(rows):
    return {
        "invalid_utf8": sum("\ufffd" in s or "\ufffd" in t for s, t, _, _ in rows),
        "control_chars": sum(bool(cleaning.CONTROL.search(s) or cleaning.CONTROL.search(t)) for s, t, _, _ in rows),
        "truncated": 0,
    }


def reference_clean(rows, max_length, max_length_ratio):
    kept, dropped, tokens = [], dict.fromkeys(cleaning.DROP_REASONS, 0), dict.fromkeys(cleaning.DROP_REASONS, 0)
    for row in rows:
        s, t, src_ids, tgt_ids = row
        longer, shorter = max(len(src_ids), len(tgt_ids)), max(min(len(src_ids), len(tgt_ids)), 1)
        if not (cleaning.CONTROL.sub(" ", s).strip() and cleaning.CONTROL.sub(" ", t).strip()):
            reason = "empty"
        elif len(src_ids) > max_length or len(tgt_ids) > max_length:
            reason = "too_long"
        elif longer / shorter > max_length_ratio:
            reason = "length_ratio"
        else:
            kept.append(row)
            continue
        dropped[reason] += 1
        tokens[reason] += len(src_ids) + len(tgt_ids)
    return kept, dropped, tokens


def letters(text):
    return "".join(c for c in text.lower() if c.isalpha())


def reference_copies(rows):
    return [letters(s) == letters(t) for s, t, _, _ in rows]


def folded(text):
    return re.sub(r"\s+", " ", text.lower()).strip()


def reference_duplicates(rows, max_targets):
    seen, targets, duplicate, repeated = set(), Counter(), [], []
    for s, t, _, _ in rows:
        pair = (folded(s), folded(t))
        duplicate.append(pair in seen)
        seen.add(pair)
        repeated.append(not duplicate[-1] and max_targets is not None and targets[pair[0]] >= max_targets)
        targets[pair[0]] += not duplicate[-1]
    return duplicate, repeated


def reference_length_stats(rows):
    stats = {}
    for i, side in ((2, "src"), (3, "tgt")):
        n = np.array([len(row[i]) for row in rows]) if rows else np.zeros(1)
        stats[f"{side}_mean"], stats[f"{side}_p95"] = float(n.mean()), float(np.percentile(n, 95))
    return stats


def tricky_encoded(n: int, seed: int = 0) -> datasets.Dataset:
    """Texts of a few tricky characters (many all whitespace by one definition or another), ids of any length."""
    rng = random.Random(seed)
    text = lambda: "".join(rng.choices(TRICKY, k=rng.randint(0, 3)))  # noqa: E731
    ids = lambda: [rng.randrange(100) for _ in range(rng.choice([0, 1, 2, 5, 10, 30, 41, 60]))]  # noqa: E731
    rows = [(text(), text(), ids(), ids()) for _ in range(n)]
    columns = dict(zip(("src", "tgt", "src_ids", "tgt_ids"), map(list, zip(*rows))))
    features = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string"),
                                  "src_ids": datasets.List(datasets.Value("int32")),
                                  "tgt_ids": datasets.List(datasets.Value("int32"))})  # fmt: skip
    return datasets.Dataset.from_dict(columns, features=features)


def rows_of(ds: datasets.Dataset):
    return list(zip(ds["src"], ds["tgt"], ds["src_ids"], ds["tgt_ids"]))


def test_cleaning_equals_its_python_definition(tmp_path):
    full = tricky_encoded(3000)
    full.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    on_disk = datasets.load_from_disk(str(tmp_path / "saved"))  # read from its Arrow files, not the memory map
    some = full.select(range(5, 3000, 3))  # a selected dataset: its table still has every row
    for ds in (full, on_disk, some, full.select([])):
        rows = rows_of(ds)
        assert cleaning.repairs(ds) == reference_repairs(rows)
        assert cleaning.length_stats(ds) == reference_length_stats(rows)
        assert cleaning.copies(ds).tolist() == reference_copies(rows)
        for max_targets in (None, 1, 3):
            found = cleaning.duplicates(ds, max_targets)
            assert tuple(f.tolist() for f in found) == reference_duplicates(rows, max_targets)
        for max_length, ratio in ((40, 2.0), (1000, 1000.0), (5, 1.5)):
            cleaned, dropped, tokens, _ = cleaning.clean(ds, {"empty": cleaning.empty(ds)}, max_length, ratio)
            kept, want_dropped, want_tokens = reference_clean(rows, max_length, ratio)
            assert (rows_of(cleaned), dropped, tokens) == (kept, want_dropped, want_tokens)
            assert cleaning.length_stats(cleaned) == reference_length_stats(kept)


def test_arrow_whitespace_and_controls_are_pythons_for_every_character():
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]
    ds = datasets.Dataset.from_dict({"src": chars, "tgt": ["x"] * len(chars)})
    assert cleaning.empty(ds).tolist() == [not cleaning.CONTROL.sub(" ", c).strip() for c in chars]
    assert cleaning.copies(ds).tolist() == [letters(c) == "x" for c in chars]
    # Arrow lowers by a newer Unicode's tables than Python 3.11's, and İ to one character (Python: i + a dot)
    cased = [c for c in chars if len(c.lower()) == 1 and unicodedata.category(c) != "Cn"]
    spaced = datasets.Dataset.from_dict({"src": [f"x{c}y" for c in cased], "tgt": ["x y"] * len(cased)})
    rows = [(s, t, None, None) for s, t in zip(spaced["src"], spaced["tgt"])]  # whitespace in the middle: "x y"
    assert tuple(found.tolist() for found in cleaning.duplicates(spaced, 2)) == reference_duplicates(rows, 2)
    counts = cleaning.repairs(ds)
    assert (
        counts["control_chars"] == sum(bool(cleaning.CONTROL.search(c)) for c in chars) == 32 - 2 + 33
    )  # C0 but tab and newline; DEL and C1
    assert counts["invalid_utf8"] == 1
