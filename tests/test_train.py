import inspect
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf, open_dict
from pytorch_lightning.callbacks import Timer
from pytorch_lightning.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.kernel_calls import record_sdpa
from transformer.base.overrides import laid_over, split_flags
from transformer.cli.command import check_overrides
from transformer.data import TranslationDataModule
from transformer.machine.allocator import HINT, jemalloc_library
from transformer.model import RuntimeConfig
from transformer.model.kernels.rules import cuda_kernel
from transformer.train import as_launched, train
from transformer.training import OptimConfig, TranslationModule, ValidationConfig
from transformer.training.resume import launch_overrides, launch_record, run_dir_for
from transformer.training.schedule import check_schedule, clock_share, lr_factor
from transformer.training.setup import model_config
from transformer.training.tensorboard import TensorBoardSamples

from .helpers import (
    MULTI30K,
    RECORD,
    ROOT,
    LossRecorder,
    callback,
    compose_train,
    config,
    run_command,
    run_train,
    tiny_data,
    write_text_corpus,
    write_word_for_word_corpus,
)  # fmt: skip
from .helpers.prerequisites import require

# --- the module -----------------------------------------------------------------------------------


def test_lr_schedules():
    assert lr_factor(0, 4, "inverse_sqrt", 0) == pytest.approx(0.25)
    assert lr_factor(3, 4, "inverse_sqrt", 0) == pytest.approx(1.0)  # peak at the end of warmup
    assert lr_factor(15, 4, "inverse_sqrt", 0) == pytest.approx(0.5)  # sqrt(4 / 16)
    assert lr_factor(3, 4, "cosine", 20) == pytest.approx(1.0)
    assert lr_factor(11, 4, "cosine", 20) == pytest.approx(0.5)
    assert lr_factor(19, 4, "cosine", 20) == pytest.approx(0.0, abs=1e-12)


def test_a_cosine_decays_by_the_clock_or_the_steps_whichever_ends_the_run_first():
    assert lr_factor(11, 4, "cosine", 10**6, clock=0.5) == pytest.approx(0.5)  # the clock's half, not the steps'
    assert lr_factor(11, 4, "cosine", 20, clock=0.1) == pytest.approx(0.5)  # the steps end it first
    assert lr_factor(11, 4, "cosine", 10**6, clock=1.0) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(15, 4, "inverse_sqrt", 0, clock=0.9) == pytest.approx(0.5)  # no end to reach
    # a clock running from step 0 (a run of 100 steps): the ramp meets the cosine without a jump, then follows it
    factors = [lr_factor(step, 10, "cosine", 10**6, clock=(step + 1) / 100) for step in range(100)]
    assert max(abs(a - b) for a, b in zip(factors, factors[1:])) <= 0.1 + 1e-9  # the ramp's own rise per step
    assert max(factors) < 1 and factors[-1] == pytest.approx(0.0, abs=1e-12)


def test_the_clocks_share_counts_a_resumed_runs_time():
    timer = Timer(duration="00:00:01:00")
    timer.load_state_dict({"time_elapsed": {"train": 30.0}})  # a resumed run that trained 30 s of its minute
    assert clock_share(SimpleNamespace(callbacks=[timer]))() == pytest.approx(0.5)
    assert clock_share(SimpleNamespace(callbacks=[]))() == 0.0  # no time limit
    assert lr_factor(11, 4, "cosine", None, clock=0.5) == pytest.approx(0.5)  # max_epochs=-1: the clock alone


