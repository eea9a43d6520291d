"""Where the real tokens of a padded batch are: worked out once per batch and passed down to every attention layer."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class SequenceLayout:
    """A batch of B rows, `width` positions each, some of them padding.

    The host fields (Python values) choose kernels without waiting on the device: they come from the collator, or
    from one sync when the layout is derived from the tokens. The tensors are computed here once and shared by every
    layer. `padded`, `empty_rows` and `longest` may err on the safe side (True, True, the width): a layout of
    selected rows keeps its batch's.
    """

    lengths: Tensor  # (B,) real tokens per row, on the batch's device
    width: int  # S
    padded: bool  # some row has padding; False: `padding` is None and attention needs no mask
    empty_rows: bool  # some row has no real token, so its queries have no key to attend to
    longest: int  # at least the longest row's length
    padding: Tensor | None = None  # (B, S) True = padding (nn.MultiheadAttention's key_padding_mask)
    # padding-free attention packs the real tokens, row after row: (total,) flat positions b * S + s, and the
    # (B + 1,) offsets of each row's first; None where the layout cannot pack (no host count of real tokens)
    index: Tensor | None = None
    offsets: Tensor | None = None

    @classmethod
    def from_padding(cls, padding: Tensor, packed: bool = False) -> "SequenceLayout":
        """From a (B, S) mask, True = padding, anywhere in a row; one sync reads the lengths' range and total."""
        lengths = (~padding).sum(dim=1)  # (B,)
        B, S = padding.shape
        shortest, longest, total = (
            torch.stack([lengths.min(), lengths.max(), lengths.sum()]).tolist() if B else (S, 0, 0)
        )
        padded = shortest < S
        return cls._build(lengths, S, padded, shortest == 0, longest, padding if padded else None, packed, total)

    @classmethod
    def of(cls, tokens: Tensor, pad_id: int, packed: bool = False) -> "SequenceLayout":
        """From token ids (B, S), padding where they are `pad_id`; one sync (see from_padding)."""
        return cls.from_padding(tokens.eq(pad_id), packed)

    @classmethod
    def right_padded(cls, lengths: Tensor, width: int, padded: bool, tokens: int, packed: bool = False):
        """As the collator pads a batch: each row `lengths[b]` real tokens (at least one, an EOS) then padding, the
        longest filling the width; `padded` and `tokens` (their sum) known on the host, so nothing waits here."""
        padding = torch.arange(width, device=lengths.device)[None, :] >= lengths[:, None] if padded else None  # (B, S)
        return cls._build(lengths, width, padded, False, width, padding, packed, tokens)

    @classmethod
    def _build(cls, lengths, width, padded, empty_rows, longest, padding, packed, total) -> "SequenceLayout":
        index = offsets = None
        if packed and padding is not None:
            index = torch.nonzero_static((~padding).flatten(), size=total).squeeze(1)  # (total,) in row order
            offsets = F.pad(lengths.cumsum(0), (1, 0))  # (B + 1,)
        return cls(lengths, width, padded, empty_rows, longest, padding, index, offsets)

    def __getitem__(self, rows: Tensor) -> "SequenceLayout":
        """The layout of batch rows `rows` (finished sentences leave a search, beams multiply rows). A layout that
        packs gives one that packs, worked out anew at the cost of one sync (searches only: training never selects
        rows), so that a search's later steps stay padding-free; otherwise the host fields stay this batch's, which
        remain true bounds, and it does not pack."""
        padding = None if self.padding is None else self.padding[rows]
        if self.index is not None:
            return SequenceLayout.from_padding(padding, packed=True)
        return SequenceLayout(self.lengths[rows], self.width, self.padded, self.empty_rows, self.longest, padding)
