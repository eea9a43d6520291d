import signal
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from omegaconf import open_dict
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.allocator import HINT, jemalloc_library
from transformer.data import TranslationDataModule
from transformer.train import model_config, train
from transformer.training import OptimConfig, TranslationModule
from transformer.training.module import lr_factor

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

# --- the module -----------------------------------------------------------------------------------


def test_lr_schedules():
    assert lr_factor(0, 4, "inverse_sqrt", 0) == pytest.approx(0.25)
    assert lr_factor(3, 4, "inverse_sqrt", 0) == pytest.approx(1.0)  # peak at the end of warmup
    assert lr_factor(15, 4, "inverse_sqrt", 0) == pytest.approx(0.5)  # sqrt(4 / 16)
    assert lr_factor(3, 4, "cosine", 20) == pytest.approx(1.0)
    assert lr_factor(11, 4, "cosine", 20) == pytest.approx(0.5)
    assert lr_factor(19, 4, "cosine", 20) == pytest.approx(0.0, abs=1e-12)


def test_training_lowers_validation_loss_and_checkpoint_loads_alone(tmp_path):
    write_text_corpus(tmp_path / "c", sizes={"train": 300, "val": 40, "test": 10})
    data = TranslationDataModule(config(tmp_path / "c", tmp_path, max_tokens=400))
    data.setup()
    model = model_config({"size": "tiny", "dropout": 0.0}, data)
    assert model.src_vocab_size == data.data.src_tokenizer.vocab_size
    module = TranslationModule(**TranslationModule.hyperparameters(model, OptimConfig(lr=3e-3, warmup_steps=20)))
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


def test_tiny_model_overfits_its_training_pairs_to_bleu_above_90(tmp_path):
    write_word_for_word_corpus(tmp_path / "c", 48)
    trainer = run_train(tmp_path / "run", [
        *tiny_data(tmp_path / "c", tmp_path / "cache"), "data.vocab_size=320", "data.valid_split=train",
        "model=tiny", "model.d_model=64", "model.d_ff=128", "model.dropout=0.0", "optim.lr=3e-3",
        "optim.warmup_steps=20", "optim.label_smoothing=0.0", "trainer.precision=32", "trainer.max_epochs=60",
        "trainer.check_val_every_n_epoch=20", "trainer.enable_progress_bar=false", "~logger",
    ])  # fmt: skip
    assert trainer.callback_metrics["val/bleu"].item() > 90


