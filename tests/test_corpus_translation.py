"""translate input=FILE output=FOLDER: a corpus translated in chunks into a corpus folder training reads, resumed
where a killed run stopped, sampling reproducible from its seed."""

import gzip
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from transformer import translate
from transformer.data.sources import read_lines
from transformer.translators import Decoding, SearchConfig, open_translator
from transformer.translators.corpus import CorpusOutput, translate_corpus

from .helpers import compose_command

SAMPLING = SearchConfig(beam_size=1, sampling_topk=5, temperature=1.5, seed=7)


@pytest.fixture(scope="module")
def corpus(trained, tmp_path_factory):
    """(translator, a 50-line input: the test sources with an empty line and the train sources' first, its lines,
    the checkpoint)."""
    tmp, _, ckpt = trained
    lines = (tmp / "c" / "test.de").read_text().splitlines()
    lines = [*lines[:20], "", *lines[20:], (tmp / "c" / "train.de").read_text().splitlines()[0]]
    path = tmp_path_factory.mktemp("corpus_input") / "input.de.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return open_translator(str(ckpt)), str(path), lines, ckpt


def read(folder, name: str) -> list[str]:
    with gzip.open(folder / name, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


class Killed(Exception):
    pass


def test_a_killed_translation_resumes_to_what_an_unbroken_one_writes(corpus, tmp_path, monkeypatch):
    translator, path, lines, ckpt = corpus
    whole = translate_corpus(
        translator, path, CorpusOutput(str(tmp_path / "whole"), chunk_lines=8), Decoding(SAMPLING), "32"
    )
    assert read(whole, "train.de.gz") == lines and len(read(whole, "train.en.gz")) == len(lines) == 50
    assert read(whole, "train.en.gz")[20] == "" and not (whole / ".train.parts").exists()

    calls, translate_nbest = [], translator.translate_nbest

    def killed_in_the_third_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Killed
        return translate_nbest(*args, **kwargs)

    monkeypatch.setattr(translator, "translate_nbest", killed_in_the_third_chunk)
    with pytest.raises(Killed):
        translate_corpus(
            translator, path, CorpusOutput(str(tmp_path / "resumed"), chunk_lines=8), Decoding(SAMPLING), "32"
        )
    parts = tmp_path / "resumed" / ".train.parts"
    assert sorted(p.name for p in parts.glob("*.jsonl")) == ["000000.jsonl", "000001.jsonl"]
    assert not (tmp_path / "resumed" / "train.en.gz").exists()  # nothing in place before every chunk is done
    (parts / "000002.jsonl.partial").write_text('["half a li')  # a kill while writing a chunk
    resumed_calls = []
    monkeypatch.setattr(
        translator, "translate_nbest", lambda *a, **k: resumed_calls.append(1) or translate_nbest(*a, **k)
    )
    resumed = translate_corpus(
        translator, path, CorpusOutput(str(tmp_path / "resumed"), chunk_lines=8), Decoding(SAMPLING), "32"
    )
    assert len(resumed_calls) == 5  # the 5 chunks of 7 not written: the first two are not translated again
    for name in ("train.de.gz", "train.en.gz", "train.scores.gz"):
        assert read(resumed, name) == read(whole, name), name
    record = json.loads((resumed / "train.translation.json").read_text())
    assert record["lines"] == record["pairs"] == 50 and record["search"]["sampling_topk"] == 5


def test_every_file_is_on_disk_before_a_rename_puts_it_in_place(corpus, tmp_path, monkeypatch):
    translator, path, _, _ = corpus
    events, fsync, replace = [], os.fsync, Path.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("synced", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd)
    )
    monkeypatch.setattr(Path, "replace", lambda self, to: events.append(("renamed", str(self))) or replace(self, to))
    translate_corpus(translator, path, CorpusOutput(str(tmp_path / "out"), chunk_lines=8), Decoding(SAMPLING), "32")
    renamed = [name for event, name in events if event == "renamed"]
    assert len(renamed) == 1 + 7 + 1 + 3  # settings, 7 chunks, the record, the corpus's 3 files
    for name in renamed:
        assert ("synced", name) in events[: events.index(("renamed", name))], name


def test_sampling_reproduces_from_its_seed_and_differs_from_search(corpus, tmp_path):
    translator, path, lines, ckpt = corpus
    sampled = translator.translate(lines, SAMPLING)
    assert translator.translate(lines, SAMPLING) == sampled
    other_seed = translator.translate(lines, SearchConfig(beam_size=1, sampling_topk=5, temperature=1.5, seed=8))
    greedy = translator.translate(lines, SearchConfig(beam_size=1))
    assert sum(a != b for a, b in zip(sampled, other_seed)) > 10 and sum(a != b for a, b in zip(sampled, greedy)) > 10
    cold = translator.translate(lines, SearchConfig(beam_size=1, sampling_topk=5, temperature=1e-4, seed=7))
    assert cold == greedy  # a temperature near 0 samples the most likely token
    with pytest.raises(ValueError, match=r"^sampling_topk=5 samples one translation: set beam_size=1"):
        SearchConfig(beam_size=4, sampling_topk=5)
    with pytest.raises(ValueError, match=r"^temperature=0.8 applies to sampling: add sampling_topk=-1"):
        SearchConfig(beam_size=1, temperature=0.8)


