"""Commands as a newcomer types them: averaging then evaluating the average, evaluate's run folder, prepare with
train's experiment=, and scoring a test set that comes without a training split, or as a plain pair of files."""

import gzip
import json
import runpy
from pathlib import Path

import datasets
import pytest
import torch
from omegaconf import OmegaConf
from sacrebleu.metrics import BLEU, CHRF

from transformer import evaluate, prepare
from transformer.translators import CheckpointTranslator, SearchConfig

from .helpers import ROOT, compose_command, tiny_data, write_text_corpus

AVERAGE = runpy.run_path(str(ROOT / "scripts" / "average_checkpoints.py"))["main"]


def one_line_error(capsys, run, *args) -> str:
    """What a command run here says when it stops on bad input: one line on stderr, exit status 2."""
    with pytest.raises(SystemExit) as stopped:
        run(*args)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "\n" not in err, err
    return err


# --- averaging --------------------------------------------------------------------------------------------------


def test_averaging_a_folder_writes_average_pt_there(trained, tmp_path):
    """`average_checkpoints.py RUN/checkpoints --last N` writes RUN/checkpoints/average.pt, the file that evaluate,
    translate and export are then given."""
    _, _, ckpt = trained
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    kept = sorted(p for p in ckpt.parent.glob("*.ckpt") if p.name != "last.ckpt")  # the best 2: 2 validations
    for path in kept:
        (folder / path.name).symlink_to(path)
    AVERAGE([str(folder), "--last", "2"])
    averaged = torch.load(folder / "average.pt", weights_only=True)
    assert sorted(averaged["averaged_from"]) == [str(folder / p.name) for p in kept]
    assert CheckpointTranslator.from_path(str(folder / "average.pt")).model is not None  # evaluate, translate open it
    assert [p.name for p in folder.iterdir() if not p.is_symlink()] == ["average.pt"]


def test_averaging_more_checkpoints_than_the_run_kept_says_how_to_keep_more(trained, capsys):
    _, _, ckpt = trained  # two validations: the best 2 by val/bleu, and last.ckpt
    with pytest.raises(SystemExit) as stopped:
        AVERAGE([str(ckpt.parent), "--last", "5"])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 1 and "\n" not in err and "Traceback" not in err, err
    assert "holds checkpoints of 2 different steps" in err and "the best 2 by val/bleu" in err
    assert "--last 2" in err and "callbacks.epoch_checkpoints.save_top_k=5" in err
    assert not (ckpt.parent / "average.pt").exists()


# --- evaluate -----------------------------------------------------------------------------------------------------


