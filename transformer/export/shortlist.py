"""A lexical shortlist (Marian's; CTranslate2 calls it a vocabulary map, vmap.txt): the target pieces a sentence's
translation may use are the most frequent ones plus, for each of its source pieces, those that co-occur with it most
in the training pairs (Dice's coefficient over pairs). Each decoding step then scores the batch's candidates, not
the whole vocabulary: the output projection and softmax, most of a one-layer decoder's work, shrink with it."""

from pathlib import Path

import numpy as np


def shortlist(sources: list[list[int]], targets: list[list[int]], vocab_size: int, frequent: int,
              per_source: int) -> tuple[list[int], dict[int, list[int]]]:  # fmt: skip
    """(the `frequent` target ids in most pairs, {source id: the `per_source` target ids of highest Dice
    2 c(s,t) / (c(s) + c(t))}), c counting pairs that hold the pieces; ties go to the lower id."""
    src_count, tgt_count = np.zeros(vocab_size, np.int64), np.zeros(vocab_size, np.int64)
    pairs = []
    for s, t in zip(sources, targets):
        s, t = np.unique(np.asarray(s, np.int64)), np.unique(np.asarray(t, np.int64))  # an empty side: int64 too
        src_count[s] += 1
        tgt_count[t] += 1
        pairs.append(np.add.outer(s * vocab_size, t).ravel())  # one key per (source piece, target piece) in the pair
    keys, together = np.unique(np.concatenate(pairs) if pairs else np.zeros(0, np.int64), return_counts=True)
    src, tgt = keys // vocab_size, keys % vocab_size
    dice = 2 * together / (src_count[src] + tgt_count[tgt])
    order = np.lexsort((tgt, -dice, src))  # by source, then best first
    src, tgt = src[order], tgt[order]
    rank = np.arange(len(src)) - np.searchsorted(src, src)  # each key's place among its source piece's
    per = {}
    for s, t in zip(src[rank < per_source].tolist(), tgt[rank < per_source].tolist()):  # at most per_source each
        per.setdefault(s, []).append(t)
    by_count = np.lexsort((np.arange(vocab_size), -tgt_count))
    return [t for t in by_count[:frequent].tolist() if tgt_count[t] > 0], per


def write_vmap(path: Path, fixed: list[int], per_source: dict[int, list[int]], src_pieces: list[str],
               tgt_pieces: list[str]) -> None:  # fmt: skip
    """CTranslate2's format: `source piece<TAB>target pieces`, one line per source piece; the empty key's line holds
    the pieces always allowed."""
    lines = ["\t" + " ".join(tgt_pieces[t] for t in fixed)]
    lines += [f"{src_pieces[s]}\t" + " ".join(tgt_pieces[t] for t in ts) for s, ts in sorted(per_source.items())]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
