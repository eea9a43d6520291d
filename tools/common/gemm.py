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


def product_seconds(model: dict, tokens: int, dtype: torch.dtype, repeats: int = 7) -> list[tuple[tuple, dict]]:
    """Each of model_products' (name, m, k, n, count) with the seconds of one product in each layout."""
    timed = []
    for product in model_products(model, tokens):
        _, m, k, n, _ = product
        seconds = {layout: gemm_seconds(*layout_shape(m, k, n, layout), dtype, layout=layout, repeats=repeats)
                   for layout in LAYOUTS}  # fmt: skip
        timed.append((product, seconds))
    return timed


def step_rate(timed: list[tuple[tuple, dict]]) -> float:
    """FLOP/s over product_seconds' products with their backward's two, each as often as a step has it."""
    flops = sum(count * 2 * m * k * n * len(seconds) for (_, m, k, n, count), seconds in timed)
    return flops / sum(count * sum(seconds.values()) for (*_, count), seconds in timed)


def step_gemm_rate(model: dict, tokens: int, dtype: torch.dtype, repeats: int = 7) -> float:
    return step_rate(product_seconds(model, tokens, dtype, repeats))
