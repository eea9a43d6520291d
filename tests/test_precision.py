import json
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from transformer.machine import precision
from transformer.machine.precision import INHERITED, bf16_speedup, resolve_precision
from transformer.model import ModelConfig

from .helpers import RECORD, run_train, tiny_data, write_text_corpus
from .helpers.ranks import run_ranks


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


def test_ranks_lightnings_launcher_starts_inherit_rank_zeros_choice(monkeypatch):
    monkeypatch.setenv(INHERITED, "unset")  # restored after the test
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(precision, "bf16_speedup", lambda: 2.0)
    assert resolve_precision("auto", "cpu")[0] == "bf16-mixed"  # rank 0 probes
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(precision, "bf16_speedup", lambda: pytest.fail("measured"))
    assert resolve_precision("auto", "cpu")[0] == "bf16-mixed"


def _train_in_rank(rank: int, speedups: tuple[float, float], overrides: list[str], folder) -> None:
    measured = []
    # each rank's own timing, forced to disagree with the other's: rank 0's alone may count
    precision.bf16_speedup = lambda: measured.append(rank) or speedups[rank]
    trainer = run_train(folder / "run", overrides)
    state = {"precision": str(trainer.precision), "world": trainer.world_size, "measured": len(measured)}
    (folder / f"rank{rank}.json").write_text(json.dumps(state))


@pytest.mark.parametrize(("launcher", "speedups"), [("torchrun", (2.0, 0.5)), ("slurm", (0.5, 2.0))])
def test_ranks_an_outside_launcher_starts_train_in_rank_zeros_choice(trained, tmp_path, launcher, speedups):
    """Two ranks started as torchrun or SLURM's srun starts them, whose bf16 timings disagree: rank 0 times once,
    and both train in its choice (each rank's own would have split them)."""
    corpus = trained[0]
    overrides = [*tiny_data(corpus / "c", corpus / "cache"), "data.vocab_size=320", "model=tiny", "trainer=ddp",
                 "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=auto", "trainer.max_steps=1",
                 "trainer.num_sanity_val_steps=0", "~logger", "trainer.enable_progress_bar=false"]  # fmt: skip
    run_ranks(_train_in_rank, speedups, overrides, tmp_path, launcher=launcher)
    chosen = precision.cpu_precision(speedups[0])
    states = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(state["precision"], state["world"]) for state in states] == [(chosen, 2)] * 2
    assert [state["measured"] for state in states] == [1, 0]  # rank 0 alone timed


def test_auto_measures_nothing_on_an_accelerator_it_cannot_time(monkeypatch):
    monkeypatch.setattr(precision, "bf16_speedup", lambda: pytest.fail("measured"))
    assert resolve_precision("auto", "mps")[0] == "32-true"


class TimedProducts(TorchFunctionMode):
    """Every matrix product recorded, (dtype, shapes), and not computed: each takes `seconds[dtype]` on a clock of
    its own."""

    def __init__(self, seconds: dict[torch.dtype, float]):
        super().__init__()
        self.seconds, self.now, self.products = seconds, 0.0, []

    def clock(self) -> float:
        return self.now

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.Tensor.matmul:
            return func(*args, **(kwargs or {}))
        a, b = args
        self.products.append((a.dtype, tuple(a.shape), tuple(b.shape)))
        self.now += self.seconds[a.dtype]
        return torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)


@pytest.mark.parametrize(("float32_s", "bf16_s"), [(3.0, 1.0), (1.0, 4.0)])
def test_bf16_speedup_is_float32s_time_over_bf16s_on_the_probe_shape(monkeypatch, float32_s, bf16_s):
    """Each dtype's product of the small model's feed-forward shapes on 4,096 tokens, once to build its kernel and
    then timed 8 times; the speedup is the quotient of their times."""
    products = TimedProducts({torch.float32: float32_s, torch.bfloat16: bf16_s})
    monkeypatch.setattr(precision, "time", SimpleNamespace(perf_counter=products.clock))
    with products:
        speedup = bf16_speedup()
    small = ModelConfig.from_size("small", src_vocab_size=2, tgt_vocab_size=2, pad_id=0)
    assert products.products == [(dtype, (4096, small.d_model), (small.d_model, small.d_ff))
                                 for dtype in (torch.float32, torch.bfloat16) for _ in range(1 + 8)]  # fmt: skip
    assert speedup == float32_s / bf16_s


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
