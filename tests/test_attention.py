import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer.model.attention import KVCache, MultiHeadAttention
from transformer.model.kernels.backends import SDPA_BACKENDS
from transformer.model.masks import attention_mask, causal, future_table

D, H = 16, 4


def pair(d=D, h=H, bias=True, **kwargs):
    """Our module and torch's, with the same weights (random biases, so that they are tested too)."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(d, h, bias=bias, **kwargs).eval()
    if bias:
        with torch.no_grad():
            ours.in_proj_bias.normal_()
            ours.out_proj.bias.normal_()
    ref = nn.MultiheadAttention(d, h, bias=bias, batch_first=True).eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def padding_mask(lengths, total):
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]  # (B, S), True = padding


def causal_mask(n):
    return torch.ones(n, n, dtype=torch.bool).triu(1)  # True = may not attend


def reference_attention(mha, q_in, k_in, v_in, allowed):
    """softmax(QK^T/sqrt(d_k))V written per head from the formulas; allowed (B, L, S) True = may attend."""
    d, h = mha.embed_dim, mha.num_heads
    hs = d // h
    w, b = mha.in_proj_weight, mha.in_proj_bias
    heads, probs = [], []
    for i in range(h):
        rows = slice(i * hs, (i + 1) * hs)
        q = q_in @ w[:d][rows].T + b[:d][rows]
        k = k_in @ w[d : 2 * d][rows].T + b[d : 2 * d][rows]
        v = v_in @ w[2 * d :][rows].T + b[2 * d :][rows]
        scores = (q @ k.transpose(1, 2) / math.sqrt(hs)).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        probs.append(p)
        heads.append(p @ v)
    out = torch.cat(heads, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias
    return out, torch.stack(probs, dim=1)


# --- equivalence with torch.nn.MultiheadAttention -------------------------------------------------


@pytest.mark.parametrize("masking", ["none", "padding", "causal", "causal+padding", "float"])
@pytest.mark.parametrize("average", [True, False])
def test_self_attention_matches_torch(masking, average):
    ours, ref = pair()
    x = torch.randn(3, 7, D)
    kpm = padding_mask([7, 4, 6], 7) if "padding" in masking else None
    am = causal_mask(7) if "causal" in masking else None
    if masking == "float":
        am = torch.randn(7, 7)
    causal = "causal" in masking
    expected, expected_w = ref(
        x, x, x, key_padding_mask=kpm, attn_mask=am, is_causal=causal, average_attn_weights=average
    )
    for kwargs in ({"attn_mask": am}, {"is_causal": True} if causal else {"attn_mask": am}):
        fast, none = ours(x, x, x, key_padding_mask=kpm, **kwargs)
        slow, w = ours(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=average, **kwargs)
        assert none is None
        torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(slow, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, expected_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("same_kv", [True, False])
def test_cross_attention_matches_torch(same_kv):
    ours, ref = pair()
    q, mem = torch.randn(2, 5, D), torch.randn(2, 9, D)
    value = mem if same_kv else torch.randn(2, 9, D)
    kpm = padding_mask([9, 3], 9)
    expected, expected_w = ref(q, mem, value, key_padding_mask=kpm)
    out, w = ours(q, mem, value, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(ours(q, mem, value, key_padding_mask=kpm)[0], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, expected_w, rtol=1e-5, atol=1e-6)


def test_per_head_float_mask_matches_torch():
    ours, ref = pair()
    x = torch.randn(2, 5, D)
    am = torch.randn(2 * H, 5, 5, dtype=torch.float64).float()
    torch.testing.assert_close(ours(x, x, x, attn_mask=am)[0], ref(x, x, x, attn_mask=am)[0], rtol=1e-5, atol=1e-6)


def test_state_dict_loads_both_ways_without_bias():
    ours, ref = pair(bias=False)
    assert set(ours.state_dict()) == set(ref.state_dict()) == {"in_proj_weight", "out_proj.weight"}
    ours2 = MultiHeadAttention(D, H, bias=False)
    ours2.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, D)
    torch.testing.assert_close(ours2(x)[0], ref(x, x, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("masking", ["padding", "causal", "window"])
def test_matches_per_head_formula_in_float64(masking):
    ours = MultiHeadAttention(D, H, window=2 if masking == "window" else None).double().eval()
    with torch.no_grad():
        ours.in_proj_bias.normal_()
        ours.out_proj.bias.normal_()
    x = torch.randn(3, 6, D, dtype=torch.float64)
    allowed = torch.ones(3, 6, 6, dtype=torch.bool)
    kwargs = {}
    if masking == "padding":
        kpm = padding_mask([6, 2, 4], 6)
        allowed &= ~kpm[:, None, :]
        kwargs["key_padding_mask"] = kpm
    if masking == "causal":
        allowed &= ~causal_mask(6)
        kwargs["is_causal"] = True
    if masking == "window":
        i = torch.arange(6)
        allowed &= (i[:, None] - i[None, :]).abs() <= 2
    expected, probs = reference_attention(ours, x, x, x, allowed)
    out, w = ours(x, **kwargs, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(ours(x, **kwargs)[0], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, probs, rtol=1e-10, atol=1e-12)


# --- masks ---------------------------------------------------------------------------------------


def test_padded_keys_get_exactly_zero_weight():
    ours, _ = pair()
    x = torch.randn(2, 6, D)
    kpm = padding_mask([6, 3], 6)
    _, w = ours(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    assert torch.all(w[1, :, :, 3:] == 0)
    assert torch.all(w[1, :, :, :3] > 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 6))


@pytest.mark.parametrize("need_weights", [False, True])
def test_appending_padding_leaves_real_positions_unchanged(need_weights):
    ours, _ = pair()
    q, mem = torch.randn(2, 4, D), torch.randn(2, 5, D)
    kpm = padding_mask([5, 3], 5)
    out = ours(q, mem, mem, key_padding_mask=kpm, need_weights=need_weights)[0]
    longer = torch.cat([mem, torch.randn(2, 4, D)], dim=1)
    out_padded = ours(q, longer, longer, key_padding_mask=padding_mask([5, 3], 9), need_weights=need_weights)[0]
    torch.testing.assert_close(out_padded, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("need_weights", [False, True])
def test_causal_outputs_ignore_future_tokens(need_weights):
    ours, _ = pair()
    x = torch.randn(2, 8, D)
    changed = x.clone()
    changed[:, 5:] = torch.randn(2, 3, D)
    a = ours(x, is_causal=True, need_weights=need_weights)[0]
    b = ours(changed, is_causal=True, need_weights=need_weights)[0]
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("kind", ["bool_padding", "float_padding", "attn_mask"])
def test_fully_masked_rows_give_zeros_not_nan(kind):
    ours = MultiHeadAttention(D, H, bias=False, dropout=0.5).train()  # the dropout path too
    x = torch.randn(2, 5, D, requires_grad=True)
    kwargs = {}
    if kind == "bool_padding":
        kwargs["key_padding_mask"] = padding_mask([5, 0], 5)  # sentence 1 is all padding
    elif kind == "float_padding":
        kwargs["key_padding_mask"] = torch.zeros(2, 5).masked_fill(padding_mask([5, 0], 5), float("-inf"))
    else:
        am = torch.zeros(5, 5, dtype=torch.bool)
        am[2] = True  # query 2 may attend nothing
        kwargs["attn_mask"] = am
    for need_weights in (False, True):
        out, w = ours(x, need_weights=need_weights, **kwargs)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        dead = (1, slice(None)) if kind != "attn_mask" else (slice(None), 2)
        assert torch.all(out[dead] == 0)  # no bias: the dead rows' zero attention stays zero
        if need_weights:
            assert torch.all(w[dead] == 0)


# --- incremental decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 2])
def test_cached_decoding_equals_full_prefix(window):
    self_attn, _ = pair(window=window)
    cross_attn, _ = pair()
    x, mem = torch.randn(2, 7, D), torch.randn(2, 5, D)
    kpm = padding_mask([5, 2], 5)
    full = cross_attn(self_attn(x, is_causal=True)[0], mem, mem, key_padding_mask=kpm)[0]
    self_cache, cross_cache = KVCache(), KVCache(static=True)
    steps = []
    for t in range(7):
        h = self_attn(x[:, t : t + 1], is_causal=True, cache=self_cache)[0]
        steps.append(cross_attn(h, mem, mem, key_padding_mask=kpm, cache=cross_cache)[0])
        if t == 0:
            projected_memory = cross_cache.k
        assert cross_cache.k is projected_memory  # the encoder output is projected once
        assert len(self_cache) == t + 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


def test_cache_appends_when_keys_are_equal_but_separate_tensors():
    attn, _ = pair()
    x = torch.randn(2, 4, D)
    cache = KVCache()
    steps = [attn(x[:, t : t + 1], x[:, t : t + 1].clone(), x[:, t : t + 1].clone(), is_causal=True, cache=cache)[0]
             for t in range(4)]  # fmt: skip
    assert len(cache) == 4
    torch.testing.assert_close(torch.cat(steps, dim=1), attn(x, is_causal=True)[0], rtol=1e-5, atol=1e-6)


def test_cache_of_another_batch_size_is_a_value_error():
    attn, _ = pair()
    mem = torch.randn(2, 5, D)
    cache = KVCache(static=True)
    attn(torch.randn(2, 1, D), mem, mem, cache=cache)
    with pytest.raises(ValueError, match="cache holds batch 2, keys have batch 3"):
        attn(torch.randn(3, 1, D), torch.randn(3, 5, D), torch.randn(3, 5, D), cache=cache)


@pytest.mark.parametrize("use_cache", [False, True])
def test_query_rows_sharing_a_key_row_attend_as_if_each_had_its_own_copy(use_cache):
    """Beam search's cross-attention: 3 beams per sentence read one encoder row, as 3 repeated rows would."""
    attn, ref = pair()
    g, mem = 3, torch.randn(2, 5, D)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    queries = torch.randn(2 * g, 2, D)
    repeated = mem.repeat_interleave(g, dim=0)  # (6, 5, D)
    expected, expected_weights = ref(queries, repeated, repeated, key_padding_mask=padding.repeat_interleave(g, 0),
                                     need_weights=True, average_attn_weights=False)  # fmt: skip
    cache = KVCache(static=True) if use_cache else None
    for _ in range(2 if use_cache else 1):  # with a cache: filled on the first call, read on the second
        got, weights = attn(queries, mem, mem, key_padding_mask=padding, cache=cache, need_weights=True,
                            average_attn_weights=False)  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    assert not use_cache or cache.k.size(0) == 2  # one row per sentence, not per beam
    with pytest.raises(ValueError, match="batch sizes differ"):
        attn(torch.randn(5, 2, D), mem, mem)


