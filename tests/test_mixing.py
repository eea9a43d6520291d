"""Several corpora in one run: shares by weight or temperature, per-epoch draws, tags, the tokenizer's sample,
one dev set per corpus, and the errors a mix config can make."""

import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from transformer import translate
from transformer.data import DataConfig, TokenBatchSampler, TranslationDataModule, load_corpus, prepare_data
from transformer.data.mixing import Mixture, mixture_shares
from transformer.data.prepare import _tokenizer_sentences
from transformer.model.transformer import EncoderDecoder
from transformer.training.errors import TrainingError
from transformer.translators import CheckpointTranslator, SearchConfig
from transformer.translators.scores import evaluate

from .helpers import (
    RECORD,
    LossRecorder,
    callback,
    compose_command,
    config,
    run_train,
    tiny_data,
    write_text_corpus,
)

SMALL = {"dev": 12, "test": 5, "train": 60}  # its training sentences are not the main corpus's (the seed is the order)


def mix_config(tmp_path, weight: float = 1.0, **overrides) -> DataConfig:
    """A main corpus of 300 training pairs and a tagged one of 60 (of `weight`), each with its own dev set."""
    write_text_corpus(tmp_path / "main")
    write_text_corpus(tmp_path / "small", SMALL)
    small = {"path": str(tmp_path / "small"), "valid_split": "dev", "weight": weight, "tag": "__small__"}
    return config(tmp_path / "main", tmp_path, corpora={"small": small}, **overrides)


def test_shares_follow_weights_or_temperature():
    sizes, weights = [1000, 100, 10], [1.0, 3.0, 0.5]
    assert mixture_shares(sizes, weights, None) == pytest.approx([1 / 4.5, 3 / 4.5, 0.5 / 4.5])  # sizes play no part
    for temperature in (1.0, 2.0, 5.0):  # weight x size^(1/T), normalised
        unnormalised = [w * n ** (1 / temperature) for w, n in zip(weights, sizes)]
        expected = [u / sum(unnormalised) for u in unnormalised]
        assert mixture_shares(sizes, weights, temperature) == pytest.approx(expected, rel=1e-12), temperature
        counts = Mixture.of(sizes, weights, temperature, 1000).counts()  # whole pairs, as near the shares as can be
        assert counts.sum() == 1000 and np.all(np.abs(counts - 1000 * np.array(expected)) < 1), counts


def test_an_epoch_repeats_a_small_corpus_and_subsamples_a_large_one_differently_each_epoch():
    mix = Mixture.of([50, 10], [1, 1], None, 40)  # 20 pairs each: 2 copies of the small one, 20 of 50 of the large
    epochs = [mix.draw(np.random.default_rng([1, e])) for e in range(2)]
    for drawn in epochs:
        counts = Counter(drawn.tolist())
        assert all(counts[i] == 2 for i in range(50, 60))  # the whole small corpus, twice
        large = [i for i in counts if i < 50]
        assert len(large) == 20 and all(counts[i] == 1 for i in large)
    assert set(epochs[0][epochs[0] < 50]) != set(epochs[1][epochs[1] < 50])


def test_one_corpus_taken_whole_batches_as_without_a_mixture():
    lengths = np.random.default_rng(0).integers(2, 30, size=(200, 2))
    plain = TokenBatchSampler(lengths, 120, seed=3).all_batches(1)
    mixed = TokenBatchSampler(lengths, 120, seed=3, mixture=Mixture.of([200], [1.0], None, None)).all_batches(1)
    assert [b.tolist() for b in plain] == [b.tolist() for b in mixed]


def test_every_epoch_of_a_mixture_has_the_first_epoch_s_number_of_batches():
    """Lightning validates and ends an epoch by the first epoch's length; a later draw packs differently."""
    lengths = np.random.default_rng(0).integers(2, 60, size=(300, 2))
    sampler = TokenBatchSampler(lengths, 100, seed=1, mixture=Mixture.of([200, 100], [1, 3], None, 250))
    assert len({len(sampler._packed(e)) for e in range(12)}) > 1  # the draws do pack into different numbers
    for e in range(12):
        batches = sampler.all_batches(e)
        assert len(batches) == len(sampler._packed(0))
        assert all(lengths[b].max() * len(b) <= 100 for b in batches)


