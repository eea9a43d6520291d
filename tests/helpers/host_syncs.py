"""What would make a GPU's host wait, recorded on a CPU, where nothing waits: reads of tensor values into Python,
tensors made on a device from Python values, outputs sized by values (nonzero, masked_select, boolean indexing),
and the collectives called from Python. Counted by name, wherever
they run, over whole optimizer steps of a real training run."""

import json
import traceback
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Checkpoint
from torch import Tensor
from torch.overrides import TorchFunctionMode

READS = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
         Tensor.__format__, Tensor.cpu, Tensor.numpy}  # fmt: skip
FROM_HOST = {torch.tensor, torch.as_tensor}  # given a device: a copy from the host's memory, which it waits for
# an output whose size depends on the values: the host reads how many there are before it can allocate
DATA_SIZED = {torch.nonzero, Tensor.nonzero, torch.masked_select, Tensor.masked_select, torch.unique, Tensor.unique,
              torch.argwhere, Tensor.argwhere}  # fmt: skip
INDEXING = {Tensor.__getitem__, Tensor.__setitem__}  # with a boolean mask: the nonzero above, inside
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "_broadcast_coalesced", "barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter")  # fmt: skip


def _caller() -> str:
    """The innermost frame outside this file and torch's dispatch: where the call was made."""
    frames = [f for f in traceback.extract_stack() if f.filename != __file__ and "torch/overrides" not in f.filename]
    last = frames[-1]
    return f"{Path(last.filename).name}:{last.name}"


class HostSyncs(TorchFunctionMode):
    """Records each call that waits for the device ("sync") as (what, where)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in READS or func in DATA_SIZED or (func in FROM_HOST and kwargs.get("device") is not None)
                or (func in INDEXING and boolean_index(args[1]))):  # fmt: skip
            self.syncs.append(f"{func.__name__} in {_caller()}")
        return func(*args, **kwargs)


def boolean_index(index) -> bool:
    """A boolean tensor among an index's parts: x[mask], x[:, mask]."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, Tensor) and part.dtype == torch.bool for part in parts)


class CountHostSyncs(Checkpoint):
    """Records syncs and collectives from the start of optimizer step `first` to the start of step first + steps:
    each of those steps whole (fetching its batches, forward, backward, optimizer, callbacks, logging). A Checkpoint,
    so that Lightning runs its hooks after the other callbacks'. With `folder`, each rank writes what it recorded to
    {folder}/syncs.rank{R}.json when training ends."""

    def __init__(self, first: int = 2, steps: int = 3, folder: str | None = None):
        self.first, self.steps, self.folder = first, steps, folder
        self.syncs: list[str] = []
        self.collectives: list[str] = []
        self._mode: HostSyncs | None = None
        self._patches: list = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        if self._mode is None and not self._patches and trainer.global_step == self.first:
            self._patches = [mock.patch.object(dist, name, self._recorded(name, getattr(dist, name)))
                             for name in COLLECTIVES if hasattr(dist, name)]  # fmt: skip
            for patch in self._patches:
                patch.start()
            self._mode = HostSyncs()
            self._mode.__enter__()
        elif self._mode is not None and trainer.global_step == self.first + self.steps:
            self._stop()

    def _recorded(self, name: str, collective):
        def call(*args, **kwargs):
            self.collectives.append(f"{name} in {_caller()}")
            return collective(*args, **kwargs)

        return call

    def _stop(self) -> None:
        self._mode.__exit__(None, None, None)
        self.syncs = self._mode.syncs
        self._mode = None
        for patch in self._patches:
            patch.stop()

    def on_train_end(self, trainer, module) -> None:
        if self._mode is not None:
            raise AssertionError(f"training ended before step {self.first + self.steps}: count fewer steps")
        if self.folder is not None:
            path = Path(self.folder) / f"syncs.rank{trainer.global_rank}.json"
            path.write_text(json.dumps({"syncs": self.syncs, "collectives": self.collectives}))
