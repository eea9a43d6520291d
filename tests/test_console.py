"""The quiet console hides named notices from inside libraries, and nothing else."""

import logging
import warnings

import datasets
import pytest
import torch

from transformer.cli.console import LIGHTNING_LOGGERS, quiet_console
from transformer.data.sources import LARGE, progress_bars_if_large

LEAF_SPEC = (
    "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"
)


def shown(message: str, category: type[Warning], module: str, quiet: bool = True) -> bool:
    """Whether a warning raised from `module` gets through, with the quiet console's filters or without."""
    with warnings.catch_warnings(record=True) as caught:  # the filters installed here end with the block
        warnings.simplefilter("always")
        if quiet:
            quiet_console()
        warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module=module)
    return len(caught) == 1


def test_a_library_deprecation_is_hidden_only_from_inside_that_library():
    lightning = "pytorch_lightning.utilities._pytree"
    assert shown(LEAF_SPEC, FutureWarning, lightning, quiet=False)
    assert not shown(LEAF_SPEC, FutureWarning, lightning)
    assert not shown(LEAF_SPEC, FutureWarning, "lightning.pytorch.utilities._pytree")  # the unified package
    # the same warning from our code, another warning from the same module, or from the rest of Lightning: shown
    assert shown(LEAF_SPEC, FutureWarning, "transformer.training.module")
    assert shown(LEAF_SPEC, FutureWarning, "pytorch_lightning.utilities._pytree_extra")
    assert shown("`LeafSpec` will be removed", FutureWarning, lightning)
    assert shown("`Trainer.foo` is deprecated in v2.6", DeprecationWarning, "pytorch_lightning.trainer.trainer")
    summary = "pytorch_lightning.utilities.model_summary.model_summary"
    bf16 = "Precision bf16-mixed is not supported by the model summary.  Estimated model size in MB will not be ..."
    assert not shown(bf16, UserWarning, summary)
    assert shown(bf16, UserWarning, "transformer.train")


def leaf_spec_warnings(quiet: bool) -> list[str]:
    from pytorch_lightning.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if quiet:
            quiet_console()
        _tree_flatten(1)  # Lightning's own helper builds a LeafSpec
    return [str(w.message) for w in caught if "LeafSpec" in str(w.message)]


def test_the_real_lightning_leaf_spec_warning_is_hidden():
    if not leaf_spec_warnings(quiet=False):
        pytest.skip(f"torch {torch.__version__} does not deprecate LeafSpec")
    assert leaf_spec_warnings(quiet=True) == []


@pytest.fixture
def no_tips_filter_left():
    yield
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if type(f).__name__ == "_NoLightningTips"]:
            logger.removeFilter(f)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_lightnings_tips_are_hidden_its_other_notices_shown(no_tips_filter_left):
    from pytorch_lightning.utilities.rank_zero import rank_zero_info

    records = Records()
    logger = logging.getLogger("pytorch_lightning.utilities.rank_zero")  # where rank_zero_info logs
    ours = logging.getLogger("transformer.train")
    for log in (logger, ours):
        log.addHandler(records)
    try:
        quiet_console()
        quiet_console()
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero_info("GPU available: False, used: False")
        ours.warning("💡 Tip: a line of ours that starts so")
    finally:
        for log in (logger, ours):
            log.removeHandler(records)
    assert records.messages == ["GPU available: False, used: False", "💡 Tip: a line of ours that starts so"]
    assert sum(type(f).__name__ == "_NoLightningTips" for f in logger.filters) == 1  # twice installed once


@pytest.mark.skipif(datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None, reason="the environment decides")
def test_datasets_progress_bars_only_for_large_splits(capfd):
    ds = datasets.Dataset.from_dict({"x": list(range(1000))})
    datasets.enable_progress_bars()  # as a fresh process has them: prepare.main, run in process by other tests, disables them
    with progress_bars_if_large(len(ds)):
        ds.map(lambda b: b, batched=True)
    assert "Map" not in capfd.readouterr().err
    assert not datasets.are_progress_bars_disabled()  # scoped: enabled again after
    with progress_bars_if_large(LARGE + 1):
        ds.map(lambda b: b, batched=True)
    assert "Map" in capfd.readouterr().err
