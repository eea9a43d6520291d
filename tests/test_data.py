import gzip
import json
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

from transformer.data import (
    DataConfig,
    DataError,
    TokenBatchSampler,
    TranslationDataModule,
    example_lengths,
    load_corpus,
    padding_fraction,
    prepare_data,
)  # fmt: skip

from .helpers import MULTI30K, ROOT, config, write_text_corpus


def pairs(ds) -> list[tuple[str, str]]:
    return list(zip(ds["src"], ds["tgt"]))


# --- sources ---------------------------------------------------------------------------------------


def test_all_local_formats_load_the_same_pairs(tmp_path):
    import pandas as pd

    corpus = write_text_corpus(tmp_path / "plain")
    write_text_corpus(tmp_path / "gz", gz=True)
    for fmt in ("translation", "columns", "parquet", "csv"):
        (tmp_path / fmt).mkdir()
    for split, (de, en) in corpus.items():
        with open(tmp_path / "translation" / f"{split}.jsonl", "w") as f:
            for s, t in zip(de, en):
                f.write(json.dumps({"translation": {"de": s, "en": t}}) + "\n")
        frame = pd.DataFrame({"de": de, "en": en})
        frame.to_json(tmp_path / "columns" / f"{split}.jsonl", orient="records", lines=True, force_ascii=False)
        frame.rename(columns={"de": "source", "en": "target"}).to_parquet(tmp_path / "parquet" / f"{split}.parquet")
        frame.to_csv(tmp_path / "csv" / f"{split}.csv", index=False)

    expected = {split: list(zip(de, en)) for split, (de, en) in corpus.items()}
    variants = [
        config(tmp_path / "plain", tmp_path),
        config(tmp_path / "gz", tmp_path),
        config(tmp_path / "translation", tmp_path, format="json"),
        config(tmp_path / "columns", tmp_path, format="json"),
        config(tmp_path / "parquet", tmp_path, format="parquet", src_column="source", tgt_column="target"),
        config(tmp_path / "csv", tmp_path, format="csv"),
    ]
    for cfg in variants:
        loaded, _ = load_corpus(cfg)
        assert {split: pairs(ds) for split, ds in loaded.items()} == expected, cfg


def test_hub_layout_loads_translation_and_column_datasets(tmp_path):
    """The hub path (format=hub) on a local folder laid out as a hub dataset: splits from file names."""
    corpus = write_text_corpus(tmp_path / "text", sizes={"train": 30, "validation": 5})
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    for split, (de, en) in corpus.items():
        with open(hub / "data" / f"{split}.jsonl", "w") as f:
            for s, t in zip(de, en):
                f.write(json.dumps({"translation": {"de": s, "en": t}}) + "\n")
    loaded, fingerprint = load_corpus(config(hub, tmp_path, format="hub", valid_split="validation"))
    assert {split: pairs(ds) for split, ds in loaded.items()} == {k: list(zip(*v)) for k, v in corpus.items()}
    again, same = load_corpus(config(hub, tmp_path, format="hub", valid_split="validation"))
    assert same == fingerprint


def test_lightning_sets_the_epoch_of_the_token_sampler(tmp_path):
    from lightning_fabric.utilities.data import _set_sampler_epoch

    write_text_corpus(tmp_path / "c")
    dm = TranslationDataModule(config(tmp_path / "c", tmp_path))
    loader = dm.train_dataloader()
    first = [b["index"].tolist() for b in loader]
    _set_sampler_epoch(loader, 1)  # what Lightning's fit loop calls at each epoch
    assert dm.train_sampler.epoch == 1
    assert [b["index"].tolist() for b in loader] != first


def test_reversed_direction_swaps_the_sides(tmp_path):
    corpus = write_text_corpus(tmp_path / "c")
    loaded, _ = load_corpus(config(tmp_path / "c", tmp_path, src="en", tgt="de"))
    de, en = corpus["train"]
    assert pairs(loaded["train"]) == list(zip(en, de))


def test_lines_split_only_on_newline(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "train.de").write_text("eins\u2028zwei\x1c drei\nvier\r\n", encoding="utf-8")
    (folder / "train.en").write_text("one two three\nfour\n", encoding="utf-8")
    loaded, _ = load_corpus(config(folder, tmp_path))
    assert pairs(loaded["train"]) == [("eins\u2028zwei\x1c drei", "one two three"), ("vier", "four")]


# --- tokenizer and cache ---------------------------------------------------------------------------


