"""One host sync per logging interval in the real Lightning loop: what would make a GPU's host wait (tensor values read
into Python, device tensors made from Python values), and the collectives, recorded on CPU over whole steps with
logging and the progress bar on, in one process and in 2 DDP ranks."""

import json
import signal

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .helpers import callback, run_train, tiny_data, write_text_corpus
from .helpers.host_syncs import CountHostSyncs, HostSyncs
from .helpers.ranks import run_ranks

STEPS = 3
THE_ONE_SYNC = "tolist in steps.py:read"  # the readout: norms, losses, stop requests at once
COUNT = ["+callbacks.count._target_=tests.helpers.host_syncs.CountHostSyncs", f"+callbacks.count.steps={STEPS}"]


def overrides(corpus, tmp_path, *extra: str) -> list[str]:
    # log_every_n_steps=1: every counted step also logs; max_tokens=120 keeps validation out of the counted steps
    return [*tiny_data(corpus, tmp_path / "cache"), "model=tiny", "data.max_tokens=120", "trainer.max_steps=6",
            "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=true", *COUNT, *extra]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [["trainer.precision=32"], ["trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=2", "optim.ema_decay=0.99"]],
    ids=["fp32", "bf16-accumulated-ema"],
)  # fmt: skip
def test_one_sync_per_optimizer_step(tmp_path, extra):
    write_text_corpus(tmp_path / "c")
    trainer = run_train(tmp_path / "run", overrides(tmp_path / "c", tmp_path, *extra))
    counted = callback(trainer, CountHostSyncs)
    assert counted.syncs == [THE_ONE_SYNC] * STEPS
    assert counted.collectives == []
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("train/loss", "train/grad_norm", "train/tokens_per_s"):  # each optimizer step once, as Lightning
        assert [e.step for e in events.Scalars(tag)] == list(range(6)), tag  # numbers them (steps done before)


def test_one_sync_per_logging_interval(tmp_path):
    """Steps 3 to 8 counted, logging every 3rd: two reads, each of its interval's three steps, and a curve point at
    each logged step with that step's own values, as Lightning numbers them."""
    write_text_corpus(tmp_path / "c")
    trainer = run_train(tmp_path / "run", [*overrides(tmp_path / "c", tmp_path, "trainer.precision=32"),
                                           "trainer.log_every_n_steps=3", "trainer.max_steps=10",
                                           "+callbacks.count.first=3", "callbacks.count.steps=6"])  # fmt: skip
    assert callback(trainer, CountHostSyncs).syncs == [THE_ONE_SYNC] * 2
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 5, 8]


def _ddp_rank(rank: int, corpus, tmp_path) -> None:
    trainer = run_train(tmp_path / "run", overrides(corpus, tmp_path, "trainer=ddp", "trainer.accelerator=cpu",
                                                    "trainer.devices=2", "trainer.precision=32",
                                                    f"+callbacks.count.folder={tmp_path}"))  # fmt: skip
    assert trainer.world_size == 2


def test_one_sync_and_one_collective_per_step_under_ddp(tmp_path):
    """Each rank: the readout's sync, and one all_reduce (tokens and stop requests summed); DDP's gradient all-reduce
    runs in its C++ reducer, unseen here, and no buffer is broadcast before each forward."""
    write_text_corpus(tmp_path / "c")
    run_train(tmp_path / "prepare", [*tiny_data(tmp_path / "c", tmp_path / "cache"), "debug=fast"])  # cache ready
    run_ranks(_ddp_rank, tmp_path / "c", tmp_path)
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"syncs.rank{rank}.json").read_text())
        assert counted["syncs"] == [THE_ONE_SYNC] * STEPS, rank
        assert counted["collectives"] == ["all_reduce in steps.py:totals"] * STEPS, rank


def _ddp_rank_signalled(rank: int, corpus, tmp_path, extra: list[str]) -> None:
    run_train(tmp_path / "run", overrides(corpus, tmp_path, "trainer=ddp", "trainer.accelerator=cpu",
                                          "trainer.devices=2", "trainer.precision=32", "trainer.max_steps=12",
                                          "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                                          "+callbacks.signal_at.step=4", "+callbacks.signal_at.rank=1", *extra))  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [[], ["trainer.log_every_n_steps=50", "+callbacks.checkpoint_on_signal.within_s=1e-6"]],
    ids=["read-every-logged-step", "read-within-seconds"],
)  # fmt: skip
def test_a_signal_to_one_ddp_rank_stops_both_after_the_same_step(tmp_path, extra):
    """SIGTERM reaches rank 1 alone, at the start of step 5: the step's collective tells rank 0, both write last.ckpt
    after it and exit with 143 (rank 0 alone saving, or the ranks stopping at different steps, would hang or fail).
    Logging every 50 steps, the request is still read within CheckpointOnSignal's within_s of training, here at
    once: at rank 0's pace, as both ranks read it, that is the next step."""
    write_text_corpus(tmp_path / "c")
    run_train(tmp_path / "prepare", [*tiny_data(tmp_path / "c", tmp_path / "cache"), "debug=fast"])
    run_ranks(_ddp_rank_signalled, tmp_path / "c", tmp_path, extra, codes=(128 + signal.SIGTERM,))
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5 and len(checkpoint["rng"]) == 2


def test_the_recorder_counts_every_kind_of_wait_and_nothing_else():
    """Each line below would make a GPU's host wait (a value read, an output sized by values, a boolean index, a
    copy from the host): the recorder must see each; the device-side work between them, none."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    waits = [lambda: x.sum().item(), lambda: x.nonzero(), lambda: torch.masked_select(x, mask), lambda: x[mask],
             lambda: x.__setitem__(mask, 0.0), lambda: torch.tensor([1, 2], device="cpu"), lambda: bool(x.any())]  # fmt: skip
    free = [lambda: x * 2, lambda: x[1:3], lambda: x.masked_fill(mask, 0.0), lambda: torch.where(mask, x, 0.0),
            lambda: x[torch.tensor([0, 2])]]  # fmt: skip
    for wait in waits:
        with HostSyncs() as recorder:
            wait()
        assert len(recorder.syncs) == 1, recorder.syncs
    with HostSyncs() as recorder:
        for step in free:
            step()
    assert recorder.syncs == []
