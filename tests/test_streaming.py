"""Streaming batches: disjoint streams that cover a corpus once per cycle, mixing, exact resume, bad shards."""

import json
import re
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
from torch.utils.data import DataLoader

from transformer.data.batching import Collate
from transformer.data.sources import DataError
from transformer.data.streaming import StreamingBatches, StreamPosition

from .helpers import RECORD, LossRecorder, callback, config, run_command, run_train, tiny_data, write_text_corpus

COLLATE = Collate(pad_id=0, bos_id=2, eos_id=3)
FEATURES = datasets.Features({
    "src": datasets.Value("string"), "tgt": datasets.Value("string"),
    "src_ids": datasets.Sequence(datasets.Value("int32")), "tgt_ids": datasets.Sequence(datasets.Value("int32")),
})  # fmt: skip


def write_corpus(folder: Path, ids: range, num_shards: int) -> list[Path]:
    """A split as prepare saves it, in record batches of 4 rows (so that tiny shards hold several); each pair's
    first source id is its own id in `ids`, lengths vary."""
    rng = np.random.default_rng(ids.start)
    src = [[i] + [7] * int(rng.integers(0, 6)) for i in ids]
    tgt = [[8] * int(rng.integers(0, 9)) for _ in ids]
    text = [""] * len(ids)
    ds = datasets.Dataset.from_dict({"src": text, "tgt": text, "src_ids": src, "tgt_ids": tgt}, features=FEATURES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", 4)
        ds.save_to_disk(str(folder), num_shards=num_shards)
    return sorted(folder.glob("data-*.arrow"))


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory) -> list[list[Path]]:
    """Corpus a (60 pairs in 3 shards) and corpus b (20 in 1), written once for the tests that only read them."""
    tmp = tmp_path_factory.mktemp("corpora")
    return [write_corpus(tmp / "a", range(10, 70), 3), write_corpus(tmp / "b", range(1000, 1020), 1)]


def streaming(corpora, probabilities=None, **overrides) -> StreamingBatches:
    values = dict(max_tokens=24, buffer_pairs=9, batches_per_worker=5, collate=COLLATE, seed=3)
    return StreamingBatches(corpora, probabilities or [1.0] * len(corpora), **{**values, **overrides})


def pair_ids(batch: dict) -> list[int]:
    return batch["src"][:, 0].tolist()


def test_streams_are_disjoint_and_cover_a_corpus_once_per_cycle(tmp_path):
    files = write_corpus(tmp_path / "a", range(10, 60), num_shards=3)  # 3 shards for 4 streams
    chunks = {}  # stream -> chunk -> pair ids
    for rank in range(2):
        ds = streaming([files], buffer_pairs=7, batches_per_worker=40, num_replicas=2, rank=rank)
        for batch in DataLoader(ds, batch_size=None, num_workers=2):
            assert batch["src"].numel() <= 24 and batch["tgt_in"].numel() <= 24
            state = batch["stream"]
            chunk = state["chunk"] - (state["in_chunk"] == 0)  # in_chunk 0: the state after its chunk's last batch
            chunks.setdefault(state["worker"], {}).setdefault(chunk, []).extend(pair_ids(batch))
    assert sorted(chunks) == [0, 1, 2, 3]
    parts = []
    for by_chunk in chunks.values():
        stream = [i for k in sorted(by_chunk)[:-1] for i in by_chunk[k]]  # whole chunks: a prefix of the stream
        counts = Counter(stream)
        cycles = len(stream) // len(counts)
        assert cycles >= 2
        assert sorted(Counter(counts.values())) == ([cycles, cycles + 1] if len(stream) % len(counts) else [cycles])
        assert sum(n == cycles + 1 for n in counts.values()) == len(stream) % len(counts)
        parts.append(set(counts))
    assert sum(map(len, parts)) == 50 and set().union(*parts) == set(range(10, 60))


