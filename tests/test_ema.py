"""The weights' moving average (optim.ema_decay): its arithmetic, validation with it, checkpoints, exact resume."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from transformer.training import OptimConfig
from transformer.training.ema import WeightAverage
from transformer.translators import CheckpointTranslator

from .helpers import RECORD, LossRecorder, callback, run_train, tiny_data, write_text_corpus
from .helpers.prerequisites import require_module


def test_the_average_is_the_decay_weighted_mean_of_every_step_and_stands_in_only_while_swapped():
    model = nn.Linear(3, 2)
    average, steps = WeightAverage(0.75), []
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.add_(float(step))
        steps.append(model.weight.detach().clone())
        average.update(model, step)
        weights = [0.75 ** (step - i) for i in range(1, step + 1)]  # step i's weights count decay^(t - i)
        expected = sum(w * s for w, s in zip(weights, steps)) / sum(weights)
        torch.testing.assert_close(average.shadow["weight"], expected)
    assert average.weight(10_000) == pytest.approx(0.25)  # a plain exponential average, long after the start
    trained = model.weight.detach().clone()
    average.swap_in(model)
    torch.testing.assert_close(model.weight.detach(), average.shadow["weight"])
    average.swap_out(model)
    assert torch.equal(model.weight.detach(), trained)
    restored = WeightAverage(0.75)
    restored.load_state_dict(average.state_dict(prefix="model."), model, prefix="model.")
    assert torch.equal(restored.shadow["bias"], average.shadow["bias"])


def test_the_average_of_a_tied_weight_is_saved_under_each_of_its_names():
    """Loaded over the weights, as a checkpoint's ema_state_dict is (CheckpointTranslator, ema=true), it replaces
    all of them."""
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as shared embeddings and a tied output layer are
    average = WeightAverage(0.5)
    for step in (1, 2):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        average.update(model, step)
    state = average.state_dict()
    assert sorted(state) == ["0.weight", "1.weight"] and torch.equal(state["1.weight"], average.shadow["0.weight"])
    model.load_state_dict({**model.state_dict(), **state})
    assert torch.equal(model[1].weight, average.shadow["0.weight"])


def test_warmup_makes_the_early_average_follow_the_recent_steps():
    model, steps = nn.Linear(1, 1, bias=False), 300
    averages = {warmup: WeightAverage(0.999, warmup=warmup) for warmup in (False, True)}
    shadow = None
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.fill_(float(step))  # weights that improve steadily
        for average in averages.values():
            average.update(model, step)
        w = 1.0 if step == 1 else max((1 - 0.999) / (1 - 0.999**step), 9 / (10 + step))
        shadow = float(step) if shadow is None else shadow + w * (step - shadow)
    torch.testing.assert_close(averages[True].shadow["weight"], torch.tensor([[shadow]]))
    # without warm-up the average is near the mean of all 300 steps; with it, about a tenth of them behind
    assert abs(averages[False].shadow["weight"].item() - 150) < 10
    assert steps - averages[True].shadow["weight"].item() < 0.15 * steps
    assert averages[True].weight(10**6) == pytest.approx(1 - 0.999)  # the plain exponential average in the end


class WeightsAroundValidation(pl.Callback):
    """The training weights after every optimizer step, and whether each validation handed them back bit for bit."""

    def __init__(self):
        self.after_step: dict[int, dict[str, torch.Tensor]] = {}
        self.handed_back: list[bool] = []

    @staticmethod
    def weights(module) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in module.model.named_parameters()}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after_step[trainer.global_step] = self.weights(module)

    def on_validation_start(self, trainer, module):
        self.before = self.weights(module)

    def on_validation_end(self, trainer, module):  # after the module's on_validation_epoch_end, before checkpoints
        if not trainer.sanity_checking:
            self.handed_back.append(all(torch.equal(p, self.before[n]) for n, p in self.weights(module).items()))


def test_a_run_validates_with_the_warmed_up_average_and_trains_on_from_its_own_weights(trained, tmp_path):
    """8 steps with optim.ema_warmup, validated after steps 4 and 8: val/loss is the loss of the checkpoint's
    ema_state_dict, computed here; the average is the warm-up formula over the weights each step left."""
    tmp = trained[0]
    decay = 0.999
    trainer = run_train(tmp_path / "run", [
        *tiny_data(tmp / "c", tmp / "cache"), "data.vocab_size=320", "model=tiny", "trainer.precision=32-true",
        "optim.lr=3e-3", "optim.warmup_steps=2", f"optim.ema_decay={decay}", "optim.ema_warmup=true",
        "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null",
        "validation.bleu_max_sentences=2", "validation.max_len_a=0", "validation.max_len_b=4",
        "trainer.enable_progress_bar=false", "~logger", "+callbacks.weights._target_=tests.test_ema.WeightsAroundValidation",
    ])  # fmt: skip
    seen = callback(trainer, WeightsAroundValidation)
    assert seen.handed_back == [True, True] and sorted(seen.after_step) == list(range(1, 9))
    expected = None
    for step, weights in sorted(seen.after_step.items()):
        weight = max((1 - decay) / (1 - decay**step), 9 / (10 + step))  # ema_warmup's floor on the weight
        expected = weights if expected is None else {n: a.lerp(weights[n], weight) for n, a in expected.items()}
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    for name, average in expected.items():
        torch.testing.assert_close(checkpoint["ema_state_dict"][f"model.{name}"], average, msg=lambda m: f"{name}: {m}")

    def validation_loss(model: nn.Module) -> float:  # NLL per target token over the dev set, as validation batches it
        nll, tokens = 0.0, 0
        with torch.no_grad():
            for batch in trainer.datamodule.val_dataloader():
                logits = model(batch["src"], batch["tgt_in"])
                nll += F.cross_entropy(
                    logits.flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=model.pad_id, reduction="sum"
                )
                tokens += int(batch["tgt_out"].ne(model.pad_id).sum())
        return nll.item() / tokens

    checkpoint_path = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    losses = {
        ema: validation_loss(CheckpointTranslator.from_path(checkpoint_path, ema=ema).model) for ema in (True, False)
    }
    logged = trainer.callback_metrics["val/loss"].item()
    assert logged == pytest.approx(losses[True], rel=1e-5) and logged != pytest.approx(losses[False], rel=1e-3)


def test_warmup_without_an_average_is_refused():
    with pytest.raises(ValueError, match="optim.ema_warmup=true .* set optim.ema_decay"):
        OptimConfig(ema_warmup=True)


@pytest.fixture(scope="module")
def ema_runs(tmp_path_factory):
    """15 steps with and without the average (same seed); and with it, stopped after step 7 and resumed."""
    tmp = tmp_path_factory.mktemp("ema")
    write_text_corpus(tmp / "c")
    common = [*tiny_data(tmp / "c", tmp / "cache"), *RECORD, "model=tiny", "trainer.precision=32", "~logger",
              "trainer.max_steps=15", "trainer.val_check_interval=5", "trainer.enable_progress_bar=false",
              "optim.warmup_steps=5"]  # fmt: skip
    plain = run_train(tmp / "plain", common)
    averaged = run_train(tmp / "ema", [*common, "optim.ema_decay=0.8"])
    with pytest.raises(SystemExit):
        run_train(tmp / "stopped", [*common, "optim.ema_decay=0.8", "+callbacks.signal_at.step=6",
                                    "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt"])  # fmt: skip
    resumed = run_train(tmp / "stopped", [*common, "optim.ema_decay=0.8", "ckpt_path=last"])
    return tmp, plain, averaged, resumed


@pytest.mark.slow  # four small training runs
def test_validation_scores_the_average_while_training_follows_the_weights(ema_runs):
    tmp, plain, averaged, _ = ema_runs
    assert callback(plain, LossRecorder).losses == callback(averaged, LossRecorder).losses  # training unchanged
    for p, q in zip(plain.lightning_module.model.parameters(), averaged.lightning_module.model.parameters()):
        torch.testing.assert_close(p, q)
    assert averaged.callback_metrics["val/loss"] != plain.callback_metrics["val/loss"]  # validated with the average
    checkpoint = torch.load(tmp / "ema" / "checkpoints" / "last.ckpt", weights_only=True)
    assert "ema_state_dict" not in torch.load(tmp / "plain" / "checkpoints" / "last.ckpt", weights_only=True)
    name = next(k for k in checkpoint["ema_state_dict"] if k.endswith("in_proj_weight"))
    assert not torch.equal(checkpoint["ema_state_dict"][name], checkpoint["state_dict"][name])
    translator = CheckpointTranslator.from_path(str(tmp / "ema" / "checkpoints" / "last.ckpt"), ema=True)
    assert torch.equal(translator.model.state_dict()[name.removeprefix("model.")], checkpoint["ema_state_dict"][name])
    with pytest.raises(ValueError, match="holds no weight average .* drop ema=true"):
        CheckpointTranslator.from_path(str(tmp / "plain" / "checkpoints" / "last.ckpt"), ema=True)


@pytest.mark.slow
def test_a_resumed_run_continues_the_average_exactly(ema_runs):
    tmp, _, averaged, resumed = ema_runs
    a, b = averaged.lightning_module.weight_average.shadow, resumed.lightning_module.weight_average.shadow
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoint_averaging_averages_the_weight_averages_too(tmp_path):
    from transformer.training.averaging import average_checkpoints

    paths = []
    for step in (1, 2):
        state = {"model.w": torch.full((2,), float(step))}
        checkpoint = {"hyper_parameters": {"model": {}}, "global_step": step, "state_dict": state,
                      "ema_state_dict": {"model.w": torch.full((2,), 10.0 * step)}}  # fmt: skip
        torch.save(checkpoint, tmp_path / f"{step}.ckpt")
        paths.append(tmp_path / f"{step}.ckpt")
    averaged = average_checkpoints(paths)
    assert torch.equal(averaged["state_dict"]["model.w"], torch.full((2,), 1.5))
    assert torch.equal(averaged["ema_state_dict"]["model.w"], torch.full((2,), 15.0))


@pytest.mark.slow
def test_export_with_ema_deploys_the_average(ema_runs, tmp_path):
    import json
    from dataclasses import asdict

    from omegaconf import OmegaConf

    require_module("ctranslate2", "pip install -e '.[dev]'")
    from transformer.config.schema import ExportConfig
    from transformer.export.__main__ import export

    checkpoint = ema_runs[0] / "ema" / "checkpoints" / "last.ckpt"
    models = {}
    for ema in (False, True):
        values = {**asdict(ExportConfig(ckpt_path=str(checkpoint))), "output": str(tmp_path / str(ema)), "ema": ema}
        folder, failure = export(OmegaConf.create({**values, "parity_sentences": 5, "beam_size": 1}))
        assert failure is None  # the gate compared the export with the weights it was given
        assert json.loads((folder / "model_card.json").read_text())["ema"] is ema
        models[ema] = (folder / "model.bin").read_bytes()
    assert models[True] != models[False]
