"""Corpora of WMT14 en-de's size and shape, for the data benchmarks (tools/bench_data.py), made from the small
real corpora here because no WMT training set can be downloaded.

Text: each synthetic pair joins random real pairs (German sides joined by spaces, the same pairs' English sides
likewise) until the pair reaches a length drawn for it. The length proxy is whitespace-separated words per side
(runs of bytes other than ASCII whitespace), before any subword tokenization: WMT-like means a mean of about 27 a
side, a p95 near 60 and a tail to 250 words (once split into subwords, pairs past prepare's max_length of 250 tokens
are dropped, as real WMT pairs are). Encoded shards: random ids with lengths drawn the same way, in the layout
`datasets.Dataset.save_to_disk` writes for one split.

Both are deterministic in (pairs, seed) and written block by block: memory stays bounded whatever the size.
"""

import gzip
import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import numpy as np

SOURCES = Path("/work/shared/data")  # {corpus}/{split}.{de,en}.gz
POOL = ("multi30k", "tatoeba_deen", "wmt_news_deen")  # their train splits are the pieces
VAL = ("wmt_news_deen", "newstest2013", 1000)  # corpus, split, first lines: copied as the val split
TEST = ("multi30k", "test_2016_flickr", None)  # copied whole as the test split
MEDIAN_WORDS, SIGMA = 15.5, 0.75  # lognormal targets; joining overshoots them to a mean of ~27 words a side
MAX_WORDS = 250
BLOCK = 50_000  # pairs planned, joined and compressed at a time: the memory bound
FIRST_PIECE = 4  # encoded ids: 0-3 are pad, unk, bos, eos (transformer/data/tokenizer.py)
MANIFEST = "wmt_shaped.json"


def _lines(path: Path) -> list[bytes]:
    """A gzipped file's lines as bytes; only b'\\n' ends a line, as the project's reader has it."""
    lines = gzip.decompress(path.read_bytes()).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r") for line in lines]


class Pool:
    """The pieces: every real training pair of the source corpora, both sides stripped, with its word counts."""

    def __init__(self, sources: Path = SOURCES, corpora: tuple[str, ...] = POOL):
        self.de, self.en = [], []
        for corpus in corpora:
            if not (sources / corpus).is_dir():
                raise ValueError(f"no {sources / corpus}; set sources to the folder that holds {', '.join(corpora)}")
            de, en = _lines(sources / corpus / "train.de.gz"), _lines(sources / corpus / "train.en.gz")
            if len(de) != len(en):
                raise ValueError(f"{sources / corpus}: train.de.gz has {len(de)} lines, train.en.gz {len(en)}")
            for d, e in zip(de, en):
                d, e = d.strip(), e.strip()
                if d and e:  # an empty piece would add nothing but a stray space
                    self.de.append(d)
                    self.en.append(e)
        if not self.de:
            raise ValueError(f"no pairs in {', '.join(corpora)} under {sources}; set sources to their folder")
        self.de_words = [len(s.split()) for s in self.de]
        self.en_words = [len(s.split()) for s in self.en]


def plan(rng: np.random.Generator, n: int, pool: Pool, keep_pieces: bool = False) -> tuple[np.ndarray, list, list]:
    """n pairs' word counts (n, 2: de, en); with keep_pieces also the pool indices they join, pair after pair, and
    where each pair's pieces end in that list (both empty otherwise). Each pair draws a target from the lognormal
    and joins random pieces until its mean side length reaches it; a piece that would take a side past MAX_WORDS
    ends the pair instead (a pair keeps at least one)."""
    targets = (2 * np.clip(rng.lognormal(np.log(MEDIAN_WORDS), SIGMA, n), 1, MAX_WORDS)).tolist()  # de + en words
    draws, p = rng.integers(0, len(pool.de), 6 * n).tolist(), 0  # ~3.5 pieces a pair on average
    de_words, en_words = pool.de_words, pool.en_words
    lengths, pieces, ends = [], [], []
    for target in targets:
        de = en = 0
        while True:
            if p == len(draws):
                draws, p = rng.integers(0, len(pool.de), n).tolist(), 0
            i = draws[p]
            p += 1
            if de and (de + de_words[i] > MAX_WORDS or en + en_words[i] > MAX_WORDS):
                break
            de, en = de + de_words[i], en + en_words[i]
            if keep_pieces:
                pieces.append(i)
            if de + en >= target:
                break
        lengths.append((de, en))
        if keep_pieces:
            ends.append(len(pieces))
    return np.array(lengths, np.int32).reshape(n, 2), pieces, ends


