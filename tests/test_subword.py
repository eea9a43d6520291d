"""Subword regularisation (data.sampling_alpha): training pairs segmented afresh each epoch, exactly reproducibly."""

import hashlib
import pickle
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from lightning_fabric.utilities.data import _set_sampler_epoch

from transformer.data import DataConfig, TranslationDataModule, subword
from transformer.data.subword import NBest, nbest_table

from .helpers import config, write_text_corpus


def rows(batch: dict, key: str, pad_id: int, special: set[int]) -> dict[int, list[int]]:
    """Each example's ids in a batch tensor, by example index, without padding and special tokens."""
    return {
        i: [t for t in row if t != pad_id and t not in special]
        for i, row in zip(batch["index"].tolist(), batch[key].tolist())
    }


def epoch_ids(dm: TranslationDataModule, loader, epoch: int) -> dict[int, tuple[list[int], list[int]]]:
    _set_sampler_epoch(loader, epoch)  # what Lightning's fit loop calls at each epoch
    tok, ids = dm.tgt_tokenizer, {}
    special = {tok.bos_id, tok.eos_id}
    for batch in loader:
        src, tgt = rows(batch, "src", tok.pad_id, special), rows(batch, "tgt_out", tok.pad_id, special)
        ids.update({i: (src[i], tgt[i]) for i in src})
    return ids


def write_corpora(folder: Path) -> Path:
    write_text_corpus(folder / "a", sizes={"train": 150, "val": 20, "test": 20})
    write_text_corpus(folder / "b", sizes={"train": 100, "val": 20, "test": 20})
    return folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The corpora's tokenizers trained and splits encoded once for the module; no n-best lists yet."""
    folder = write_corpora(tmp_path_factory.mktemp("prepared"))
    TranslationDataModule(sampling_config(folder)).setup()
    return folder / "cache"


@pytest.fixture
def corpora(tmp_path, prepared) -> Path:
    """The corpora, with a copy of the prepared cache of the test's own (its n-best lists are the test's to make,
    damage or remove); the cache is keyed by the corpora's content, so the copy is found."""
    shutil.copytree(prepared, tmp_path / "cache")
    return write_corpora(tmp_path)


def sampling_config(tmp_path, **overrides) -> DataConfig:
    corpora = {"b": {"path": str(tmp_path / "b"), "tag": "__b__", "test_split": "test"}}
    values = dict(corpora=corpora, temperature=1.0, sampling_alpha=0.1, vocab_size=360, max_tokens=400)
    return config(tmp_path / "a", tmp_path, **{**values, **overrides})


def test_each_epoch_samples_new_segmentations_of_the_same_text(corpora):
    dm = TranslationDataModule(sampling_config(corpora))
    dm.setup()
    splits = [dm.dataset("a/train"), dm.dataset("b/train")]
    texts = [(s, t) for ds in splits for s, t in zip(ds["src"], ds["tgt"])]
    stored = [(s, t) for ds in splits for s, t in zip(ds["src_ids"], ds["tgt_ids"])]
    tag = dm.src_tokenizer.tag_id("__b__")
    loader = dm.train_dataloader()
    epochs = [epoch_ids(dm, loader, e) for e in (0, 1)]
    assert sorted(epochs[0]) == list(range(len(texts)))  # every pair once (temperature 1: shares by size)
    # a later epoch keeps the first's batch count, so a surplus batch of its packing is left out (all_batches)
    assert set(epochs[1]) <= set(epochs[0]) and len(epochs[1]) > 0.9 * len(texts)
    for ids in epochs:
        for i, (src, tgt) in ids.items():
            from_b = i >= len(splits[0])
            assert (src[0] == tag) == from_b  # the corpus tag stays first, unsampled
            assert dm.src_tokenizer.decode([src[from_b:]]) == [texts[i][0]]  # the segmentation changes, not the text
            assert dm.tgt_tokenizer.decode([tgt]) == [texts[i][1]]
        changed = sum(ids[i] != tuple(stored[i]) for i in ids)
        assert changed > len(ids) / 2
    assert sum(epochs[0][i] != epochs[1][i] for i in epochs[1]) > len(epochs[1]) / 2

    val = dm.validation_split
    special = {dm.tgt_tokenizer.bos_id, dm.tgt_tokenizer.eos_id}
    for batch in dm.val_dataloader():  # dev sets keep their one segmentation
        for i, ids in rows(batch, "src", dm.tgt_tokenizer.pad_id, special).items():
            assert ids == val[i]["src_ids"]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_sampling_reproduces_from_the_seed_and_resumes_mid_epoch(corpora, num_workers):
    cfg = sampling_config(corpora, num_workers=num_workers)
    dm = TranslationDataModule(cfg)
    loader = dm.train_dataloader()
    expected = [b["src"] for b in (_set_sampler_epoch(loader, 2), loader)[1]]

    first = TranslationDataModule(cfg)
    loader = first.train_dataloader()
    _set_sampler_epoch(loader, 2)
    it = iter(loader)
    seen = [next(it)["src"] for _ in range(3)]
    first.set_resume_point(2, 3)  # as ExactResume does: workers fetch ahead of the batches trained
    state = first.state_dict()
    del it

    resumed = TranslationDataModule(cfg)  # a new process's view: segmentations from (seed, epoch) alone
    resumed.load_state_dict(state)
    loader = resumed.train_dataloader()
    _set_sampler_epoch(loader, 2)
    rest = [b["src"] for b in loader]
    assert len(seen + rest) == len(expected)
    assert all(a.equal(b) for a, b in zip(seen + rest, expected))