def test_each_cycle_walks_the_part_in_a_new_order(tmp_path):
    files = write_corpus(tmp_path / "a", range(10, 30), num_shards=2)  # record batches of 4, 4, 2 rows per shard
    chunks = {}
    for batch in streaming([files], buffer_pairs=5, batches_per_worker=200):  # 4 chunks a cycle
        state = batch["stream"]
        chunks.setdefault(state["chunk"] - (state["in_chunk"] == 0), set()).update(pair_ids(batch))
    cycles = [frozenset(frozenset(chunks[k]) for k in range(c, c + 4)) for c in range(0, max(chunks) - 3, 4)]
    assert len(cycles) >= 5 and all(frozenset().union(*cycle) == set(range(10, 30)) for cycle in cycles)
    assert len(set(cycles)) > 1


def test_corpora_are_mixed_by_probability_and_a_small_one_repeats(tmp_path):
    large = write_corpus(tmp_path / "large", range(10, 410), num_shards=2)
    small = write_corpus(tmp_path / "small", range(1000, 1010), num_shards=1)  # 10 pairs for a share of ~250
    ds = streaming([large, small], [0.8, 0.2], max_tokens=40, buffer_pairs=50, batches_per_worker=300)
    ids = [i for batch in ds for i in pair_ids(batch)]
    from_small = Counter(i for i in ids if i >= 1000)
    assert sum(from_small.values()) / len(ids) == pytest.approx(0.2, abs=0.05)
    assert sorted(from_small) == list(range(1000, 1010)) and min(from_small.values()) >= 2


