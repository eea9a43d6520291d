"""The progress bar shows the step readout's loss and the target tokens per second, whichever bar Lightning picks:
tqdm's, or Rich's where the `rich` package is installed (transformers and typer pull it in)."""

import types

import pytest
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar

from transformer.training.progress import ProgressBar, RichBar, in_place_of

from .helpers.prerequisites import require_module


@pytest.mark.parametrize("default, ours", [(TQDMProgressBar, ProgressBar), (RichProgressBar, RichBar)])
def test_the_bar_lightning_picks_shows_the_readouts_loss_and_target_tokens_per_second(default, ours, monkeypatch):
    if default is RichProgressBar:
        require_module("rich", 'pip install -e ".[dev]"')
    bar = in_place_of(default(refresh_rate=7))
    assert type(bar) is ours and bar.refresh_rate == 7
    trainer = types.SimpleNamespace(loggers=[], progress_bar_metrics={"val/bleu": 30.0}, world_size=2)
    module = types.SimpleNamespace(ledger=types.SimpleNamespace(readout=types.SimpleNamespace(loss=2.5)))
    monkeypatch.setattr(default, "on_train_batch_end", lambda *args: None)  # Lightning's own redraw needs a real run
    bar.on_train_batch_end(trainer, module, None, {"tgt_tokens": 1000}, 0)
    assert bar.rate.tokens == 2 * 1000  # one rank's batch counts for all ranks
    metrics = bar.get_metrics(trainer, module)
    assert metrics["loss"] == "2.500" and metrics["val/bleu"] == 30.0 and float(metrics["tok/s"].replace(",", "")) > 0
    assert "tok/s" not in bar.get_metrics(trainer, module)  # per refresh: nothing counted since the last


def test_a_configs_own_bar_is_left_as_it_is():
    class Custom(TQDMProgressBar):
        pass

    assert in_place_of(Custom()) is None and in_place_of(None) is None
