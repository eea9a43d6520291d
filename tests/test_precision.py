from types import SimpleNamespace

import pytest
import torch

from transformer import precision
from transformer.precision import INHERITED, bf16_speedup, resolve_precision

from .helpers import RECORD, run_train, tiny_data, write_text_corpus


@pytest.mark.parametrize("given", ["32", "32-true", "bf16-mixed", "16-mixed", 32])
def test_a_chosen_precision_is_kept(given):
    assert resolve_precision(given, "cpu") == (given, None)


@pytest.mark.parametrize(("speedup", "chosen"), [(0.6, "32-true"), (1.05, "32-true"), (2.7, "bf16-mixed")])
def test_auto_on_cpu_takes_bf16_only_where_it_multiplies_faster(monkeypatch, speedup, chosen):
    monkeypatch.setattr(precision, "bf16_speedup", lambda: speedup)
    found, note = resolve_precision("auto", "cpu")
    assert found == chosen and f"{speedup:.2f}x" in note and chosen in note


@pytest.mark.parametrize("resumed", ["32-true", "bf16-mixed"])
def test_a_resumed_cpu_run_keeps_its_checkpoints_precision(monkeypatch, resumed):
    monkeypatch.setattr(precision, "bf16_speedup", lambda: pytest.fail("measured"))
    found, note = resolve_precision("auto", "cpu", resumed=resumed)
    assert found == resumed and "resumed" in note


def test_ddp_ranks_take_rank_zeros_choice(monkeypatch):
    monkeypatch.setenv(INHERITED, "unset")  # restored after the test
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(precision, "bf16_speedup", lambda: 2.0)
    assert resolve_precision("auto", "cpu")[0] == "bf16-mixed"  # rank 0 probes
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(precision, "bf16_speedup", lambda: pytest.fail("measured"))
    assert resolve_precision("auto", "cpu")[0] == "bf16-mixed"


def test_auto_measures_nothing_on_an_accelerator_it_cannot_time(monkeypatch):
    monkeypatch.setattr(precision, "bf16_speedup", lambda: pytest.fail("measured"))
    assert resolve_precision("auto", "mps")[0] == "32-true"


def test_bf16_speedup_times_both_dtypes():
    speedup = bf16_speedup((256, 64, 128), repeats=3)
    assert 0.01 < speedup < 100  # a ratio of two real timings, whatever this CPU's bf16


@pytest.mark.parametrize(("bf16_seconds", "bf16_timed"), [(100.0, 1), (0.5, 3)])
def test_an_emulated_bf16_is_timed_once(monkeypatch, bf16_seconds, bf16_timed):
    """A clock on which each float32 product takes 1 s: a bf16 product 100x slower ends bf16's timing, one 0.5 s
    does not."""
    ticks, now, repeats = [], [0.0], 3

    def clock():
        ticks.append(now[0])
        if len(ticks) % 2 == 0:  # a product timed: start, end
            now[0] += 1.0 if len(ticks) <= 2 * repeats else bf16_seconds
        return now[0]

    monkeypatch.setattr(precision, "time", SimpleNamespace(perf_counter=clock))
    assert bf16_speedup((64, 64, 64), repeats=repeats) == pytest.approx(1 / bf16_seconds)
    assert len(ticks) == 2 * (repeats + bf16_timed)


def test_training_with_auto_records_the_precision_it_chose_and_resumes_in_it(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(INHERITED, "unset")
    monkeypatch.setattr(precision, "bf16_speedup", lambda: 0.5)
    write_text_corpus(tmp_path / "c")
    overrides = [*tiny_data(tmp_path / "c", tmp_path / "cache"), *RECORD, "model=tiny", "trainer.precision=auto",
                 "~logger", "trainer.enable_progress_bar=false"]  # fmt: skip
    trainer = run_train(tmp_path / "run", [*overrides, "trainer.max_steps=2"])
    assert str(trainer.precision) == "32-true"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["precision"] == "32-true"
    assert "trainer.precision=auto: 32-true (bf16 matmuls run 0.50x" in capfd.readouterr().err
    monkeypatch.setattr(precision, "bf16_speedup", lambda: 2.0)  # a fresh probe would now take bf16
    resumed = run_train(tmp_path / "run", [*overrides, "trainer.max_steps=3", "ckpt_path=last"])
    assert str(resumed.precision) == "32-true" and resumed.global_step == 3
    assert "32-true, as the resumed checkpoint was trained" in capfd.readouterr().err