def test_the_tokenizer_sample_follows_the_shares_and_is_capped(tmp_path):
    cfg = mix_config(tmp_path)
    trains = [load_corpus(c, cfg.src, cfg.tgt, cfg.cache_dir)[0][c.train_split] for c in cfg.all_corpora().values()]
    main, small = set(trains[0]["src"]), set(trains[1]["src"])
    sample = list(_tokenizer_sentences(trains, np.array([0.5, 0.5]), 200, ("src",), seed=0))
    assert len(sample) == 200
    from_small = sum(s in small and s not in main for s in sample)
    assert from_small >= 95  # 100 of 200 by share, though the corpus has 60 pairs: it repeats
    everything = list(_tokenizer_sentences(trains[:1], np.array([1.0]), 10_000, ("src", "tgt"), seed=0))
    assert everything == list(trains[0]["src"]) + list(trains[0]["tgt"])  # under the cap: all of it, in order


def test_a_tag_is_a_reserved_piece_put_before_that_corpus_sources_only(tmp_path):
    prepared = prepare_data(mix_config(tmp_path))
    tok = prepared.src_tokenizer
    tag = tok.tag_id("__small__")
    assert tok.tags == ["__small__"] and tok.sp.encode("x __small__ y").count(tag) == 1  # never split
    assert all(ids[0] == tag for split in ("train", "dev") for ids in prepared.corpora["small"][split]["src_ids"])
    assert not any(tag in ids for split in prepared.splits.values() for ids in split["src_ids"])
    with pytest.raises(ValueError, match=r"tag='__bt__' is not a reserved piece .*reserved: __small__"):
        tok.tag_id("__bt__")


def test_the_data_module_draws_each_corpus_by_its_share_and_validates_each(tmp_path):
    """Shares by weight x size^(1/T); the tagged corpus's sources, and only those, start with its tag."""
    dm = TranslationDataModule(mix_config(tmp_path, weight=3.0, temperature=2.0, epoch_pairs=150))
    dm.setup()
    assert list(dm.validation_sets) == ["main", "small"]
    loaders = dm.val_dataloader()
    assert [sum(len(b["index"]) for b in loader) for loader in loaders] == [20, 12]
    tag = dm.src_tokenizer.tag_id("__small__")
    assert all((b["src"][:, 0] == tag).all() for b in loaders[1])
    assert not any((b["src"] == tag).any() for b in loaders[0])
    main, small = (len(dm.data.corpora[name]["train"]) for name in ("main", "small"))  # pairs after cleaning
    batches = list(dm.train_dataloader())
    drawn = torch.cat([b["index"] for b in batches])
    assert len(drawn) == 150 and (drawn >= main).sum() == round(150 * 3 * small**0.5 / (main**0.5 + 3 * small**0.5))
    for b in batches:  # the small corpus's pairs are indices main .. main + small - 1
        assert torch.equal(b["src"][:, 0] == tag, b["index"] >= main) and not (b["src"][:, 1:] == tag).any()
    assert dm.dataset("small/dev") is dm.data.corpora["small"]["dev"]
    with pytest.raises(ValueError, match=r"unknown split 'small/nope'; the corpora have test, train, val, small/dev, "):
        dm.dataset("small/nope")


@pytest.fixture(scope="module")
def mix_overrides(tmp_path_factory) -> list[str]:
    """A main corpus and a tagged one with its own dev set, and one data cache for the runs on them."""
    tmp = tmp_path_factory.mktemp("mix")
    write_text_corpus(tmp / "main")
    write_text_corpus(tmp / "small", SMALL)
    return [*tiny_data(tmp / "main", tmp / "cache"), f"+data.corpora.small.path={tmp / 'small'}",
            "+data.corpora.small.valid_split=dev", "+data.corpora.small.tag=__small__"]  # fmt: skip


# An untrained model's hypotheses run to the length limit: greedy, and short, for decoding that is about tags
SHORT = SearchConfig(beam_size=1, max_len_a=0, max_len_b=4)
SHORT_COMMAND = ["beam_size=1", "max_len_a=0", "max_len_b=4"]
SHORT_VALIDATION = ["validation.bleu_max_sentences=4", "validation.max_len_a=0", "validation.max_len_b=4"]


def encoded_sources(monkeypatch) -> list[torch.Tensor]:
    """Every source batch the model encodes from now on (ids + EOS, right-padded)."""
    seen, encode = [], EncoderDecoder.encode

    def recorded(model, src, *args):
        seen.append(src)
        return encode(model, src, *args)

    monkeypatch.setattr(EncoderDecoder, "encode", recorded)
    return seen


def translate_command(*overrides: str) -> None:
    """`python -m transformer.translate OVERRIDES`, run here."""
    translate.main(compose_command("translate", list(overrides)))


