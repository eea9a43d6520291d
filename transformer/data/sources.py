"""Load a parallel corpus as a datasets.DatasetDict of (src, tgt) strings, from local files or the hub.

Memory stays bounded at any corpus size: text files are streamed into an Arrow file in the cache and read back
memory-mapped; tables and hub datasets are memory-mapped by datasets itself.
"""

import gzip
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import datasets
import pyarrow as pa

EXTENSIONS = {"json": (".jsonl", ".json"), "parquet": (".parquet",), "csv": (".csv",)}
LARGE = 500_000  # rows: a map over fewer takes seconds, worth neither worker processes nor a progress bar
BLOCK_LINES = 10_000  # lines per side held in Python while a text file is copied to Arrow (a few MB)
READ_BYTES = 1 << 18  # bytes of text decoded at a time
HASH_BYTES = 1 << 20  # bytes hashed at a time
TEXT_FEATURES = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})


class DataError(ValueError):
    """Bad data or data config: the message names the problem and the fix."""


class Corpus(Protocol):
    """Where a corpus is and how to read it: DataConfig, and each of its corpora, has these."""

    path: str
    format: str  # text, json, parquet, csv or hub
    hub_config: str | None
    src_column: str | None
    tgt_column: str | None
    train_split: str


@contextmanager
def progress_bars_if_large(rows: int):
    """datasets' progress bars (Map, Saving the dataset) only over more than LARGE rows: for a 1,000-line split
    they are noise. HF_DATASETS_DISABLE_PROGRESS_BARS, when set, decides instead."""
    hide = rows <= LARGE and datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is None
    hide = hide and not datasets.are_progress_bars_disabled()
    if hide:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            datasets.enable_progress_bars()


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_lines(path: Path) -> list[str]:
    """The lines of a plain or gzipped UTF-8 file, all in memory (for small files; corpora are streamed by
    stream_lines, which gives the same lines). Only '\\n' ends a line (str.splitlines would also split on \\x1c,
    \\u2028 and others, which can misalign the two sides of a corpus). One '\\r' before it is dropped. Bytes that
    are not UTF-8 become U+FFFD, in their own line only (prepare counts them)."""
    with _open(path) as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.decode("utf-8", errors="replace").removesuffix("\r") for line in lines]


def _decode_lines(block: bytes) -> list[str]:
    """The lines of a block of whole lines (ending with b"\\n"). Decoding the block at once equals decoding its
    lines one by one: b"\\n" is never inside a UTF-8 sequence, so an undecodable byte becomes U+FFFD within its own
    line. "\\r\\n" occurs only at a line's end."""
    return block.decode("utf-8", errors="replace").replace("\r\n", "\n")[:-1].split("\n")


def stream_lines(path: Path) -> Iterator[list[str]]:
    """The lines of read_lines(path), a few thousand at a time, reading READ_BYTES at a time."""
    rest = b""
    with _open(path) as f:
        while chunk := f.read(READ_BYTES):
            block = rest + chunk
            end = block.rfind(b"\n") + 1
            block, rest = block[:end], block[end:]
            if block:
                yield _decode_lines(block)
    if rest:
        yield [rest.decode("utf-8", errors="replace").removesuffix("\r")]


class _Lines:
    """Lines of a file taken n at a time, whatever the size of the blocks stream_lines reads."""

    def __init__(self, path: Path):
        self.blocks, self.lines = stream_lines(path), []

    def take(self, n: int) -> list[str]:
        while len(self.lines) < n and (block := next(self.blocks, None)) is not None:
            self.lines += block
        taken, self.lines = self.lines[:n], self.lines[n:]  # keeps no line it has given out
        return taken

    def count_rest(self) -> int:
        return len(self.lines) + sum(map(len, self.blocks))


