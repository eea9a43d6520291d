"""`python -m transformer.score`: its scores are the model's own teacher-forced loss (and the margin over another
pair's source), it resumes chunk by chunk, and prepare filters by them (data.scores with min_score or keep_best), refusing a file of another text."""

import json
import shutil

import datasets
import numpy as np
import pytest
import torch

from transformer import score
from transformer.data import DataError, prepare_data
from transformer.data.batching import Collate
from transformer.data.scores import dual_score, read_scores, split_fingerprint
from transformer.model.loss import batch_loss_sum
from transformer.translators import CheckpointTranslator, pair_scores
from transformer.translators.pair_scores import mean_log_probs, score_split

from .helpers import compose_command, config
from .test_commands import one_line_error


@pytest.fixture(scope="module")
def scorer(trained):
    tmp, _, ckpt = trained
    translator = CheckpointTranslator.from_path(str(ckpt))
    corpus = tmp / "c"
    pairs = list(zip(*((corpus / f"train.{lang}").read_text().splitlines() for lang in ("de", "en"))))
    return translator, corpus, ckpt, pairs


def test_scores_are_the_models_own_teacher_forced_loss(scorer):
    translator, _, _, pairs = scorer
    sources, targets = [s for s, _ in pairs[:12]], [t for _, t in pairs[:12]]
    targets[3] = ""  # only its end token to score
    together = mean_log_probs(translator, sources, targets, max_tokens=300)  # padded batches of several pairs
    model, tok = translator.model, translator.tgt_tokenizer
    collate = Collate(tok.pad_id, tok.bos_id, tok.eos_id)
    for i, (source, target) in enumerate(zip(sources, targets)):
        src, tgt = (np.array(t.encode([x])[0]) for t, x in ((translator.src_tokenizer, source), (tok, target)))
        batch = collate([(src, tgt, 0)])
        with torch.no_grad():
            loss, tokens = batch_loss_sum(model, batch, label_smoothing=0.0)
        assert together[i] == pytest.approx(-loss.item() / tokens, abs=1e-5)


