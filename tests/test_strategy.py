"""The strategies a run trains with: DDP without a buffer broadcast before each forward (the 2-rank run of
tests/test_host_syncs.py sees none), and the sharded strategies refused in one line, before any data is read."""

import pytest
from pytorch_lightning.strategies import DDPStrategy

from transformer.training.strategy import training_strategy

from .helpers import run_train, tiny_data


@pytest.mark.parametrize("name, devices, nodes", [("ddp", 2, 1), ("ddp_spawn", "0,1", 1),
                                                  ("ddp_find_unused_parameters_true", [0, 1], 1),
                                                  ("auto", 2, 1), ("auto", 1, 2)])  # fmt: skip
def test_ddp_however_named_broadcasts_no_buffers(name, devices, nodes):
    strategy = training_strategy(name, devices, nodes)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs["broadcast_buffers"] is False


def test_a_single_device_stays_lightnings_choice():
    assert training_strategy("auto", 1) == "auto" and training_strategy("single_device", 1) == "single_device"


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_2"])
def test_sharded_strategies_are_refused_in_one_line_naming_ddp(tmp_path, strategy):
    """As the command's one_line_errors prints it (a ValueError), before the tokenizer is trained."""
    with pytest.raises(ValueError) as refused:
        run_train(tmp_path / "run", ["model=tiny", f"trainer.strategy={strategy}",
                                     *tiny_data(tmp_path / "c", tmp_path / "cache")])  # fmt: skip
    message = str(refused.value)
    assert message.startswith(f"trainer.strategy={strategy} shards the weights") and "trainer=ddp" in message
    assert "\n" not in message and not (tmp_path / "cache").exists()