def test_another_seed_samples_other_segmentations(corpora):
    one, other = (TranslationDataModule(sampling_config(corpora, seed=seed)) for seed in (0, 2))
    ids, others = epoch_ids(one, one.train_dataloader(), 2), epoch_ids(other, other.train_dataloader(), 2)
    assert sum(ids[i] != others[i] for i in ids) > len(ids) / 2


SEGMENT_IN_A_NEW_PROCESS = """
import hashlib, pickle, sys
from transformer.data import TranslationDataModule
config, epoch = sys.stdin.readline().split()
dm = TranslationDataModule(pickle.load(open(config, "rb")))
segmentation = dm.train_dataloader().dataset.segmentation(int(epoch))
print(hashlib.sha256(b"".join(a.tobytes() for side in segmentation for a in side)).hexdigest())
"""


@pytest.fixture(scope="module", autouse=True)
def another_process():
    """A new Python process that segments the training pairs of the config it is sent, for
    test_segmentations_are_the_same_in_another_process: started with the module's first test, so that its imports
    (seconds) overlap the tests that run before that one, the module's last."""
    pipe = subprocess.PIPE
    with subprocess.Popen([sys.executable, "-c", SEGMENT_IN_A_NEW_PROCESS], stdin=pipe, stdout=pipe, stderr=pipe,
                          text=True) as child:  # fmt: skip
        yield child
        child.kill()  # unused (a test selected alone), or already done


def digest(segmentation) -> str:
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for side in segmentation for a in side)).hexdigest()


def nbest_caches(cfg: DataConfig) -> list[Path]:
    return sorted(p for p in Path(cfg.cache_dir).rglob("nbest*") if p.is_dir())


