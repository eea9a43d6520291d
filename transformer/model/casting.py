"""The dtype matmuls run in here and now: autocast's where it is on, else the tensors' own."""

import torch
from torch import Tensor


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """What a matmul on `device_type` computes in: autocast's dtype inside autocast, else `default`."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default


def cast_once(x: Tensor) -> Tensor:
    """x in the dtype autocast would cast it to at each matmul that reads it, cast here once for all of them:
    autocast casts a parameter once per forward, but a slice of one, or an activation, anew at every use."""
    return x.to(compute_dtype(x.device.type, x.dtype))
