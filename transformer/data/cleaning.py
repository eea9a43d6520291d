"""What cleaning counts and drops, computed by Arrow: no column is read into Python, and text is read record batch
by record batch, so it runs in bounded memory at any corpus size. Each function gives what its Python definition in
its docstring gives."""

import re
from collections.abc import Iterator

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0/C1 controls but tab and newline (same pattern in RE2)
DROP_REASONS = ("empty", "too_long", "length_ratio")
BATCH_ROWS = 10_000


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


def clean(
    ds: datasets.Dataset, is_empty: np.ndarray, max_length: int, max_length_ratio: float
) -> tuple[datasets.Dataset, dict[str, int], dict[str, int]]:
    """Drop the pairs that are empty (is_empty: `empty` of their texts), too long (either side over max_length
    tokens), or of an extreme length ratio (longer side over max_length_ratio times the shorter, at least 1); each
    pair is counted under its first reason. Returns the pairs kept, and per reason the pairs dropped and their tokens
    (src_ids + tgt_ids)."""
    src_len, tgt_len = _lengths(ds, "src_ids"), _lengths(ds, "tgt_ids")
    too_long = ~is_empty & ((src_len > max_length) | (tgt_len > max_length))
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    bad_ratio = ~is_empty & ~too_long & (ratio > max_length_ratio)
    keep = ~(is_empty | too_long | bad_ratio)
    tokens = src_len.astype(np.int64) + tgt_len
    masks = (is_empty, too_long, bad_ratio)
    dropped = {reason: int(mask.sum()) for reason, mask in zip(DROP_REASONS, masks)}
    dropped_tokens = {reason: int(tokens[mask].sum()) for reason, mask in zip(DROP_REASONS, masks)}
    return (ds if keep.all() else ds.select(np.flatnonzero(keep))), dropped, dropped_tokens


def length_stats(ds: datasets.Dataset) -> dict[str, float]:
    """Mean and 95th percentile of the tokens per sequence, per side (src_mean, src_p95, tgt_mean, tgt_p95)."""
    stats = {}
    for side in ("src", "tgt"):
        n = _lengths(ds, f"{side}_ids") if len(ds) else np.zeros(1)
        stats[f"{side}_mean"], stats[f"{side}_p95"] = float(n.mean()), float(np.percentile(n, 95))
    return stats
