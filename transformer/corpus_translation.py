"""translate input=FILE output=FOLDER: a whole corpus translated into a corpus folder that data.path or
data.corpora.NAME.path takes as it is ({split}.{src}.gz holding the input, {split}.{tgt}.gz its translations), for
back-translation and distillation. The input is translated in chunks of chunk_lines lines, each written whole under
a temporary name and then renamed, so a killed run resumes at its first missing chunk and a half-written line never
lands; the folder's files appear only once every chunk is done."""

import gzip
import itertools
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from .translators import SearchConfig, Translator


def read_lines(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace", newline="\n") as f:
        for line in f:
            yield line.removesuffix("\n").removesuffix("\r")


def write_atomically(path: Path, text: str) -> None:
    """The file appears whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(partial, "wt", encoding="utf-8") as f:
        f.write(text)
    partial.replace(path)


def translate_corpus(translator: Translator, input_path: str, output: str, search: SearchConfig, precision: str,
                     nbest: int = 1, tag: str | None = None, split: str = "train", chunk_lines: int = 10_000,
                     about: dict | None = None) -> Path:  # fmt: skip
    """The corpus folder `output`, with nbest pairs per input line (an empty line: one empty pair), and
    {split}.scores.gz holding each pair's score (nan for greedy search and sampling, which are unscored). Sampling
    draws chunk i's translations with seed + i, so a resumed run writes what an unbroken one does. `about`: what
    else translation.json records (the command's settings)."""
    folder, src, tgt = Path(output), translator.data["src"], translator.data["tgt"]
    files = {name: folder / f"{split}.{name}.gz" for name in (src, tgt, "scores")}
    if files[tgt].exists():
        print(f"{files[tgt]} exists: nothing to translate", file=sys.stderr)
        return folder
    parts = folder / f".{split}.parts"
    settings = {"input": str(Path(input_path).resolve()), "input_bytes": Path(input_path).stat().st_size,
                "search": asdict(search), "nbest": nbest, "tag": tag, "precision": precision,
                "chunk_lines": chunk_lines, **(about or {})}  # fmt: skip
    check_parts(parts, settings)
    total = sum(1 for _ in read_lines(input_path))
    start = time.monotonic()
    lines = read_lines(input_path)
    with tqdm(total=total, unit=" lines", file=sys.stderr, desc=f"translating {Path(input_path).name}") as bar:
        for index in range(math.ceil(total / chunk_lines)):
            chunk = list(itertools.islice(lines, chunk_lines))
            part = parts / f"{index:06d}.jsonl"
            if not part.exists():
                chunk_search = replace(search, seed=search.seed + index)
                found = translator.translate_nbest(chunk, chunk_search, nbest, precision, tag=tag)
                # a translation on one line, as translate writes it (input lines hold no \n: only \n ends a line)
                pairs = [[line, " ".join(text.splitlines()), score] for line, hyps in zip(chunk, found)
                         for score, text in hyps]  # fmt: skip
                write_atomically(part, "".join(json.dumps(pair) + "\n" for pair in pairs))
            bar.update(len(chunk))
    assemble(parts, files, src, tgt)
    record = {**settings, "lines": total, "pairs": sum(1 for _ in read_lines(str(files[src]))),
              "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    (folder / f"{split}.translation.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(parts)
    return folder


def check_parts(parts: Path, settings: dict) -> None:
    """Chunks already written count only if they were written from the same input with the same settings."""
    manifest = parts / "settings.json"
    if manifest.exists():
        if json.loads(manifest.read_text()) != settings:
            raise ValueError(f"{parts} holds chunks of another input or other settings; delete it to start again, "
                             "or give another output=")  # fmt: skip
        return
    parts.mkdir(parents=True, exist_ok=True)
    write_atomically(manifest, json.dumps(settings, indent=2) + "\n")


def assemble(parts: Path, files: dict[str, Path], src: str, tgt: str) -> None:
    """The chunks in order into the folder's files, streamed, each file whole or not at all; the target side last,
    whose presence says the corpus is done."""
    partial = {name: path.with_name(path.name + ".partial") for name, path in files.items()}
    outs = {name: gzip.open(path, "wt", encoding="utf-8") for name, path in partial.items()}
    try:
        for chunk in sorted(parts.glob("*.jsonl")):
            with open(chunk, encoding="utf-8") as rows:
                for row in rows:
                    source, translation, score = json.loads(row)
                    outs[src].write(source + "\n")
                    outs[tgt].write(translation + "\n")
                    outs["scores"].write(f"{score}\n")
    finally:
        for out in outs.values():
            out.close()
    for name in (src, "scores", tgt):
        partial[name].replace(files[name])
