"""Per-pair scores of a corpus split, as `python -m transformer.score` writes them and prepare filters by: a TSV with
a header and one row per pair (line, forward, margin; with a reverse model line, forward, reverse, dual, margin),
beside a JSON card (`{file}.json`) naming the split it scores by its pairs and their fingerprint."""

import hashlib
import json
from pathlib import Path

import datasets
import numpy as np

from .cleaning import record_batches
from .sources import DataError

COLUMNS = ("line", "forward", "reverse", "dual", "margin")  # a score file's header with a reverse model
FORWARD_COLUMNS = ("line", "forward", "margin")  # without one
FILTERED_BY = ("margin", "dual", "forward")  # the column prepare filters by: the first a file has


def other_pairs(n: int) -> np.ndarray:
    """For each of n pairs, the pair whose source stands in for its own in the margin: half the split away, so that
    neighbouring lines (a document's) are not taken; itself when it is alone."""
    return (np.arange(n) + n // 2) % max(n, 1)


def margin_score(own: np.ndarray, other: np.ndarray) -> np.ndarray:
    """How much more likely a target is given its own source than given another pair's, in nats per token (summed
    over both directions with a reverse model): a translation's source explains it, a misaligned pair's explains
    it no better than a stranger's. A margin as in margin-based bitext mining (Artetxe and Schwenk 2019): it cancels
    what the model finds likely in any target, fluent generic captions included, which dual cross-entropy keeps."""
    return own - other


def card_path(scores: Path) -> Path:
    return scores.with_name(scores.name + ".json")


def split_fingerprint(ds: datasets.Dataset) -> str:
    """A digest of a split's texts, pair by pair in order: what a score file was computed from."""
    digests = {side: hashlib.sha256() for side in ("src", "tgt")}  # per side: the same for any record batches
    for batch in record_batches(ds, ("src", "tgt")):
        for side, digest in digests.items():
            digest.update("".join(text + "\x1e" for text in batch.column(side).to_pylist()).encode())
    return hashlib.sha256(b"".join(d.digest() for d in digests.values())).hexdigest()[:16]


def dual_score(forward: np.ndarray, reverse: np.ndarray) -> np.ndarray:
    """Dual conditional cross-entropy (Junczys-Dowmunt 2018), negated so that higher is better like the log-probs it
    comes from: -(|H_f - H_r| + (H_f + H_r) / 2), H_f = -forward and H_r = -reverse the two models' cross-entropies
    per token. A pair both models find likely and equally so scores near 0; a misaligned one far below."""
    h_f, h_r = -forward, -reverse
    return -(np.abs(h_f - h_r) + (h_f + h_r) / 2)


def read_scores(path: Path, ds: datasets.Dataset, key: str) -> np.ndarray:
    """The scores prepare filters by, one per pair of ds (the file's first column of FILTERED_BY); a one-line
    DataError naming `key` when the file does not score ds."""
    card = card_path(path)
    if not path.is_file() or not card.is_file():
        raise DataError(f"{key}={path}: no score file with its card ({card.name}) there; write it with "
                        "python -m transformer.score")  # fmt: skip
    scored = json.loads(card.read_text())
    if scored["pairs"] != len(ds) or scored["fingerprint"] != split_fingerprint(ds):
        raise DataError(f"{key}={path} scores {scored['pairs']} pairs of another text ({scored['corpus']}, split "
                        f"{scored['split']}), not this corpus's {len(ds)} training pairs; score this corpus with "
                        "python -m transformer.score")  # fmt: skip
    columns = read_columns(path)
    return columns[next(name for name in FILTERED_BY if name in columns)]


def read_columns(path: Path) -> dict[str, np.ndarray]:
    """A score file's columns by their header's names, in its order."""
    with path.open() as f:
        names = f.readline().rstrip("\n").split("\t")
        table = np.loadtxt(f, delimiter="\t", ndmin=2, dtype=np.float64).reshape(-1, len(names))
    return {name: table[:, i] for i, name in enumerate(names)}


def below(scores: np.ndarray, min_score: float | None, keep_best: float | None) -> np.ndarray:
    """Per pair (bool): scored under min_score, or outside the best keep_best fraction (ties at the cut kept)."""
    drop = np.zeros(len(scores), bool)
    if min_score is not None:
        drop |= scores < min_score
    if keep_best is not None and len(scores):
        cut = np.quantile(scores, 1 - keep_best, method="lower")
        drop |= scores < cut
    return drop