def test_vocabulary_fingerprint_ignores_where_a_tokenizer_was_trained(tmp_path):
    from transformer.data.tokenizer import vocabulary_fingerprint

    write_text_corpus(tmp_path / "c")
    here = prepare_data(config(tmp_path / "c", tmp_path / "a")).src_tokenizer.path.read_bytes()
    there = prepare_data(config(tmp_path / "c", tmp_path / "b")).src_tokenizer.path.read_bytes()
    other = prepare_data(config(tmp_path / "c", tmp_path / "a", vocab_size=360)).src_tokenizer.path.read_bytes()
    assert here != there  # the files record their temporary training path
    assert vocabulary_fingerprint(here) == vocabulary_fingerprint(there) != vocabulary_fingerprint(other)


def test_cache_is_reused_and_invalidated(tmp_path, caplog):
    folder = tmp_path / "c"
    write_text_corpus(folder)
    cfg = config(folder, tmp_path)
    first = prepare_data(cfg)
    assert not first.reused
    model_file = first.src_tokenizer.path
    stamp = model_file.stat().st_mtime_ns
    with caplog.at_level("INFO"):
        again = prepare_data(cfg)
    assert again.reused and again.folder == first.folder
    assert model_file.stat().st_mtime_ns == stamp  # nothing retrained
    assert "reused the cached tokenizer" in caplog.text

    longer = prepare_data(config(folder, tmp_path, max_length=5))  # cleaning changes: re-encode, same tokenizer
    assert longer.folder != first.folder and longer.src_tokenizer.path == model_file
    assert model_file.stat().st_mtime_ns == stamp
    assert prepare_data(config(folder, tmp_path, vocab_size=330)).src_tokenizer.path != model_file
    assert prepare_data(config(folder, tmp_path, tokenizer_type="bpe")).src_tokenizer.path != model_file
    assert prepare_data(config(folder, tmp_path, src="en", tgt="de")).src_tokenizer.path != model_file

    with open(folder / "train.en", "a") as f:  # the corpus changes: everything is redone
        f.write("one more line.\n")
    with open(folder / "train.de", "a") as f:
        f.write("noch eine zeile.\n")
    changed = prepare_data(cfg)
    assert not changed.reused and changed.src_tokenizer.path != model_file
    assert changed.stats["train"]["pairs"] == 301


def test_tokenizer_specials_and_separate_vocabularies(tmp_path):
    write_text_corpus(tmp_path / "c")
    joint = prepare_data(config(tmp_path / "c", tmp_path))
    assert joint.src_tokenizer is joint.tgt_tokenizer
    tok = joint.src_tokenizer
    assert tok.vocab_size == 340
    assert len({tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id}) == 4
    separate = prepare_data(config(tmp_path / "c", tmp_path, joint_vocab=False, vocab_size=320))
    assert separate.src_tokenizer.path != separate.tgt_tokenizer.path
    assert separate.src_tokenizer.path.name == "spm.de.model"
    de_words = separate.src_tokenizer.sp.id_to_piece(list(range(separate.src_tokenizer.vocab_size)))
    assert "▁hund" in de_words or "▁Hund" in de_words or any("hund" in p for p in de_words)
    assert not any("dog" in p for p in de_words)  # the German model never saw English


def test_byte_fallback_encodes_unseen_characters(tmp_path):
    write_text_corpus(tmp_path / "c")
    tok = prepare_data(config(tmp_path / "c", tmp_path)).src_tokenizer
    text = "Ein Hund 🐕 läuft — 東京"
    ids = tok.encode([text])[0]
    assert tok.unk_id not in ids
    assert tok.decode([ids])[0] == text


@pytest.fixture(scope="module")
def multi30k(multi30k_cache):
    if not (MULTI30K / "train.de.gz").exists():
        pytest.fail(f'{MULTI30K} is missing; link it: ln -s "$PWD/../shared/data/multi30k" data/multi30k')
    cfg = DataConfig(cache_dir=str(multi30k_cache), path=str(MULTI30K))
    return cfg, prepare_data(cfg)


def test_multi30k_detokenization_is_exact_for_ordinary_text(multi30k):
    cfg, prepared = multi30k
    tok = prepared.tgt_tokenizer
    checked = 0
    for split in ("val", "test_2016_flickr"):
        for column in ("src", "tgt"):
            texts = [
                s
                for s in prepared.splits[split][column]
                if s == " ".join(s.split()) and unicodedata.normalize("NFKC", s) == s
            ]
            ids = tok.encode(texts)
            assert tok.decode(ids) == texts
            checked += len(texts)
    assert checked > 3900


