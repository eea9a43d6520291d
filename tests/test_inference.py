import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer.averaging import average_checkpoints
from transformer.evaluate import data_config, evaluate
from transformer.inference import SearchConfig, Translator

from .test_train import run_train, tiny_data, write_word_for_word_corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained to translate a word-for-word corpus well; validation (BLEU) at the end."""
    tmp = tmp_path_factory.mktemp("trained")
    write_word_for_word_corpus(tmp / "c", 48)
    trainer = run_train(tmp / "run", [
        *tiny_data(tmp / "c", tmp / "cache"), "data.vocab_size=320", "model=tiny", "model.d_model=64",
        "model.d_ff=128", "model.dropout=0.0", "optim.lr=3e-3", "optim.warmup_steps=20", "trainer.precision=bf16-mixed",
        "trainer.max_epochs=24", "trainer.check_val_every_n_epoch=12", "trainer.enable_progress_bar=false", "~logger",
    ])  # fmt: skip
    return tmp, trainer, tmp / "run" / "checkpoints" / "last.ckpt"


def test_evaluate_with_greedy_search_reproduces_the_validation_bleu(trained):
    tmp, trainer, ckpt = trained
    translator = Translator.from_path(str(ckpt))
    data = data_config(translator.data, {})
    assert translator.trained_precision == "bf16"  # decoded as validation was: bf16, the same batches
    search = SearchConfig(beam_size=1, max_tokens=data.max_tokens)
    result = evaluate(translator, data, "val", search, translator.trained_precision)
    assert result["bleu"] == pytest.approx(trainer.callback_metrics["val/bleu"].item(), abs=1e-4)  # logged as float32
    assert result["bleu"] > 20 and result["bleu_line"].startswith("BLEU|nrefs:1|case:mixed")
    beam = evaluate(translator, data, "val", SearchConfig(beam_size=4), "32")
    assert beam["sentences"] == result["sentences"] == 48


def test_translate_command_gives_one_line_per_input_line_in_order(trained):
    tmp, trainer, ckpt = trained
    sources = (tmp / "c" / "test.de").read_text().splitlines()[:6]
    lines = [sources[0], "", sources[1], "   ", *sources[2:], "wort " * 2000]
    result = subprocess.run(
        [sys.executable, "-m", "transformer.translate", f"ckpt_path={ckpt}", "beam_size=2", "max_tokens=64"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout.split("\n")[:-1]
    assert len(out) == len(lines) and out[1] == "" and out[3] == ""
    expected = Translator.from_path(str(ckpt)).translate(sources, SearchConfig(beam_size=2), "32")
    assert [out[0], out[2], *out[4:-1]] == expected
    assert "tokens was translated up to its first 1023 (model.max_positions)" in result.stderr


def test_evaluate_command_writes_hypotheses_and_scores(trained, tmp_path):
    tmp, trainer, ckpt = trained
    result = subprocess.run(
        [sys.executable, "-m", "transformer.evaluate", f"ckpt_path={ckpt}", "split=test", "beam_size=3",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("BLEU|nrefs:1")
    scores = json.loads((tmp_path / "test.beam3.json").read_text())
    assert scores["split"] == "test" and scores["search"]["beam_size"] == 3
    assert len((tmp_path / "test.beam3.hyp").read_text().splitlines()) == 48


@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt_path=/nonexistent.ckpt"], "error: ckpt_path=/nonexistent.ckpt cannot be loaded"),
        (["ckpt_path=CKPT", "split=nosuch"], "error: unknown split 'nosuch'"),
        (["ckpt_path=CKPT", "beam_size=0"], "error: beam_size=0 must be at least 1"),
        (["ckpt_path=CKPT", "data.src=en", "data.tgt=de"], "error: the checkpoint translates de->en"),
        ([], "error: ckpt_path is required"),
    ],
)
def test_evaluate_bad_input_is_one_line(trained, args, message, tmp_path):
    tmp, trainer, ckpt = trained
    args = [a.replace("CKPT", str(ckpt)) for a in args]
    result = subprocess.run([sys.executable, "-m", "transformer.evaluate", *args, f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message)


def test_averaging_is_exact_and_loadable(trained, tmp_path):
    tmp, trainer, ckpt = trained
    first = torch.load(ckpt, weights_only=True)
    second = {**first, "global_step": first["global_step"] + 1,
              "state_dict": {k: v + 1 if v.is_floating_point() else v for k, v in first["state_dict"].items()}}  # fmt: skip
    torch.save(second, tmp_path / "second.ckpt")
    averaged = average_checkpoints([ckpt, tmp_path / "second.ckpt"])
    for name, value in first["state_dict"].items():
        torch.testing.assert_close(averaged["state_dict"][name], value + 0.5 if value.is_floating_point() else value)
    torch.save(averaged, tmp_path / "avg.pt")
    result = subprocess.run([sys.executable, "scripts/average_checkpoints.py", str(ckpt), str(tmp_path / "second.ckpt"),
                             "--output", str(tmp_path / "avg2.pt")], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    translator = Translator.from_path(str(tmp_path / "avg2.pt"))
    assert translator.translate(["ein mann"], SearchConfig(beam_size=2), "32")[0] is not None
