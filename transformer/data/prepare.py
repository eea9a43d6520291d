"""Tokenize and clean the corpora once; cache the tokenizer and the encoded splits under data/.

Cache layout, each folder keyed by a hash of everything it depends on:
    {cache_dir}/{corpora}.{src}-{tgt}.{tokenizer key}/spm.model             (joint; or spm.{lang}.model each)
    {cache_dir}/{corpora}.{src}-{tgt}.{tokenizer key}/encoded.{data key}/{corpus}/   (DatasetDict, Arrow files)
    {cache_dir}/{corpora}.{src}-{tgt}.{tokenizer key}/encoded.{data key}/nbest{N}.v{format}/  (data.sampling_alpha:
        the training pairs' n-best segmentations, .npy files; written by the data module, data/subword.py)
A damaged encoded folder (a truncated Arrow file, say) is found on loading, named in a warning and rebuilt.
"""

import hashlib
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .cleaning import (
    CONTROL,
    DROP_REASONS,
    clean,
    copies,
    duplicates,
    empty,
    length_stats,
    record_batches,
    repairs,
    write_dropped,
    wrong_languages,
)
from .config import CorpusConfig, DataConfig
from .language import judged_languages
from .mixing import Mixture, mixture_shares
from .scores import below, read_scores
from .sources import LARGE, DataError, file_sha256, load_corpus, progress_bars_if_large
from .tokenizer import SentencePiece, train_sentencepiece

log = logging.getLogger(__name__)
FORMAT_VERSION = 4  # bump when the encoded layout or cleaning changes, so old caches are not reused
SHARD_PAIRS = 100_000  # pairs per Arrow file of a training split: the unit a stream reads and splits
ID_FEATURES = datasets.Features(
    {"src_ids": datasets.List(datasets.Value("int32")), "tgt_ids": datasets.List(datasets.Value("int32"))}
)
FEATURES = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string"), **ID_FEATURES})


@dataclass
class PreparedData:
    src_tokenizer: SentencePiece
    tgt_tokenizer: SentencePiece
    corpora: dict[str, datasets.DatasetDict]  # by corpus name, the main one first; columns src_ids, tgt_ids (no
    # special tokens; a corpus's tag is the first source id), and src, tgt (text) but in training splits (there too
    # with data.sampling_alpha)
    corpus_stats: dict[str, dict[str, dict]]  # per corpus and split: pairs, kept, dropped by reason, lengths
    mixture: Mixture  # the training splits laid end to end in corpora order, and each one's share of an epoch
    folder: Path  # the encoded folder
    reused: bool  # True when nothing was trained or encoded

    @property
    def splits(self) -> datasets.DatasetDict:
        """The main corpus's splits."""
        return next(iter(self.corpora.values()))

    @property
    def stats(self) -> dict[str, dict]:
        return next(iter(self.corpus_stats.values()))


def _key(*parts) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12]


def _tokenizer_sentences(trains: list[datasets.Dataset], shares: np.ndarray, cap: int, columns: tuple[str, ...],
                         seed: int) -> Iterator[str]:  # fmt: skip
    """At most `cap` sentences of the training splits, each corpus by its share of the mix (a small corpus is not
    drowned by a large one; one above its size repeats), corpus by corpus and column by column. A corpus sampled
    whole is read in order."""
    total = min(cap, sum(len(t) for t in trains) * len(columns))
    rng = np.random.default_rng(seed)
    for ds, share in zip(trains, shares):
        pairs = int(round(share * total / len(columns)))
        if not len(ds) or not pairs:
            continue
        whole, rest = divmod(pairs, len(ds))
        picked = np.sort(rng.permutation(len(ds))[:rest])
        texts = _rows(ds, np.arange(len(ds)) if whole else picked, columns)
        for column in columns:
            if not whole:
                yield from texts[column]
                continue
            for _ in range(whole):
                yield from texts[column]
            yield from (texts[column][i] for i in picked)


