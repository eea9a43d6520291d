"""The training loss: label-smoothed cross-entropy summed over target tokens."""

import torch.nn.functional as F
from torch import Tensor

from .transformer import EncoderDecoder


def loss_sum(model: EncoderDecoder, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
             label_smoothing: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(cross-entropy summed over the real target tokens, their number). Logits are computed only there: padding
    is about a tenth of a length-sorted token batch, and the output layer and its softmax are its costliest part."""
    real = tgt_out.ne(model.pad_id)  # (B, T)
    logits = model(src, tgt_in, where=real).float()  # (N, V)
    loss = F.cross_entropy(logits, tgt_out[real], label_smoothing=label_smoothing, reduction="sum")
    return loss, real.sum()