def test_a_mixed_run_logs_every_dev_set_and_translates_a_tagged_one_with_its_tag(mix_overrides, tmp_path, monkeypatch,
                                                                                 capsys):  # fmt: skip
    trainer = run_train(tmp_path / "run", [
        *mix_overrides, "model=tiny", "trainer.precision=32-true", "trainer.max_epochs=3", "data.epoch_pairs=60",
        *SHORT_VALIDATION, "trainer.enable_progress_bar=false", "~logger", *RECORD,
    ])  # fmt: skip
    assert trainer.lightning_module.validations == 3  # every epoch validated, though each draw packs differently
    logged = set(trainer.callback_metrics)
    assert {"val/bleu", "val/main/bleu", "val/small/bleu", "val/small/loss"} <= logged
    assert trainer.callback_metrics["val/bleu"] == trainer.callback_metrics["val/main/bleu"]
    batches = callback(trainer, LossRecorder).batches
    assert any(i >= 300 for b in batches.values() for i in b)  # the small corpus's pairs were trained on
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    translator = CheckpointTranslator.from_path(str(checkpoint))
    tag = translator.src_tokenizer.tag_id("__small__")
    sources = encoded_sources(monkeypatch)
    result = evaluate(translator, DataConfig.from_dict(translator.data), "small/dev", SHORT, "32")
    assert result["sentences"] == 12 and sources and all((src[:, 0] == tag).all() for src in sources)
    (tmp_path / "in.de").write_text("ein hund\nzwei katzen laufen\n")
    capsys.readouterr()  # training's output (with `rich` installed, Lightning prints its model summary there)
    for given, tagged in (("tag=__small__", True), ("tag=null", False)):
        sources.clear()
        translate_command(f"ckpt_path={checkpoint}", f"input={tmp_path / 'in.de'}", *SHORT_COMMAND, given)
        assert len(capsys.readouterr().out.splitlines()) == 2
        assert [src[:, 0].eq(tag).tolist() for src in sources] == [[tagged, tagged]]
    with pytest.raises(SystemExit) as stopped:
        translate_command(f"ckpt_path={checkpoint}", f"input={tmp_path / 'in.de'}", "tag=__bt__")
    assert stopped.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: tag='__bt__' is not a reserved piece of this tokenizer (reserved: __small__); use one of those, or "
        "train with that tag on a corpus (data.corpora.<name>.tag)"
    ]


def test_a_monitor_naming_a_missing_dev_set_stops_before_training(mix_overrides, tmp_path):
    with pytest.raises(TrainingError, match=r"monitors 'val/nope/bleu', which validation does not log; use one of"):
        run_train(tmp_path / "run", [*mix_overrides, "model=tiny", "trainer.precision=32-true",
                                     "callbacks.best_checkpoint.monitor=val/nope/bleu", "~logger"])  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("corpus", "message"),
    [
        ({"path": "x", "weight": 0}, r"data.corpora.bad.weight=0.0 must be positive"),
        ({"path": "x", "weight": -1.5}, r"data.corpora.bad.weight=-1.5 must be positive"),
        ({"path": "x", "tag": "a b"}, r"data.corpora.bad.tag='a b' must be one piece without spaces"),
        ({"path": "x", "wieght": 2}, r"unknown field\(s\) in data.corpora.bad: wieght"),
        ({"weight": 2}, r"data.corpora.<name>.path is empty|data.corpora.bad.path is empty"),
    ],
)
def test_bad_corpus_entries_fail_in_one_line(tmp_path, corpus, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, tmp_path, corpora={"bad": corpus})


def test_a_missing_dev_split_of_a_mixed_corpus_is_named(tmp_path):
    cfg = mix_config(tmp_path)
    small = {**vars(cfg.corpora["small"]), "valid_split": "newstest"}
    with pytest.raises(
        ValueError,
        match=r"corpus small .* has no split 'newstest' \(found dev, test, train\); set data.corpora.small.valid_split",
    ):
        prepare_data(config(tmp_path / "main", tmp_path, corpora={"small": small}))


def test_a_damaged_cache_is_named_and_rebuilt(tmp_path):
    cfg = mix_config(tmp_path)
    first = prepare_data(cfg)
    pairs = list(first.corpora["small"]["train"]["src_ids"])
    arrow = next((first.folder / "small" / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = prepare_data(cfg)
    assert any(f"the encoded cache {first.folder} is damaged" in str(w.message) for w in caught)
    assert list(again.corpora["small"]["train"]["src_ids"]) == pairs and not again.reused