def test_a_cosine_without_an_end_or_by_a_clock_the_ddp_ranks_read_apart_is_refused():
    run = {"max_time": "00:00:01:00", "max_steps": -1, "max_epochs": None, "num_nodes": 1, "devices": 1,
           "accelerator": "cpu"}  # fmt: skip
    check_schedule("cosine", run)
    check_schedule("inverse_sqrt", {**run, "devices": 2})
    check_schedule("cosine", {**run, "devices": 2, "max_time": None, "max_steps": 100})
    with pytest.raises(ValueError, match=r"max_time=00:00:01:00 decays by the clock, which the 4 ranks .*max_steps=N"):
        check_schedule("cosine", {**run, "devices": 2, "num_nodes": 2})
    with pytest.raises(ValueError, match="max_epochs=-1 without trainer.max_steps or trainer.max_time never ends"):
        check_schedule("cosine", {**run, "max_time": None, "max_epochs": -1})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder with a small generated corpus (c/: 13 batches an epoch at tiny_data's max_tokens) and the data cache
    that every run on it shares (cache/): its tokenizer is trained and its splits encoded once for the module."""
    folder = tmp_path_factory.mktemp("corpus")
    write_text_corpus(folder / "c")
    return folder


def on(corpus: Path) -> list[str]:
    return tiny_data(corpus / "c", corpus / "cache")


def test_training_lowers_validation_loss_and_checkpoint_loads_alone(corpus, tmp_path):
    data = TranslationDataModule(config(corpus / "c", corpus, max_tokens=400))
    data.setup()
    model = model_config({"size": "tiny", "dropout": 0.0}, data)
    assert model.src_vocab_size == data.data.src_tokenizer.vocab_size
    module = TranslationModule(**TranslationModule.hyperparameters(model, OptimConfig(lr=3e-3, warmup_steps=20),
                                                                   ValidationConfig(bleu_every=0)))  # loss only  # fmt: skip
    trainer = pl.Trainer(max_epochs=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    first = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    trainer.fit(module, datamodule=data)
    last = trainer.callback_metrics["val/loss"].item()
    assert last < 0.6 * first

    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = TranslationModule.load_from_checkpoint(path, weights_only=True).eval()
    module.eval()
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch["src"], batch["tgt_in"]), module(batch["src"], batch["tgt_in"]))
    assert torch.load(path, weights_only=True)["tokenizers"]["src"] == data.data.src_tokenizer.path.read_bytes()


@pytest.fixture(scope="module")
def overfitted(tmp_path_factory) -> tuple[Path, pl.Trainer]:
    """The tiny model trained on 48 word-for-word pairs until it translates them (60 epochs of 2 batches), validated
    on them every 12 epochs: BLEU and chrF climb. The best checkpoints are kept by chrF (validation.best_metric=chrf)
    in checkpoints/, and by BLEU, by a second BestCheckpoint, in best_bleu/."""
    tmp = tmp_path_factory.mktemp("overfitted")
    write_word_for_word_corpus(tmp / "c", 48)
    cfg = compose_train(tmp / "run", [
        *tiny_data(tmp / "c", tmp / "cache"), "data.vocab_size=320", "data.valid_split=train", "data.max_tokens=1000",
        "model=tiny", "model.d_model=64", "model.d_ff=128", "model.dropout=0.0", "optim.lr=3e-3",
        "optim.warmup_steps=20", "optim.label_smoothing=0.0", "trainer.precision=32-true", "trainer.max_epochs=60",
        "trainer.check_val_every_n_epoch=12", "trainer.enable_progress_bar=false", "validation.best_metric=chrf",
    ])  # fmt: skip
    with open_dict(cfg):
        cfg.callbacks.best_bleu = {"_target_": "transformer.training.checkpoint.BestCheckpoint",
                                   "dirpath": str(tmp / "run" / "best_bleu"), "monitor": "val/bleu", "mode": "max",
                                   "filename": "epoch{epoch}-step{step}-bleu{val/bleu:.2f}", "save_top_k": 3,
                                   "auto_insert_metric_name": False}  # fmt: skip
    return tmp / "run", train(cfg, tmp / "run")


def test_tiny_model_overfits_its_training_pairs_to_bleu_above_90(overfitted):
    assert overfitted[1].callback_metrics["val/bleu"].item() > 90


# --- one run, interrupted by SIGTERM and resumed, against the same run uninterrupted ---------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """A: 20 steps (13 batches an epoch, validation every 4 batches scoring 6 sentences, dropout on)
    uninterrupted. The same run stopped, then resumed with `ckpt_path=last` into its folder: B by SIGTERM during
    step 15 (mid-epoch); C during step 13, the last of the first epoch; E during step 8, after which a validation is
    due: it runs before the checkpoint; D validating at the epoch's last batch only, ended by max_steps at step 16
    (mid-epoch). And D2: resumed from D's best checkpoint, of step 13, into a folder of its own."""
    tmp = tmp_path_factory.mktemp("runs")
    common = [*on(corpus), *RECORD, "model=tiny", "trainer.precision=32-true", "trainer.max_steps=20",
              "trainer.val_check_interval=4", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
              "optim.warmup_steps=10", "validation.bleu_max_sentences=6",
              "data.num_workers=1"]  # a loader worker fetches ahead of training  # fmt: skip
    a = run_train(tmp / "a", common)
    codes, resumed = {}, {}
    for name, step in (("b", 14), ("c", 12), ("e", 7)):
        with pytest.raises(SystemExit) as stopped:
            run_train(tmp / name, [*common, "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                                   f"+callbacks.signal_at.step={step}"])  # fmt: skip
        codes[name] = stopped.value.code
        resumed[step + 1] = run_train(tmp / name, [*common, "ckpt_path=last"])
    epoch_end = [*common, "trainer.val_check_interval=13"]
    run_train(tmp / "d", [*epoch_end, "trainer.max_steps=16"])
    resumed[16] = run_train(tmp / "d", [*epoch_end, "ckpt_path=last"])
    (best,) = (tmp / "d" / "checkpoints").glob("epoch0-step13-*.ckpt")
    resumed["best"] = run_train(tmp / "d2", [*common, f"ckpt_path={best}"])
    return tmp, a, codes, resumed


def test_sigterm_writes_a_checkpoint_and_exits_with_its_code(runs):
    tmp, a, codes, resumed = runs
    assert codes["b"] == 128 + signal.SIGTERM
    assert resumed[15].global_step == 20


# mid-epoch; epoch end; best (13); before validation; at max_steps mid-epoch
@pytest.mark.parametrize("stopped_after", [15, 13, "best", 8, 16])
def test_resumed_run_continues_exactly(runs, stopped_after):
    tmp, a, codes, resumed_runs = runs
    resumed = resumed_runs[stopped_after]
    a_record, resumed_record = callback(a, LossRecorder), callback(resumed, LossRecorder)
    first = 14 if stopped_after == "best" else stopped_after + 1
    assert sorted(resumed_record.losses) == list(range(first, 21))  # only the remaining steps
    for step, loss in resumed_record.losses.items():
        assert resumed_record.batches[step] == a_record.batches[step], step
        assert loss == pytest.approx(a_record.losses[step], rel=1e-6, abs=1e-7), step
    for (name, p), q in zip(a.lightning_module.named_parameters(), resumed.lightning_module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def short_run(corpus: Path) -> list[str]:
    """Training only (no validation), with no loggers: for runs whose checkpoints alone are looked at."""
    return [*on(corpus), "model=tiny", "trainer.precision=32-true", "~logger", "trainer.max_steps=30",
            "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"]  # fmt: skip


def test_ctrl_c_writes_a_checkpoint_at_the_batch_boundary(corpus, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "run", [*short_run(corpus), "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                                     "+callbacks.signal_at.step=3", f"+callbacks.signal_at.signum={int(signal.SIGINT)}"])  # fmt: skip
    assert stopped.value.code == 128 + signal.SIGINT
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4
    assert checkpoint["TranslationDataModule"]["train_sampler"]["position"] == 4  # batches trained, none fetched ahead


class SecondCtrlC(pl.Callback):
    """Ctrl-C as optimizer step `step` + 1 starts, and again while its loss is computed."""

    def __init__(self, step: int):
        self.step, self.sent = step, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step and self.sent == 0:
            self.sent = 1
            os.kill(os.getpid(), signal.SIGINT)

    def on_before_backward(self, trainer, module, loss):
        if self.sent == 1:
            self.sent = 2
            os.kill(os.getpid(), signal.SIGINT)


def test_a_second_ctrl_c_stops_at_once(corpus, tmp_path):
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:
            run_train(tmp_path / "run", [*short_run(corpus), "callbacks.last_checkpoint.every_n_train_steps=2",
                                         f"+callbacks.ctrl_c._target_={__name__}.SecondCtrlC", "+callbacks.ctrl_c.step=3"])  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl-C once it has handled a KeyboardInterrupt
    assert stopped.value.code == 1  # Lightning's exit on a KeyboardInterrupt, not 130 after a checkpoint
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2  # step 4 did not end


def test_a_checkpoint_records_the_overrides_its_run_was_launched_with(runs):
    tmp = runs[0]
    (best,) = (tmp / "d" / "checkpoints").glob("epoch0-step13-*.ckpt")  # by D's first run: [*epoch_end, max_steps]
    first, resumed = launch_overrides(str(best), tmp / "d"), launch_overrides("last", tmp / "d")  # [*epoch_end]
    assert "trainer.val_check_interval=13" in resumed  # what a resume by ckpt_path alone needs
    assert first == [*resumed, "trainer.max_steps=16"]  # the resume's own ckpt_path=last is not carried on


def test_the_command_resumes_with_the_recorded_overrides_first_and_says_when_there_are_none(runs, tmp_path, capsys):
    last = runs[0] / "d" / "checkpoints" / "last.ckpt"
    given = [f"ckpt_path={last}", "trainer.max_steps=30"]
    recorded = launch_overrides(str(last), last.parent.parent)
    assert "trainer.max_steps=20" in recorded
    assert as_launched(given) == [*(o for o in recorded if o != "trainer.max_steps=20"), *given]
    assert "resuming as launched:" in capsys.readouterr().err
    assert as_launched(["--cfg", "job", *given]) == [*as_launched(given), "--cfg", "job"]  # shows what resumes
    assert as_launched([*given, "--info"])[-1] == "--info"  # last: it would take an override for its value
    for multirun in (["-m", *given], ["--multi", *given], [*given, "hydra.mode=MULTIRUN"]):  # jobs have own folders
        assert as_launched(multirun) == multirun
    checkpoint = torch.load(last, weights_only=True)
    del checkpoint["overrides"]  # as checkpoints written before they were recorded
    torch.save(checkpoint, tmp_path / "old.ckpt")
    argv = [f"ckpt_path={tmp_path / 'old.ckpt'}", "model=tiny"]
    assert as_launched(argv) == argv
    assert "records no overrides" in capsys.readouterr().err


def test_hydras_flags_are_told_from_overrides_with_their_values():
    argv = ["ckpt_path=x", "a=1", "~b", "-cn", "train", "--cfg", "job", "--info", "defaults", "--resolve", "--info"]
    assert split_flags(argv) == (["-cn", "train", "--cfg", "job", "--info", "defaults", "--resolve", "--info"],
                                 ["ckpt_path=x", "a=1", "~b"])  # fmt: skip
    # argparse's abbreviations of long flags, as Hydra reads them; an ambiguous one (--c) names no flag
    argv = ["ckpt_path=x", "--config-n", "train", "--cf", "job", "--inf", "defaults", "--multi", "a=1", "--c"]
    assert split_flags(argv) == (["--config-n", "train", "--cf", "job", "--inf", "defaults", "--multi", "--c"],
                                 ["ckpt_path=x", "a=1"])  # fmt: skip


@pytest.mark.parametrize(
    "given, expected",
    [
        (["callbacks.x.step=5"], {"callbacks.x.step": 5, "logger": None}),  # sets what the launch added
        (["+callbacks.x.step=7"], {"callbacks.x.step": 7}),  # adds it anew
        (["~callbacks.x"], {"callbacks.x": None}),  # deletes what the launch added
        (["logger=tensorboard"], {"logger.tensorboard.name": "tensorboard"}),  # brings back what it deleted
        (["~logger"], {"logger": None}),  # deleted once
        (["optim.lr=5e-4"], {"optim.lr": 5e-4, "model.size": "tiny", "callbacks.x.step": 2}),
    ],
)  # fmt: skip
def test_a_resumes_overrides_are_laid_over_the_recorded_ones_as_hydra_composes_them(given, expected):
    recorded = ["model=tiny", "+callbacks.x._target_=tests.helpers.runs.SignalAt", "+callbacks.x.step=2", "~logger",
                "optim.lr=1e-3"]  # fmt: skip
    cfg = check_overrides("train", laid_over(recorded, ["ckpt_path=x.ckpt", *given]))
    assert {key: OmegaConf.select(cfg, key) for key in expected} == expected


def test_ckpt_path_last_resumes_the_newest_run_that_has_a_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    now = time.time()
    for run, age in (("a", 60), ("b", 0), ("c", 120)):  # neither the first nor the last by name is the newest
        last = tmp_path / "outputs" / run / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        last.write_bytes(b"")
        os.utime(last, (now - age, now - age))
    (tmp_path / "outputs" / "d" / "checkpoints").mkdir(parents=True)  # the newest folder, with no last.ckpt
    (tmp_path / "outputs" / "d" / "checkpoints" / "epoch0-step5-bleu1.00.ckpt").write_bytes(b"")
    assert check_overrides("train", ["ckpt_path=last"]).hydra.run.dir == str(Path("outputs") / "b")
    os.utime(tmp_path / "outputs" / "a" / "checkpoints" / "last.ckpt", (now + 60, now + 60))  # a run resumed since
    assert check_overrides("train", ["ckpt_path=last"]).hydra.run.dir == str(Path("outputs") / "a")
    assert run_dir_for("last", "outputs/new", outputs=str(tmp_path / "elsewhere")) == "outputs/new"  # none: a new run


def scalars(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.mark.parametrize("run", ["b", "e"])
def test_resumed_run_continues_the_same_tensorboard_curves(runs, run):
    tmp = runs[0]
    for tag in ("train/loss", "val/bleu"):  # one curve, no second from 0; no validation lost to the stop
        assert [e.step for e in scalars(tmp / run).Scalars(tag)] == [e.step for e in scalars(tmp / "a").Scalars(tag)]
    assert len(list((tmp / run / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_tensorboard_holds_scalars_text_and_attention_images(runs):
    tmp = runs[0]
    events = scalars(tmp / "a")
    tags = events.Tags()
    for tag in ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/padding",
                "val/loss", "val/ppl", "val/bleu", "val/chrf"]:  # fmt: skip
        assert tag in tags["scalars"], tag
    if sys.platform.startswith("linux"):  # where the kernel says
        assert all(0.1 < e.value < 64 for e in events.Scalars("train/resident_gib"))  # GiB, not KiB or bytes
    assert len(events.Scalars("val/bleu")) == len(events.Scalars("val/loss")) == 4  # every 4 batches of 13
    text = events.Tensors("val/translations/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert text.count("**hypothesis:**") == 3 and "nrefs:1|case:mixed" in text  # with sacreBLEU's signature
    for kind in ("cross", "decoder_self"):
        for layer in range(2):
            image = events.Images(f"attention/{kind}/layer{layer}")[-1]
            assert image.width > image.height > 0


def test_attention_maps_run_in_the_runs_precision_which_flash_requires(corpus, tmp_path):
    """TensorBoard's attention maps are a forward pass of their own after validation: in a bf16 run it computes in
    bf16 too, since a GPU's flash kernel has none for float32 (an H200 run of runtime.attention_backend=flash stopped
    there). Every recorded call is judged by sm90's rules."""
    data = TranslationDataModule(config(corpus / "c", corpus, max_tokens=400))
    data.setup()
    runtime = RuntimeConfig(attention_backend="flash", padding_free_attention=True)
    module = TranslationModule(**TranslationModule.hyperparameters(model_config({"size": "tiny"}, data), OptimConfig(),
                                                                   ValidationConfig(bleu_every=0), runtime))  # fmt: skip
    trainer = pl.Trainer(max_steps=1, precision="bf16-mixed", num_sanity_val_steps=0, limit_val_batches=1,
                         val_check_interval=1, logger=pl.loggers.TensorBoardLogger(tmp_path, name="", version=""),
                         callbacks=[TensorBoardSamples()], enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    with record_sdpa(module.model) as calls:
        trainer.fit(module, datamodule=data)
    maps = [c for c in calls if c.batch == 1]  # the one sentence of the maps' pass
    assert maps and all(c.site.startswith("encoder.") for c in maps)
    assert [c for c in calls if cuda_kernel(c)[0] != "flash"] == []
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    assert "attention/cross/layer0" in events.Tags()["images"]


# The overfitted run, whose scores climb (run A's, 20 steps in, are all 0: it translates to nothing yet)
@pytest.mark.parametrize("metric, folder", [("chrf", "checkpoints"), ("bleu", "best_bleu")])
def test_checkpoints_keep_the_3_best_by_the_logged_metric_and_last(overfitted, metric, folder):
    run_dir, trainer = overfitted
    # read back from TensorBoard, where Lightning numbers a validation by the steps done before the one it follows
    logged = {e.step + 1: e.value for e in scalars(run_dir).Scalars(f"val/{metric}")}
    files = sorted(p.name for p in (run_dir / folder).iterdir())
    assert not [f for f in files if f.endswith(".tmp")]
    best = {}
    for name in files:
        if name != "last.ckpt":
            step, score = re.fullmatch(rf"epoch\d+-step(\d+)-{metric}(\d+\.\d\d)\.ckpt", name).groups()
            best[int(step)] = score
    assert len(logged) > 3 and len(best) == 3, (logged, files)
    assert {step: f"{logged[step]:.2f}" for step in best} == best  # each named with its validation's logged score
    assert min(logged[step] for step in best) >= max(v for step, v in logged.items() if step not in best), logged
    if folder == "checkpoints":
        last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
        assert last["global_step"] == trainer.global_step == max(logged)  # the end of training


# --- the command line ------------------------------------------------------------------------------


def test_a_run_folders_first_launch_records_its_config_in_hydras_folder_and_a_later_one_beside_it(tmp_path):
    assert launch_record(str(tmp_path), "2026-12-08_02-10-00") == ".hydra"
    (tmp_path / ".hydra").mkdir()
    assert launch_record(str(tmp_path), "2026-12-08_02-10-00") == ".hydra/2026-12-08_02-10-00"


@pytest.mark.slow  # end to end in a subprocess
def test_a_refused_resume_leaves_the_config_the_run_was_launched_with(runs, tmp_path):
    """A resume refused after Hydra wrote its record (a model the checkpoint does not hold, found once the data are
    prepared) records itself beside the run's own config, not over it."""
    tmp, *_ = runs
    run = tmp_path / "run"
    shutil.copytree(tmp / "a", run)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("the config the run was launched with\n")
    result = run_command("ckpt_path=last", f"hydra.run.dir={run}", "model=small")
    assert result.returncode == 2 and "has model model.d_model=32, this run has 256" in result.stderr, result.stderr
    assert (run / ".hydra" / "config.yaml").read_text() == "the config the run was launched with\n"
    (later,) = [p for p in (run / ".hydra").iterdir() if p.is_dir()]
    assert "size: small" in (later / "config.yaml").read_text()  # the refused command's


@pytest.mark.slow  # end to end in subprocesses
def test_train_command_writes_its_run_folder_and_resumes_it_as_launched(tmp_path):
    write_text_corpus(tmp_path / "c")
    run_dir = tmp_path / "run"
    result = run_command("debug=fast", f"hydra.run.dir={run_dir}", *tiny_data(tmp_path / "c", tmp_path / "cache"),
                         "trainer.fast_dev_run=false", "trainer.max_steps=2", "trainer.limit_val_batches=1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert (run_dir / "tokenizer" / "spm.model").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (HINT in result.stderr) == (jemalloc_library() is None)  # restarted under jemalloc where there is one
    moved = run_dir.rename(tmp_path / "moved")  # resumed by its checkpoint alone, in its folder wherever it is now
    shown = run_command(f"ckpt_path={moved / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=4", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "max_steps: 4" in shown.stdout and "size: tiny" in shown.stdout  # debug=fast's model, as recorded
    resumed = run_command(f"ckpt_path={moved / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming as launched: debug=fast" in resumed.stderr
    assert torch.load(moved / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert not run_dir.exists()


@pytest.mark.slow  # every experiment file end to end, on Multi30k (and the mix's other corpora)
@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml")))
def test_every_experiment_runs_one_batch(experiment, tmp_path, multi30k_cache):
    corpora = [MULTI30K] + (
        [ROOT / "data" / c for c in ("tatoeba_deen", "wmt_news_deen")] if "mix" in experiment else []
    )
    require(all(c.exists() for c in corpora), f"data/ links to {', '.join(c.name for c in corpora)}",
            "link them from ../shared/data as data/README.md says")  # fmt: skip
    # GPU recipes run here with the tiny model: everything else as on the GPU (batches, workers, bf16, schedule).
    tiny = ["model.size=tiny"] if experiment.endswith("_gpu") else []
    trainer = run_train(tmp_path / "run", [f"experiment={experiment}", "trainer.fast_dev_run=true", *tiny,
                                           f"data.cache_dir={multi30k_cache}", "trainer.enable_progress_bar=false"])  # fmt: skip
    assert trainer.global_step == 1 and torch.isfinite(trainer.callback_metrics["val/loss"])


def test_bf16_mixed_precision_on_cpu(corpus, tmp_path):
    cfg = compose_train(tmp_path / "run", [*on(corpus), *RECORD, "model=tiny",
                                           "trainer.precision=bf16-mixed", "trainer.max_steps=20", "~logger",
                                           "trainer.enable_progress_bar=false", "optim.lr=3e-3"])  # fmt: skip
    with open_dict(cfg):
        cfg.callbacks.dtype = {"_target_": f"{__name__}.BF16Probe"}
    trainer = train(cfg, tmp_path / "run")
    assert callback(trainer, BF16Probe).dtypes == {torch.bfloat16}
    losses = list(callback(trainer, LossRecorder).losses.values())
    assert all(map(lambda x: x == x, losses)) and sum(losses[-5:]) < sum(losses[:5])
    assert all(p.dtype == torch.float32 for p in trainer.lightning_module.parameters())  # fp32 master weights


def test_a_run_bound_by_the_clock_decays_its_cosine_to_zero_when_the_clock_stops_it(corpus, tmp_path):
    cfg = compose_train(tmp_path / "run", [*on(corpus), "model=tiny", "trainer.precision=32-true", "~logger",
                                           "optim.schedule=cosine", "optim.warmup_steps=5", "optim.lr=1e-3",
                                           "trainer.max_time=00:00:00:06", "trainer.max_epochs=1000",
                                           "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"])  # fmt: skip
    with open_dict(cfg):
        cfg.callbacks.lr = {"_target_": f"{__name__}.LearningRates"}
    trainer = train(cfg, tmp_path / "run")
    rates = callback(trainer, LearningRates).rates
    assert 20 < len(rates) < 1000 * 13  # the clock stopped it
    assert rates[-1] < 0.05 * 1e-3 and all(a >= b for a, b in zip(rates[5:], rates[6:]))


class LearningRates(pl.Callback):
    def __init__(self):
        self.rates = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


class BF16Probe(pl.Callback):
    """Records the dtype of the last decoder layer's feed-forward output during training (the output layer's matmul
    runs inside the fused loss, no module of its own)."""

    def on_train_start(self, trainer, module):
        self.dtypes = set()
        module.model.decoder.layers[-1].ff.register_forward_hook(
            lambda m, i, out: self.dtypes.add(out.dtype) if m.training else None
        )


def test_fp16s_scaled_gradients_are_unscaled_before_they_are_measured_and_clipped(corpus, tmp_path, monkeypatch):
    """fp16 with a gradient scaler (a GPU's 16-mixed, which Lightning runs only on CUDA, built here with its plugin
    on a CPU): fused AdamW unscales inside its own step, so Lightning leaves the gradients scaled when clipping; the
    module unscales them first, so that the norm logged and clipped is the float32 run's, not 256 times it."""
    norms = {}
    for precision in ("32-true", "16-mixed"):
        if precision == "16-mixed":
            real = pl.Trainer

            class WithScaler(real):
                def __init__(self, **kwargs):
                    del kwargs["precision"]
                    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
                    super().__init__(
                        **kwargs | {"plugins": [*kwargs["plugins"], MixedPrecision("16-mixed", "cpu", scaler)]}
                    )

            WithScaler.__init__.__signature__ = inspect.signature(real.__init__)  # the arguments train() checks
            monkeypatch.setattr(pl, "Trainer", WithScaler)
        trainer = run_train(tmp_path / precision, [*on(corpus), "model=tiny", "trainer.precision=32-true",
                                                   "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                                                   "trainer.limit_val_batches=0", "trainer.gradient_clip_val=1.0",
                                                   "~logger", "trainer.enable_progress_bar=false"])  # fmt: skip
        norms[precision] = trainer.lightning_module.ledger.readout.grad_norm
    assert type(trainer.precision_plugin) is MixedPrecision and trainer.lightning_module.ledger.skipped_steps == 0
    assert norms["16-mixed"] == pytest.approx(norms["32-true"], rel=0.05)


@pytest.mark.slow  # end to end in subprocesses
def test_ddp_with_two_cpu_processes(tmp_path):
    write_text_corpus(tmp_path / "c")
    run_dir = tmp_path / "run"
    result = run_command("trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "model=tiny",
                         "trainer.precision=32", "trainer.max_steps=4", "trainer.val_check_interval=2",
                         f"hydra.run.dir={run_dir}", *tiny_data(tmp_path / "c", tmp_path / "cache"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MEMBER: 2/2" in result.stderr + result.stdout
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4


@pytest.mark.slow  # end to end in subprocesses
def test_multirun_writes_one_folder_per_job(tmp_path):
    write_text_corpus(tmp_path / "c")
    result = run_command("-m", "debug=fast", "optim.lr=5e-4,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                         *tiny_data(tmp_path / "c", tmp_path / "cache"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    overrides = [(tmp_path / "sweep" / job / ".hydra" / "overrides.yaml").read_text() for job in ("0", "1")]
    assert "- optim.lr=0.0005\n" in overrides[0] and "- optim.lr=0.001\n" in overrides[1]


# --- bad input: one line, before training ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_file(runs):
    return runs[0] / "a" / "checkpoints" / "last.ckpt"


@pytest.mark.slow  # end to end in subprocesses
@pytest.mark.parametrize(
    "overrides, message, before_data",  # before_data: refused before the tokenizer is trained and the data encoded
    [
        (["trainer.foo=1"], "error: Could not override 'trainer.foo'. To append to your config use +trainer.foo=1", True),
        (["trainer.max_epochs=abc"], "error: trainer.max_epochs='abc' must be one of: int, null", True),
        (["model.d_model=250", "model.n_heads=8"], "error: d_model=250 is not divisible by n_heads=8; change one of them", True),
        (["ckpt_path=/nonexistent/last.ckpt"], "error: ckpt_path=/nonexistent/last.ckpt: no such file", True),
        (["optim.schedule=cosine", "trainer.max_time=00:00:10:00", "trainer.devices=2"], "error: optim.schedule=cosine with trainer.max_time=00:00:10:00 decays by the clock", True),
        (["ckpt_path=TRUNCATED"], "error: ckpt_path=TRUNCATED cannot be loaded (", True),
        (["ckpt_path=CHECKPOINT", "data.vocab_size=360"], "error: ckpt_path=CHECKPOINT was trained with another src vocabulary", False),
        (["ckpt_path=CHECKPOINT", "model=small"], "error: ckpt_path=CHECKPOINT has model model.d_model=32, this run has 256", False),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_before_training(overrides, message, before_data, checkpoint_file, corpus, tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(checkpoint_file.read_bytes()[:5000])
    swap = {"TRUNCATED": str(truncated), "CHECKPOINT": str(checkpoint_file)}
    for key, value in swap.items():
        overrides = [o.replace(key, value) for o in overrides]
        message = message.replace(key, value)
    result = run_command("model=tiny", f"hydra.run.dir={tmp_path / 'run'}",
                         *tiny_data(corpus / "c", tmp_path / "cache"), *overrides)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert (tmp_path / "cache").exists() != before_data


@pytest.mark.slow  # inductor compiles C++ kernels: about 40 s on 2 cores
def test_compiled_model_trains_and_saves_plain_parameter_names(corpus, tmp_path):
    trainer = run_train(tmp_path / "run", [*on(corpus), "model=tiny", "compile=true",
                                           "trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.precision=32"])  # fmt: skip
    assert trainer.global_step == 3
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert state.keys() == TranslationModule(**trainer.lightning_module.hparams).state_dict().keys()
