import contextlib
import errno
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import unittest.mock
from pathlib import Path

import hydra.core.utils
import pytest
import pytorch_lightning as pl
import torch
from omegaconf import open_dict

from transformer.train import cli, train
from transformer.training.checkpoint import KILL_AT, AtomicCheckpointIO, RunFolderLock
from transformer.training.errors import TrainingError
from transformer.training.steps import StepLedger

from .helpers import ROOT, compose_train, config, run_train, tiny_data, write_text_corpus


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> list[str]:
    """Overrides for a run of the tiny model on a small generated corpus (13 batches an epoch) whose tokenizer is
    trained and splits encoded once for the module."""
    tmp = tmp_path_factory.mktemp("small")
    write_text_corpus(tmp / "c")
    return [*tiny_data(tmp / "c", tmp / "cache"), "model=tiny", "trainer.precision=32-true",
            "trainer.enable_progress_bar=false"]  # fmt: skip


class NaNLogitsAt(pl.Callback):
    """From a given step on, the decoder's output states, hence the logits, are NaN (as a numerical blow-up would make
    them)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, module):
        module.model.decoder.register_forward_hook(
            lambda m, i, out: out * float("nan") if m.training and trainer.global_step >= self.step else None
        )


def test_non_finite_loss_stops_before_any_update_and_keeps_the_last_checkpoint(tmp_path, small):
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(nan\) at step 7 \(epoch 0, batch 7"):
        run_train(tmp_path / "run", [
            *small, "~logger", "trainer.max_steps=20", "callbacks.last_checkpoint.every_n_train_steps=5",
            "+callbacks.nan._target_=tests.test_reliability.NaNLogitsAt", "+callbacks.nan.step=7",
        ])  # fmt: skip
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt"]  # no validation ran, so no best checkpoint either
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 5 and all(v.isfinite().all() for v in last["state_dict"].values())


class NaNLogitsOnlyAt(pl.Callback):
    """The decoder's output states are NaN at one step alone (a transient blow-up); the parameters are recorded after
    every step, by trainer.global_step."""

    last: "NaNLogitsOnlyAt | None" = None  # the newest, to read after training raised

    def __init__(self, step: int):
        self.step, self.weights = step, {}
        NaNLogitsOnlyAt.last = self

    def on_train_start(self, trainer, module):
        module.model.decoder.register_forward_hook(
            lambda m, i, out: out * float("nan") if m.training and trainer.global_step == self.step else None
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.weights[trainer.global_step] = torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


def test_a_non_finite_step_is_skipped_on_the_device_and_stops_training_at_the_next_read(tmp_path, small):
    """Nothing waits on the device to learn that step 5 was not finite: the optimizer skips it there (the weights
    after it are those before it), step 6 runs, and the read that ends the logging interval, in step 6, stops
    training before step 6's update, naming step 5."""
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(nan\) at step 5 \(epoch 0, batch 5"):
        run_train(tmp_path / "run", [*small, "~logger", "trainer.max_steps=20", "trainer.log_every_n_steps=7",
                                     "+callbacks.nan._target_=tests.test_reliability.NaNLogitsOnlyAt",
                                     "+callbacks.nan.step=5"])  # fmt: skip
    weights = NaNLogitsOnlyAt.last.weights  # after each step, by the steps done
    assert sorted(weights) == [1, 2, 3, 4, 5, 6]
    assert torch.equal(weights[6], weights[5]) and not torch.equal(weights[5], weights[4])
    assert torch.isfinite(weights[6]).all()


def test_an_unfused_optimizer_is_refused_before_it_could_apply_a_non_finite_step():
    """The device-side skip relies on fused AdamW reading found_inf; an unfused optimizer ignores it and would apply
    the NaN update silently: one line instead, and nothing handed to the optimizer."""
    ledger = StepLedger()
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], fused=False)
    with pytest.raises(TrainingError, match=r"^AdamW\(fused=False\) would apply a non-finite step's update"):
        ledger.skip_if_not_finite(optimizer, torch.tensor(float("nan")))
    assert not hasattr(optimizer, "found_inf")