def test_cache_accepts_several_new_tokens_at_once():
    self_attn, _ = pair()
    x = torch.randn(2, 7, D)
    full = self_attn(x, is_causal=True)[0]
    cache = KVCache()
    first = self_attn(x[:, :3], is_causal=True, cache=cache)[0]
    rest = self_attn(x[:, 3:], is_causal=True, cache=cache)[0]
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad", [True, False])
def test_cache_reorder_follows_beams(grad):
    """One token a step for 40 steps, rows reordered, dropped and repeated on the way: each step's output is the
    full causal pass's over what that row was fed."""
    attn, _ = pair()
    x = torch.randn(3, 40, D)
    cache, fed, rows = KVCache(), x[:, :0], torch.arange(3)  # fed (rows, t, D); rows: the row of x each follows
    index_at = {5: [2, 2, 0], 17: [1, 0], 30: [0, 1, 1, 0]}
    with torch.set_grad_enabled(grad):
        for t in range(40):
            if t in index_at:
                index = torch.tensor(index_at[t])
                cache.reorder(index)
                fed, rows = fed[index], rows[index]
            fed = torch.cat([fed, x[rows, t : t + 1]], dim=1)
            step = attn(x[rows, t : t + 1], is_causal=True, cache=cache)[0]  # (rows, 1, D)
            torch.testing.assert_close(step, attn(fed, is_causal=True)[0][:, -1:], rtol=1e-5, atol=1e-5)
    assert len(cache) == 40