def _write_text_split(src_file: Path, tgt_file: Path, path: Path) -> None:
    """Line i of both files as row i of an Arrow stream file (what datasets memory-maps), written atomically:
    a file that is there is complete. Lines are counted on the way; files that do not align leave nothing."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    src, tgt = _Lines(src_file), _Lines(tgt_file)
    rows = 0
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, TEXT_FEATURES.arrow_schema) as writer:
            while True:  # each block becomes Arrow at once: Python holds one block of lines at a time
                src_block, tgt_block = (
                    pa.array(src.take(BLOCK_LINES), pa.string()),
                    pa.array(tgt.take(BLOCK_LINES), pa.string()),
                )
                if len(src_block) != len(tgt_block):
                    src_n, tgt_n = rows + len(src_block) + src.count_rest(), rows + len(tgt_block) + tgt.count_rest()
                    raise DataError(
                        f"{src_file} has {src_n} lines but {tgt_file} has {tgt_n}; "
                        "the two sides must align line by line"
                    )
                if not len(src_block):
                    break
                writer.write_batch(pa.record_batch([src_block, tgt_block], schema=TEXT_FEATURES.arrow_schema))
                rows += len(src_block)
        tmp.rename(path)  # atomic; another process writing the same content may win: either copy is the same
    finally:
        tmp.unlink(missing_ok=True)


def _text_file(folder: Path, split: str, lang: str) -> Path | None:
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _languages(folder: Path, split: str) -> list[str]:
    return sorted({p.name.removesuffix(".gz").split(".")[-1] for p in folder.glob(f"{split}.*")})


def _text_files(corpus: Corpus, src: str, tgt: str, folder: Path, need_train: bool) -> dict[str, tuple[Path, Path]]:
    """(src file, tgt file) per split; a split with no tgt file is skipped, unless it is the training split."""
    splits = sorted({p.name.split(".")[0] for p in folder.iterdir() if _text_file(folder, p.name.split(".")[0], src)})
    if need_train and corpus.train_split not in splits:
        found = _languages(folder, corpus.train_split)
        raise DataError(
            f"no {corpus.train_split}.{src}[.gz] in {folder}: language {src!r} is not in the corpus "
            f"(found {', '.join(found) or 'no files'}); set data.src to one of those or fetch the data"
        )
    files = {}
    for split in splits:
        src_file, tgt_file = _text_file(folder, split, src), _text_file(folder, split, tgt)
        if tgt_file is None:
            if need_train and split == corpus.train_split:
                raise DataError(
                    f"no {split}.{tgt}[.gz] in {folder}: language {tgt!r} is not in the corpus "
                    f"(found {', '.join(_languages(folder, split))}); set data.tgt to one of those"
                )
            continue
        files[split] = (src_file, tgt_file)
    return files


def _text_corpus(files: dict[str, tuple[Path, Path]], folder: Path) -> dict[str, datasets.Dataset]:
    """Each split memory-mapped from {folder}/{split}.arrow, written first if it is not there yet."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = {}
    for split, (src_file, tgt_file) in files.items():
        path = folder / f"{split}.arrow"
        if not path.exists():
            _write_text_split(src_file, tgt_file, path)
        corpus[split] = datasets.Dataset.from_file(str(path))
    return corpus


def _pairs(ds: datasets.Dataset, corpus: Corpus, src: str, tgt: str, where: str) -> datasets.Dataset:
    """Rows of a table as (src, tgt): a translation column keyed by language, or two text columns."""
    cols = ds.column_names
    if corpus.src_column is None and "translation" in cols:

        def split_translation(batch):
            rows = batch["translation"]
            try:
                return {"src": [r[src] for r in rows], "tgt": [r[tgt] for r in rows]}
            except KeyError as e:
                raise DataError(
                    f"{where}: language {e.args[0]!r} is not in its translation column (found {', '.join(rows[0])}); set data.src/data.tgt"
                ) from None

        with progress_bars_if_large(len(ds)):
            return ds.map(split_translation, batched=True, remove_columns=cols)
    src_col, tgt_col = corpus.src_column or src, corpus.tgt_column or tgt
    missing = [c for c in (src_col, tgt_col) if c not in cols]
    if missing:
        raise DataError(
            f"{where} has columns {cols}: no 'translation' column and no {missing}; "
            "set data.src_column and data.tgt_column"
        )
    ds = ds.select_columns([src_col, tgt_col])
    return ds.rename_columns({src_col: "src", tgt_col: "tgt"}) if (src_col, tgt_col) != ("src", "tgt") else ds


