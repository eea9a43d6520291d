"""Several corpora in one run: shares by weight or temperature, per-epoch draws, tags, the tokenizer's sample,
one dev set per corpus, and the errors a mix config can make."""

import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from transformer.data import DataConfig, TokenBatchSampler, TranslationDataModule, load_corpus, prepare_data
from transformer.data.mixing import Mixture, mixture_shares
from transformer.data.prepare import _tokenizer_sentences
from transformer.evaluate import evaluate
from transformer.inference import SearchConfig, Translator
from transformer.training.errors import TrainingError

from .helpers import RECORD, LossRecorder, callback, config, run_train, tiny_data, write_text_corpus

SMALL = {"dev": 12, "test": 5, "train": 60}  # its training sentences are not the main corpus's (the seed is the order)


def mix_config(tmp_path, **overrides) -> DataConfig:
    """A main corpus of 300 training pairs and a tagged one of 60, each with its own dev set."""
    write_text_corpus(tmp_path / "main")
    write_text_corpus(tmp_path / "small", SMALL)
    small = {"path": str(tmp_path / "small"), "valid_split": "dev", "weight": 1.0, "tag": "__small__"}
    return config(tmp_path / "main", tmp_path, corpora={"small": small}, **overrides)


def test_shares_follow_weights_or_temperature():
    assert mixture_shares([100, 10], [3, 1], None).tolist() == [0.75, 0.25]
    proportional, flatter = mixture_shares([100, 10], [1, 1], 1.0), mixture_shares([100, 10], [1, 1], 5.0)
    assert proportional == pytest.approx([100 / 110, 10 / 110])
    assert flatter[1] > proportional[1] and flatter[0] > flatter[1]
    assert Mixture.of([7, 5, 3], [1, 2, 4], None, 100).counts().sum() == 100


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
    dm = TranslationDataModule(mix_config(tmp_path, epoch_pairs=150))
    dm.setup()
    assert list(dm.validation_sets) == [tmp_path.joinpath("main").name, "small"]
    loaders = dm.val_dataloader()
    assert [sum(len(b["index"]) for b in loader) for loader in loaders] == [20, 12]
    sizes = dm.data.mixture.sizes
    drawn = torch.cat([b["index"] for b in dm.train_dataloader()])
    assert len(drawn) == 150 and (drawn >= sizes[0]).sum() == 75  # equal weights: half from the small corpus
    assert dm.dataset("small/dev") is dm.data.corpora["small"]["dev"]
    with pytest.raises(ValueError, match=r"unknown split 'small/nope'; the corpora have test, train, val, small/dev, "):
        dm.dataset("small/nope")


def test_a_mixed_run_logs_every_dev_set_and_evaluates_a_tagged_one(tmp_path):
    main, small = tmp_path / "main", tmp_path / "small"
    write_text_corpus(main)
    write_text_corpus(small, SMALL)
    trainer = run_train(tmp_path / "run", [
        *tiny_data(main, tmp_path / "cache"), "model=tiny", "trainer.max_epochs=3", "trainer.enable_progress_bar=false",
        f"+data.corpora.small.path={small}", "+data.corpora.small.valid_split=dev", "+data.corpora.small.tag=__small__",
        "data.epoch_pairs=120", "~logger", *RECORD,
    ])  # fmt: skip
    assert trainer.lightning_module.validations == 3  # every epoch validated, though each draw packs differently
    logged = set(trainer.callback_metrics)
    assert {"val/bleu", "val/main/bleu", "val/small/bleu", "val/small/loss"} <= logged
    assert trainer.callback_metrics["val/bleu"] == trainer.callback_metrics["val/main/bleu"]
    batches = callback(trainer, LossRecorder).batches
    assert any(i >= 300 for b in batches.values() for i in b)  # the small corpus's pairs were trained on
    translator = Translator.from_path(str(tmp_path / "run" / "checkpoints" / "last.ckpt"))
    result = evaluate(translator, DataConfig.from_dict(translator.data), "small/dev", SearchConfig(beam_size=1), "32")
    assert result["sentences"] == 12
    tagged = translator.translate(["ein hund"], SearchConfig(beam_size=1), tag="__small__")
    assert len(tagged) == 1


def test_a_monitor_naming_a_missing_dev_set_stops_before_training(tmp_path):
    main, small = tmp_path / "main", tmp_path / "small"
    write_text_corpus(main)
    write_text_corpus(small, SMALL)
    with pytest.raises(TrainingError, match=r"monitors 'val/nope/bleu', which validation does not log; use one of"):
        run_train(tmp_path / "run", [
            *tiny_data(main, tmp_path / "cache"), "model=tiny", f"+data.corpora.small.path={small}",
            "+data.corpora.small.valid_split=dev", "callbacks.best_checkpoint.monitor=val/nope/bleu", "~logger",
        ])  # fmt: skip


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
