"""The pages jemalloc keeps between steps go back to the kernel after each validation, when the training step's
working set is idle anyway (at each epoch's end in a run that does not validate): kept for the whole run, what steps
of different batch shapes free fragments, and resident memory grows while the live tensors do not
(docs/lab/2026-12-07-memory-over-a-run.md). The next step faults its working set in again."""

import sys

from pytorch_lightning import Callback, LightningModule, Trainer

from ..machine.allocator import purge_freed_pages


class ReleaseFreedMemory(Callback):
    def __init__(self):
        self.failed = False  # said once; training goes on without it

    def purge(self) -> None:
        if self.failed:
            return
        try:
            purge_freed_pages()
        except OSError as e:
            self.failed = True
            print(f"note: {e}; training goes on, resident memory may grow", file=sys.stderr)

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        self.purge()

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        if not trainer.enable_validation:
            self.purge()