class LengthHistogram:
    """Words (or tokens) per side over everything added: mean, p95 and max without keeping the lengths."""

    def __init__(self):
        self.counts = np.zeros((2, MAX_WORDS + 1), np.int64)

    def add(self, lengths: np.ndarray) -> None:
        """lengths: (n, 2), one column a side."""
        for side in range(2):
            counts = np.bincount(lengths[:, side], minlength=self.counts.shape[1])
            if len(counts) > self.counts.shape[1]:  # read back from files: a line may be longer
                self.counts = np.pad(self.counts, ((0, 0), (0, len(counts) - self.counts.shape[1])))
            self.counts[side, : len(counts)] += counts

    def stats(self) -> dict:
        n = int(self.counts[0].sum())
        out = {"pairs": n}
        for side, name in enumerate(("de", "en")):
            c = self.counts[side]
            out[name] = {
                "mean": float((c * np.arange(len(c))).sum() / max(n, 1)),
                "p95": int(np.searchsorted(np.cumsum(c), 0.95 * n)),  # nearest rank
                "max": int(np.flatnonzero(c).max(initial=0)),
            }
        return out


def format_length_stats(stats: dict, unit: str = "words") -> str:
    de, en = stats["de"], stats["en"]
    return (
        f"{stats['pairs']:,} pairs; {unit} a side (de / en): mean {de['mean']:.1f} / {en['mean']:.1f}, "
        f"p95 {de['p95']} / {en['p95']}, max {de['max']} / {en['max']}"
    )


def _joined(side: list[bytes], pieces: list[int], ends: np.ndarray) -> bytes:
    """The lines of consecutive pairs: pieces joined by spaces, a newline after each pair's last piece."""
    seps = np.full(len(pieces), b" ", dtype=object)
    seps[ends - 1] = b"\n"
    return b"".join(chain.from_iterable(zip(map(side.__getitem__, pieces), seps)))


def _copy_split(src: Path, dst: Path, lines: int | None) -> None:
    data = _lines(src)[:lines]
    dst.write_bytes(gzip.compress(b"".join(x + b"\n" for x in data), mtime=0))


def _write_eval_splits(folder: Path, sources: Path) -> None:
    for split, (corpus, name, lines) in (("val", VAL), ("test", TEST)):
        for lang in ("de", "en"):
            _copy_split(sources / corpus / f"{name}.{lang}.gz", folder / f"{split}.{lang}.gz", lines)


def write_wmt_shaped(folder: Path, pairs: int, seed: int = 0, shards: int | None = None,
                     sources: Path = SOURCES) -> dict:  # fmt: skip
    """A text corpus of `pairs` WMT-shaped training pairs, `train.{de,en}.gz`, with `val` (newstest2013's first
    1,000 lines) and `test` (Multi30k's test_2016_flickr) as they are. With shards=k, k complete corpus folders
    `part-0000i/` instead, each with its consecutive share of the same pairs (their concatenation is the unsharded
    corpus) and the same val and test. Written to FOLDER.tmp and renamed, with a manifest (wmt_shaped.json: pairs,
    seed, shards, length stats). Returns the length stats (words a side, see format_length_stats)."""
    folder = Path(folder)
    if folder.exists():
        raise ValueError(f"{folder} exists; remove it or choose another folder (a corpus is never overwritten)")
    if pairs <= 0 or (shards is not None and not 0 < shards <= pairs):
        raise ValueError(f"pairs={pairs}, shards={shards}: need pairs > 0 and 0 < shards <= pairs")
    pool, histogram = Pool(sources), LengthHistogram()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a write cut short
    parts = [tmp] if shards is None else [tmp / f"part-{i:05d}" for i in range(shards)]
    bounds = np.linspace(0, pairs, len(parts) + 1).round().astype(np.int64)  # pairs [bounds[i], bounds[i+1]) in part i
    for part in parts:
        part.mkdir(parents=True)
        _write_eval_splits(part, sources)
    # mtime=0: the same pairs and seed give the same bytes, which is what prepare's cache key hashes
    files = [[gzip.GzipFile(part / f"train.{lang}.gz", "wb", compresslevel=1, mtime=0) for lang in ("de", "en")]
             for part in parts]  # fmt: skip
    with ThreadPoolExecutor(2) as compress:  # zlib lets go of the GIL: both sides compress while the next block plans
        pending = []
        for block, start in enumerate(range(0, pairs, BLOCK)):
            n = min(BLOCK, pairs - start)
            lengths, pieces, ends = plan(np.random.default_rng([seed, block]), n, pool, keep_pieces=True)  # own seed
            histogram.add(lengths)
            ends = np.asarray(ends)
            writes = []
            for i, part_files in enumerate(files):  # the block's pairs that fall in part i
                a, b = max(bounds[i], start) - start, min(bounds[i + 1], start + n) - start
                if a < b:
                    first = ends[a - 1] if a else 0
                    for f, side in zip(part_files, (pool.de, pool.en)):
                        writes.append((f, _joined(side, pieces[first : ends[b - 1]], ends[a:b] - first)))
            for future in pending:
                future.result()
            pending = [compress.submit(f.write, data) for f, data in writes]
        for future in pending:
            future.result()
    for f in chain.from_iterable(files):
        f.close()
    stats = histogram.stats()
    (tmp / MANIFEST).write_text(json.dumps({"pairs": pairs, "seed": seed, "shards": shards, "stats": stats}, indent=1))
    tmp.rename(folder)
    return stats


