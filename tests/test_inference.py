import json
import runpy
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from sacrebleu.metrics import CHRF, TER

from transformer.data import DataConfig, TranslationDataModule
from transformer.training import TranslationModule
from transformer.training.averaging import average_checkpoints
from transformer.translators import CheckpointTranslator, SearchConfig
from transformer.translators.scores import evaluate

from .helpers import ROOT


def test_evaluate_with_greedy_search_reproduces_the_validation_bleu(trained):
    tmp, trainer, ckpt = trained
    translator = CheckpointTranslator.from_path(str(ckpt))
    data = DataConfig.from_checkpoint(translator.data, {})
    assert translator.trained_precision == "32"  # decoded as validation was, the same batches
    search = SearchConfig(beam_size=1, max_tokens=data.max_tokens)
    result = evaluate(translator, data, "val", search, translator.trained_precision)
    assert result["bleu"] == pytest.approx(trainer.callback_metrics["val/bleu"].item(), abs=1e-4)  # logged as float32
    assert result["bleu"] > 20 and result["bleu_line"].startswith("BLEU|nrefs:1|case:mixed")
    beam = evaluate(translator, data, "val", SearchConfig(beam_size=4), "32")
    assert beam["sentences"] == result["sentences"] == 48
    hypotheses, references = result["hypotheses"], [result["references"]]
    assert result["chrf"] == CHRF(word_order=2).corpus_score(hypotheses, references).score  # chrF++
    assert result["ter"] == TER().corpus_score(hypotheses, references).score and result["ter_line"].startswith("TER|")


