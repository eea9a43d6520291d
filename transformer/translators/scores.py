"""A translator scored on a split of its corpora or on a pair of text files: its translations and their BLEU, chrF++
and TER, and their paired significance against a baseline's. What `python -m transformer.evaluate` does, for
scripts too."""

from dataclasses import asdict
from pathlib import Path

from sacrebleu.metrics import BLEU

from ..data import DataConfig, DataError, load_corpus
from ..data.sources import read_lines as read_corpus_lines
from ..evaluation.significance import metrics, paired_tests
from .interface import SearchConfig, Translator


def evaluate(translator: Translator, data: DataConfig, split: str, search: SearchConfig, precision: str) -> dict:
    """Translations of the split (input order; a split of the main corpus, or corpus/split of any), its references,
    and BLEU, chrF++ and TER against them. A tagged corpus's sources get its tag, as in training. The corpus needs
    no training split: a folder holding the split alone will do."""
    corpora = data.all_corpora()
    name, part = data.locate(split)
    if name not in corpora:
        raise DataError(f"split={split!r}: no corpus {name!r}; the checkpoint's corpora are {', '.join(corpora)}")
    corpus = corpora[name]
    loaded, _ = load_corpus(corpus, data.src, data.tgt, data.cache_dir, need_train=False)
    if part not in loaded:
        found = ", ".join(loaded) or f"no split with both {data.src} and {data.tgt} files"
        raise DataError(f"unknown split {split!r}; {corpus.path} has {found}")
    sources, references = list(loaded[part]["src"]), list(loaded[part]["tgt"])
    if not sources:
        raise DataError(f"split {split!r} of {corpus.path} is empty; choose another with split=")
    return {"split": split, **score(translator, sources, references, search, precision, corpus.tag)}


def read_pair(sources: str, references: str) -> tuple[list[str], list[str]]:
    """input= and references=, as sacreBLEU takes them: line i of one is the reference of line i of the other (plain
    or gzipped UTF-8 text, read as a corpus's files are)."""
    for key, path in (("input", sources), ("references", references)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{key}={path} is not a file; give a text file with one sentence per line")
    pair = read_corpus_lines(Path(sources)), read_corpus_lines(Path(references))
    if len(pair[0]) != len(pair[1]):
        raise ValueError(f"input={sources} has {len(pair[0])} lines where references={references} has "
                         f"{len(pair[1])}; give one reference per input line")  # fmt: skip
    if not pair[0]:
        raise ValueError(f"input={sources} is empty; give a text file with one sentence per line")
    return pair


def score(translator: Translator, sources: list[str], references: list[str], search: SearchConfig, precision: str,
          tag: str | None = None) -> dict:  # fmt: skip
    """Translations of the sources (in order), and their BLEU, chrF++ and TER against the references."""
    # Batched by both sides' lengths, as validation batches pairs: with search.max_tokens = data.max_tokens,
    # a validation split decodes exactly as in training.
    target_lengths = [len(t) + 1 for t in translator.tgt_tokenizer.encode(references)]  # BOS + target
    hypotheses = translator.translate(sources, search, precision, target_lengths, tag=tag)
    # BLEU as reported (cased, 13a) and lowercased: papers on Multi30k mostly quote tokenized lowercase BLEU,
    # which runs higher; the two are kept apart by their sacreBLEU signatures. chrF is chrF++ (word bigrams too).
    used = {**metrics(), "bleu_lowercase": BLEU(lowercase=True)}
    scores = {name: metric.corpus_score(hypotheses, [references]) for name, metric in used.items()}
    lines = {
        f"{name}_line": scores[name].format(signature=str(metric.get_signature())) for name, metric in used.items()
    }
    return {
        "sentences": len(sources), **{name: s.score for name, s in scores.items()}, **lines,
        "search": asdict(search), "precision": precision, "hypotheses": hypotheses, "references": references,
    }  # fmt: skip


def compare(result: dict, baseline_path: str, baseline: list[str]) -> dict:
    """Paired significance of this evaluation's hypotheses against a baseline's (read from baseline_path), one line
    per sentence of the split."""
    if len(baseline) != result["sentences"]:
        scored = f"split {result['split']}" if "split" in result else f"input={result['input']}"
        raise ValueError(f"compare={baseline_path} has {len(baseline)} lines where {scored} has "
                         f"{result['sentences']} sentences; give the baseline's hypotheses of those")  # fmt: skip
    return {"baseline": baseline_path, **paired_tests(result["hypotheses"], baseline, result["references"])}


def check_pair(sources: str | None, references: str | None, split: str | None) -> tuple[list[str], list[str]]:
    """input= and references= read (see read_pair), after checking they come together and without split=."""
    if sources is not None and split is not None:
        raise ValueError(f"split={split} and input={sources}: give one of them")
    if references is None:
        raise ValueError(f"input={sources} needs its references: add references=REF, one line per input line")
    if sources is None:
        raise ValueError(f"references={references} scores the translations of input=: add input=SOURCES")
    return read_pair(sources, references)