def _table_corpus(corpus: Corpus, src: str, tgt: str, cache_dir: str, folder: Path, need_train: bool):
    """Each split as (src, tgt), and the files read: {split}.jsonl, .parquet or .csv, as datasets loads them."""
    fmt = corpus.format
    files = {p.name.split(".")[0]: p for ext in EXTENSIONS[fmt] for p in sorted(folder.glob(f"*{ext}"))}
    if need_train and corpus.train_split not in files:
        raise DataError(
            f"no {corpus.train_split}{EXTENSIONS[fmt][0]} in {folder}; name the files {{split}}{EXTENSIONS[fmt][0]}"
        )
    splits = {}
    for split, path in files.items():
        ds = datasets.load_dataset(
            fmt, data_files={split: str(path)}, split=split, cache_dir=str(Path(cache_dir) / "hf")
        )
        splits[split] = _pairs(ds, corpus, src, tgt, str(path))
    return splits, list(files.values())


def _hub_corpus(corpus: Corpus, src: str, tgt: str, cache_dir: str) -> dict[str, datasets.Dataset]:
    loaded = datasets.load_dataset(corpus.path, corpus.hub_config, cache_dir=str(Path(cache_dir) / "hf"))
    return {split: _pairs(ds, corpus, src, tgt, f"{corpus.path}[{split}]") for split, ds in loaded.items()}


def file_sha256(path: Path) -> "hashlib._Hash":
    """The sha256 of a file's bytes, read HASH_BYTES at a time."""
    content = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_BYTES):
            content.update(chunk)
    return content


def _hash_file(digest, path: Path) -> None:
    """The file's name and the sha256 of its bytes."""
    digest.update(path.name.encode())
    digest.update(file_sha256(path).digest())


def load_corpus(
    corpus: Corpus,
    src: str | None = None,
    tgt: str | None = None,
    cache_dir: str | None = None,
    need_train: bool = True,
) -> tuple[datasets.DatasetDict, str]:
    """Every split of the corpus as columns src, tgt (memory-mapped); and a fingerprint of its content for caching.
    src, tgt and cache_dir default to the corpus's own (a DataConfig has them). need_train=False: a corpus without
    its training split will do (evaluating reads one test set)."""
    src = corpus.src if src is None else src
    tgt = corpus.tgt if tgt is None else tgt
    cache_dir = corpus.cache_dir if cache_dir is None else cache_dir
    digest = hashlib.sha256(f"{corpus.format}|{src}|{tgt}|{corpus.src_column}|{corpus.tgt_column}".encode())
    if corpus.format == "hub":
        splits = _hub_corpus(corpus, src, tgt, cache_dir)
        for split in sorted(splits):
            digest.update(f"{split}:{splits[split]._fingerprint}".encode())
    else:
        folder = Path(corpus.path)
        if not folder.is_dir():
            raise DataError(f"data folder {folder} does not exist; fetch the corpus there or set data.path")
        if corpus.format == "text":
            files = _text_files(corpus, src, tgt, folder, need_train)
            for pair in files.values():
                for path in pair:
                    _hash_file(digest, path)
            splits = _text_corpus(files, Path(cache_dir) / "text" / digest.hexdigest()[:16])
        else:
            splits, paths = _table_corpus(corpus, src, tgt, cache_dir, folder, need_train)
            for path in paths:
                _hash_file(digest, path)
    if need_train and corpus.train_split not in splits:
        raise DataError(
            f"split {corpus.train_split!r} not found in {corpus.path} (found {', '.join(splits)}); set data.train_split"
        )
    return datasets.DatasetDict({split: _as_text(ds) for split, ds in splits.items()}), digest.hexdigest()[:16]


def _as_text(ds: datasets.Dataset) -> datasets.Dataset:
    """Tables may hold empty (null) or non-text cells: they become "" and str(value), so that cleaning sees
    text (an empty pair is then dropped from training and counted). Arrow's types and null counts tell whether
    any cell needs it, without reading the text."""
    columns = [ds.data.column(side) for side in ("src", "tgt")]
    if all(pa.types.is_string(c.type) or pa.types.is_large_string(c.type) for c in columns) and not any(
        c.null_count for c in columns
    ):
        return ds
    with progress_bars_if_large(len(ds)):
        return ds.map(lambda b: {side: ["" if x is None else str(x) for x in b[side]] for side in ("src", "tgt")},
                      batched=True)  # fmt: skip