def disk_has(monkeypatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))


def fill_the_disk(monkeypatch, failure: str, free: int, from_step: int = 0) -> None:
    """torch.save into a checkpoint file fails as on a full disk (ENOSPC, or torch's zip writer error) from a
    given global_step on, after writing some bytes; the disk has `free` bytes left."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, io.BufferedWriter) or obj.get("global_step", 0) < from_step:
            return real_save(obj, f, *args, **kwargs)  # an earlier checkpoint, or the size estimate
        f.write(b"\0" * 64)
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 470")

    monkeypatch.setattr(torch, "save", save)
    disk_has(monkeypatch, free)


def serialized_size(obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return len(buffer.getvalue())


@pytest.mark.parametrize("failure", ["enospc", "torch"])
def test_a_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure):
    folder, writer = tmp_path / "checkpoints", AtomicCheckpointIO()
    writer.save_checkpoint({"global_step": 1, "w": torch.zeros(100)}, folder / "last.ckpt")
    previous = (folder / "last.ckpt").read_bytes()
    checkpoint = {"global_step": 2, "w": torch.zeros(1000)}
    needed = serialized_size(checkpoint)
    fill_the_disk(monkeypatch, failure, free=1234)
    with pytest.raises(TrainingError) as error:
        writer.save_checkpoint(checkpoint, folder / "last.ckpt")
    assert str(error.value) == (
        f"disk full: {folder} has 1,234 bytes free, last.ckpt needs {needed:,}; {folder / 'last.ckpt'} is intact: "
        f"free space and resume with ckpt_path={folder / 'last.ckpt'}"
    )
    assert (folder / "last.ckpt").read_bytes() == previous
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"]  # no temporary file left


def test_a_failed_write_with_room_to_spare_is_not_called_a_full_disk(tmp_path, monkeypatch):
    fill_the_disk(monkeypatch, "torch", free=10**12)
    with pytest.raises(RuntimeError, match="unexpected pos") as error:
        AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "last.ckpt")
    assert not isinstance(error.value, TrainingError)
    assert list(tmp_path.iterdir()) == []


def test_training_stops_when_the_disk_fills(tmp_path, monkeypatch, small):
    fill_the_disk(monkeypatch, "torch", free=1000, from_step=4)
    with pytest.raises(TrainingError, match=f"disk full: {tmp_path / 'run' / 'checkpoints'} has 1,000 bytes free"):
        run_train(tmp_path / "run", [
            *small, "~logger", "trainer.max_steps=10", "callbacks.last_checkpoint.every_n_train_steps=2",
        ])  # fmt: skip
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2


# `python -m transformer.train` in this process: configs/ found beside the file, as when it is __main__; Hydra's
# logging left alone
IN_PROCESS = {"HYDRA_MAIN_MODULE": "__main__"}
NO_LOGGING = ["hydra/job_logging=none", "hydra/hydra_logging=none"]


def run_the_command(monkeypatch, argv: list[str]) -> int:
    """`python -m transformer.train ARGV` in this process: its exit status."""
    monkeypatch.setattr(sys, "argv", ["transformer.train", *argv, *NO_LOGGING])
    monkeypatch.setenv("HYDRA_MAIN_MODULE", IN_PROCESS["HYDRA_MAIN_MODULE"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the command sets it: undone after the test
    # the command wraps Python's own hook (which prints a thread's traceback), not pytest's (which warns)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    with pytest.raises(SystemExit) as stopped:
        cli()
    return stopped.value.code


def test_a_full_disk_under_tensorboard_stops_with_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys,
                                                                                     small):  # fmt: skip
    """TensorBoard's writer thread meets the full disk first (once last.ckpt exists); the training loop meets it at
    its next write, and the command ends with one line, the thread printing nothing of its own."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    real_write = gfile.LocalFileSystem._write

    def write(self, filename, content, mode):
        if "tfevents" in str(filename) and last.exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, filename, content, mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", write)
    disk_has(monkeypatch, 1000)
    code = run_the_command(monkeypatch, [*small, f"hydra.run.dir={run}", "trainer.max_steps=12",
                                         "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
                                         "callbacks.last_checkpoint.every_n_train_steps=2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: disk full: {run} has 1,000 bytes free, too few to write into it (No space left on device); {last} "
        f"is intact: free space and resume with ckpt_path={last}"
    )
    assert 2 <= torch.load(last, weights_only=True)["global_step"] < 12  # whole, and training stopped early
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]


