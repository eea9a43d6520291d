"""A quiet console: a run shows its progress bar, its data and its scores, not notices from inside libraries.

Each filter names one message and the library module that raises it: the same warning raised from our code, and
every other warning of that library, still show."""

import logging
import warnings

LIGHTNING = r"(pytorch_lightning|lightning\.pytorch)"  # the standalone package or the unified one

# (message, category, module raising it), as warnings.filterwarnings matches them: regular expressions from the start
LIBRARY_WARNINGS = [
    # torch (2.13 here) deprecates LeafSpec; Lightning 2.6 still builds one whenever it wraps a loop's dataloaders
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, LIGHTNING + r"\.utilities\._pytree\Z"),
    # mixed precision keeps float32 weights, so the summary's 32-bit size estimate that this warns about is right
    (
        r"Precision (bf16|16)-mixed is not supported by the model summary",
        UserWarning,
        LIGHTNING + r"\.utilities\.model_summary\.model_summary\Z",
    ),
    # a streamed epoch's length is exact: every loader worker yields the same number of batches, each its own pairs
    (r"Your `IterableDataset` has `__len__` defined", UserWarning, LIGHTNING + r"\.utilities\.data\Z"),
]

# Lightning's rank-zero notices go to one of these loggers (the last Lightning package imported picks it)
LIGHTNING_LOGGERS = [f"{p}.utilities.rank_zero" for p in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch")]


class _NoLightningTips(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: For seamless cloud logging ... try installing litlogger")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")


_NO_TIPS = _NoLightningTips()


def quiet_console() -> None:
    """Install the filters above; calling it again changes nothing."""
    for message, category, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).addFilter(_NO_TIPS)  # a no-op when already there
