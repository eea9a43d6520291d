"""What every search needs from its sources: each sentence's length limit, and the encoder output of the rows
still decoding."""

from torch import Tensor

from ..model import EncoderDecoder, SequenceLayout

# Hypotheses stop at int(MAX_LEN_A * source length + MAX_LEN_B) tokens unless told otherwise: every search's default
MAX_LEN_A, MAX_LEN_B = 1.2, 10


def max_target_lengths(model: EncoderDecoder, src: Tensor, max_len_a: float, max_len_b: int) -> tuple[Tensor, int]:
    """Per sentence of right-padded sources (B, S), the most tokens it may generate (EOS included):
    int(max_len_a * src_len + max_len_b), src_len being its own non-pad length, never beyond the model's
    max_positions; and the decoding steps the batch needs (the largest of them, 0 for an empty batch)."""
    src_len = src.ne(model.pad_id).sum(dim=1)  # (B,)
    max_len = (src_len.double() * max_len_a + max_len_b).long()  # float64, int(): as Python computes it
    max_len = max_len.clamp(0, model.max_target_positions)  # (B,)
    return max_len, int(max_len.max()) if src.size(0) else 0


def select_encoded(memory: Tensor, src_layout: SequenceLayout, index: Tensor) -> tuple[Tensor, SequenceLayout]:
    """The encoder output of the rows in index (n',): to drop finished sentences or repeat one per beam."""
    return memory[index], src_layout[index]  # (n', S, d), n' rows