def test_a_full_disk_under_hydras_record_stops_with_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch,
                                                                                      capsys):  # fmt: skip
    """Resuming into a run folder on a full disk: Hydra's .hydra record, written before training starts, fails."""
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"a checkpoint")  # never read: the command stops before training

    class FullDisk(io.TextIOBase):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        open(file, mode, *args, **kwargs).close()  # opening truncates as ever; the write fails
        return FullDisk()

    monkeypatch.setattr(hydra.core.utils, "open", open_on_a_full_disk, raising=False)  # Hydra's _save_config
    disk_has(monkeypatch, 1000)
    code = run_the_command(monkeypatch, ["model=tiny", f"hydra.run.dir={run}", "ckpt_path=last"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines() == [
        f"error: disk full: {run} has 1,000 bytes free, too few to write into it (No space left on device); {last} "
        f"is intact: free space and resume with ckpt_path={last}"
    ]
    assert last.read_bytes() == b"a checkpoint"


def test_validations_that_score_no_bleu_save_no_best_checkpoint(tmp_path, small):
    run_train(tmp_path / "run", [
        *small, "~logger", "trainer.max_steps=20", "trainer.val_check_interval=5", "validation.bleu_every=2",
        "validation.bleu_max_sentences=4",
    ])  # fmt: skip  # 13 batches an epoch: validations at steps 5, 10 and 18; BLEU at the first and third
    files = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert [f.split("-")[1] for f in files if f != "last.ckpt"] == ["step5", "step18"] and "last.ckpt" in files
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 20


def test_a_second_run_in_the_same_folder_is_refused(tmp_path):
    first = RunFolderLock(tmp_path)
    with pytest.raises(TrainingError, match=f"{tmp_path} is in use by a training run \\(pid {os.getpid()}\\)"):
        RunFolderLock(tmp_path)
    first.release()
    RunFolderLock(tmp_path).release()  # free again once the first run has stopped


@pytest.mark.slow  # end to end in subprocesses
def test_crafted_checkpoint_with_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.ckpt"
    torch.save({"hyper_parameters": {"model": {}}, "state_dict": {}, "payload": Payload()}, path)
    for module in ("transformer.evaluate", "transformer.translate"):
        result = subprocess.run([sys.executable, "-m", module, f"ckpt_path={path}", f"hydra.run.dir={tmp_path}"],
                                capture_output=True, text=True, cwd=ROOT, input="")  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: ckpt_path={path} is refused: it holds code")
    assert not (tmp_path / "pwned").exists()


def test_a_corpus_of_bad_lines_is_cleaned_with_counts_and_stays_aligned(tmp_path):
    from transformer.data import TranslationDataModule

    corpus = write_text_corpus(tmp_path / "c")
    bad_src = [b"Ein \xff\xfe kaputt.", b"Null\x00 und \x1b[31m farbe.", b"   \t ", b"lang " * 20_000]
    bad_tgt = [b"Broken \xc3 bytes.", b"Nul\x07 and bell.", b"fine.", b"long " * 20_000]
    for split in ("train", "val"):
        for lang, lines, bad in (("de", corpus[split][0], bad_src), ("en", corpus[split][1], bad_tgt)):
            rows = [line.encode() for line in lines[:5]] + bad + [line.encode() for line in lines[5:]]
            (tmp_path / "c" / f"{split}.{lang}").write_bytes(b"\n".join(rows) + b"\n")
    data = TranslationDataModule(config(tmp_path / "c", tmp_path, max_tokens=300))
    data.setup()
    stats = data.data.stats
    assert stats["train"]["repaired"] == {"invalid_utf8": 1, "control_chars": 1, "truncated": 0}
    assert stats["train"]["dropped"]["empty"] == 1 and stats["train"]["dropped"]["too_long"] == 1
    assert stats["val"]["kept"] == stats["val"]["pairs"] == len(corpus["val"][0]) + 4  # evaluation keeps all
    assert stats["val"]["repaired"] == {"invalid_utf8": 1, "control_chars": 1, "truncated": 1}
    train, val = data.data.splits["train"], data.data.splits["val"]
    assert train.column_names == ["src_ids", "tgt_ids"] and {"src", "tgt"} <= set(val.column_names)  # text for scoring

    def encoded(pairs):
        sources, targets = zip(*pairs)
        tokenizers = data.data.src_tokenizer, data.data.tgt_tokenizer
        return set(zip(*(map(tuple, tok.encode(list(texts))) for tok, texts in zip(tokenizers, (sources, targets)))))

    repaired = encoded(
        [("Ein \ufffd\ufffd kaputt.", "Broken \ufffd bytes."), ("Null  und  [31m farbe.", "Nul  and bell.")]
    )
    kept = list(zip(map(tuple, train["src_ids"]), map(tuple, train["tgt_ids"])))
    assert set(kept) <= encoded(zip(*corpus["train"])) | repaired  # no line paired with another's translation
    assert repaired <= set(kept) and len(kept) == stats["train"]["kept"]
    for loader in (data.train_dataloader(), data.val_dataloader()):
        assert sum(len(b["index"]) for b in loader) == len(loader.dataset)


@pytest.mark.slow  # end to end in subprocesses
def test_translate_survives_random_bytes_and_unicode_one_line_out_per_line_in(trained):
    tmp, trainer, ckpt = trained
    rng = random.Random(0)
    lines = []
    for i in range(300):
        if i % 2:  # arbitrary bytes, newline excepted (it ends the line)
            lines.append(bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randint(0, 80))))
        else:  # arbitrary code points from every plane, surrogates excepted (UTF-8 cannot hold them)
            points = [rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])
                      for _ in range(rng.randint(0, 40))]  # fmt: skip
            lines.append("".join(chr(p) for p in points if p != 10).encode())
    stdin = b"\n".join(lines) + b"\n"
    result = subprocess.run([sys.executable, "-m", "transformer.translate", f"ckpt_path={ckpt}", "beam_size=2"],
                            input=stdin, capture_output=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(b"\n") == len(lines)
    blank = [i for i, line in enumerate(lines) if not line.decode("utf-8", "replace").strip()]
    out = result.stdout.split(b"\n")
    assert blank and all(out[i] == b"" for i in blank)


@pytest.mark.slow  # end to end in subprocesses
def test_killed_at_chosen_moments_and_resumed_the_run_ends_as_if_never_killed(tmp_path, small):
    """SIGKILL at chosen moments of a real training process, resuming with ckpt_path=last each time: at each stage of
    a checkpoint's write (the checkpoint writer kills itself there, KILL_AT) and in the middle of a training step.
    Every kill leaves a whole last.ckpt, and the run ends with the weights and the checkpoint files of a run never
    killed. Subword sampling is on: each resumed process must draw the segmentations the reference process drew.
    last.ckpt is written every 4 steps and after the validation at step 10 (after that validation's best checkpoint)."""
    common = [sys.executable, "-m", "transformer.train", *small, "trainer.max_steps=24", "trainer.val_check_interval=10",
              "callbacks.last_checkpoint.every_n_train_steps=4", "validation.bleu_max_sentences=5",
              "data.sampling_alpha=0.1"]  # fmt: skip

    def command(run_dir: Path, *extra: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, **({KILL_AT: kill_at} if kill_at else {})}
        return subprocess.run([*common, f"hydra.run.dir={run_dir}", *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip

    reference = command(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-2000:]

    run, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    at_step = ["+callbacks.kill._target_=tests.helpers.runs.SignalAt", f"+callbacks.kill.signum={int(signal.SIGKILL)}"]
    kills = [  # (how, last.ckpt's step after the kill)
        ({"kill_at": "saved:2"}, 4),  # step 4's write done; step 8's temporary file cut short
        ({"kill_at": "synced:1"}, 4),  # resumed at 4; step 8's temporary file whole, not renamed
        ({"kill_at": "renamed:1"}, 8),  # step 8's in place, its folder not synced
        ({"kill_at": "saved:1"}, 8),  # resumed at 8; the best checkpoint of step 10's validation cut short
        ({"extra": [*at_step, "+callbacks.kill.step=9"]}, 8),  # during step 10, between writes
    ]  # fmt: skip
    for i, (how, step) in enumerate(kills):
        before = last.read_bytes() if i else None
        killed = command(run, *how.get("extra", []), *(["ckpt_path=last"] if i else []), kill_at=how.get("kill_at"))
        assert killed.returncode == -signal.SIGKILL, (how, killed.stderr[-2000:])
        assert torch.load(last, weights_only=True)["global_step"] == step, how  # whole and loadable
        if before is not None and step == torch.load(io.BytesIO(before), weights_only=True)["global_step"]:
            assert last.read_bytes() == before, how  # untouched
    finished = command(run, "ckpt_path=last")
    assert finished.returncode == 0, finished.stderr[-2000:]
    final = torch.load(last, weights_only=True)
    expected = torch.load(tmp_path / "reference" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == expected["global_step"] == 24
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(final["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    files = sorted(p.name for p in last.parent.iterdir())  # the best checkpoints (their scores in their names)
    assert files == sorted(p.name for p in (tmp_path / "reference" / "checkpoints").iterdir()), files


class SecondCommand(pl.Callback):
    """At the first training batch, while this run holds its folder: the training command on the same folder with
    `argv`, in this process (cli(), the command's code): its exit status and stderr, and the folder's files before
    and after it; then the run stops."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.code, self.err, self.before, self.after = None, "", {}, {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.code is None:
            run = Path(trainer.default_root_dir)
            self.before = files_in(run)
            argv = sys.argv
            sys.argv = ["transformer.train", *self.argv, *NO_LOGGING]
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), unittest.mock.patch.dict(os.environ, IN_PROCESS):
                    cli()
            except SystemExit as e:
                self.code = e.code
            finally:
                sys.argv = argv
                self.err = err.getvalue()
            self.after = files_in(run)
            trainer.should_stop = True


def files_in(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_training_command_on_a_folder_in_use_changes_nothing_there(tmp_path, small):
    run = tmp_path / "run"
    cfg = compose_train(run, [*small, "~logger", "trainer.max_steps=1", "trainer.num_sanity_val_steps=0"])
    with open_dict(cfg):
        cfg.callbacks.second = {"_target_": f"{__name__}.SecondCommand",
                                "argv": [*small, "optim.lr=0.5", f"hydra.run.dir={run}"]}  # fmt: skip
    second = next(c for c in train(cfg, run).callbacks if isinstance(c, SecondCommand))
    assert second.code == 2 and len(second.err.strip().splitlines()) == 1, second.err[-3000:]
    assert second.err.startswith(f"error: {run} is in use by a training run (pid {os.getpid()})")
    assert ".lock" in second.before and "tokenizer/spm.model" in second.before
    assert second.after == second.before  # no .hydra record, no log, the lock file's holder intact
