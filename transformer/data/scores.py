"""Per-pair scores of a corpus split, as `python -m transformer.score` writes them and prepare filters by: a TSV with
a header and one row per pair (line, forward; with a reverse model also reverse and dual), beside a JSON card
(`{file}.json`) naming the split it scores by its pairs and their fingerprint."""

import hashlib
import json
from pathlib import Path

import datasets
import numpy as np

from .cleaning import record_batches
from .sources import DataError

COLUMNS = ("line", "forward", "reverse", "dual")  # a score file's header; the last two with a reverse model


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
    """The scores prepare filters by, one per pair of ds (dual where the file has it, else forward); a one-line
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
    with path.open() as f:
        header = f.readline().rstrip("\n").split("\t")
        table = np.loadtxt(f, delimiter="\t", ndmin=2, dtype=np.float64)
    column = "dual" if "dual" in header else "forward"
    return table[:, header.index(column)] if len(table) else np.zeros(0)


def below(scores: np.ndarray, min_score: float | None, keep_best: float | None) -> np.ndarray:
    """Per pair (bool): scored under min_score, or outside the best keep_best fraction (ties at the cut kept)."""
    drop = np.zeros(len(scores), bool)
    if min_score is not None:
        drop |= scores < min_score
    if keep_best is not None and len(scores):
        cut = np.quantile(scores, 1 - keep_best, method="lower")
        drop |= scores < cut
    return drop