def test_multi30k_batches_have_little_padding(multi30k):
    cfg, prepared = multi30k
    train = prepared.splits["train"]
    assert prepared.stats["train"]["pairs"] == 29000
    assert prepared.stats["val"]["kept"] == 1014 and prepared.stats["test_2016_flickr"]["kept"] == 1000
    lengths = example_lengths(train)
    batches = TokenBatchSampler(lengths, cfg.max_tokens, seed=cfg.seed).all_batches(0)
    token_padding = padding_fraction(batches, lengths)
    order = np.random.default_rng(0).permutation(len(lengths))
    sentence_padding = padding_fraction([order[i : i + 128] for i in range(0, len(order), 128)], lengths)
    assert token_padding < 0.10 and sentence_padding > 0.30


# --- cleaning --------------------------------------------------------------------------------------


def test_cleaning_drops_only_training_pairs_and_counts_each_reason(tmp_path):
    folder = tmp_path / "c"
    corpus = write_text_corpus(folder)
    long_de, long_en = " ".join(["hund"] * 80), " ".join(["dog"] * 80)
    extra = [("", "a dog."), ("ein hund.", "   "), (long_de, long_en), ("ein hund.", " ".join(["the green dog"] * 8))]
    for split in ("train", "val"):
        de, en = corpus[split]
        (folder / f"{split}.de").write_text("\n".join(de + [s for s, _ in extra]) + "\n")
        (folder / f"{split}.en").write_text("\n".join(en + [t for _, t in extra]) + "\n")
    prepared = prepare_data(config(folder, tmp_path, max_length=40))
    train = prepared.stats["train"]
    assert {reason: n for reason, n in train["dropped"].items() if n} == {"empty": 2, "too_long": 1, "length_ratio": 1}
    assert train["pairs"] == 304 and train["kept"] == 300 == len(prepared.splits["train"])
    assert prepared.stats["val"]["kept"] == 24 == len(prepared.splits["val"])  # validation is never cleaned


# --- batching --------------------------------------------------------------------------------------


def random_lengths(n=500, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(2, 40, n), rng.integers(2, 40, n)], axis=1)


def test_token_batches_fit_cover_everything_and_reproduce():
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, 300, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        for b in batches:
            assert len(b) * lengths[b].max() <= 300
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(lengths)))  # every example exactly once
        assert batches == [b.tolist() for b in TokenBatchSampler(lengths, 300, seed=3).all_batches(epoch)]
    e0, e1 = (
        TokenBatchSampler(lengths, 300, seed=3).all_batches(0),
        TokenBatchSampler(lengths, 300, seed=3).all_batches(1),
    )
    assert [b.tolist() for b in e0] != [b.tolist() for b in e1]
    assert [b.tolist() for b in e0] != [b.tolist() for b in TokenBatchSampler(lengths, 300, seed=4).all_batches(0)]


def test_ranks_get_disjoint_equal_batches():
    lengths = random_lengths()
    per_rank = [list(TokenBatchSampler(lengths, 300, seed=1, num_replicas=3, rank=r)) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) > 0
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen))


def test_sampler_resumes_mid_epoch_to_the_same_remaining_batches():
    lengths = random_lengths()
    uninterrupted = TokenBatchSampler(lengths, 300, seed=5)
    uninterrupted.set_epoch(2)
    expected = list(uninterrupted)

    first = TokenBatchSampler(lengths, 300, seed=5)
    first.set_epoch(2)
    it = iter(first)
    seen = [next(it) for _ in range(7)]
    state = first.state_dict()

    resumed = TokenBatchSampler(lengths, 300, seed=5)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == expected
    fresh = TokenBatchSampler(lengths, 300, seed=5)
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # straight after loading: the resumed position belongs to epoch 2, not to the next one
    assert list(fresh) == [b.tolist() for b in TokenBatchSampler(lengths, 300, seed=5).all_batches(3)]
    with pytest.raises(ValueError, match="resume with data.seed=5"):
        TokenBatchSampler(lengths, 300, seed=6).load_state_dict(state)