def _rows(ds: datasets.Dataset, index: np.ndarray, columns: tuple[str, ...]) -> dict[str, list[str]]:
    """The texts of rows `index` (sorted), read record batch by record batch (`record_batches`)."""
    texts, start = {column: [] for column in columns}, 0
    for batch in record_batches(ds, columns):
        rows = index[np.searchsorted(index, start) : np.searchsorted(index, start + batch.num_rows)] - start
        if len(rows):
            taken = batch.take(pa.array(rows))
            for column in columns:
                texts[column] += taken.column(column).to_pylist()
        start += batch.num_rows
    return texts


def _score_file_digest(path: Path) -> str | None:
    """A score file's content digest for the cache key (None where there is none: reading it names the problem)."""
    return file_sha256(path).hexdigest() if path.is_file() else None


def tokenizer_file_names(src: str, tgt: str, joint: bool) -> tuple[str, str]:
    """The names of data.tokenizer's files: spm.model for both languages, or spm.{src}.model and spm.{tgt}.model."""
    return ("spm.model", "spm.model") if joint else (f"spm.{src}.model", f"spm.{tgt}.model")


def write_tokenizer_folder(folder: Path, src: str, tgt: str, models: tuple[bytes, bytes]) -> None:
    """Sentencepiece models (source, target) as data.tokenizer reads them: one spm.model where both are the same.
    Each file is written whole under its own temporary name (processes may write one folder at once: DDP's ranks),
    and left as it is when it already holds the model; the other layout's files, which would be read instead, go."""
    folder.mkdir(parents=True, exist_ok=True)
    names = tokenizer_file_names(src, tgt, joint=models[0] == models[1])
    for stale in {*tokenizer_file_names(src, tgt, True), *tokenizer_file_names(src, tgt, False)} - set(names):
        (folder / stale).unlink(missing_ok=True)
    for name, model in zip(names, models):
        path = folder / name
        if not path.is_file() or path.read_bytes() != model:
            tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
            tmp.write_bytes(model)
            tmp.replace(path)


def given_tokenizers(cfg: DataConfig) -> tuple[Path, Path]:
    """The sentencepiece model files of data.tokenizer's folder: (source, target)."""
    folder = Path(cfg.tokenizer)
    joint = folder / "spm.model"
    if joint.is_file():
        return joint, joint
    files = tuple(folder / name for name in tokenizer_file_names(cfg.src, cfg.tgt, joint=False))
    if not all(f.is_file() for f in files):
        raise DataError(f"data.tokenizer={cfg.tokenizer} holds neither spm.model nor both {files[0].name} and "
                        f"{files[1].name}; give a folder of this run's languages' sentencepiece models")  # fmt: skip
    return files


def _tokenizers(cfg: DataConfig, trains: list[datasets.Dataset], shares: np.ndarray, folder: Path,
                given: tuple[Path, Path] | None) -> tuple[SentencePiece, SentencePiece, bool]:  # fmt: skip
    """The tokenizers: `given` (data.tokenizer's files), checked; or trained (or reused) in `folder`."""
    if given is not None:
        src, tgt = (SentencePiece(path) for path in given)
        for side, tok in (("source", src), ("target", tgt)):
            missing = [name for name in ("pad", "eos", "bos") if getattr(tok, f"{name}_id") < 0]
            if missing:
                raise DataError(f"data.tokenizer={cfg.tokenizer}: the {side} model {tok.path.name} has no "
                                f"{' or '.join(missing)} piece, which batches need; give models trained with them")  # fmt: skip
        if src.pad_id != tgt.pad_id:
            raise DataError(f"data.tokenizer={cfg.tokenizer}: pad is {src.pad_id} in the source model but "
                            f"{tgt.pad_id} in the target one; the model has one pad id")  # fmt: skip
        return src, tgt, True

    def train(columns: tuple[str, ...], name: str) -> SentencePiece:
        sentences = _tokenizer_sentences(trains, shares, cfg.tokenizer_sentences, columns, cfg.seed)
        return train_sentencepiece(sentences, folder / name, cfg.vocab_size, cfg.tokenizer_type, cfg.tags(),
                                   cfg.tokenizer_sentences)  # fmt: skip

    if cfg.joint_vocab:
        path = folder / "spm.model"
        if path.exists():
            return SentencePiece(path), SentencePiece(path), True
        log.info("training a joint %s sentencepiece model of %d pieces", cfg.tokenizer_type, cfg.vocab_size)
        sp = train(("src", "tgt"), "spm")
        return sp, sp, False
    models, reused = [], True
    for column, lang in (("src", cfg.src), ("tgt", cfg.tgt)):
        path = folder / f"spm.{lang}.model"
        if path.exists():
            models.append(SentencePiece(path))
        else:
            log.info("training a %s sentencepiece model of %d pieces for %s", cfg.tokenizer_type, cfg.vocab_size, lang)
            models.append(train((column,), f"spm.{lang}"))
            reused = False
    return models[0], models[1], reused


