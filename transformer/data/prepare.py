"""Tokenize and clean a corpus once; cache the tokenizer and the encoded splits under data/.

Cache layout, each folder keyed by a hash of everything it depends on:
    {cache_dir}/{corpus}.{src}-{tgt}.{tokenizer key}/spm.model             (joint; or spm.{lang}.model each)
    {cache_dir}/{corpus}.{src}-{tgt}.{tokenizer key}/encoded.{data key}/   (DatasetDict, Arrow files)
"""

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from .config import DataConfig
from .sources import LARGE, load_corpus, progress_bars_if_large
from .tokenizer import SentencePiece, train_sentencepiece

log = logging.getLogger(__name__)
FORMAT_VERSION = 2  # bump when the encoded layout or cleaning changes, so old caches are not reused
DROP_REASONS = ("empty", "too_long", "length_ratio")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0/C1 controls but tab and newline


@dataclass
class PreparedData:
    src_tokenizer: SentencePiece
    tgt_tokenizer: SentencePiece
    splits: datasets.DatasetDict  # columns: src, tgt (text), src_ids, tgt_ids (no special tokens)
    stats: dict[str, dict]  # per split: pairs, kept, dropped by reason, token lengths
    folder: Path  # the encoded folder
    reused: bool  # True when nothing was trained or encoded


def _key(*parts) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12]


def _tokenizers(
    cfg: DataConfig, corpus: datasets.DatasetDict, folder: Path
) -> tuple[SentencePiece, SentencePiece, bool]:
    train = corpus[cfg.train_split]
    if cfg.joint_vocab:
        path = folder / "spm.model"
        if path.exists():
            return SentencePiece(path), SentencePiece(path), True
        log.info("training a joint %s sentencepiece model of %d pieces", cfg.tokenizer_type, cfg.vocab_size)
        both = (s for column in ("src", "tgt") for s in train[column])
        sp = train_sentencepiece(both, folder / "spm", cfg.vocab_size, cfg.tokenizer_type)
        return sp, sp, False
    models, reused = [], True
    for column, lang in (("src", cfg.src), ("tgt", cfg.tgt)):
        path = folder / f"spm.{lang}.model"
        if path.exists():
            models.append(SentencePiece(path))
        else:
            log.info("training a %s sentencepiece model of %d pieces for %s", cfg.tokenizer_type, cfg.vocab_size, lang)
            models.append(
                train_sentencepiece(train[column], folder / f"spm.{lang}", cfg.vocab_size, cfg.tokenizer_type)
            )
            reused = False
    return models[0], models[1], reused


def _clean(ds: datasets.Dataset, cfg: DataConfig) -> tuple[datasets.Dataset, dict[str, int]]:
    """Drop training pairs that are empty, too long, or of an extreme length ratio; count each reason."""
    src_len = pc.list_value_length(ds.data.column("src_ids")).to_numpy()
    tgt_len = pc.list_value_length(ds.data.column("tgt_ids")).to_numpy()
    empty = np.array([not (s.strip() and t.strip()) for s, t in zip(ds["src"], ds["tgt"])], dtype=bool)
    too_long = ~empty & ((src_len > cfg.max_length) | (tgt_len > cfg.max_length))
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    bad_ratio = ~empty & ~too_long & (ratio > cfg.max_length_ratio)
    keep = ~(empty | too_long | bad_ratio)
    dropped = dict(zip(DROP_REASONS, (int(empty.sum()), int(too_long.sum()), int(bad_ratio.sum()))))
    return (ds if keep.all() else ds.select(np.flatnonzero(keep))), dropped


def _repairs(ds: datasets.Dataset) -> dict[str, int]:
    """Pairs with undecodable bytes (read as U+FFFD) and pairs with control characters: kept, repaired."""
    pairs = list(zip(ds["src"], ds["tgt"]))
    return {
        "invalid_utf8": sum("\ufffd" in s or "\ufffd" in t for s, t in pairs),
        "control_chars": sum(bool(CONTROL.search(s) or CONTROL.search(t)) for s, t in pairs),
        "truncated": 0,
    }


def _length_stats(ds: datasets.Dataset) -> dict[str, float]:
    stats = {}
    for side in ("src", "tgt"):
        n = pc.list_value_length(ds.data.column(f"{side}_ids")).to_numpy() if len(ds) else np.zeros(1)
        stats[f"{side}_mean"], stats[f"{side}_p95"] = float(n.mean()), float(np.percentile(n, 95))
    return stats


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Train or reuse the tokenizer, encode and clean every split, or reuse all of it from the cache."""
    corpus, fingerprint = load_corpus(cfg)
    name = Path(cfg.path).name or "corpus"
    tok_key = _key(FORMAT_VERSION, fingerprint, cfg.src, cfg.tgt, cfg.vocab_size, cfg.joint_vocab, cfg.tokenizer_type)
    tok_folder = Path(cfg.cache_dir) / f"{name}.{cfg.src}-{cfg.tgt}.{tok_key}"
    src_tok, tgt_tok, tok_reused = _tokenizers(cfg, corpus, tok_folder)

    folder = tok_folder / f"encoded.{_key(cfg.train_split, cfg.max_length, cfg.max_length_ratio)}"
    if folder.exists():
        stats = json.loads((folder / "stats.json").read_text())
        log.info("reused the cached tokenizer and encoded data in %s", folder)
        return PreparedData(src_tok, tgt_tok, datasets.load_from_disk(str(folder)), stats, folder, tok_reused)

    features = datasets.Features(
        {"src": datasets.Value("string"), "tgt": datasets.Value("string"),
         "src_ids": datasets.List(datasets.Value("int32")), "tgt_ids": datasets.List(datasets.Value("int32"))}
    )  # fmt: skip

    def encode(batch):  # control characters become spaces
        src, tgt = [CONTROL.sub(" ", t) for t in batch["src"]], [CONTROL.sub(" ", t) for t in batch["tgt"]]
        return {"src": src, "tgt": tgt, "src_ids": src_tok.encode(src), "tgt_ids": tgt_tok.encode(tgt)}

    def truncate(batch):
        return {side: [x[: cfg.max_length] for x in batch[side]] for side in ("src_ids", "tgt_ids")}

    encoded, stats = {}, {}
    for split, ds in corpus.items():
        repaired = _repairs(ds)
        big = len(ds) > LARGE  # worker processes pay for themselves only on large corpora
        with progress_bars_if_large(len(ds)):
            ds = ds.map(
                encode, batched=True, batch_size=10_000, features=features, num_proc=os.cpu_count() if big else None
            )
        dropped = dict.fromkeys(DROP_REASONS, 0)
        if split == cfg.train_split:
            ds, dropped = _clean(ds, cfg)
        else:  # evaluation pairs are never dropped; sequences too long to batch are cut to max_length tokens
            longest = np.maximum(*(pc.list_value_length(ds.data.column(c)).to_numpy() for c in ("src_ids", "tgt_ids")))
            repaired["truncated"] = int((longest > cfg.max_length).sum())
            if repaired["truncated"]:
                with progress_bars_if_large(len(ds)):
                    ds = ds.map(truncate, batched=True, features=features)
        encoded[split] = ds
        stats[split] = {
            "pairs": len(ds) + sum(dropped.values()),
            "kept": len(ds),
            "dropped": dropped,
            "repaired": repaired,
            **_length_stats(ds),
        }
        if sum(dropped.values()):
            log.info("%s: dropped %s", split, ", ".join(f"{n} {reason}" for reason, n in dropped.items()))

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    with progress_bars_if_large(max(map(len, encoded.values()))):
        datasets.DatasetDict(encoded).save_to_disk(str(tmp))
    (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
    try:
        tmp.rename(folder)  # atomic: another process sees all of it or nothing
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData(src_tok, tgt_tok, datasets.load_from_disk(str(folder)), stats, folder, False)