def test_a_killed_run_resumes_at_its_first_chunk_not_written(scorer, tmp_path, monkeypatch):
    translator, corpus, ckpt, pairs = scorer
    ds = datasets.Dataset.from_dict({"src": [s for s, _ in pairs], "tgt": [t for _, t in pairs]})
    settings = {"checkpoint": str(ckpt), "fingerprint": split_fingerprint(ds)}
    whole = score_split(ds, tmp_path / "whole.tsv", settings, translator, translator, 300, 10, "32")
    calls = []
    real = pair_scores.mean_log_probs

    def dies_on_the_fourth_chunk(*args, **kwargs):  # four calls a chunk: each model given own and other sources
        calls.append(len(args[1]))
        if len(calls) == 13:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pair_scores, "mean_log_probs", dies_on_the_fourth_chunk)
    with pytest.raises(KeyboardInterrupt):
        score_split(ds, tmp_path / "resumed.tsv", settings, translator, translator, 300, 10, "32")
    calls.clear()
    monkeypatch.setattr(pair_scores, "mean_log_probs", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    resumed = score_split(ds, tmp_path / "resumed.tsv", settings, translator, translator, 300, 10, "32")
    assert len(calls) == 8  # chunks 4 and 5 of 48 pairs: each scored forward and reverse, given each source
    assert resumed == whole and (tmp_path / "resumed.tsv").read_text() == (tmp_path / "whole.tsv").read_text()
    assert not (tmp_path / "resumed.tsv.parts").exists()
    table = np.loadtxt(tmp_path / "whole.tsv", delimiter="\t", skiprows=1)
    assert table[:, 0].tolist() == list(range(1, len(pairs) + 1))
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    reverse = mean_log_probs(translator, targets, sources, 300)
    assert np.allclose(table[:, 2], reverse, atol=1e-6) and np.allclose(
        table[:, 3], dual_score(table[:, 1], reverse), atol=1e-5
    )
    other = [(i + len(pairs) // 2) % len(pairs) for i in range(len(pairs))]  # each pair's stand-in, half the split away
    given_others = mean_log_probs(translator, [sources[j] for j in other], targets, 300)
    reverse_given_others = mean_log_probs(translator, [targets[j] for j in other], sources, 300)
    assert np.allclose(table[:, 4], table[:, 1] - given_others + reverse - reverse_given_others, atol=1e-5)
    with pytest.raises(ValueError, match="other settings"):
        score_split(
            ds, tmp_path / "whole.tsv", {**settings, "checkpoint": "another.ckpt"}, translator, None, 300, 10, "32"
        )


def test_dual_score_prefers_likely_pairs_both_ways():
    forward, reverse = np.array([-0.5, -0.5, -3.0, -0.5]), np.array([-0.5, -3.0, -3.0, -0.6])
    dual = dual_score(forward, reverse)
    # likely both ways first; a pair one model finds likely and the other not is worse than one both find unlikely
    assert dual.tolist() == pytest.approx([-0.5, -4.25, -3.0, -0.65]) and dual[0] > dual[3] > dual[2] > dual[1]


def test_prepare_drops_the_pairs_scored_lowest(scorer, tmp_path, capsys):
    translator, corpus, ckpt, pairs = scorer
    folder = tmp_path / "c"
    shutil.copytree(corpus, folder)
    scores = tmp_path / "scores.tsv"
    score.main(compose_command("score", [f"ckpt_path={ckpt}", f"data.path={folder}", f"output={scores}"]))
    assert scores.read_text().splitlines()[0].split("\t") == ["line", "forward", "margin"]
    margin = np.loadtxt(scores, delimiter="\t", skiprows=1)[:, 2]  # which prepare filters by
    assert json.loads((tmp_path / "scores.tsv.json").read_text())["pairs"] == len(pairs)
    prepared = prepare_data(config(folder, tmp_path, scores=str(scores), keep_best=0.5))
    dropped = prepared.stats["train"]["dropped"]
    assert dropped["score"] == int((margin < np.quantile(margin, 0.5, method="lower")).sum()) > 0
    by_min = prepare_data(config(folder, tmp_path, scores=str(scores), min_score=float(np.median(margin))))
    assert by_min.stats["train"]["dropped"]["score"] == int((margin < np.median(margin)).sum())
    (folder / "train.en").write_text((folder / "train.en").read_text().replace("e", "a", 1))  # another text now
    with pytest.raises(DataError, match=r"data.scores=.* scores 48 pairs of another text"):
        prepare_data(config(folder, tmp_path, scores=str(scores), keep_best=0.5))
    with pytest.raises(ValueError, match=r"data.scores filters by data.min_score or .keep_best"):
        config(folder, tmp_path, scores=str(scores))
    assert read_scores(scores, datasets.Dataset.from_dict({"src": [s for s, _ in pairs], "tgt": [t for _, t in pairs]}),
                       "data.scores").tolist() == pytest.approx(margin.tolist())  # fmt: skip


def test_a_reverse_model_of_the_same_direction_or_an_unknown_precision_is_one_line(scorer, tmp_path, capsys):
    _, corpus, ckpt, _ = scorer
    cfg = compose_command("score", [f"ckpt_path={ckpt}", f"reverse_ckpt_path={ckpt}", f"output={tmp_path / 's.tsv'}"])
    err = one_line_error(capsys, score.main, cfg)
    assert "translates de->en, not en->de" in err and "give a checkpoint trained en->de" in err
    cfg = compose_command("score", [f"ckpt_path={ckpt}", "precision=bf16-mixed", f"output={tmp_path / 's.tsv'}"])
    assert "precision=bf16-mixed is not one of 32, bf16" in one_line_error(capsys, score.main, cfg)
