"""What exact resume needs from a GPU that a CPU has anyway: deterministic kernels on request, and each process's
random state restored into its own device however many devices it sees. Recorded on a CPU."""

import os
import random

import pytorch_lightning as pl
import torch

from transformer.training.exact_resume import rng_state, set_rng_state

from .helpers import callback, run_train, tiny_data, write_text_corpus


class FakeCuda:
    """torch.cuda's random-state functions for `visible` devices, as torch's behave: each device's state is its
    own (here: its index), and a device index beyond those visible raises (torch.cuda.default_generators[idx])."""

    def __init__(self, monkeypatch, visible: int, current: int):
        self.visible, self.current, self.restored = visible, current, {}
        for name in ("is_available", "device_count", "current_device", "get_rng_state", "get_rng_state_all",
                     "set_rng_state", "set_rng_state_all"):  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.visible

    def current_device(self) -> int:
        return self.current

    def _index(self, device) -> int:
        index = self.current if device in ("cuda", None) else int(device)
        if index >= self.visible:
            raise IndexError(f"device {index} of {self.visible} visible")
        return index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return torch.tensor([self._index(device)], dtype=torch.uint8)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.visible)]

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.restored[self._index(device)] = int(state[0])

    def set_rng_state_all(self, states) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def test_a_rank_restores_its_own_devices_random_state_whatever_it_sees(monkeypatch):
    """Saved by rank 2 seeing all 4 GPUs of its node; resumed by the same rank started with CUDA_VISIBLE_DEVICES=2,
    where its GPU is device 0 of 1."""
    FakeCuda(monkeypatch, visible=4, current=2)
    saved = rng_state()
    resumed = FakeCuda(monkeypatch, visible=1, current=0)
    set_rng_state(saved)
    assert resumed.restored == {0: 2}  # device 2's state, into the one device this process has


def test_checkpoints_with_every_devices_state_still_restore(monkeypatch):
    saved = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(4)],
    }  # every device's state, as checkpoints held them before
    resumed = FakeCuda(monkeypatch, visible=4, current=3)
    set_rng_state(saved)
    assert resumed.restored == {3: 3}


class Flags(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def test_runtime_deterministic_trains_with_deterministic_algorithms(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # and back to unset afterwards
    write_text_corpus(tmp_path / "c")
    try:
        trainer = run_train(tmp_path / "run", [*tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny",
                                               "runtime.deterministic=true", "trainer.max_steps=3", "~logger",
                                               "trainer.precision=32", "trainer.enable_progress_bar=false",
                                               "+callbacks.flags._target_=tests.test_determinism.Flags"])  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(False)
    flags = callback(trainer, Flags)
    assert flags.deterministic and flags.workspace == ":4096:8"  # cuBLAS: a fixed workspace, read when it starts
