"""What cleaning counts and drops, computed by Arrow: no column is read into Python, and text is read record batch
by record batch, so it runs in bounded memory at any corpus size. Each function gives what its Python definition in
its docstring gives."""

import os
import re
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from .language import wrong_language
from .sources import LARGE, progress_bars_if_large

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0/C1 controls but tab and newline (same pattern in RE2)
# in the order a pair is judged: it is counted (and listed) under the first that holds
TEXT_REASONS = ("empty", "copy", "language", "duplicate", "repeated_source", "score")  # judged on the texts
DROP_REASONS = (*TEXT_REASONS, "too_long", "length_ratio")  # then on the tokens
BATCH_ROWS = 10_000
WHITESPACE = r"[\s\x0b\x1c-\x1f\x85\p{Z}]+"  # a run of what Python's re calls \s, in RE2 (whose \s is ASCII's)


def record_batches(ds: datasets.Dataset, columns: tuple[str, ...]) -> Iterator[pa.RecordBatch | pa.Table]:
    """The columns of ds's rows, in order, a record batch at a time. A dataset held in Arrow files is read from them
    with plain reads: through their memory map, every page read would stay resident in this process (at WMT size,
    the whole corpus)."""
    files = [f["filename"] for f in ds.cache_files]
    if not files or ds._indices is not None or ds.data.num_rows != len(ds):  # in memory, or select()ed
        yield from ds.with_format("arrow").select_columns(list(columns)).iter(batch_size=BATCH_ROWS)
        return
    rows = 0
    for path in files:
        with pa.OSFile(path) as source:
            for batch in pa.ipc.open_stream(source):
                rows += batch.num_rows
                yield batch.select(list(columns))
    if rows != len(ds):
        raise RuntimeError(f"the Arrow files of a dataset of {len(ds)} rows hold {rows}: {files}")


def _per_row(ds: datasets.Dataset, values: np.ndarray) -> np.ndarray:
    """values, one per row of ds's table, for the rows of ds: a select()ed dataset keeps its whole table and
    a mapping of indices (datasets has no public accessor for it)."""
    return values if ds._indices is None else values[ds._indices.column(0).to_numpy()]


def _rows_where(ds: datasets.Dataset, *tests) -> list[np.ndarray]:
    """Per test, per row of ds: test(text) holds for src or tgt (bool). The texts are read once for all tests."""
    hits = [[np.zeros(0, bool)] for _ in tests]
    for batch in record_batches(ds, ("src", "tgt")):
        for test, found in zip(tests, hits):
            either = pc.or_(test(batch.column("src")), test(batch.column("tgt")))
            found.append(either.to_numpy(zero_copy_only=False).astype(bool))
    return [np.concatenate(found) for found in hits]


def _lengths(ds: datasets.Dataset, column: str) -> np.ndarray:
    """Tokens per row of a list column (int): only its offsets are read."""
    return _per_row(ds, pc.list_value_length(ds.data.column(column)).to_numpy(zero_copy_only=False))


def empty(ds: datasets.Dataset) -> np.ndarray:
    """Per pair of texts: `not (CONTROL.sub(" ", src).strip() and CONTROL.sub(" ", tgt).strip())` (encoding replaces
    control characters by spaces). Arrow's whitespace is Python's str.isspace (Unicode category Zs, bidi classes WS,
    B and S: \\x1c-\\x1f, \\x85, \\u2028 and \\u3000 too)."""

    def blank(c):
        spaced = pc.replace_substring_regex(c, CONTROL.pattern, " ")
        return pc.or_(pc.equal(pc.binary_length(spaced), 0), pc.utf8_is_space(spaced))

    return _rows_where(ds, blank)[0]


def repairs(ds: datasets.Dataset) -> dict[str, int]:
    """Pairs with undecodable bytes (read as U+FFFD): `"\\ufffd" in src or "\\ufffd" in tgt`, and pairs with
    control characters: `CONTROL.search(src) or CONTROL.search(tgt)`. They are kept, repaired."""
    invalid, control = _rows_where(
        ds, lambda c: pc.match_substring(c, "\ufffd"), lambda c: pc.match_substring_regex(c, CONTROL.pattern)
    )
    return {"invalid_utf8": int(invalid.sum()), "control_chars": int(control.sum()), "truncated": 0}


def _folded(column: pa.Array, pattern: str, by: str) -> pa.Array:
    """Lower-cased, each match of `pattern` (RE2) replaced by `by`, outer whitespace trimmed."""
    return pc.utf8_trim_whitespace(pc.replace_substring_regex(pc.utf8_lower(column), pattern, by))


def copies(ds: datasets.Dataset) -> np.ndarray:
    """Per pair: the target is the source untranslated, `letters(src) == letters(tgt)` with letters(t) =
    "".join(c for c in t.lower() if c.isalpha()) (case, spacing, punctuation and digits aside: "Paris." and
    "paris" are one; so are "1." and "1.")."""

    def letters(c):
        return _folded(c, r"[^\p{L}]+", "")

    found = [np.zeros(0, bool)]
    for batch in record_batches(ds, ("src", "tgt")):
        same = pc.equal(letters(batch.column("src")), letters(batch.column("tgt")))
        found.append(same.to_numpy(zero_copy_only=False).astype(bool))
    return np.concatenate(found)


