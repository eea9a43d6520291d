"""Load a parallel corpus as a datasets.DatasetDict of (src, tgt) strings, from local files or the hub."""

import gzip
import hashlib
from contextlib import contextmanager
from pathlib import Path

import datasets

from .config import DataConfig

EXTENSIONS = {"json": (".jsonl", ".json"), "parquet": (".parquet",), "csv": (".csv",)}
LARGE = 500_000  # rows: a map over fewer takes seconds, worth neither worker processes nor a progress bar


class DataError(ValueError):
    """Bad data or data config: the message names the problem and the fix."""


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


def read_lines(path: Path) -> list[str]:
    """The lines of a plain or gzipped UTF-8 file. Only '\\n' ends a line (str.splitlines would also
    split on \\x1c, \\u2028 and others, which can misalign the two sides of a corpus). Bytes that are not
    UTF-8 become U+FFFD, in their own line only (prepare counts them)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.decode("utf-8", errors="replace").removesuffix("\r") for line in lines]


def _text_file(folder: Path, split: str, lang: str) -> Path | None:
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _languages(folder: Path, split: str) -> list[str]:
    return sorted({p.name.removesuffix(".gz").split(".")[-1] for p in folder.glob(f"{split}.*")})


def _text_corpus(cfg: DataConfig, folder: Path) -> tuple[dict[str, datasets.Dataset], list[Path]]:
    splits = sorted(
        {p.name.split(".")[0] for p in folder.iterdir() if _text_file(folder, p.name.split(".")[0], cfg.src)}
    )
    if cfg.train_split not in splits:
        found = _languages(folder, cfg.train_split)
        raise DataError(
            f"no {cfg.train_split}.{cfg.src}[.gz] in {folder}: language {cfg.src!r} is not in the corpus "
            f"(found {', '.join(found) or 'no files'}); set data.src to one of those or fetch the data"
        )
    corpus, files = {}, []
    for split in splits:
        src_file, tgt_file = _text_file(folder, split, cfg.src), _text_file(folder, split, cfg.tgt)
        if tgt_file is None:
            if split == cfg.train_split:
                raise DataError(
                    f"no {split}.{cfg.tgt}[.gz] in {folder}: language {cfg.tgt!r} is not in the corpus "
                    f"(found {', '.join(_languages(folder, split))}); set data.tgt to one of those"
                )
            continue
        src, tgt = read_lines(src_file), read_lines(tgt_file)
        if len(src) != len(tgt):
            raise DataError(
                f"{src_file} has {len(src)} lines but {tgt_file} has {len(tgt)}; the two sides must align line by line"
            )
        corpus[split] = datasets.Dataset.from_dict({"src": src, "tgt": tgt})
        files += [src_file, tgt_file]
    return corpus, files


def _pairs(ds: datasets.Dataset, cfg: DataConfig, where: str) -> datasets.Dataset:
    """Rows of a table as (src, tgt): a translation column keyed by language, or two text columns."""
    cols = ds.column_names
    if cfg.src_column is None and "translation" in cols:

        def split_translation(batch):
            rows = batch["translation"]
            try:
                return {"src": [r[cfg.src] for r in rows], "tgt": [r[cfg.tgt] for r in rows]}
            except KeyError as e:
                raise DataError(
                    f"{where}: language {e.args[0]!r} is not in its translation column (found {', '.join(rows[0])}); set data.src/data.tgt"
                ) from None

        with progress_bars_if_large(len(ds)):
            return ds.map(split_translation, batched=True, remove_columns=cols)
    src_col, tgt_col = cfg.src_column or cfg.src, cfg.tgt_column or cfg.tgt
    missing = [c for c in (src_col, tgt_col) if c not in cols]
    if missing:
        raise DataError(
            f"{where} has columns {cols}: no 'translation' column and no {missing}; "
            "set data.src_column and data.tgt_column"
        )
    ds = ds.select_columns([src_col, tgt_col])
    return ds.rename_columns({src_col: "src", tgt_col: "tgt"}) if (src_col, tgt_col) != ("src", "tgt") else ds


def _table_corpus(cfg: DataConfig, folder: Path) -> tuple[dict[str, datasets.Dataset], list[Path]]:
    files = {p.name.split(".")[0]: p for ext in EXTENSIONS[cfg.format] for p in sorted(folder.glob(f"*{ext}"))}
    if cfg.train_split not in files:
        raise DataError(
            f"no {cfg.train_split}{EXTENSIONS[cfg.format][0]} in {folder}; name the files {{split}}{EXTENSIONS[cfg.format][0]}"
        )
    corpus = {}
    for split, path in files.items():
        ds = datasets.load_dataset(
            cfg.format, data_files={split: str(path)}, split=split, cache_dir=str(Path(cfg.cache_dir) / "hf")
        )
        corpus[split] = _pairs(ds, cfg, str(path))
    return corpus, list(files.values())


def _hub_corpus(cfg: DataConfig) -> dict[str, datasets.Dataset]:
    loaded = datasets.load_dataset(cfg.path, cfg.hub_config, cache_dir=str(Path(cfg.cache_dir) / "hf"))
    return {split: _pairs(ds, cfg, f"{cfg.path}[{split}]") for split, ds in loaded.items()}


def load_corpus(cfg: DataConfig) -> tuple[datasets.DatasetDict, str]:
    """Every split of the corpus as columns src, tgt; and a fingerprint of its content for caching."""
    digest = hashlib.sha256(f"{cfg.format}|{cfg.src}|{cfg.tgt}|{cfg.src_column}|{cfg.tgt_column}".encode())
    if cfg.format == "hub":
        corpus = _hub_corpus(cfg)
        for split in sorted(corpus):
            digest.update(f"{split}:{corpus[split]._fingerprint}".encode())
    else:
        folder = Path(cfg.path)
        if not folder.is_dir():
            raise DataError(f"data folder {folder} does not exist; fetch the corpus there or set data.path")
        corpus, files = (_text_corpus if cfg.format == "text" else _table_corpus)(cfg, folder)
        for path in files:
            digest.update(path.name.encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    if cfg.train_split not in corpus:
        raise DataError(
            f"split {cfg.train_split!r} not found in {cfg.path} (found {', '.join(corpus)}); set data.train_split"
        )
    return datasets.DatasetDict({split: _as_text(ds) for split, ds in corpus.items()}), digest.hexdigest()[:16]


def _as_text(ds: datasets.Dataset) -> datasets.Dataset:
    """Tables may hold empty (null) or non-text cells: they become "" and str(value), so that cleaning sees
    text (an empty pair is then dropped from training and counted)."""
    if all(isinstance(x, str) for side in ("src", "tgt") for x in ds[side]):
        return ds
    with progress_bars_if_large(len(ds)):
        return ds.map(lambda b: {side: ["" if x is None else str(x) for x in b[side]] for side in ("src", "tgt")},
                      batched=True)  # fmt: skip
