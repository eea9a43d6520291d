"""The matrix products of a training step, and the rate this machine runs them at (issue 55: MFU is judged against
the machine's own GEMM rate, at 2048^3 and at the model's shapes)."""

import torch

from .machine import gemm_seconds

LAYOUTS = ("nt", "nn", "tn")  # forward x @ W.t(), input gradient g @ W, weight gradient g.t() @ x


def model_dims(cfg) -> dict:
    """What model_products needs of a ModelConfig, as plain values (a benchmark's JSON record keeps them)."""
    return {"d_model": cfg.d_model, "d_ff": cfg.d_ff, "vocab": cfg.tgt_vocab_size,
            "encoder_layers": cfg.n_encoder_layers, "decoder_layers": cfg.n_decoder_layers}  # fmt: skip


def model_products(model: dict, tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(name, m, k, n, count) of the step's linear-layer products, forward only, at `tokens` rows; model as
    {d_model, d_ff, vocab, encoder_layers, decoder_layers}."""
    d, ff, V = model["d_model"], model["d_ff"], model["vocab"]
    enc, dec = model["encoder_layers"], model["decoder_layers"]
    return [("self-attention Q, K, V", tokens, d, 3 * d, enc + dec),
            ("out-projections, cross Q", tokens, d, d, enc + 3 * dec),
            ("cross-attention K, V", tokens, d, 2 * d, dec),
            ("feed-forward in", tokens, d, ff, enc + dec),
            ("feed-forward out", tokens, ff, d, enc + dec),
            ("output layer", tokens, d, V, 1)]  # fmt: skip


def layout_shape(m: int, k: int, n: int, layout: str) -> tuple[int, int, int]:
    """The (m, k, n) of the product a layer's forward (m, k) x (k, n) becomes in `layout`."""
    return {"nt": (m, k, n), "nn": (m, n, k), "tn": (n, m, k)}[layout]


def step_gemm_rate(model: dict, tokens: int, dtype: torch.dtype, repeats: int = 7) -> float:
    """FLOP/s over the model's products with their backward's two, each as often as a step has it."""
    flops = seconds = 0.0
    for _, m, k, n, count in model_products(model, tokens):
        for layout in LAYOUTS:
            flops += count * 2 * m * k * n
            seconds += count * gemm_seconds(*layout_shape(m, k, n, layout), dtype, layout=layout, repeats=repeats)
    return flops / seconds