# --- kernels, gradients, windows ------------------------------------------------------------------


def available_backends():
    x = torch.randn(1, 1, 2, 4)
    names = []
    for name in SDPA_BACKENDS:
        try:
            MultiHeadAttention(4, 1, backend=name)(x[0])
            names.append(name)
        except RuntimeError:
            pass
    return names


def test_every_available_backend_gives_the_same_outputs():
    names = available_backends()
    assert {"auto", "math"} <= set(names)
    x = torch.randn(2, 6, D)
    kpm = padding_mask([6, 4], 6)
    outputs = {}
    for name in names:
        attn, _ = pair(backend=name)
        outputs[name] = (attn(x, is_causal=True)[0], attn(x, key_padding_mask=kpm)[0])
    for name in names:
        for got, want in zip(outputs[name], outputs["math"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unavailable_backend_is_an_error_not_a_silent_fallback():
    if "efficient" in available_backends():
        pytest.skip("efficient kernel exists on this machine")
    with pytest.raises(RuntimeError):
        MultiHeadAttention(D, H, backend="efficient")(torch.randn(1, 3, D))


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_float64(need_weights):
    attn = MultiHeadAttention(4, 2, window=1).double()
    q = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    kpm = padding_mask([4, 2], 4)
    assert torch.autograd.gradcheck(lambda a: attn(a, is_causal=True, need_weights=need_weights)[0], (q,))
    assert torch.autograd.gradcheck(
        lambda a, m: attn(a, m, m, key_padding_mask=kpm, need_weights=need_weights)[0], (q, mem)
    )


def test_window_limits_attention_span():
    attn, _ = pair(window=1)
    x = torch.randn(1, 6, D)
    _, w = attn(x, need_weights=True)
    far = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs() > 1
    assert torch.all(w[0][far] == 0) and torch.all(w[0][~far] > 0)
    _, w = attn(x, is_causal=True, need_weights=True)
    assert torch.all(w[0][far | causal_mask(6)] == 0)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(torch.randn(4, D)), r"query must be \(batch, length, 16\), got shape \(4, 16\)"),
        (lambda m: m(torch.randn(2, 3, 8)), r"query must be .* got shape \(2, 3, 8\)"),
        (lambda m: m(torch.randn(2, 3, D), torch.randn(3, 3, D)), "batch sizes differ"),
        (lambda m: m(torch.randn(2, 3, D), torch.randn(2, 4, D), torch.randn(2, 5, D)), "lengths differ"),
        (lambda m: m(torch.randn(2, 3, D), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
         r"key_padding_mask has shape \(2, 4\), expected one of \[\(2, 3\)\]"),
        (lambda m: m(torch.randn(2, 3, D), key_padding_mask=torch.zeros(2, 3, dtype=torch.long)),
         "key_padding_mask must be bool or floating point, got dtype torch.int64"),
        (lambda m: m(torch.randn(2, 3, D), attn_mask=torch.zeros(3, 4, dtype=torch.bool)), r"attn_mask has shape \(3, 4\)"),
    ],
)  # fmt: skip
def test_bad_input_raises_value_error_naming_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call(MultiHeadAttention(D, H))