def _text_drops(ds: datasets.Dataset, cfg: DataConfig, corpus: CorpusConfig, key: str,
                languages: tuple[str, str] | None) -> dict[str, np.ndarray]:  # fmt: skip
    """Per reason of cleaning.TEXT_REASONS that data.* asks for, the pairs of ds (texts) it holds for (bool); `key`:
    the corpus's settings' prefix (data, data.corpora.NAME)."""
    drops = {"empty": empty(ds)}
    if cfg.drop_copies:
        drops["copy"] = copies(ds)
    if languages is not None:
        drops["language"] = wrong_languages(ds, languages, cfg.language_threshold, cfg.language_min_chars)
    if cfg.dedupe or cfg.max_targets_per_source is not None:
        duplicate, drops["repeated_source"] = duplicates(ds, cfg.max_targets_per_source)
        if cfg.dedupe:
            drops["duplicate"] = duplicate
    if corpus.scores is not None:
        drops["score"] = below(
            read_scores(Path(corpus.scores), ds, f"{key}.scores"), corpus.min_score, corpus.keep_best
        )
    return drops


def _encode_corpus(corpus: CorpusConfig, key: str, splits: datasets.DatasetDict, cfg: DataConfig,
                   src_tok: SentencePiece, tgt_tok: SentencePiece, languages: tuple[str, str] | None
                   ) -> tuple[dict[str, datasets.Dataset], dict[str, dict], dict[str, tuple]]:  # fmt: skip
    """Every split encoded (the tag, if any, first); the training split cleaned, the others cut to max_length.
    Training keeps token ids only (the texts, as large again at WMT size, are for scoring dev and test sets), and
    its texts too when subword sampling segments them afresh each epoch. Also returns, for the training split, its
    texts and each pair's drop reason (cleaning.clean's), to list what was dropped."""
    tag = [src_tok.tag_id(corpus.tag)] if corpus.tag else []

    def encode(batch, with_text: bool):  # control characters become spaces
        src, tgt = [CONTROL.sub(" ", t) for t in batch["src"]], [CONTROL.sub(" ", t) for t in batch["tgt"]]
        ids = {"src_ids": [tag + x for x in src_tok.encode(src)], "tgt_ids": tgt_tok.encode(tgt)}
        return {"src": src, "tgt": tgt, **ids} if with_text else ids

    def truncate(batch):
        return {side: [x[: cfg.max_length] for x in batch[side]] for side in ("src_ids", "tgt_ids")}

    encoded, stats, dropped_rows = {}, {}, {}
    for split, ds in splits.items():
        train = split == corpus.train_split
        with_text = not train or split in (corpus.valid_split, corpus.test_split) or cfg.sampling_alpha is not None
        texts, repaired, text_drops = ds, repairs(ds), _text_drops(ds, cfg, corpus, key, languages) if train else None
        big = len(ds) > LARGE  # worker processes pay for themselves only on large corpora
        with progress_bars_if_large(len(ds)):
            ds = ds.map(encode, fn_kwargs={"with_text": with_text}, batched=True, batch_size=10_000,
                        features=FEATURES if with_text else ID_FEATURES, remove_columns=None if with_text else ["src", "tgt"],
                        num_proc=os.cpu_count() if big else None)  # fmt: skip
        dropped, dropped_tokens = dict.fromkeys(DROP_REASONS, 0), dict.fromkeys(DROP_REASONS, 0)
        if train:
            ds, dropped, dropped_tokens, reason = clean(ds, text_drops, cfg.max_length, cfg.max_length_ratio)
            dropped_rows[split] = texts, reason
        else:  # evaluation pairs are never dropped; sequences too long to batch are cut to max_length tokens
            longest = np.maximum(*(pc.list_value_length(ds.data.column(c)).to_numpy() for c in ("src_ids", "tgt_ids")))
            repaired["truncated"] = int((longest > cfg.max_length).sum())
            if repaired["truncated"]:
                with progress_bars_if_large(len(ds)):
                    ds = ds.map(truncate, batched=True, features=FEATURES)
        encoded[split] = ds
        stats[split] = {"pairs": len(ds) + sum(dropped.values()), "kept": len(ds), "dropped": dropped,
                        "dropped_tokens": dropped_tokens, "repaired": repaired, **length_stats(ds)}  # fmt: skip
        if sum(dropped.values()):
            log.info(
                "%s/%s: dropped %s", corpus.path, split, ", ".join(f"{n} {reason}" for reason, n in dropped.items())
            )
    return encoded, stats, dropped_rows


def dropped_file(folder: Path, corpus: str, split: str) -> Path:
    """The list of a training split's dropped pairs (cleaning.write_dropped) in an encoded folder."""
    return folder / corpus / f"dropped.{split}.tsv"


def _load_encoded(folder: Path, names: list[str]) -> tuple[dict[str, datasets.DatasetDict], dict] | None:
    """The cached encoded corpora, or None (with a warning naming the folder) when any part is damaged."""
    try:
        stats = json.loads((folder / "stats.json").read_text())
        corpora = {name: datasets.load_from_disk(str(folder / name)) for name in names}
        for name, splits in corpora.items():
            for split, ds in splits.items():
                if len(ds) != stats[name][split]["kept"]:
                    raise ValueError(f"{name}/{split} holds {len(ds)} pairs, {stats[name][split]['kept']} were written")
    except Exception as e:  # any damage: the cache is ours to rebuild from the corpora
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        warnings.warn(f"the encoded cache {folder} is damaged ({reason}); rebuilding it", stacklevel=2)
        return None
    return corpora, stats


@contextmanager
def written_whole(folder: Path) -> Iterator[Path]:
    """A temporary folder beside `folder` to write into, renamed to it when the block ends (atomic: another process
    sees all of it or nothing); removed if the block raises, or if another process finished first (its copy kept)."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _save(corpora: dict[str, dict[str, datasets.Dataset]], stats: dict, dropped_rows: dict[str, dict[str, tuple]],
          folder: Path) -> None:  # fmt: skip
    with written_whole(folder) as tmp:
        for name, splits in corpora.items():
            for split, ds in splits.items():
                with progress_bars_if_large(len(ds)):
                    ds.save_to_disk(str(tmp / name / split), num_shards=max(1, math.ceil(len(ds) / SHARD_PAIRS)))
            (tmp / name / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
            for split, (texts, reason) in dropped_rows[name].items():
                write_dropped(dropped_file(tmp, name, split), texts, reason)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1))


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Train or reuse the tokenizer, encode and clean every split of every corpus, or reuse all of it."""
    corpora = cfg.all_corpora()
    languages = judged_languages(cfg.src, cfg.tgt, cfg.language_id)
    loaded, fingerprints = {}, []
    for name, corpus in corpora.items():
        loaded[name], fingerprint = load_corpus(corpus, cfg.src, cfg.tgt, cfg.cache_dir)
        if corpus.train_split not in loaded[name]:
            raise DataError(f"corpus {name} ({corpus.path}) has no split {corpus.train_split!r} (found "
                            f"{', '.join(loaded[name])}); set its train_split")  # fmt: skip
        for field, split in (("valid_split", corpus.valid_split), ("test_split", corpus.test_split)):
            if split is not None and split not in loaded[name]:
                raise DataError(f"corpus {name} ({corpus.path}) has no split {split!r} (found "
                                f"{', '.join(loaded[name])}); set data.{field if name == cfg.main_name else f'corpora.{name}.{field}'}")  # fmt: skip
        fingerprints.append((name, fingerprint, corpus.train_split, corpus.weight, corpus.tag))
    trains = [loaded[name][c.train_split] for name, c in corpora.items()]
    shares = mixture_shares([len(t) for t in trains], [c.weight for c in corpora.values()], cfg.temperature)
    given = given_tokenizers(cfg) if cfg.tokenizer is not None else None
    if given is None:
        tok_key = _key(FORMAT_VERSION, fingerprints, cfg.temperature, cfg.tokenizer_sentences, cfg.src, cfg.tgt,
                       cfg.vocab_size, cfg.joint_vocab, cfg.tokenizer_type)  # fmt: skip
    else:  # the given models' whole files (their reserved pieces too), wherever they are
        hashes = [hashlib.sha256(path.read_bytes()).hexdigest() for path in given]
        tok_key = _key(FORMAT_VERSION, fingerprints, cfg.src, cfg.tgt, "given", *hashes)
    tok_folder = Path(cfg.cache_dir) / f"{'+'.join(corpora)}.{cfg.src}-{cfg.tgt}.{tok_key}"
    src_tok, tgt_tok, tok_reused = _tokenizers(cfg, trains, shares, tok_folder, given)

    training_text = ["training text"] if cfg.sampling_alpha is not None else []  # the same key as before without
    # a text that starts with a reserved piece is encoded as that tag, then the rest (tokenizer.encode): a cache
    # encoded before, by a tokenizer with reserved pieces, is not reused
    leading_tags = ["leading tags"] if src_tok.tags or tgt_tok.tags else []
    scoring = [(c.scores and _score_file_digest(Path(c.scores)), c.min_score, c.keep_best) for c in corpora.values()]
    cleaning = [languages, cfg.language_threshold, cfg.language_min_chars, cfg.dedupe, cfg.max_targets_per_source,
                cfg.drop_copies, *(scoring if any(c.scores for c in corpora.values()) else [])]  # fmt: skip
    key = _key(cfg.max_length, cfg.max_length_ratio, *training_text, *leading_tags, *cleaning)
    folder = tok_folder / f"encoded.{key}"
    cached = _load_encoded(folder, list(corpora)) if folder.exists() else None
    if cached is None:
        if folder.exists():
            shutil.rmtree(folder)
        encoded, stats, dropped_rows = {}, {}, {}
        for name, corpus in corpora.items():
            key = "data" if name == cfg.main_name else f"data.corpora.{name}"
            encoded[name], stats[name], dropped_rows[name] = _encode_corpus(corpus, key, loaded[name], cfg, src_tok,
                                                                            tgt_tok, languages)  # fmt: skip
        _save(encoded, stats, dropped_rows, folder)
        for splits in loaded.values():  # the encoding maps' own cache files, next to the text's Arrow copy
            for ds in splits.values():
                ds.cleanup_cache_files()
        cached = _load_encoded(folder, list(corpora))
        if cached is None:
            raise DataError(f"the encoded cache {folder} could not be read back just after writing; check the disk")
        reused = False
    else:
        log.info("reused the cached tokenizer and encoded data in %s", folder)
        reused = tok_reused
    encoded, stats = cached
    sizes = [len(encoded[name][c.train_split]) for name, c in corpora.items()]
    mixture = Mixture.of(sizes, [c.weight for c in corpora.values()], cfg.temperature, cfg.epoch_pairs)
    return PreparedData(src_tok, tgt_tok, encoded, stats, mixture, folder, reused)
