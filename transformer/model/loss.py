"""The training loss: label-smoothed cross-entropy summed over target tokens; R-Drop's, when asked."""

import torch
import torch.nn.functional as F
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


def rdrop_loss(logits: Tensor, targets: Tensor, label_smoothing: float, alpha: float) -> Tensor:
    """R-Drop (Liang et al. 2021) on two passes' logits (2N, V), pass one's N tokens first, and targets (N,):
    summed over tokens, the mean of the passes' cross-entropies plus alpha / 4 x the symmetric KL divergence
    between the passes, which is the paper's NLL1 + NLL2 + alpha / 2 (KL(P1||P2) + KL(P2||P1)), halved so that
    the loss stays on the scale of one pass's (as the paper's fairseq criterion over its doubled batch)."""
    n = len(targets)
    ce = F.cross_entropy(logits, targets.repeat(2), label_smoothing=label_smoothing, reduction="sum")
    log_p = F.log_softmax(logits, dim=-1)
    p1, p2 = log_p[:n], log_p[n:]  # (N, V) each
    kl = F.kl_div(p2, p1, log_target=True, reduction="sum") + F.kl_div(p1, p2, log_target=True, reduction="sum")
    return ce / 2 + alpha / 4 * kl


def _src_layout(model: EncoderDecoder, batch: dict, copies: int = 1) -> SequenceLayout:
    lengths = batch["src_lengths"].repeat(copies) if copies > 1 else batch["src_lengths"]
    return SequenceLayout.right_padded(lengths, batch["src"].size(1), batch["src_padded"],
                                       copies * batch["src_tokens"], packed=model.padding_free)  # fmt: skip


def batch_loss_sum(model: EncoderDecoder, batch: dict, label_smoothing: float,
                   rdrop_alpha: float | None = None) -> tuple[Tensor, int]:  # fmt: skip
    """(the loss summed over target tokens, their number) of a batch as the data module's collator makes it (src,
    tgt_in, tgt_out, tgt_positions, tgt_labels, and the host facts src_lengths, src_padded, src_tokens, tgt_tokens):
    the training step's loss, with no wait on the device. With rdrop_alpha, the batch goes through the model twice in one pass (two
    dropout masks) and the loss is rdrop_loss."""
    if rdrop_alpha is None:
        loss = model.loss(batch["src"], batch["tgt_in"], batch["tgt_labels"], where=batch["tgt_positions"],
                          src_layout=_src_layout(model, batch), label_smoothing=label_smoothing)  # fmt: skip
        return loss, batch["tgt_tokens"]
    src, tgt_in, tgt_out = (batch[k].repeat(2, 1) for k in ("src", "tgt_in", "tgt_out"))  # (2B, S), (2B, T) x 2
    logits, targets = target_logits(model, src, tgt_in, tgt_out, _src_layout(model, batch, 2), 2 * batch["tgt_tokens"])
    n = batch["tgt_tokens"]
    return rdrop_loss(logits, targets[:n], label_smoothing, rdrop_alpha), n
