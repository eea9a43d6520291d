"""torch.compile as training uses it: the model's loss (its training graph), shapes symbolic from the first trace, the
model's float constants not."""

import torch

from .transformer import EncoderDecoder


def compile_dynamic(model: EncoderDecoder, **options) -> None:
    """Compile in place model.loss (the encoder, the decoder and the fused loss: the training step's graph, R-Drop's
    too), so parameter names (and checkpoints) stay the plain model's. dynamic=True: every batch has other sizes, so
    they are symbols from the first trace on, not after a recompile or two of static ones.

    dynamic=True also makes every Python float symbolic (torch's specialize_float=False): each module's eps, dropout
    p and embedding scale becomes a graph input, and the first that an operator cannot take symbolically
    (nn.Embedding's norm_type) makes dynamo trace the whole step again. Constants they are: 8.5 s to capture a
    one-layer model's forward and backward, against 13 s."""
    torch._dynamo.config.specialize_float = True
    model.loss = torch.compile(model.loss, dynamic=True, **options)
