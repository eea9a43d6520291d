"""translate input=FILE output=FOLDER: a whole corpus translated into a corpus folder that data.path or
data.corpora.NAME.path takes as it is ({split}.{src}.gz holding the input, {split}.{tgt}.gz its translations), for
back-translation and distillation. The input is translated in chunks of chunk_lines lines, each written whole under
a temporary name and then renamed, so a killed run resumes at its first missing chunk and a half-written line never
lands; the folder's files appear only once every chunk is done."""

import gzip
import itertools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from ..data.sources import stream_lines
from .interface import Decoding, Translator


def write_atomically(path: Path, text: str) -> None:
    """The file appears whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(partial, "wt", encoding="utf-8") as f:
        f.write(text)
    synced(partial).replace(path)


def synced(path: Path) -> Path:
    """The file's bytes on disk before a rename puts it in place: after a crash, the whole file, never an empty one
    under its final name (which a resumed run would take as done)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


@dataclass(frozen=True)
class CorpusOutput:
    """Where translate output= writes and how: the corpus folder, its split's name, the lines per chunk (a killed run
    resumes at its first missing chunk), and the score below which pairs are left out (None: none are)."""

    folder: str
    split: str = "train"
    chunk_lines: int = 10_000
    min_score: float | None = None


def translate_corpus(translator: Translator, input_path: str, output: CorpusOutput, decoding: Decoding, precision: str,
                     about: dict | None = None) -> Path:  # fmt: skip
    """The corpus folder output.folder, with decoding.nbest pairs per input line (an empty line: one empty pair),
    and {split}.scores.gz holding each pair's score (nan for greedy search and sampling, which are unscored).
    Sampling draws chunk i's translations with seed + i, so a resumed run writes what an unbroken one does.
    output.min_score: pairs scored below it are left out (with length_penalty=1, a score is the log-probability per
    token), and counted in {split}.translation.json. `about`: what else that file records (the command's settings)."""
    search, nbest, tag = decoding.search, decoding.nbest, decoding.tag
    split, chunk_lines, min_score = output.split, output.chunk_lines, output.min_score
    folder, src, tgt = Path(output.folder), translator.data["src"], translator.data["tgt"]
    if min_score is not None and (search.beam_size == 1 or search.sampling_topk):
        raise ValueError(f"min_score={min_score} filters by beam search's scores; greedy search and sampling score "
                         "nothing: set beam_size to 2 or more, or drop min_score")  # fmt: skip
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines={chunk_lines} must be at least 1")
    files = {name: folder / f"{split}.{name}.gz" for name in (src, tgt, "scores")}
    parts, card = folder / f".{split}.parts", folder / f"{split}.translation.json"
    source = Path(input_path)
    settings = {"input": str(source.resolve()), "input_bytes": source.stat().st_size,
                "input_mtime": source.stat().st_mtime, "search": asdict(search), "nbest": nbest, "tag": tag,
                "precision": precision, "chunk_lines": chunk_lines, "min_score": min_score, **(about or {})}  # fmt: skip
    if files[tgt].exists():  # done: the same settings, or one line
        check_settings(card, settings, "holds a corpus translated")
        shutil.rmtree(parts, ignore_errors=True)  # left if a run was stopped just after the last rename
        print(f"{files[tgt]} exists: nothing to translate", file=sys.stderr)
        return folder
    check_settings(parts / "settings.json", settings, "holds chunks translated")
    parts.mkdir(parents=True, exist_ok=True)
    write_atomically(parts / "settings.json", json.dumps(settings, indent=2) + "\n")
    total = sum(map(len, stream_lines(source)))  # read as corpora are: only \n ends a line
    chunks = math.ceil(total / chunk_lines)
    done = sum(min(chunk_lines, total - i * chunk_lines) for i in range(chunks) if part_of(parts, i).exists())
    start = time.monotonic()
    lines = itertools.chain.from_iterable(stream_lines(source))
    with tqdm(total=total, initial=done, unit=" lines", file=sys.stderr, desc=f"translating {source.name}") as bar:
        for index in range(chunks):
            chunk = list(itertools.islice(lines, chunk_lines))
            if part_of(parts, index).exists():
                continue
            chunk_search = replace(search, seed=search.seed + index)
            found = translator.translate_nbest(chunk, chunk_search, nbest, precision, tag=tag)
            # a translation on one line, as translate writes it (input lines hold no \n: only \n ends a line)
            pairs = [[line, " ".join(text.splitlines()), score] for line, hyps in zip(chunk, found)
                     for score, text in hyps]  # fmt: skip
            write_atomically(part_of(parts, index), "".join(json.dumps(pair) + "\n" for pair in pairs))
            bar.update(len(chunk))
    written, kept, dropped = assemble(parts, files, min_score)
    if dropped:
        print(f"{dropped} of {kept + dropped} pairs scored below min_score={min_score}: left out", file=sys.stderr)
    record = {**settings, "lines": total, "pairs": kept, "dropped_below_min_score": dropped,
              "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    write_atomically(card, json.dumps(record, indent=2) + "\n")
    for name in (src, "scores", tgt):  # the target side last: its presence says the corpus is done
        synced(written[name]).replace(files[name])
    shutil.rmtree(parts)
    return folder


def part_of(parts: Path, index: int) -> Path:
    return parts / f"{index:06d}.jsonl"


def check_settings(path: Path, settings: dict, what: str) -> None:
    """What a folder holds counts only if it was translated from the same input with the same settings, batch
    sizes aside (search.max_tokens: a GPU resumes what a CPU began)."""

    def compared(found: dict) -> dict:
        return {**found, "search": {k: v for k, v in found.get("search", {}).items() if k != "max_tokens"}}

    if not path.exists():
        return
    saved = {k: v for k, v in json.loads(path.read_text()).items() if k in settings}
    if compared(saved) != compared(settings):
        raise ValueError(f"{path.parent} {what} from another input or with other settings; delete it to start "
                         "again, or give another output=")  # fmt: skip


def assemble(parts: Path, files: dict[str, Path], min_score: float | None) -> tuple[dict[str, Path], int, int]:
    """The chunks in order into a partial file per name of `files`, streamed: the partial files, the pairs kept
    and those left out, scored below min_score (a pair whose source is empty has no score to judge)."""
    partial = {name: path.with_name(path.name + ".partial") for name, path in files.items()}
    outs = {name: gzip.open(path, "wt", encoding="utf-8") for name, path in partial.items()}
    src, tgt, _ = files
    kept = dropped = 0
    try:
        for chunk in sorted(parts.glob("*.jsonl")):
            with open(chunk, encoding="utf-8") as rows:
                for row in rows:
                    source, translation, score = json.loads(row)
                    if min_score is not None and source.strip() and not score >= min_score:
                        dropped += 1
                        continue
                    kept += 1
                    outs[src].write(source + "\n")
                    outs[tgt].write(translation + "\n")
                    outs["scores"].write(f"{score}\n")
    finally:
        for out in outs.values():
            out.close()
    return partial, kept, dropped