def run_epochs(ds: StreamingBatches, position: StreamPosition, epochs: range, workers: int, stop: int | None = None,
               label_epochs: bool = True) -> list[dict]:  # fmt: skip
    """The batches consumed over these epochs, feeding `position`; stops after `stop` batches. label_epochs=False
    leaves set_epoch uncalled: the states alone say where an epoch starts."""
    out = []
    for epoch in epochs:
        if label_epochs:
            ds.set_epoch(epoch)
        ds.resume_from(position.worker_states())
        for batch in DataLoader(ds, batch_size=None, num_workers=workers):
            position.update(batch)
            out.append(batch)
            if len(out) == stop:
                return out
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x["src"].equal(y["src"]) for x, y in zip(a, b))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize(
    ("workers", "stops", "label_epochs"), [(2, [1, 3, 8, 9, 10, 11, 19], True), (3, [1, 2, 13, 14, 15, 16], False)]
)
def test_resume_continues_exactly_where_the_consumed_batches_end(two_corpora, workers, stops, label_epochs):
    """A run stopped after `stop` batches saved the states of those batches (the uninterrupted run's first `stop`:
    batches are a pure function of the seed and the files); resumed from them, it yields the rest of that run."""
    per_epoch = 5 * workers

    def make():
        return streaming(two_corpora, [0.7, 0.3])

    full = run_epochs(make(), StreamPosition(workers), range(3), workers, label_epochs=label_epochs)
    assert len(full) == 3 * per_epoch
    for stop in stops:
        position = StreamPosition(workers)
        for batch in full[:stop]:
            position.update(batch)
        saved = json.loads(json.dumps(position.state_dict()))  # plain data, as a checkpoint holds it
        resumed = StreamPosition(workers)
        resumed.load_state_dict(saved)
        rest = run_epochs(make(), resumed, range(stop // per_epoch, 3), workers, label_epochs=label_epochs)
        assert same(rest, full[stop:]), f"resumed after {stop} batches"


def test_set_epoch_keeps_the_streams_going(two_corpora):
    corpora = two_corpora
    long = run_epochs(streaming(corpora, batches_per_worker=6), StreamPosition(2), range(1), 2)
    short = run_epochs(streaming(corpora, batches_per_worker=3), StreamPosition(2), range(2), 2)
    assert same(short, long)
    # in the main process the dataset also carries its stream over by itself, epoch label or not
    one = list(streaming(corpora, batches_per_worker=9))
    ds = streaming(corpora, batches_per_worker=3)
    three = [*ds, *ds]
    ds.set_epoch(2)
    three += list(ds)
    assert same(one, three)


def test_an_epoch_left_unfinished_is_followed_by_a_whole_one_that_continues_each_stream(two_corpora):
    corpora = two_corpora[:1]
    streams = {}  # the uninterrupted batches of each stream
    for batch in DataLoader(streaming(corpora, batches_per_worker=20), batch_size=None, num_workers=2):
        streams.setdefault(batch["stream"]["worker"], []).append(batch["src"])
    ds, position = streaming(corpora), StreamPosition(2)
    run_epochs(ds, position, range(1), 2, stop=3)  # as limit_train_batches would
    consumed = {w: s["batch"] for w, s in enumerate(position.states)}
    ds.set_epoch(1)
    ds.resume_from(position.worker_states())
    epoch = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(epoch) == ds.epoch_batches(2)
    for w in (0, 1):
        mine = [b["src"] for b in epoch if b["stream"]["worker"] == w]
        expected = streams[w][consumed[w] : consumed[w] + 5]
        assert len(mine) == 5 and all(a.equal(b) for a, b in zip(mine, expected))


def test_a_state_for_other_workers_is_refused(tmp_path):
    ds = streaming([write_corpus(tmp_path / "a", range(10, 30), 1)])
    ds.resume_from([None, None])
    with pytest.raises(ValueError, match="data.num_workers"):
        next(iter(ds))
    with pytest.raises(ValueError, match="data.num_workers=2"):
        StreamPosition(3).load_state_dict(StreamPosition(2).state_dict())

    from transformer.data import TranslationDataModule

    write_text_corpus(tmp_path / "c")
    data = TranslationDataModule(config(tmp_path / "c", tmp_path, streaming=True))
    data.load_state_dict({"streams": [StreamPosition(1).state_dict()] * 2})  # saved by two DDP ranks
    with pytest.raises(DataError, match="streamed on 2 rank.*this run has 1: resume on 2 devices"):
        data.train_dataloader()


CUTS = {
    "half": lambda n: n // 2,
    "all but a byte": lambda n: n - 1,
    "all but the end-of-stream marker": lambda n: n - 8,
}


@pytest.mark.parametrize("kept", CUTS)  # inside a message, inside the last one, between two messages
def test_a_truncated_shard_is_skipped_with_a_warning_or_refused(tmp_path, kept):
    files = write_corpus(tmp_path / "a", range(10, 40), num_shards=2)
    data = files[1].read_bytes()
    files[1].write_bytes(data[: CUTS[kept](len(data))])
    with pytest.warns(UserWarning, match=re.escape(str(files[1]))) as warned:
        ds = streaming([files], batches_per_worker=20)
    assert [len(str(w.message).splitlines()) for w in warned] == [1]
    ids = {i for batch in ds for i in pair_ids(batch)}
    assert ids == set(range(10, 25))  # shard 0's pairs, all of them
    with pytest.raises(DataError, match=re.escape(str(files[1])) + ".*data.bad_shards=warn"):
        streaming([files], bad_shard="error")


def test_a_shard_cut_after_it_was_indexed_is_skipped_when_read(tmp_path):
    files = write_corpus(tmp_path / "a", range(10, 40), num_shards=2)
    warned, refused = streaming([files], batches_per_worker=20), streaming([files], bad_shard="error")
    files[1].write_bytes(files[1].read_bytes()[:100])  # within its schema: no record batch left
    with pytest.warns(UserWarning, match=re.escape(str(files[1]))):
        ids = {i for batch in warned for i in pair_ids(batch)}
    assert ids == set(range(10, 25))
    with pytest.raises(DataError, match=re.escape(str(files[1])) + ".*data.bad_shards=warn"):
        list(refused)


@pytest.mark.slow  # three short training runs with two loader workers each
@pytest.mark.parametrize("stop", [8, 11])  # an epoch's end, and mid-epoch
def test_a_streamed_run_stopped_and_resumed_trains_exactly_as_one_never_stopped(tmp_path, stop):
    """Two corpora streamed by 2 loader workers in chunks of 60 pairs, 8 batches an epoch: stopped after a step
    and resumed, the losses and batches after it are the uninterrupted run's."""
    write_text_corpus(tmp_path / "main")
    write_text_corpus(tmp_path / "small", {"dev": 12, "test": 5, "train": 60})
    common = [
        *tiny_data(tmp_path / "main", tmp_path / "cache"), "model=tiny", "data.streaming=true", "data.num_workers=2",
        "data.buffer_pairs=60", "data.max_tokens=160", "data.epoch_pairs=100", f"+data.corpora.small.path={tmp_path / 'small'}",
        "~logger", "trainer.enable_progress_bar=false", "trainer.check_val_every_n_epoch=2",
        "validation.bleu_max_sentences=4", *RECORD,
    ]  # fmt: skip
    whole = run_train(tmp_path / "a", [*common, "trainer.max_steps=20"])
    assert whole.num_training_batches == 8
    run_train(tmp_path / "b", [*common, f"trainer.max_steps={stop}"])
    resumed = run_train(tmp_path / "b", [*common, "trainer.max_steps=20", "ckpt_path=last"])
    a, b = callback(whole, LossRecorder), callback(resumed, LossRecorder)
    assert sorted(b.losses) == list(range(stop + 1, 21))
    for step, loss in b.losses.items():
        assert b.batches[step] == a.batches[step], step
        assert loss == pytest.approx(a.losses[step], rel=1e-6, abs=1e-7), step


@pytest.mark.slow  # three short DDP runs of two CPU processes (gloo) each
@pytest.mark.parametrize("streaming", [True, False])
def test_two_ddp_ranks_stopped_and_resumed_train_exactly_as_never_stopped(tmp_path, streaming):
    """The checkpoint gathers both ranks' states (random state for dropout; streamed: each rank's own part of the
    corpus) and each rank resumes its own: after the stop, every rank's losses and batches are the uninterrupted
    run's. In memory, both ranks step through one list of batches, whose place rank 0's checkpoint holds."""
    write_text_corpus(tmp_path / "main")
    common = [
        *tiny_data(tmp_path / "main", tmp_path / "cache"), "model=tiny", f"data.streaming={str(streaming).lower()}",
        "data.num_workers=1", "data.worker_start=forkserver",  # a fork of a DDP rank could wait forever on a lock
        "data.buffer_pairs=60", "data.max_tokens=160", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
        "trainer.precision=32", "~logger", "trainer.enable_progress_bar=false", "trainer.check_val_every_n_epoch=50",
        "+callbacks.recorder._target_=tests.helpers.runs.LossFile",
    ]  # fmt: skip

    def run(name: str, *overrides: str) -> list[dict]:
        folder = tmp_path / name
        result = run_command(*common, f"hydra.run.dir={folder}", f"+callbacks.recorder.folder={folder}", *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads((folder / f"losses.rank{rank}.json").read_text()) for rank in (0, 1)]

    whole = run("a", "trainer.max_steps=12")
    run("b", "trainer.max_steps=5")
    resumed = run("b", "trainer.max_steps=12", "ckpt_path=last")
    for rank in (0, 1):
        a, b = whole[rank], resumed[rank]
        assert sorted(map(int, b["losses"])) == list(range(6, 13))
        for step, loss in b["losses"].items():
            assert b["batches"][step] == a["batches"][step], (rank, step)
            assert loss == pytest.approx(a["losses"][step], rel=1e-6, abs=1e-7), (rank, step)
    seen = [{i for batch in whole[rank]["batches"].values() for i in batch} for rank in (0, 1)]
    if streaming:  # each rank streams its own part of the corpus
        assert seen[0] and seen[1] and not seen[0] & seen[1]