def wrong_languages(ds: datasets.Dataset, languages: tuple[str, str], threshold: float, min_chars: int) -> np.ndarray:
    """Per pair: its source is judged not in languages[0] or its target not in languages[1]
    (language.wrong_language); in worker processes over a large corpus."""

    def judge(batch):
        src, tgt = (
            wrong_language(batch[side], lang, threshold, min_chars) for side, lang in zip(("src", "tgt"), languages)
        )
        return {"wrong": src | tgt}

    with progress_bars_if_large(len(ds)):
        judged = ds.map(judge, batched=True, batch_size=BATCH_ROWS, remove_columns=ds.column_names,
                        features=datasets.Features({"wrong": datasets.Value("bool")}),
                        num_proc=os.cpu_count() if len(ds) > LARGE else None)  # fmt: skip
    return judged.data.column("wrong").to_numpy().astype(bool)


def _hashes(column: pa.Array) -> np.ndarray:
    """A 64-bit hash per text, the same in every process (pandas' SipHash with a fixed key)."""
    return pd.util.hash_array(column.to_numpy(zero_copy_only=False))


def duplicates(ds: datasets.Dataset, max_targets: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per pair (bool): (a duplicate: an earlier pair has the same source and target once lower-cased with runs of
    whitespace as one space; a repeated source: `max_targets` earlier pairs, duplicates aside, have its source so
    folded). Reads 16 bytes a pair into memory: 72 MB at WMT14's 4.5M pairs."""
    pair_hash, source_hash = [np.zeros(0, np.uint64)], [np.zeros(0, np.uint64)]
    for batch in record_batches(ds, ("src", "tgt")):
        src, tgt = (_folded(batch.column(side), WHITESPACE, " ") for side in ("src", "tgt"))
        pair_hash.append(_hashes(pc.binary_join_element_wise(src, tgt, "\t")))
        source_hash.append(_hashes(src))
    pairs, sources = np.concatenate(pair_hash), np.concatenate(source_hash)
    duplicate = np.ones(len(pairs), bool)
    duplicate[np.unique(pairs, return_index=True)[1]] = False  # each pair's first occurrence
    repeated = np.zeros(len(pairs), bool)
    if max_targets is not None:
        rows = np.flatnonzero(~duplicate)
        order = np.argsort(sources[rows], kind="stable")  # by source, in corpus order within one
        ranked = sources[rows][order]
        starts = np.r_[0, np.flatnonzero(ranked[1:] != ranked[:-1]) + 1]
        rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        repeated[rows[order[rank >= max_targets]]] = True
    return duplicate, repeated


def clean(
    ds: datasets.Dataset, text_drops: dict[str, np.ndarray], max_length: int, max_length_ratio: float
) -> tuple[datasets.Dataset, dict[str, int], dict[str, int], np.ndarray]:
    """Drop the pairs that text_drops marks (a bool per pair for each of TEXT_REASONS it holds), too long (either
    side over max_length tokens), or of an extreme length ratio (longer side over max_length_ratio times the shorter,
    at least 1); each pair is counted under its first reason (DROP_REASONS' order). Returns the pairs kept, per
    reason the pairs dropped and their tokens (src_ids + tgt_ids), and per pair its reason's index in DROP_REASONS
    (int8, -1: kept)."""
    src_len, tgt_len = _lengths(ds, "src_ids"), _lengths(ds, "tgt_ids")
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    masks = {**text_drops, "too_long": (src_len > max_length) | (tgt_len > max_length),
             "length_ratio": ratio > max_length_ratio}  # fmt: skip
    reason = np.full(len(ds), -1, np.int8)
    for code, name in reversed(list(enumerate(DROP_REASONS))):  # the first reason written last
        if name in masks:
            reason[masks[name]] = code
    tokens = src_len.astype(np.int64) + tgt_len
    dropped = {name: int((reason == code).sum()) for code, name in enumerate(DROP_REASONS)}
    dropped_tokens = {name: int(tokens[reason == code].sum()) for code, name in enumerate(DROP_REASONS)}
    keep = reason < 0
    return (ds if keep.all() else ds.select(np.flatnonzero(keep))), dropped, dropped_tokens, reason


def write_dropped(path: Path, ds: datasets.Dataset, reason: np.ndarray) -> int:
    """The pairs of ds (its texts) that `reason` (clean's) drops, one a line: line number (1-based row of the
    split, a text file's line), reason, source, target, tab-separated, tabs and line breaks in the texts as spaces.
    Returns the pairs listed."""
    listed, start = 0, 0
    with path.open("w", encoding="utf-8") as out:
        out.write("line\treason\tsource\ttarget\n")
        for batch in record_batches(ds, ("src", "tgt")):
            rows = np.flatnonzero(reason[start : start + batch.num_rows] >= 0)
            if len(rows):
                taken = batch.take(pa.array(rows))
                texts = [pc.replace_substring_regex(taken.column(side), r"[\t\n\r]", " ").to_pylist()
                         for side in ("src", "tgt")]  # fmt: skip
                for row, src, tgt in zip(rows, *texts):
                    out.write(f"{start + row + 1}\t{DROP_REASONS[reason[start + row]]}\t{src}\t{tgt}\n")
                listed += len(rows)
            start += batch.num_rows
    return listed


def length_stats(ds: datasets.Dataset) -> dict[str, float]:
    """Mean and 95th percentile of the tokens per sequence, per side (src_mean, src_p95, tgt_mean, tgt_p95)."""
    stats = {}
    for side in ("src", "tgt"):
        n = _lengths(ds, f"{side}_ids") if len(ds) else np.zeros(1)
        stats[f"{side}_mean"], stats[f"{side}_p95"] = float(n.mean()), float(np.percentile(n, 95))
    return stats