def test_nbest_lists_are_computed_once_per_prepared_data(corpora, monkeypatch):
    """A resumed run, a new run on the same data and a node's other ranks load the cached lists (and draw the same
    segmentations); a damaged cache is named in a warning and rebuilt; prepare_data, Lightning's once-per-node hook,
    fills the cache before the other ranks ask for it."""

    def computed_again(*args, **kwargs):
        raise AssertionError("the n-best lists were computed again")

    def drawn(cfg: DataConfig, cached: bool) -> str:
        """Epoch 3's segmentations in a new data module; cached: computing the lists fails the test."""
        with monkeypatch.context() as patched:
            if cached:
                patched.setattr(subword, "nbest_table", computed_again)
            return digest(TranslationDataModule(cfg).train_dataloader().dataset.segmentation(3))

    cfg = sampling_config(corpora)
    built = drawn(cfg, cached=False)
    (cache,) = nbest_caches(cfg)
    assert drawn(cfg, cached=True) == built

    cut = cache / "tgt.values.npy"
    cut.write_bytes(cut.read_bytes()[:-8])
    with pytest.warns(UserWarning, match=r"the n-best cache .*nbest.* is damaged"):
        assert drawn(cfg, cached=False) == built
    assert drawn(cfg, cached=True) == built  # rebuilt whole

    other = sampling_config(corpora, nbest_size=8)  # other lists, in a folder of their own
    TranslationDataModule(other).prepare_data()
    assert len(nbest_caches(other)) == 2
    assert drawn(other, cached=True) != built


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(corpora, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    cfg = sampling_config(corpora)
    with pytest.warns(UserWarning, match=r"could not be cached in .*No space left on device"):
        lengths = TranslationDataModule(cfg).train_dataloader().dataset.lengths(0)
    assert len(lengths) == sum(TranslationDataModule(cfg).data.corpus_stats[c]["train"]["kept"] for c in ("a", "b"))
    assert nbest_caches(cfg) == []  # nothing half-written left to be mistaken for a cache


def test_the_draw_follows_sentencepiece_sampling_distribution(corpora):
    """Our seeded draw from the n-best list against sentencepiece's own nbest sampling: p ∝ exp(alpha * score)."""
    dm = TranslationDataModule(sampling_config(corpora))
    dm.setup()
    tok, text, alpha, n, draws = dm.src_tokenizer, dm.dataset("a/train")[0]["src"], 0.1, 8, 20_000
    stored = np.asarray(tok.encode([text])[0], np.int32)
    one = nbest_table([text], tok, n, (stored, np.array([0, len(stored)])), max_length=100)
    table = NBest(one.values, one.offsets, np.zeros(draws, np.int64), np.tile(one.scores, (draws, 1)))
    values, offsets = table.draw(alpha, np.random.default_rng(0))
    ours = Counter(tuple(values[offsets[i] : offsets[i + 1]]) for i in range(draws))
    theirs = Counter(tuple(x) for x in tok.sp.encode([text] * draws, enable_sampling=True, alpha=alpha, nbest_size=n))
    assert max(ours.values()) < 0.5 * draws  # spread over several segmentations, or the comparison says little
    for hyp in set(ours) | set(theirs):  # each frequency within 4 standard deviations of their difference
        assert abs(ours[hyp] - theirs[hyp]) / draws < 0.02, (hyp, ours[hyp], theirs[hyp])


def test_unseeded_sampling_warns_that_resume_will_differ(corpora):
    dm = TranslationDataModule(sampling_config(corpora, nbest_size=-1))
    with pytest.warns(UserWarning, match="data.nbest_size=N"):
        lengths = dm.train_dataloader().dataset.lengths(0)
    assert len(lengths) == sum(dm.data.corpus_stats[c]["train"]["kept"] for c in ("a", "b"))


def test_a_sampled_segmentation_too_long_keeps_the_stored_one(corpora):
    """max_length below the sampled lengths: the stored ids (within it) are used, and no pair is dropped."""
    dm = TranslationDataModule(sampling_config(corpora, sampling_alpha=0.01, max_length=30))
    dm.setup()
    lengths = dm.train_dataloader().dataset.lengths(0)
    assert lengths.max() <= 31
    assert len(lengths) == sum(dm.data.corpus_stats[c]["train"]["kept"] for c in ("a", "b"))
    ids = epoch_ids(dm, dm.train_dataloader(), 0)
    stored = dm.dataset("a/train")["tgt_ids"]
    assert any(ids[i][1] == stored[i] for i in range(len(stored)))
    assert np.mean([ids[i][1] != stored[i] for i in range(len(stored))]) > 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sampling_alpha": 0.0}, "data.sampling_alpha=0.0 must be positive"),
        ({"sampling_alpha": 1.5, "tokenizer_type": "bpe"}, "at most 1 for bpe"),
        ({"sampling_alpha": 0.1, "streaming": True}, "set data.streaming=false or data.sampling_alpha=null"),
        ({"nbest_size": 1}, "data.nbest_size=1 must be -1"),
    ],
)
def test_bad_sampling_settings_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path / "a", tmp_path, **overrides)


def test_segmentations_are_the_same_in_another_process(corpora, another_process):
    """What a run resumed in a new process sees: sentencepiece's own sampler differs in every process, and so does
    Python's hash seed. Each process computes its own n-best lists (the other's cached ones removed)."""
    cfg = sampling_config(corpora)
    (corpora / "config.pkl").write_bytes(pickle.dumps(cfg))
    out, err = another_process.communicate(f"{corpora / 'config.pkl'} 3\n", timeout=300)
    assert another_process.returncode == 0, err[-3000:]
    (cache,) = nbest_caches(cfg)
    shutil.rmtree(cache)
    assert digest(TranslationDataModule(cfg).train_dataloader().dataset.segmentation(3)) == out.split()[-1]