def test_bad_construction():
    with pytest.raises(ValueError, match="embed_dim=10 is not divisible by num_heads=4"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        MultiHeadAttention(D, H, backend="fast")


def test_auto_goes_explicit_only_for_short_reduced_precision_cpu_training():
    from transformer.model.kernels.explicit import CPU_EXPLICIT_MAX_KEYS, explicit_is_faster

    assert explicit_is_faster("cpu", torch.bfloat16, True, CPU_EXPLICIT_MAX_KEYS)
    assert not explicit_is_faster("cpu", torch.bfloat16, True, CPU_EXPLICIT_MAX_KEYS + 1)  # long: flash wins
    assert not explicit_is_faster("cpu", torch.bfloat16, False, 32)  # inference: SDPA's forward is fine
    assert not explicit_is_faster("cpu", torch.float32, True, 32)
    assert not explicit_is_faster("cuda", torch.bfloat16, True, 32)


def test_bf16_autocast_training_step_matches_float32():
    ours, _ = pair()
    ours.train()
    x = torch.randn(4, 12, D, requires_grad=True)
    kpm = padding_mask([12, 5, 9, 12], 12)
    out32 = ours(x, key_padding_mask=kpm)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = ours(x, key_padding_mask=kpm)[0]  # the explicit path on CPU (see explicit_is_faster)
        with torch.no_grad():
            sdpa16 = ours(x, key_padding_mask=kpm)[0]  # SDPA's kernels
    assert out16.dtype == torch.bfloat16
    out16.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(out16.float(), out32, rtol=0.05, atol=0.05)
    torch.testing.assert_close(sdpa16.float(), out32, rtol=0.05, atol=0.05)


def test_padding_free_attention_equals_the_padded_path(monkeypatch):
    """Self-attention (padded queries dropped too) and cross-attention (all queries), outputs and gradients."""
    from transformer.model.kernels import padding_free

    calls = []
    real = padding_free.attention
    monkeypatch.setattr(padding_free, "attention", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    padded = MultiHeadAttention(D, H).eval()
    free = MultiHeadAttention(D, H, padding_free=True).eval()
    free.load_state_dict(padded.state_dict())
    mask = padding_mask([6, 2, 4], 6)
    real_rows = ~mask[..., None]  # (B, S, 1): padded queries' outputs are read by nothing downstream
    x, q = torch.randn(3, 6, D, requires_grad=True), torch.randn(3, 5, D, requires_grad=True)
    for query, key, rows in ((x, x, real_rows), (q, x, torch.ones(3, 5, 1, dtype=torch.bool))):
        outputs = []
        for module in (padded, free):
            out = module(query, key, key, key_padding_mask=mask)[0] * rows
            grads = torch.autograd.grad(out.square().sum(), [query, key, *module.parameters()])
            outputs.append((out, grads))
        torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-5, atol=1e-6)
        for g_free, g_padded in zip(outputs[1][1], outputs[0][1]):
            torch.testing.assert_close(g_free, g_padded, rtol=1e-5, atol=1e-6)
    assert len(calls) == 2  # both went padding-free, not through the padded fallback


def test_padding_free_attention_falls_back_where_it_cannot_apply(monkeypatch):
    """A row with no real key, a causal mask or requested weights take the padded path, with its results."""
    from transformer.model.kernels import padding_free

    monkeypatch.setattr(padding_free, "attention", lambda *a: pytest.fail("padding-free path taken"))
    torch.manual_seed(0)
    padded = MultiHeadAttention(D, H).eval()
    free = MultiHeadAttention(D, H, padding_free=True).eval()
    free.load_state_dict(padded.state_dict())
    x = torch.randn(2, 4, D)
    dead = padding_mask([4, 0], 4)
    torch.testing.assert_close(free(x, key_padding_mask=dead)[0], padded(x, key_padding_mask=dead)[0])
    some = padding_mask([4, 2], 4)
    for kwargs in ({"is_causal": True}, {"need_weights": True}):
        torch.testing.assert_close(free(x, key_padding_mask=some, **kwargs)[0],
                                   padded(x, key_padding_mask=some, **kwargs)[0])  # fmt: skip


def test_causal_alone_keeps_sdpa_s_own_causal_kernel():
    """nn.MultiheadAttention-style is_causal=True with no other mask passes no attn_mask to SDPA (flash takes none),
    called per layer or built once by the model."""
    for mask in (
        attention_mask(None, None, batch=2, heads=4, q_len=5, k_len=5, is_causal=True),
        causal(5, 5, None, future_table(8)),
    ):
        assert mask.sdpa is None and mask.is_causal and mask.dead is None
        assert torch.equal(mask.explicit.reshape(5, 5), torch.ones(5, 5, dtype=torch.bool).triu(1))  # the explicit's
    seen = []
    real = F.scaled_dot_product_attention
    attention = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: seen.append(k) or real(*a, **k))
        attention(x, is_causal=True)
    assert seen and seen[0]["attn_mask"] is None and seen[0]["is_causal"]
    longer = attention_mask(None, None, batch=1, heads=1, q_len=5, k_len=3, is_causal=True)  # queries before the keys
    assert longer.dead is not None and bool(longer.dead.any())
