"""The strategy a run trains with, as trainer.strategy names it: Lightning's own, with DDP told not to broadcast
buffers, and the strategies that shard the weights refused."""

import torch
from pytorch_lightning.strategies import DDPStrategy, Strategy, StrategyRegistry

from ..machine.precision import device_type

SHARDED = ("fsdp", "deepspeed")


def training_strategy(name: str, devices, num_nodes: int = 1, accelerator: str = "auto") -> Strategy | str:
    """What to hand Lightning's Trainer for trainer.strategy=`name`. DDP gets broadcast_buffers=False: its default
    copies every buffer from rank 0 before each forward, and the only buffers here are the sinusoidal position
    tables, which every rank builds the same. `auto` is resolved as Lightning resolves it where that gives DDP."""
    if name.startswith(SHARDED):
        raise ValueError(
            f"trainer.strategy={name} shards the weights across ranks, but gradient clipping and the weight average "
            "here read whole weights on each rank; train with trainer=ddp (transformer-big's weights, gradients and "
            "Adam state, about 3.4 GB, fit on every GPU)"
        )
    if name == "auto" and (num_nodes > 1 or device_count(devices, accelerator) > 1):
        name = "ddp"
    entry = StrategyRegistry[name] if name in StrategyRegistry else None
    if entry is None or not issubclass(entry["strategy"], DDPStrategy):
        return name
    return entry["strategy"](**entry["init_params"], broadcast_buffers=False)


def device_count(devices, accelerator: str) -> int:
    """How many devices of one node trainer.devices names (Lightning's forms: 2, "2", [0, 1], "0,1", "auto", -1):
    "auto" and -1 are every GPU on a GPU, one process on a CPU."""
    if isinstance(devices, list | tuple):
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return max(torch.cuda.device_count(), 1) if device_type(accelerator) == "cuda" else 1
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.isdigit() else 1