def test_evaluate_in_bf16_reproduces_a_bf16_validation_of_the_same_weights(trained):
    """The float32-trained model validated under bf16-mixed (as a bf16 run validates) and evaluated in bf16: the same
    chrF++, which float32 decoding does not reach: bf16 is what evaluate ran."""
    _, _, ckpt = trained
    translator = CheckpointTranslator.from_path(str(ckpt))
    data = DataConfig.from_checkpoint(translator.data, {})
    trainer = pl.Trainer(precision="bf16-mixed", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    module = TranslationModule.load_from_checkpoint(ckpt)
    validated = trainer.validate(module, TranslationDataModule(data), verbose=False)
    greedy = SearchConfig(beam_size=1, max_tokens=data.max_tokens)
    bf16, float32 = (evaluate(translator, data, "val", greedy, precision)["chrf"] for precision in ("bf16", "32"))
    assert bf16 == pytest.approx(validated[0]["val/chrf"], abs=1e-4) and abs(bf16 - float32) > 1e-3


@pytest.mark.slow  # end to end in subprocesses
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
    translator = CheckpointTranslator.from_path(str(ckpt))  # the command decodes as training validated
    expected = translator.translate(sources, SearchConfig(beam_size=2), translator.trained_precision)
    assert [out[0], out[2], *out[4:-1]] == expected
    assert "tokens was translated up to its first 1023 (model.max_positions)" in result.stderr


@pytest.mark.slow  # end to end in subprocesses
def test_translate_nbest_writes_the_n_best_of_each_line_as_tsv(trained):
    tmp, trainer, ckpt = trained
    sources = (tmp / "c" / "test.de").read_text().splitlines()[:3]
    lines = [sources[0], "", *sources[1:]]
    result = subprocess.run(
        [sys.executable, "-m", "transformer.translate", f"ckpt_path={ckpt}", "beam_size=3", "nbest=2"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 1, 2, 2, 3, 3] and rows[2][2] == ""
    translator = CheckpointTranslator.from_path(str(ckpt))
    best = translator.translate(sources, SearchConfig(beam_size=3), translator.trained_precision)
    assert [rows[0][2], rows[3][2], rows[5][2]] == best
    for first, second in ((rows[0], rows[1]), (rows[3], rows[4]), (rows[5], rows[6])):
        assert float(first[1]) >= float(second[1]) and first[2] != second[2]


@pytest.mark.slow  # end to end in subprocesses
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
    assert scores["ter"] > 0 and scores["ter_line"].startswith("TER|") and "chrF2++|" in scores["chrf_line"]
    baseline = tmp_path / "baseline.hyp"
    baseline.write_text("".join(line + "\n" if i % 2 else "\n" for i, line in enumerate(
        (tmp_path / "test.beam3.hyp").read_text().splitlines())))  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "transformer.evaluate", f"ckpt_path={ckpt}", "split=test", "beam_size=3",
         f"compare={baseline}", f"hydra.run.dir={tmp_path / 'compared'}"], capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"paired significance against {baseline}" in result.stdout and "approximate randomisation" in result.stdout
    compared = json.loads((tmp_path / "compared" / "test.beam3.json").read_text())["compare"]
    assert compared["bleu"]["system"] == scores["bleu"] and compared["bleu"]["p_bootstrap"] < 0.05


@pytest.mark.slow  # end to end in subprocesses
@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt_path=/nonexistent.ckpt"], "error: ckpt_path=/nonexistent.ckpt: no such file"),
        (["ckpt_path=CKPT", "precision=16"], "error: precision='16' is not one of 32, bf16"),
        (["ckpt_path=CKPT", "split=nosuch"], "error: unknown split 'nosuch'"),
        (["ckpt_path=CKPT", "beam_size=0"], "error: beam_size=0 must be at least 1"),
        (["ckpt_path=CKPT", "data.src=en", "data.tgt=de"], "error: the checkpoint translates de->en"),
        ([], "error: ckpt_path is required"),
        (["ckpt_path=CKPT", "compare=/nonexistent.hyp"], "error: compare=/nonexistent.hyp is not a file"),
    ],
)
def test_evaluate_bad_input_is_one_line(trained, args, message, tmp_path):
    tmp, trainer, ckpt = trained
    args = [a.replace("CKPT", str(ckpt)) for a in args]
    result = subprocess.run([sys.executable, "-m", "transformer.evaluate", *args, f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message)


def test_averaging_is_exact_and_loadable(trained, tmp_path, capsys):
    tmp, trainer, ckpt = trained
    first = torch.load(ckpt, weights_only=True)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for shift in (0, 1, 2):  # three steps, the first and the last saved twice (a best and an epoch checkpoint)
        state = {k: v + shift if v.is_floating_point() else v for k, v in first["state_dict"].items()}
        for name in {f"a{shift}.ckpt", f"b{min(shift, 1)}.ckpt"}:
            torch.save({**first, "global_step": 10 + shift, "state_dict": state}, folder / name)
    average = runpy.run_path(str(ROOT / "scripts" / "average_checkpoints.py"))["main"]  # the script, in process
    average([str(folder), "--last", "2", "--output", str(tmp_path / "avg.pt")])
    averaged = torch.load(tmp_path / "avg.pt", weights_only=True)
    assert averaged["global_step"] == 12 and len(averaged["averaged_from"]) == 2  # steps 11 and 12, once each
    for name, value in first["state_dict"].items():
        if value.is_floating_point():  # the mean of the two stored tensors, in float64, rounded once
            value = ((value + 1).double() + (value + 2).double()).div(2).to(value.dtype)
        assert torch.equal(averaged["state_dict"][name], value), name

    with pytest.raises(SystemExit):  # one step's best and epoch checkpoints, as a glob of the folder gives them
        average([str(folder / "a0.ckpt"), str(folder / "b0.ckpt"), str(folder / "a1.ckpt")])
    assert "hold the same step (10) of one run" in capsys.readouterr().err

    same = average_checkpoints([ckpt])  # the average of one checkpoint translates as it does
    torch.save(same, tmp_path / "same.pt")
    search = SearchConfig(beam_size=2)
    sources = (tmp / "c" / "test.de").read_text().splitlines()[:8]
    averaged = CheckpointTranslator.from_path(str(tmp_path / "same.pt"))
    assert averaged.translate(sources, search) == CheckpointTranslator.from_path(str(ckpt)).translate(sources, search)


@pytest.mark.slow  # end to end in subprocesses
def test_translate_answers_each_line_as_it_arrives(trained):
    import os
    import select

    tmp, trainer, ckpt = trained
    process = subprocess.Popen([sys.executable, "-m", "transformer.translate", f"ckpt_path={ckpt}", "beam_size=2"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)  # fmt: skip
    out, pending = process.stdout.fileno(), b""

    def answer(seconds: float = 300) -> bytes:
        """The next line translate writes; the test fails, rather than waits for ever, if none comes in time."""
        nonlocal pending
        while b"\n" not in pending:
            if not select.select([out], [], [], seconds)[0]:
                pytest.fail(f"no answer in {seconds} s to a line sent (so far {pending!r})")
            chunk = os.read(out, 65536)
            if not chunk:
                pytest.fail(f"translate ended before answering (exit {process.wait(timeout=60)})")
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        return line

    try:
        for line in (tmp / "c" / "test.de").read_text().splitlines()[:3]:
            process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()  # the pipe stays open: an answer must come before any further input
            assert answer().strip()
        process.stdin.close()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()  # if it is still there
        process.wait()
