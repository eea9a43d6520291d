"""Token embeddings scaled by sqrt(d_model), plus sinusoidal or learned positions."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import Dropout


def sinusoidal_table(length: int, d_model: int, concat: bool = False) -> Tensor:
    """The paper's PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), (length, d); with `concat` the
    same waves laid out as Marian's: every sine (ceil(d/2) of them), then every cosine."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    sines, cosines = torch.sin(pos * inv_freq), torch.cos(pos * inv_freq[: d_model // 2])  # (length, ceil, floor)
    if concat:
        return torch.cat([sines, cosines], dim=1).float()  # (length, d)
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = sines, cosines
    return table.float()


class Embeddings(nn.Module):
    """tokens (B, T) -> dropout(token_table[tokens] * sqrt(d) + positions[offset : offset + T]), (B, T, d).

    `offset` is the position of the first token: non-zero when decoding step by step with a cache. In training,
    token_dropout drops whole tokens' embeddings (the position stays), the rest scaled by 1 / (1 - p): word dropout,
    as Nematus's dropout_source / dropout_target.
    """

    def __init__(self, tokens: nn.Embedding, max_positions: int, positions: str, dropout: float,
                 token_dropout: float = 0.0):  # fmt: skip
        super().__init__()
        d_model = tokens.embedding_dim
        self.tokens = tokens
        self.scale = math.sqrt(d_model)
        self.max_positions = max_positions
        self.positions_kind = positions
        if positions == "learned":
            self.positions = nn.Parameter(torch.empty(max_positions, d_model))
        else:  # not a parameter, and not saved: rebuilt from the config
            self.register_buffer("positions", torch.empty(max_positions, d_model), persistent=False)
            self.init_buffers()
        self.dropout = Dropout(dropout)
        self.token_dropout = token_dropout

    def init_buffers(self) -> None:
        """The sinusoidal table, computed (again after a build on the meta device, which computes nothing)."""
        if self.positions_kind != "learned":
            d_model = self.tokens.embedding_dim
            self.positions = sinusoidal_table(self.max_positions, d_model, self.positions_kind == "sinusoidal_concat")

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        end = offset + tokens.size(1)
        if end > self.max_positions:
            raise ValueError(
                f"sequence reaches position {end} but max_positions={self.max_positions}; "
                "shorten the inputs or raise model.max_positions"
            )
        if self.training and self.token_dropout > 0:
            x = self.tokens(tokens) * self.scale  # (B, T, d)
            kept = F.dropout(x.new_ones(*tokens.shape, 1), self.token_dropout)  # (B, T, 1): 0 or 1 / (1 - p)
            return self.dropout(x * kept + self.positions[offset:end])
        return self.dropout(torch.add(self.positions[offset:end], self.tokens(tokens), alpha=self.scale))  # (B, T, d)
