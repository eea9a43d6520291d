"""The training loss: label-smoothed cross-entropy summed over target tokens."""

import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import SequenceLayout
from .transformer import EncoderDecoder


def loss_sum(model: EncoderDecoder, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, label_smoothing: float,
             src_layout: SequenceLayout | None = None, tokens: int | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(cross-entropy summed over the real target tokens, their number). Logits are computed only there: padding
    is about a tenth of a length-sorted token batch, and the output layer and its softmax are its costliest part.
    With the source's layout and the number of real target tokens known on the host (`tokens`, the collator's),
    nothing waits on the device."""
    real = tgt_out.ne(model.pad_id).flatten()  # (B*T,)
    where = real.nonzero() if tokens is None else torch.nonzero_static(real, size=tokens)  # (N, 1) flat positions
    where = where.squeeze(1)  # (N,)
    logits = model(src, tgt_in, where=where, src_layout=src_layout).float()  # (N, V)
    loss = F.cross_entropy(logits, tgt_out.flatten()[where], label_smoothing=label_smoothing, reduction="sum")
    return loss, real.sum()


def batch_loss_sum(model: EncoderDecoder, batch: dict, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """loss_sum of a batch as the data module's collator makes it (src, tgt_in, tgt_out, and the host facts
    src_lengths, src_padded, src_tokens, tgt_tokens): the training step's loss, with no wait on the device."""
    src_layout = SequenceLayout.right_padded(batch["src_lengths"], batch["src"].size(1), batch["src_padded"],
                                             batch["src_tokens"], packed=model.padding_free)  # fmt: skip
    return loss_sum(model, batch["src"], batch["tgt_in"], batch["tgt_out"], label_smoothing, src_layout,
                    batch["tgt_tokens"])  # fmt: skip