# --- one run, interrupted by SIGTERM and resumed, against the same run uninterrupted ---------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 30 steps (13 batches an epoch, validation every 5 batches, dropout on) uninterrupted. B: the same
    run, SIGTERM during step 18 (mid-epoch), then `ckpt_path=last` into the same folder. C: SIGTERM during
    step 13, the last of the first epoch, then resumed. D, E, F below."""
    tmp = tmp_path_factory.mktemp("runs")
    write_text_corpus(tmp / "c")
    common = [*tiny_data(tmp / "c", tmp / "cache"), *RECORD, "model=tiny", "trainer.precision=32",
              "trainer.max_steps=30", "trainer.val_check_interval=5", "trainer.log_every_n_steps=1",
              "trainer.enable_progress_bar=false", "optim.warmup_steps=10",
              "data.num_workers=1"]  # a loader worker fetches ahead of training  # fmt: skip
    a = run_train(tmp / "a", common)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp / "b", [*common, "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                              "+callbacks.signal_at.step=17"])  # fmt: skip
    b = run_train(tmp / "b", [*common, "ckpt_path=last"])
    with pytest.raises(SystemExit):
        run_train(tmp / "c", [*common, "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                              "+callbacks.signal_at.step=12"])  # fmt: skip
    c = run_train(tmp / "c", [*common, "ckpt_path=last"])
    # D: validating at the epoch's last batch only, 16 steps; then resumed from its best checkpoint of step 13
    run_train(tmp / "d", [*common, "trainer.val_check_interval=13", "trainer.max_steps=16"])
    (best,) = (tmp / "d" / "checkpoints").glob("epoch0-step13-*.ckpt")
    d = run_train(tmp / "d2", [*common, f"ckpt_path={best}"])
    # E: SIGTERM during step 10, after which a validation is due: it runs before the checkpoint
    with pytest.raises(SystemExit):
        run_train(tmp / "e", [*common, "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                              "+callbacks.signal_at.step=9"])  # fmt: skip
    e = run_train(tmp / "e", [*common, "ckpt_path=last"])
    # F: a run of 7 steps (max_steps ends it mid-epoch), continued to 30
    run_train(tmp / "f", [*common, "trainer.max_steps=7"])
    f = run_train(tmp / "f", [*common, "ckpt_path=last"])
    return tmp, a, b, stopped.value.code, {18: b, 13: c, "best": d, 10: e, 7: f}


def test_sigterm_writes_a_checkpoint_and_exits_with_its_code(runs):
    tmp, a, b, code, _ = runs
    assert code == 128 + signal.SIGTERM
    assert b.global_step == 30


# mid-epoch; epoch end; best (13); before validation; at max_steps mid-epoch
@pytest.mark.parametrize("stopped_after", [18, 13, "best", 10, 7])
def test_resumed_run_continues_exactly(runs, stopped_after):
    tmp, a, b, code, resumed_runs = runs
    resumed = resumed_runs[stopped_after]
    a_record, resumed_record = callback(a, LossRecorder), callback(resumed, LossRecorder)
    first = 14 if stopped_after == "best" else stopped_after + 1
    assert sorted(resumed_record.losses) == list(range(first, 31))  # only the remaining steps
    for step, loss in resumed_record.losses.items():
        assert resumed_record.batches[step] == a_record.batches[step], step
        assert loss == pytest.approx(a_record.losses[step], rel=1e-6, abs=1e-7), step
    for (name, p), q in zip(a.lightning_module.named_parameters(), resumed.lightning_module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_ctrl_c_writes_a_checkpoint_at_the_batch_boundary(tmp_path):
    write_text_corpus(tmp_path / "c")
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "run", [*tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "~logger",
                                     "trainer.max_steps=30", "trainer.enable_progress_bar=false",
                                     "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                                     "+callbacks.signal_at.step=3", f"+callbacks.signal_at.signum={int(signal.SIGINT)}"])  # fmt: skip
    assert stopped.value.code == 128 + signal.SIGINT
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4
    assert checkpoint["TranslationDataModule"]["train_sampler"]["position"] == 4  # batches trained, none fetched ahead


def scalars(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.mark.parametrize("run", ["b", "e"])
def test_resumed_run_continues_the_same_tensorboard_curves(runs, run):
    tmp, a, b, code, _ = runs
    for tag in ("train/loss", "val/bleu"):  # one curve, no second from 0; no validation lost to the stop
        assert [e.step for e in scalars(tmp / run).Scalars(tag)] == [e.step for e in scalars(tmp / "a").Scalars(tag)]
    assert len(list((tmp / run / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_tensorboard_holds_scalars_text_and_attention_images(runs):
    tmp, a, b, code, _ = runs
    events = scalars(tmp / "a")
    tags = events.Tags()
    for tag in ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/padding",
                "val/loss", "val/ppl", "val/bleu", "val/chrf"]:  # fmt: skip
        assert tag in tags["scalars"], tag
    assert len(events.Scalars("val/bleu")) == len(events.Scalars("val/loss")) == 4  # every 5 batches of 13
    text = events.Tensors("val/translations/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert text.count("**hypothesis:**") == 3 and "nrefs:1|case:mixed" in text  # with sacreBLEU's signature
    for kind in ("cross", "decoder_self"):
        for layer in range(2):
            image = events.Images(f"attention/{kind}/layer{layer}")[-1]
            assert image.width > image.height > 0


def test_checkpoints_keep_last_and_best_by_bleu(runs):
    tmp, a, b, code, _ = runs
    files = sorted(p.name for p in (tmp / "a" / "checkpoints").iterdir())
    assert "last.ckpt" in files and not [f for f in files if f.endswith(".tmp")]
    best = [f for f in files if f != "last.ckpt"]
    assert 1 <= len(best) <= 3 and all("-bleu" in f for f in best)
    assert torch.load(tmp / "a" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 30


# --- the command line ------------------------------------------------------------------------------


@pytest.mark.slow  # end to end in subprocesses
def test_train_command_writes_its_run_folder(tmp_path):
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


@pytest.mark.slow  # every experiment file end to end, on Multi30k (and the mix's other corpora)
@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml")))
def test_every_experiment_runs_one_batch(experiment, tmp_path, multi30k_cache):
    corpora = [MULTI30K] + (
        [ROOT / "data" / c for c in ("tatoeba_deen", "wmt_news_deen")] if "mix" in experiment else []
    )
    if not all(c.exists() for c in corpora):
        pytest.skip(f"{', '.join(c.name for c in corpora)} not all linked into data/ (see data/README.md)")
    # GPU recipes run here with the tiny model: everything else as on the GPU (batches, workers, bf16, schedule).
    tiny = ["model.size=tiny"] if experiment.endswith("_gpu") else []
    trainer = run_train(tmp_path / "run", [f"experiment={experiment}", "trainer.fast_dev_run=true", *tiny,
                                           f"data.cache_dir={multi30k_cache}", "trainer.enable_progress_bar=false"])  # fmt: skip
    assert trainer.global_step == 1 and torch.isfinite(trainer.callback_metrics["val/loss"])


def test_bf16_mixed_precision_on_cpu(tmp_path):
    write_text_corpus(tmp_path / "c")
    cfg = compose_train(tmp_path / "run", [*tiny_data(tmp_path / "c", tmp_path / "cache"), *RECORD, "model=tiny",
                                           "trainer.precision=bf16-mixed", "trainer.max_steps=20", "~logger",
                                           "trainer.enable_progress_bar=false", "optim.lr=3e-3"])  # fmt: skip
    with open_dict(cfg):
        cfg.callbacks.dtype = {"_target_": f"{__name__}.BF16Probe"}
    trainer = train(cfg, tmp_path / "run")
    assert callback(trainer, BF16Probe).dtypes == {torch.bfloat16}
    losses = list(callback(trainer, LossRecorder).losses.values())
    assert all(map(lambda x: x == x, losses)) and sum(losses[-5:]) < sum(losses[:5])
    assert all(p.dtype == torch.float32 for p in trainer.lightning_module.parameters())  # fp32 master weights


class BF16Probe(pl.Callback):
    """Records the dtype of the model's logits during training."""

    def on_train_start(self, trainer, module):
        self.dtypes = set()
        module.model.output.register_forward_hook(lambda m, i, out: self.dtypes.add(out.dtype) if m.training else None)


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
        (["ckpt_path=TRUNCATED"], "error: ckpt_path=TRUNCATED cannot be loaded (", True),
        (["ckpt_path=CHECKPOINT", "data.vocab_size=360"], "error: ckpt_path=CHECKPOINT was trained with another src vocabulary", False),
        (["ckpt_path=CHECKPOINT", "model=small"], "error: ckpt_path=CHECKPOINT has model model.d_model=32, this run has 256", False),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_before_training(overrides, message, before_data, checkpoint_file, tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(checkpoint_file.read_bytes()[:5000])
    swap = {"TRUNCATED": str(truncated), "CHECKPOINT": str(checkpoint_file)}
    for key, value in swap.items():
        overrides = [o.replace(key, value) for o in overrides]
        message = message.replace(key, value)
    corpus = checkpoint_file.parents[2] / "c"
    result = run_command("model=tiny", f"hydra.run.dir={tmp_path / 'run'}",
                         *tiny_data(corpus, tmp_path / "cache"), *overrides)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert (tmp_path / "cache").exists() != before_data


@pytest.mark.slow  # inductor compiles C++ kernels: about 40 s on 2 cores
def test_compiled_model_trains_and_saves_plain_parameter_names(tmp_path):
    write_text_corpus(tmp_path / "c")
    trainer = run_train(tmp_path / "run", [*tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "compile=true",
                                           "trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.precision=32"])  # fmt: skip
    assert trainer.global_step == 3
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert state.keys() == TranslationModule(**trainer.lightning_module.hparams).state_dict().keys()