def read_manifest(folder: Path) -> dict | None:
    """What write_wmt_shaped recorded in folder (pairs, seed, shards, stats), or None for any other folder."""
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def length_stats(folder: Path) -> dict:
    """Words a side of the training pairs in folder's train.{de,en}.gz (or its part-*/ folders), read back
    line by line: the check that the written corpus has the planned shape."""
    parts = sorted(Path(folder).glob("part-*")) or [Path(folder)]
    histogram = LengthHistogram()
    for part in parts:
        with gzip.open(part / "train.de.gz", "rb") as de, gzip.open(part / "train.en.gz", "rb") as en:
            while True:
                block = [(len(d.split()), len(e.split())) for d, e in zip(_take(de, BLOCK), _take(en, BLOCK))]
                if not block:
                    break
                histogram.add(np.array(block, np.int64))
    return histogram.stats()


def _take(f, n: int) -> list[bytes]:
    return [line for _, line in zip(range(n), f)]


def write_encoded_shards(folder: Path, pairs: int, shard_pairs: int, seed: int = 0, vocab_size: int = 32000,
                         tokens_per_word: float = 1.0, sources: Path = SOURCES) -> dict:  # fmt: skip
    """One encoded split as `Dataset.save_to_disk` writes it (`datasets.load_from_disk(folder)` opens it): Arrow
    stream files `data-0000i-of-0000N.arrow` of `shard_pairs` rows each (record batches of 1,000 rows), columns
    src_ids and tgt_ids (list<int32>, ids uniform in [4, vocab_size), no special tokens), with state.json and
    dataset_info.json. Token counts per side are plan()'s word counts times tokens_per_word (prepare's report of the
    text corpus gives the ratio for a vocabulary: its mean tokens over the words' mean), at most MAX_WORDS tokens,
    prepare's default max_length. Shard by shard (each from its own seed), so memory holds one shard. Written to
    FOLDER.tmp and renamed; returns the length stats (tokens a side)."""
    import datasets
    import pyarrow as pa

    folder = Path(folder)
    if folder.exists():
        raise ValueError(f"{folder} exists; remove it or choose another folder (shards are never overwritten)")
    if pairs <= 0 or shard_pairs <= 0 or vocab_size <= FIRST_PIECE or tokens_per_word <= 0:
        raise ValueError(f"pairs={pairs}, shard_pairs={shard_pairs}, vocab_size={vocab_size}, tokens_per_word="
                         f"{tokens_per_word}: need positive pairs, shard_pairs and tokens_per_word and vocab_size > "
                         f"{FIRST_PIECE}")  # fmt: skip
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    features = datasets.Features({side: datasets.List(datasets.Value("int32")) for side in ("src_ids", "tgt_ids")})
    schema = features.arrow_schema  # with the "huggingface" metadata that load_from_disk reads the features from
    pool, histogram = Pool(sources), LengthHistogram()
    count = -(-pairs // shard_pairs)
    names = [f"data-{i:05d}-of-{count:05d}.arrow" for i in range(count)]
    for shard, name in enumerate(names):
        rng = np.random.default_rng([seed, shard])
        n = min(shard_pairs, pairs - shard * shard_pairs)
        words = np.concatenate([plan(rng, min(BLOCK, n - s), pool)[0] for s in range(0, n, BLOCK)])  # (n, 2)
        lengths = np.clip(np.rint(words * tokens_per_word), 1, MAX_WORDS).astype(np.int64)
        histogram.add(lengths)
        columns = []
        for side in range(2):
            offsets = np.concatenate([[0], np.cumsum(lengths[:, side], dtype=np.int64)])
            if offsets[-1] >= 2**31:
                raise ValueError(f"shard_pairs={shard_pairs} holds more than 2**31 tokens a side; lower it")
            ids = rng.integers(FIRST_PIECE, vocab_size, int(offsets[-1]), dtype=np.int32)
            columns.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids)))
        table = pa.Table.from_arrays(columns, schema=schema)
        with pa.OSFile(str(tmp / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table, max_chunksize=1000)
        del table, columns
    key = hashlib.sha256(f"{pairs}|{shard_pairs}|{seed}|{vocab_size}|{tokens_per_word}".encode()).hexdigest()[:16]
    state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": key, "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}  # fmt: skip
    info = {"citation": "", "description": "", "features": features.to_dict(), "homepage": "", "license": ""}
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (tmp / "dataset_info.json").write_text(json.dumps(info, indent=2))
    stats = histogram.stats()
    manifest = {"pairs": pairs, "shard_pairs": shard_pairs, "seed": seed, "vocab_size": vocab_size,
                "tokens_per_word": tokens_per_word, "stats": stats}  # fmt: skip
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    tmp.rename(folder)
    return stats