def test_the_command_writes_a_corpus_folder_training_reads_with_the_nbest_and_scores(corpus, tmp_path, capsys):
    translator, path, lines, ckpt = corpus
    out = tmp_path / "bt"
    cfg = compose_command("translate", [f"ckpt_path={ckpt}", f"input={path}", f"output={out}",
                                        "beam_size=3", "nbest=2", "chunk_lines=16"])  # fmt: skip
    translate.main(cfg)
    sources, targets = read(out, "train.de.gz"), read(out, "train.en.gz")
    scores = [float(s) for s in read(out, "train.scores.gz")]
    assert len(sources) == len(targets) == len(scores) == 2 * 49 + 1  # the empty line: one empty pair
    nbest = translator.translate_nbest(lines[:3], SearchConfig(beam_size=3), 2)
    assert list(zip(sources[:6], targets[:6])) == [(line, text) for line, hyps in zip(lines, nbest) for _, text in hyps]
    assert scores[:6] == pytest.approx([s for hyps in nbest for s, _ in hyps], abs=1e-5)
    assert read_lines(out / "train.en.gz") == targets  # as the data loader reads a corpus folder's split
    translate.main(cfg)  # done: a second run leaves it as it is
    assert "exists: nothing to translate" in capsys.readouterr().err
    translate.main(compose_command("translate", [f"ckpt_path={ckpt}", f"input={path}", f"output={out}", "beam_size=3",
                                                 "nbest=2", "chunk_lines=16", "max_tokens=512"]))  # fmt: skip
    assert "exists: nothing to translate" in capsys.readouterr().err  # batch sizes aside: a GPU resumes a CPU's
    with pytest.raises(SystemExit):  # but not one with other settings
        translate.main(compose_command("translate", [f"ckpt_path={ckpt}", f"input={path}", f"output={out}",
                                                     "beam_size=3", "nbest=2", "chunk_lines=16", "min_score=-1"]))  # fmt: skip
    assert "holds a corpus translated from another input or with other settings" in capsys.readouterr().err
    changed = compose_command("translate", [f"ckpt_path={ckpt}", f"input={path}", f"output={tmp_path / 'x'}",
                                            "beam_size=3", "chunk_lines=16"])  # fmt: skip
    (tmp_path / "x" / ".train.parts").mkdir(parents=True)
    (tmp_path / "x" / ".train.parts" / "settings.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        translate.main(changed)
    assert stopped.value.code == 2 and "holds chunks translated from another input or with other settings" in (
        capsys.readouterr().err
    )


def test_min_score_leaves_out_the_pairs_scored_below_it_and_counts_them(corpus, tmp_path):
    translator, path, lines, ckpt = corpus
    beam = SearchConfig(beam_size=3)
    every = translate_corpus(translator, path, CorpusOutput(str(tmp_path / "every")), Decoding(beam), "32")
    scores = [float(s) for s in read(every, "train.scores.gz")]
    threshold = sorted(scores)[len(scores) // 2]
    kept = translate_corpus(
        translator, path, CorpusOutput(str(tmp_path / "kept"), min_score=threshold), Decoding(beam), "32"
    )
    pairs = list(zip(read(every, "train.de.gz"), read(every, "train.en.gz"), scores))
    want = [(s, t) for s, t, score in pairs if score >= threshold or not s]  # an empty source: nothing to judge
    assert list(zip(read(kept, "train.de.gz"), read(kept, "train.en.gz"))) == want and 20 < len(want) < 40
    record = json.loads((kept / "train.translation.json").read_text())
    assert record["pairs"] == len(want) and record["dropped_below_min_score"] == 50 - len(want)
    with pytest.raises(ValueError, match=r"^min_score=-1.0 filters by beam search's scores; greedy search"):
        translate_corpus(translator, path, CorpusOutput(str(tmp_path / "x"), min_score=-1.0), Decoding(SAMPLING), "32")


def test_sampling_never_draws_the_tokens_it_is_told_not_to():
    import torch

    from transformer.decoding import sampled_token

    logits = torch.tensor([[9.0, 9.0, 0.0, 1.0]]).repeat(200, 1)  # (200, 4): pad and BOS the most likely by far
    draw = sampled_token(-1, 1.0, torch.Generator().manual_seed(0), never=(0, 1))
    tokens = draw(logits)
    assert set(tokens.tolist()) == {2, 3} and sampled_token(1, 1.0, torch.Generator(), (0,))(logits).eq(1).all()


def test_sampling_from_a_flattened_distribution_never_draws_a_byte_piece(corpus, tmp_path):
    from omegaconf import OmegaConf

    from transformer.config.schema import ExportConfig
    from transformer.export.__main__ import export

    translator, _, lines, ckpt = corpus
    assert len(translator.tgt_tokenizer.byte_ids) == 256  # 256 of its 320 pieces: drawn often at T=50
    flat = SearchConfig(beam_size=1, sampling_topk=-1, temperature=50.0, seed=3)
    folder, failure = export(OmegaConf.create({**asdict(ExportConfig(ckpt_path=str(ckpt))), "output": str(tmp_path)}))
    assert failure is None
    with pytest.warns(UserWarning, match="CTranslate2 issue #1757"):  # its sampling is unseeded
        exported = open_translator(str(folder)).translate(lines, flat)
    for found in (translator.translate(lines, flat), exported):
        assert not any("\ufffd" in text for text in found)  # U+FFFD: a byte decoded alone
        assert sum(map(len, found)) > 20 * len(lines)  # long: flat sampling rarely draws EOS