def test_datamodule_batches_and_map_back_to_input_order(tmp_path):
    write_text_corpus(tmp_path / "c")
    dm = TranslationDataModule(config(tmp_path / "c", tmp_path))
    dm.setup()
    tok = dm.data.tgt_tokenizer
    batch = next(iter(dm.train_dataloader()))
    assert batch["src"].shape[0] * max(batch["src"].shape[1], batch["tgt_in"].shape[1]) <= 200
    assert (batch["tgt_in"][:, 0] == tok.bos_id).all()
    real = batch["tgt_out"] != tok.pad_id
    shifted = real[:, 1:]  # positions whose target input is the previous position's label
    assert (batch["tgt_in"][:, 1:] == batch["tgt_out"][:, :-1])[shifted].all() and shifted.any()
    last = real.sum(1) - 1
    assert (batch["tgt_out"][range(len(last)), last] == tok.eos_id).all()

    val = dm.data.splits["val"]
    decoded = {}
    for b in dm.val_dataloader():
        for i, row in zip(b["index"].tolist(), b["tgt_out"].tolist()):
            decoded[i] = tok.decode([[t for t in row if t not in (tok.pad_id, tok.eos_id)]])[0]
    assert [decoded[i] for i in range(len(val))] == val["tgt"]

    loader = dm.train_dataloader()
    it = iter(loader)
    next(it), next(it)
    state = dm.state_dict()
    rest = [b["index"].tolist() for b in it]
    dm2 = TranslationDataModule(config(tmp_path / "c", tmp_path))
    dm2.load_state_dict(state)
    assert [b["index"].tolist() for b in dm2.train_dataloader()] == rest


# --- bad input -------------------------------------------------------------------------------------


def test_bad_input_gives_one_clear_error(tmp_path):
    folder = tmp_path / "c"
    write_text_corpus(folder)
    with pytest.raises(
        DataError, match=r"data folder .*nowhere does not exist; fetch the corpus there or set data.path"
    ):
        load_corpus(config(tmp_path / "nowhere", tmp_path))
    with pytest.raises(DataError, match=r"language 'fr' is not in the corpus \(found de, en\)"):
        load_corpus(config(folder, tmp_path, tgt="fr"))
    with pytest.raises(DataError, match=r"language 'xx' is not in the corpus"):
        load_corpus(config(folder, tmp_path, src="xx"))
    with pytest.raises(DataError, match=r"data.vocab_size=5000 is larger than this corpus allows \(at most \d+\)"):
        prepare_data(config(folder, tmp_path, vocab_size=5000))
    with open(folder / "val.en", "a") as f:
        f.write("one line too many.\n")
    with pytest.raises(DataError, match=r"val.de has 20 lines but .*val.en has 21"):
        load_corpus(config(folder, tmp_path))
    with pytest.raises(ValueError, match="data.max_tokens=100 cannot hold one pair of data.max_length=250"):
        DataConfig(max_tokens=100)
    with pytest.raises(ValueError, match="unknown data config field"):
        DataConfig.from_dict({"vocab": 3})


def test_translation_column_without_the_language(tmp_path):
    folder = tmp_path / "j"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"translation": {"de": "hallo", "en": "hello"}}) + "\n")
    with pytest.raises(DataError, match="language 'fr' is not in its translation column"):
        load_corpus(config(folder, tmp_path, format="json", tgt="fr"))
    (folder / "train.jsonl").write_text(json.dumps({"a": "hallo", "b": "hello"}) + "\n")
    with pytest.raises(DataError, match="set data.src_column and data.tgt_column"):
        load_corpus(config(folder, tmp_path, format="json"))


# --- commands --------------------------------------------------------------------------------------


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow  # end to end in subprocesses
def test_prepare_command_prints_the_table_and_reuses_the_cache(tmp_path):
    write_text_corpus(tmp_path / "c")
    args = ["-m", "transformer.prepare", f"data.path={tmp_path / 'c'}", f"data.cache_dir={tmp_path / 'cache'}",
            "data.vocab_size=340", "data.test_split=test", "data.max_tokens=300"]  # fmt: skip
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert "training a joint unigram sentencepiece model" in first.stdout + first.stderr
    for word in ("train", "val", "test", "padding", "batches", "vocabulary: 340"):
        assert word in first.stdout
    second = run(*args)
    assert "(reused)" in second.stdout and "training a" not in second.stdout + second.stderr
    bad = run(*args, "data.src=xx")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "language 'xx' is not in the corpus" in bad.stderr


def test_fetch_script_offline_and_from_a_folder(tmp_path):
    offline = run("scripts/fetch_multi30k.py", "--to", str(tmp_path / "m"), "--url", "http://127.0.0.1:9")
    assert offline.returncode != 0 and offline.stderr.strip().count("\n") == 0
    assert "--from DIR" in offline.stderr and "cannot download" in offline.stderr
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en", "fr", "cs"):
            (src / f"{split}.{lang}.gz").write_bytes(gzip.compress(f"{split} {lang}\n".encode()))
    copied = run("scripts/fetch_multi30k.py", "--to", str(tmp_path / "m"), "--from", str(src))
    assert copied.returncode == 0, copied.stderr
    assert gzip.decompress((tmp_path / "m" / "val.fr.gz").read_bytes()) == b"val fr\n"
