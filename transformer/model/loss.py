"""The training loss: label-smoothed cross-entropy summed over target tokens; R-Drop's, when asked."""

import torch
from torch import Tensor

from .layout import SequenceLayout
from .transformer import EncoderDecoder


def target_positions(tgt_out: Tensor, pad_id: int, tokens: int | None = None) -> Tensor:
    """(N,) flat positions b * T + t of the N real target tokens, in row-major order; with their number known on the
    host (`tokens`), found without waiting on the device. The collator gives them ready-made ("tgt_positions")."""
    real = tgt_out.ne(pad_id).flatten()  # (B*T,)
    where = real.nonzero() if tokens is None else torch.nonzero_static(real, size=tokens)  # (N, 1)
    return where.squeeze(1)  # (N,)


def target_logits(model: EncoderDecoder, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
                  src_layout: SequenceLayout | None = None, tokens: int | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(logits (N, V) in float32, targets (N,)) at the N real target tokens, in row-major order. Logits are
    computed only there: padding is about a tenth of a length-sorted token batch, and the output layer and its
    softmax are its costliest part. With the source's layout and the number of real target tokens known on the host
    (`tokens`, the collator's), nothing waits on the device."""
    where = target_positions(tgt_out, model.pad_id, tokens)
    logits = model(src, tgt_in, where=where, src_layout=src_layout).float()  # (N, V)
    return logits, tgt_out.flatten()[where]


def batch_source_layout(model: EncoderDecoder, batch: dict, copies: int = 1) -> SequenceLayout:
    """The source's layout from the collator's host facts (no wait on the device), for the batch repeated `copies`
    times along its rows."""
    lengths = batch["src_lengths"].repeat(copies) if copies > 1 else batch["src_lengths"]
    return SequenceLayout.right_padded(lengths, batch["src"].size(1), batch["src_padded"],
                                       copies * batch["src_tokens"], packed=model.padding_free)  # fmt: skip


def batch_loss_sum(model: EncoderDecoder, batch: dict, label_smoothing: float,
                   rdrop_alpha: float | None = None) -> tuple[Tensor, int]:  # fmt: skip
    """(the loss summed over target tokens, their number) of a batch as the data module's collator makes it (src,
    tgt_in, tgt_out, tgt_positions, tgt_labels, and the host facts src_lengths, src_padded, src_tokens, tgt_tokens):
    the training step's loss, with no wait on the device. With rdrop_alpha, the batch goes through the model twice in
    one pass (two dropout masks) and the loss is R-Drop's (EncoderDecoder.loss)."""
    if rdrop_alpha is None:
        loss = model.loss(batch["src"], batch["tgt_in"], batch["tgt_labels"], where=batch["tgt_positions"],
                          src_layout=batch_source_layout(model, batch), label_smoothing=label_smoothing)  # fmt: skip
        return loss, batch["tgt_tokens"]
    B, T = batch["tgt_in"].shape
    src, tgt_in = (batch[k].repeat(2, 1) for k in ("src", "tgt_in"))  # (2B, S), (2B, T)
    positions = batch["tgt_positions"]  # (N,) flat positions in (B, T); the second copy's rows follow the first's
    where = torch.cat([positions, positions + B * T])  # (2N,)
    loss = model.loss(src, tgt_in, batch["tgt_labels"], where=where, src_layout=batch_source_layout(model, batch, 2),
                      label_smoothing=label_smoothing, rdrop_alpha=rdrop_alpha)  # fmt: skip
    return loss, batch["tgt_tokens"]
