"""What cleaning counts and drops, computed by Arrow over whole columns: no column is read into Python, so it
runs in bounded memory at any corpus size. Each function gives what its Python definition in its docstring gives."""

import re

import datasets
import numpy as np
import pyarrow.compute as pc

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0/C1 controls but tab and newline (same pattern in RE2)
DROP_REASONS = ("empty", "too_long", "length_ratio")


def _per_row(ds: datasets.Dataset, values: np.ndarray) -> np.ndarray:
    """values, one per row of ds's table, for the rows of ds: a select()ed dataset keeps its whole table and
    a mapping of indices (datasets has no public accessor for it)."""
    return values if ds._indices is None else values[ds._indices.column(0).to_numpy()]


def _rows_where(ds: datasets.Dataset, test, columns=("src", "tgt")) -> np.ndarray:
    """Per row of ds: test(column) holds for any of the columns (bool)."""
    hits = [test(ds.data.column(c)) for c in columns]
    either = hits[0] if len(hits) == 1 else pc.or_(*hits)
    return _per_row(ds, either.to_numpy(zero_copy_only=False).astype(bool))


def _lengths(ds: datasets.Dataset, column: str) -> np.ndarray:
    """Tokens per row of a list column (int)."""
    return _per_row(ds, pc.list_value_length(ds.data.column(column)).to_numpy(zero_copy_only=False))


def empty(ds: datasets.Dataset) -> np.ndarray:
    """Per pair: `not (src.strip() and tgt.strip())`. Arrow's whitespace is Python's str.isspace (Unicode
    category Zs, bidi classes WS, B and S: \\x1c-\\x1f, \\x85, \\u2028 and \\u3000 too)."""
    return _rows_where(ds, lambda c: pc.or_(pc.equal(pc.binary_length(c), 0), pc.utf8_is_space(c)))


def repairs(ds: datasets.Dataset) -> dict[str, int]:
    """Pairs with undecodable bytes (read as U+FFFD): `"\\ufffd" in src or "\\ufffd" in tgt`, and pairs with
    control characters: `CONTROL.search(src) or CONTROL.search(tgt)`. They are kept, repaired."""
    return {
        "invalid_utf8": int(_rows_where(ds, lambda c: pc.match_substring(c, "\ufffd")).sum()),
        "control_chars": int(_rows_where(ds, lambda c: pc.match_substring_regex(c, CONTROL.pattern)).sum()),
        "truncated": 0,
    }


def clean(
    ds: datasets.Dataset, max_length: int, max_length_ratio: float
) -> tuple[datasets.Dataset, dict[str, int], dict[str, int]]:
    """Drop the pairs that are empty, too long (either side over max_length tokens), or of an extreme length
    ratio (longer side over max_length_ratio times the shorter, at least 1); each pair is counted under its first
    reason. Returns the pairs kept, and per reason the pairs dropped and their tokens (src_ids + tgt_ids)."""
    src_len, tgt_len = _lengths(ds, "src_ids"), _lengths(ds, "tgt_ids")
    is_empty = empty(ds)
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
