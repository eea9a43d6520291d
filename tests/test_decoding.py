import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from transformer.decoding import greedy_search
from transformer.model import ModelConfig, build_model

PAD, UNK, BOS, EOS, V = 0, 1, 2, 3, 23


def config(**overrides):
    return ModelConfig.from_size("tiny", **{"src_vocab_size": V, "tgt_vocab_size": V, "pad_id": PAD, **overrides})


def random_model(eos_scale=1.5, **overrides):
    """An untrained model whose greedy outputs vary with the source and the prefix: an untied,
    large output layer (a tied one mostly repeats its input token), EOS a little likelier so that
    some sentences stop early and others run to their length limit."""
    torch.manual_seed(0)
    model = build_model(config(tie_output=False, **overrides)).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.output.weight, std=1.0)
        model.output.weight[EOS] *= eos_scale
    return model


def sources(lengths, seed=1):
    """Right-padded sources (B, max(lengths)) of ordinary tokens, each ending with EOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(EOS + 1, V, (len(lengths), max(lengths)), generator=g)
    for i, n in enumerate(lengths):
        src[i, n - 1], src[i, n:] = EOS, PAD
    return src


LENGTHS = [9, 3, 6, 1, 7, 5]


def reference_greedy(model, src, max_len):
    """One sentence (S,) without padding, the full prefix each step: the obvious way."""
    prefix = [BOS]
    while len(prefix) - 1 < max_len:
        logits = model(src[None], torch.tensor([prefix]))  # (1, T, V)
        token = logits[0, -1].argmax().item()
        if token == EOS:
            break
        prefix.append(token)
    return prefix[1:]


@pytest.mark.parametrize("overrides", [{}, {"norm_first": False}, {"window": 2}, {"positions": "learned"}])
def test_cached_equals_uncached(overrides):
    model, src = random_model(**overrides), sources(LENGTHS)
    cached = greedy_search(model, src, BOS, EOS)
    assert cached == greedy_search(model, src, BOS, EOS, use_cache=False)
    assert len(cached) == len(LENGTHS)
    assert len({tuple(ids) for ids in cached}) > 1  # not a constant model: the test can fail
    assert any(len(set(ids)) > 2 for ids in cached)


def test_result_does_not_depend_on_the_rest_of_the_batch():
    model, src = random_model(), sources(LENGTHS)
    batch = greedy_search(model, src, BOS, EOS)
    alone = [greedy_search(model, src[i : i + 1, :n], BOS, EOS)[0] for i, n in enumerate(LENGTHS)]
    assert batch == alone
    assert greedy_search(model, src.flip(0), BOS, EOS) == batch[::-1]


@pytest.mark.parametrize("use_cache", [True, False])
def test_equals_a_per_sentence_reference(use_cache):
    model, src = random_model(), sources(LENGTHS)
    got = greedy_search(model, src, BOS, EOS, max_len_a=1.5, max_len_b=2, use_cache=use_cache)
    limits = [int(1.5 * n + 2) for n in LENGTHS]
    assert got == [reference_greedy(model, src[i, :n], limit) for i, (n, limit) in enumerate(zip(LENGTHS, limits))]
    # the test covers both ways a sentence ends: at EOS (shorter than its limit) and at its limit
    assert any(len(ids) < limit for ids, limit in zip(got, limits))
    assert any(len(ids) == limit for ids, limit in zip(got, limits))


@pytest.mark.parametrize("use_cache", [True, False])
def test_stops_at_eos_and_at_each_sentences_own_limit(use_cache):
    """Logits forced by position: tokens 10, 11, 12, 13, then EOS at position 4, then 14, 15, ..."""
    model = random_model()
    position = {}

    def record_positions(module, args):  # the target embedding gets (tokens (n, T), offset)
        tokens, offset = args
        position["p"] = offset + torch.arange(tokens.size(1))  # (T,)

    def forced(module, args, logits):  # (n, T, V)
        want = torch.where(position["p"] == 4, EOS, 10 + position["p"])  # (T,)
        return logits + 1e4 * F.one_hot(want, V)

    model.tgt_embed.register_forward_pre_hook(record_positions)
    model.output.register_forward_hook(forced)
    src = sources([1, 2, 3, 4, 12])
    got = greedy_search(model, src, BOS, EOS, max_len_a=1.0, max_len_b=0, use_cache=use_cache)
    assert got == [[10], [10, 11], [10, 11, 12], [10, 11, 12, 13], [10, 11, 12, 13]]
    assert greedy_search(model, src, BOS, EOS, max_len_a=0.0, max_len_b=0, use_cache=use_cache) == [[]] * 5


def test_runs_under_autocast():
    model, src = random_model(), sources(LENGTHS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = greedy_search(model, src, BOS, EOS)
    assert all(len(ids) <= int(1.2 * n + 10) for ids, n in zip(got, LENGTHS))
    assert all(isinstance(t, int) for ids in got for t in ids)


def test_reproduces_a_few_memorized_pairs():
    torch.manual_seed(0)
    model = build_model(config(dropout=0.0)).train()
    src = sources([7, 5, 6, 4], seed=2)
    targets = [[5, 9, 4, 17, 8], [12, 6, 6], [20, 11, 7, 19, 5, 13], [4, 15]]
    T = max(map(len, targets)) + 1
    tgt_in = torch.tensor([[BOS, *t] + [PAD] * (T - len(t) - 1) for t in targets])  # (B, T)
    tgt_out = torch.tensor([[*t, EOS] + [PAD] * (T - len(t) - 1) for t in targets])  # (B, T)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert greedy_search(model, src, BOS, EOS) == targets
    assert greedy_search(model, src, BOS, EOS, use_cache=False) == targets


def test_decoding_package_imports_neither_lightning_nor_hydra():
    code = (
        "import sys, transformer.decoding; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'hydra', 'omegaconf')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
