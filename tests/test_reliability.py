import errno
import io
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from transformer.training.checkpoint import AtomicCheckpointIO, RunFolderLock
from transformer.training.errors import TrainingError

from .helpers import ROOT, run_train, tiny_data, write_text_corpus


class NaNLogitsAt(pl.Callback):
    """From a given step on, the model's logits are NaN (as a numerical blow-up would make them)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, module):
        module.model.output.register_forward_hook(
            lambda m, i, out: out * float("nan") if m.training and trainer.global_step >= self.step else None
        )


def test_non_finite_loss_stops_before_any_update_and_keeps_the_last_checkpoint(tmp_path):
    write_text_corpus(tmp_path / "c")
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(nan\) at step 7 \(epoch 0, batch 7"):
        run_train(tmp_path / "run", [
            *tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "~logger", "trainer.max_steps=20",
            "trainer.enable_progress_bar=false", "callbacks.last_checkpoint.every_n_train_steps=5",
            "+callbacks.nan._target_=tests.test_reliability.NaNLogitsAt", "+callbacks.nan.step=7",
        ])  # fmt: skip
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt"]  # no validation ran, so no best checkpoint either
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 5 and all(v.isfinite().all() for v in last["state_dict"].values())


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
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))


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


def test_training_stops_when_the_disk_fills(tmp_path, monkeypatch):
    write_text_corpus(tmp_path / "c")
    fill_the_disk(monkeypatch, "torch", free=1000, from_step=4)
    with pytest.raises(TrainingError, match=f"disk full: {tmp_path / 'run' / 'checkpoints'} has 1,000 bytes free"):
        run_train(tmp_path / "run", [
            *tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "~logger", "trainer.max_steps=10",
            "trainer.enable_progress_bar=false", "callbacks.last_checkpoint.every_n_train_steps=2",
        ])  # fmt: skip
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2


def test_validations_that_score_no_bleu_save_no_best_checkpoint(tmp_path):
    write_text_corpus(tmp_path / "c")
    run_train(tmp_path / "run", [
        *tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "~logger", "trainer.max_steps=20",
        "trainer.enable_progress_bar=false", "trainer.val_check_interval=5", "validation.bleu_every=2",
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

    from .test_data import config

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
def test_killed_at_random_moments_and_resumed_the_run_ends_as_if_never_killed(tmp_path):
    """SIGKILL at random moments of a real training process (three after a random delay, two as soon as a
    checkpoint's temporary file appears, i.e. mid-write), resuming with ckpt_path=last each time: every kill
    leaves a loadable last.ckpt, and the final weights equal those of a run never killed. Subword sampling is on:
    each resumed process must draw the segmentations the reference process drew."""
    write_text_corpus(tmp_path / "c")
    args = [sys.executable, "-m", "transformer.train", "model=tiny", "trainer.precision=32", "trainer.max_steps=300",
            "trainer.max_epochs=100",
            "trainer.val_check_interval=10", "callbacks.last_checkpoint.every_n_train_steps=4",
            "trainer.enable_progress_bar=false", "validation.bleu_max_sentences=5", "data.sampling_alpha=0.1",
            *tiny_data(tmp_path / "c", tmp_path / "cache")]  # fmt: skip

    def launch(run_dir: Path, resume: bool) -> subprocess.Popen:
        extra = ["ckpt_path=last"] if resume else []
        return subprocess.Popen([*args, f"hydra.run.dir={run_dir}", *extra], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip

    reference = launch(tmp_path / "reference", resume=False)
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-2000:]

    rng, run, last = random.Random(0), tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    kills, mid_write, plan = 0, 0, ["delay", "write", "delay", "write", "delay"]
    while True:
        before = last.stat().st_mtime_ns if last.exists() else None
        process = launch(run, resume=last.exists())
        if kills == len(plan):
            assert process.wait(timeout=600) == 0, process.stderr.read()[-2000:]
            break
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if last.exists() and last.stat().st_mtime_ns != before:
                break  # this run has trained and written a checkpoint of its own
            time.sleep(0.01)
        if plan[kills] == "delay":
            time.sleep(rng.uniform(0, 1.5))
        else:
            while process.poll() is None and not list(last.parent.glob(".last.ckpt.*.tmp")):
                time.sleep(0.001)  # kill as soon as a checkpoint is being written (a write takes tens of ms)
            mid_write += process.poll() is None
        process.kill()
        process.wait()
        kills += 1
        assert torch.load(last, weights_only=True)["global_step"] > 0  # still a whole, loadable checkpoint
    assert mid_write == 2  # both "write" kills were sent while a checkpoint's temporary file existed
    final = torch.load(last, weights_only=True)
    expected = torch.load(tmp_path / "reference" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == expected["global_step"] == 300
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(final["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # end to end in subprocesses
def test_a_second_training_command_on_a_folder_in_use_changes_nothing_there(tmp_path):
    write_text_corpus(tmp_path / "c")
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "transformer.train", "model=tiny", "trainer.max_steps=100000",
                              "trainer.max_epochs=-1", f"hydra.run.dir={run}", *tiny_data(tmp_path / "c", tmp_path / "cache")],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while not (run / "tokenizer").exists():  # the first run holds the lock by then
            assert first.poll() is None
            time.sleep(0.1)
        config = (run / ".hydra" / "overrides.yaml").read_text()
        second = subprocess.run([sys.executable, "-m", "transformer.train", "model=tiny", "optim.lr=0.5",
                                 f"hydra.run.dir={run}", *tiny_data(tmp_path / "c", tmp_path / "cache")],
                                cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines()[-1].startswith(f"error: {run} is in use by a training run (pid ")
        assert (run / ".hydra" / "overrides.yaml").read_text() == config  # the first run's record is intact
    finally:
        first.kill()
        first.wait()