def test_evaluate_writes_into_the_checkpoints_run_folder(tmp_path):
    """RUN/evaluate/DATE_TIME/ for a checkpoint of RUN/checkpoints/, outputs/evaluate/DATE_TIME/ for any other."""
    inside = compose_command("evaluate", [f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'average.pt'}"])
    outside = compose_command("evaluate", [f"ckpt_path={tmp_path / 'model.ckpt'}"])
    assert Path(inside.hydra.run.dir).parent == tmp_path / "run" / "evaluate"
    assert Path(outside.hydra.run.dir).parent == Path("outputs") / "evaluate"


def write_split(folder: Path, split: str, source: list[str], target: list[str], gz: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for lang, lines in (("de", source), ("en", target)):
        text = "".join(line + "\n" for line in lines).encode()
        if gz:
            (folder / f"{split}.{lang}.gz").write_bytes(gzip.compress(text))
        else:
            (folder / f"{split}.{lang}").write_bytes(text)


def a_test_set(trained_dir: Path) -> tuple[list[str], list[str]]:
    """16 sentence pairs the trained model translates well; decoded in one batch (max_tokens=8192 below)."""
    return tuple((trained_dir / "c" / f"test.{lang}").read_text().splitlines()[:16] for lang in ("de", "en"))


def test_evaluate_scores_a_folder_holding_only_the_test_set(trained, tmp_path):
    """data.path=DIR split=S with DIR holding S.de.gz and S.en.gz alone (no train.*): the same scores as that split
    evaluated inside a full corpus."""
    tmp, _, ckpt = trained
    source, target = a_test_set(tmp)
    write_split(tmp_path / "alone", "newtest", source, target, gz=True)
    write_split(tmp_path / "full", "newtest", source, target, gz=False)
    write_split(tmp_path / "full", "train", source, target, gz=False)
    common = [f"ckpt_path={ckpt}", "split=newtest", "beam_size=1", "precision=32", "max_tokens=8192"]
    evaluate.main(compose_command("evaluate", [*common, f"data.path={tmp_path / 'alone'}"], tmp_path / "a"))
    evaluate.main(compose_command("evaluate", [*common, f"data.path={tmp_path / 'full'}"], tmp_path / "f"))
    alone, full = (json.loads((tmp_path / r / "newtest.beam1.json").read_text()) for r in ("a", "f"))
    assert alone["sentences"] == 16 and alone["bleu"] == full["bleu"] > 20 and alone["chrf"] == full["chrf"]
    assert (tmp_path / "a" / "newtest.beam1.hyp").read_text() == (tmp_path / "f" / "newtest.beam1.hyp").read_text()


def test_evaluate_scores_a_pair_of_files(trained, tmp_path, capsys):
    """input=SRC references=REF, as sacreBLEU takes them: the model's translations of SRC, and sacreBLEU's scores of
    them against REF, written as for a split."""
    tmp, _, ckpt = trained
    source, target = a_test_set(tmp)
    (tmp_path / "src.de").write_text("".join(line + "\n" for line in source))
    (tmp_path / "ref.en").write_text("".join(line + "\n" for line in target))
    pair = [f"input={tmp_path / 'src.de'}", f"references={tmp_path / 'ref.en'}"]
    out = tmp_path / "out"
    common = [f"ckpt_path={ckpt}", "beam_size=1", "precision=32", "max_tokens=8192"]
    evaluate.main(compose_command("evaluate", [*common, *pair], out))
    printed = capsys.readouterr().out
    scores = json.loads((out / "src.de.beam1.json").read_text())
    hypotheses = CheckpointTranslator.from_path(str(ckpt)).translate(source, SearchConfig(beam_size=1), "32")
    assert (out / "src.de.beam1.hyp").read_text().splitlines() == hypotheses
    assert scores["sentences"] == 16 and scores["bleu"] == BLEU().corpus_score(hypotheses, [target]).score > 20
    assert scores["chrf"] == CHRF(word_order=2).corpus_score(hypotheses, [target]).score
    assert scores["input"] == str(tmp_path / "src.de") and scores["references"] == str(tmp_path / "ref.en")
    assert printed.startswith("BLEU|nrefs:1") and f"{out / 'src.de.beam1'}.hyp, .json" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["input=SRC"], "error: input=SRC needs its references: add references=REF"),
        (["references=SRC"], "error: references=SRC scores the translations of input=: add input="),
        (["input=SRC", "references=/nonexistent.en"], "error: references=/nonexistent.en is not a file"),
        (["input=/nonexistent.de", "references=SRC"], "error: input=/nonexistent.de is not a file"),
        (["input=SRC", "references=SHORT"], "error: input=SRC has 48 lines where references=SHORT has 2"),
        (["input=SRC", "references=SRC", "split=val"], "error: split=val and input=SRC: give one of them"),
    ],
)
def test_evaluate_bad_pair_of_files_is_one_line(trained, tmp_path, capsys, args, message):
    tmp, _, ckpt = trained
    (tmp_path / "short.en").write_text("one\ntwo\n")
    out = tmp_path / "out"
    paths = {"SRC": str(tmp / "c" / "val.de"), "SHORT": str(tmp_path / "short.en")}
    args = [a.replace("SRC", paths["SRC"]).replace("SHORT", paths["SHORT"]) for a in args]
    message = message.replace("SRC", paths["SRC"]).replace("SHORT", paths["SHORT"])
    cfg = compose_command("evaluate", [f"ckpt_path={ckpt}", *args], out)
    assert one_line_error(capsys, evaluate.main, cfg).startswith(message)
    assert not list(out.iterdir())  # nothing written


# --- prepare ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experiment", ["mix_de_en_cpu", "multi30k_de_en_cpu", "multi30k_en_de"])
def test_prepare_takes_the_experiment_train_takes(experiment):
    """`prepare experiment=X` (run before `torchrun ... train experiment=X`) prepares the data that training will
    read: the same data config."""
    overrides = [f"experiment={experiment}", "data.vocab_size=6000"]
    prepared = OmegaConf.to_container(compose_command("prepare", overrides).data, resolve=True)
    trained = OmegaConf.to_container(compose_command("train", overrides).data, resolve=True)
    assert prepared == trained


def test_prepare_runs_an_experiment_on_other_corpora(tmp_path, capsys):
    """The mix experiment, its three corpora pointed at small ones: prepare accepts the experiment's trainer and
    model keys and prints the mix."""
    for name in ("main", "tatoeba", "news"):
        write_text_corpus(tmp_path / name)
    overrides = [
        "experiment=mix_de_en_cpu", *tiny_data(tmp_path / "main", tmp_path / "cache"), "data.epoch_pairs=400",
        f"data.corpora.tatoeba.path={tmp_path / 'tatoeba'}", "data.corpora.tatoeba.valid_split=val",
        "data.corpora.tatoeba.test_split=test", f"data.corpora.news.path={tmp_path / 'news'}",
        "data.corpora.news.valid_split=val",
    ]  # fmt: skip
    try:
        prepare.main(compose_command("prepare", overrides))
    finally:
        datasets.enable_progress_bars()  # the command hides them for its process; this one goes on
    out = capsys.readouterr().out
    assert "train (mix)" in out and "tatoeba/val" in out and "news/val" in out and "400 pairs per epoch" in out
