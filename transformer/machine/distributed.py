"""What every DDP rank holds, gathered (torch.distributed; without it, the one process's own)."""

import torch


def every_rank(obj) -> list:
    """Every rank's `obj`, by rank. All ranks must call this together (as they all save a checkpoint, or all
    finish a validation)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered
