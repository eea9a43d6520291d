import math

import pytest
import torch
import torch.nn.functional as F

from transformer.decoding import Hypothesis, beam_search, greedy_search
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


@pytest.fixture(scope="module")
def memorized():
    """A tiny model trained on four sentence pairs until it knows them: (model in eval mode, src, targets)."""
    torch.manual_seed(0)
    model = build_model(config(dropout=0.0)).train()
    src = sources([7, 5, 6, 4], seed=2)
    targets = [[5, 9, 4, 17, 8], [12, 6, 6], [20, 11, 7, 19, 5, 13], [4, 15]]
    T = max(map(len, targets)) + 1
    tgt_in = torch.tensor([[BOS, *t] + [PAD] * (T - len(t) - 1) for t in targets])  # (B, T)
    tgt_out = torch.tensor([[*t, EOS] + [PAD] * (T - len(t) - 1) for t in targets])  # (B, T)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(80):  # to a loss of 0.002
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, src, targets


def test_reproduces_a_few_memorized_pairs(memorized):
    model, src, targets = memorized
    assert greedy_search(model, src, BOS, EOS) == targets
    assert greedy_search(model, src, BOS, EOS, use_cache=False) == targets


# beam search


def sequence_logprob(model, src, tokens, with_eos):
    """Summed log-probability of tokens (+ EOS) given one source (S,) without padding: one teacher-forced
    forward pass over BOS + tokens, in float32."""
    target = tokens + [EOS] if with_eos else tokens
    tgt_in = torch.tensor([[BOS, *target[:-1]]])  # (1, T)
    lprobs = model(src[None], tgt_in).float().log_softmax(dim=-1)[0]  # (T, V)
    return lprobs.gather(1, torch.tensor(target)[:, None]).sum().item()


def unpadded(src, lengths):
    return [src[i, :n] for i, n in enumerate(lengths)]


def reference_beam(model, src, beam_size, length_penalty, max_len, early_stopping=False):
    """One sentence (S,) without padding, in plain Python with the full prefix: beam_search's rules
    spelled out. Returns the K best finished (tokens, score), best first."""
    K, live, finished = beam_size, [([], 0.0)], []
    for t in range(max_len):
        prefixes = torch.tensor([[BOS, *tokens] for tokens, _ in live])  # (k, t + 1): the live prefixes
        lprobs = model(src.expand(len(live), -1), prefixes)[:, -1].float().log_softmax(dim=-1)  # (k, V)
        candidates = [(score + lp, tokens, v) for (tokens, score), row in zip(live, lprobs.tolist())
                      for v, lp in enumerate(row)]  # (summed log-prob, prefix, token)  # fmt: skip
        candidates = sorted(candidates, key=lambda c: -c[0])[: 2 * K]
        for score, tokens, v in candidates[:K]:  # the best K candidates can finish
            if v == EOS or t + 1 == max_len:
                finished.append((tokens if v == EOS else tokens + [v], score / (t + 1) ** length_penalty))
        finished = sorted(finished, key=lambda h: -h[1])[:K]
        live = [(tokens + [v], score) for score, tokens, v in candidates if v != EOS][:K]
        if len(finished) == K and (early_stopping or live[0][1] / (t + 1) ** length_penalty <= finished[-1][1]):
            break
    return finished


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("limits", [(1.2, 10), (1.5, 2)])
def test_beam_of_one_equals_greedy(length_penalty, use_cache, limits):
    model, src = random_model(), sources(LENGTHS)
    a, b = limits
    greedy = greedy_search(model, src, BOS, EOS, max_len_a=a, max_len_b=b)
    beam = beam_search(model, src, BOS, EOS, beam_size=1, length_penalty=length_penalty, max_len_a=a,
                       max_len_b=b, use_cache=use_cache)  # fmt: skip
    assert [[h.tokens for h in hyps] for hyps in beam] == [[ids] for ids in greedy]
    if limits == (1.5, 2):  # both ways a sentence ends: at EOS and at its limit
        assert any(len(ids) < int(a * n + b) for ids, n in zip(greedy, LENGTHS))
        assert any(len(ids) == int(a * n + b) for ids, n in zip(greedy, LENGTHS))


@pytest.mark.parametrize("overrides", [{}, {"norm_first": False}, {"window": 2}, {"positions": "learned"}])
def test_beam_cached_equals_uncached(overrides):
    model, src = random_model(**overrides), sources(LENGTHS)
    kwargs = dict(beam_size=4, nbest=4, max_len_a=1.5, max_len_b=2)
    cached = beam_search(model, src, BOS, EOS, **kwargs)
    uncached = beam_search(model, src, BOS, EOS, use_cache=False, **kwargs)
    assert [[h.tokens for h in hyps] for hyps in cached] == [[h.tokens for h in hyps] for hyps in uncached]
    for c, u in zip(cached, uncached):
        assert [h.score for h in c] == pytest.approx([h.score for h in u], abs=1e-5)
    assert len({tuple(hyps[0].tokens) for hyps in cached}) > 1  # not a constant model


def test_beam_result_does_not_depend_on_the_rest_of_the_batch():
    model, src = random_model(), sources(LENGTHS)
    kwargs = dict(beam_size=3, nbest=3, length_penalty=0.6)
    batch = beam_search(model, src, BOS, EOS, **kwargs)
    alone = [beam_search(model, s[None], BOS, EOS, **kwargs)[0] for s in unpadded(src, LENGTHS)]
    flipped = beam_search(model, src.flip(0), BOS, EOS, **kwargs)[::-1]
    for b, a, f in zip(batch, alone, flipped):
        assert [h.tokens for h in b] == [h.tokens for h in a] == [h.tokens for h in f]
        assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=1e-5)
        assert [h.score for h in b] == pytest.approx([h.score for h in f], abs=1e-5)


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("beam_size, length_penalty", [(2, 0.0), (4, 1.0), (5, 0.6)])
def test_beam_equals_a_per_sentence_reference(beam_size, length_penalty, early_stopping):
    model, src = random_model(eos_scale=0.5), sources(LENGTHS, seed=3)
    got = beam_search(model, src, BOS, EOS, beam_size=beam_size, nbest=beam_size, length_penalty=length_penalty,
                      early_stopping=early_stopping)  # fmt: skip
    for s, hyps in zip(unpadded(src, LENGTHS), got):
        expected = reference_beam(model, s, beam_size, length_penalty, int(1.2 * len(s) + 10), early_stopping)
        assert [h.tokens for h in hyps] == [tokens for tokens, _ in expected]
        assert [h.score for h in hyps] == pytest.approx([score for _, score in expected], abs=1e-4)


@pytest.mark.parametrize("eos_scale", [1.0, 1.5, 2.0])
def test_beam_scores_at_least_as_well_as_greedy_on_random_models(eos_scale):
    """With length_penalty=0 the best hypothesis's summed log-probability is at least greedy's, on
    these models. Not a theorem: greedy's prefix can fall out of the beam, and then every beam may
    end lower (random_model(eos_scale=0.5), sources(LENGTHS, seed=3), sentence 4 does, with beams
    of 2 to 5; the reference test above checks that model)."""
    model, src = random_model(eos_scale=eos_scale), sources(LENGTHS, seed=3)
    greedy = greedy_search(model, src, BOS, EOS)
    beam = beam_search(model, src, BOS, EOS, beam_size=4, length_penalty=0.0)
    strictly_better = 0
    for s, ids, hyps in zip(unpadded(src, LENGTHS), greedy, beam):
        limit = int(1.2 * len(s) + 10)
        greedy_logprob = sequence_logprob(model, s, ids, with_eos=len(ids) < limit)
        assert hyps[0].score >= greedy_logprob - 1e-4
        strictly_better += hyps[0].score > greedy_logprob + 1e-4
    assert strictly_better > 0  # the search does something greedy does not


@pytest.mark.parametrize("vocab", [8000, 8001, 8009, 40, 24])  # chunks of 64, 63, none (prime), 20, too few
def test_candidates_are_the_top_of_all_beams_times_vocabulary(vocab):
    from transformer.decoding.beam import candidates

    g = torch.Generator().manual_seed(vocab)
    n, K, C = 7, 5, 10
    logits = torch.randn(n, K, vocab, generator=g) * 4
    scores = torch.randn(n, K, generator=g) * 3
    scores[0, 1:] = float("-inf")  # a first step: one live beam
    scores[1] = torch.tensor([0.0, -50.0, -60.0, -70.0, -80.0])  # one beam far ahead
    expected = (scores[:, :, None] + logits.log_softmax(-1)).view(n, -1).topk(C, dim=1)
    top_scores, source, token = candidates(scores, logits.clone(), C)
    torch.testing.assert_close(top_scores, expected.values)
    assert torch.equal((source % K) * vocab + token, expected.indices)
    assert torch.equal(source // K, torch.arange(n)[:, None].expand(n, C))


def forced_model(table):
    """A model whose next-token logits depend only on the current input token: table (V, V)."""
    model = random_model()
    current = {}
    model.tgt_embed.register_forward_pre_hook(lambda module, args: current.update(tokens=args[0]))
    model.output.register_forward_hook(lambda module, args, logits: table[current["tokens"]].to(logits.dtype))
    return model


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_beats_greedy_where_greedy_is_led_astray(use_cache):
    """BOS -> 10 (p=.55) or 11 (p=.45); 11 -> EOS; 10 -> ten tokens, each about .1, each -> EOS.
    Greedy takes 10 then 12 (p=.06 in all); a beam of 2 finds 11 (p=.45)."""
    table = torch.full((V, V), 1e-9)
    table[BOS, 10], table[BOS, 11] = 0.55, 0.45
    table[11, EOS] = 1.0
    table[10, 12:22] = 0.1
    table[10, 12] = 0.11
    table[12:22, EOS] = 1.0
    table = table.log()
    model, src = forced_model(table), sources([4, 2])
    assert greedy_search(model, src, BOS, EOS, use_cache=use_cache) == [[10, 12]] * 2
    for lp in (0.0, 1.0):
        beam = beam_search(model, src, BOS, EOS, beam_size=2, nbest=2, length_penalty=lp, use_cache=use_cache)
        assert [[h.tokens for h in hyps] for hyps in beam] == [[[11], [10, 12]]] * 2
        assert beam[0][0].score == pytest.approx(math.log(0.45) / 2**lp, abs=1e-4)
        assert beam[0][1].score == pytest.approx(math.log(0.55 * 0.11 / 1.01) / 3**lp, abs=1e-4)


@pytest.mark.parametrize("use_cache", [True, False])
def test_early_stopping_ends_a_sentence_at_beam_size_finished(use_cache):
    """BOS -> 10 (.4), EOS (.35), 11 (.25); 10 -> EOS (.55), 12 (.45); 11 -> 13; 12, 13 -> EOS. With a beam of 2,
    [] ends on step 1 and [10] on step 2: early_stopping stops there, while the live [11, 13] (.25) still beats
    [] at its length, and finishes best of all at length 3: log(.25) / 3."""
    table = torch.full((V, V), 1e-9)
    table[BOS, 10], table[BOS, EOS], table[BOS, 11] = 0.4, 0.35, 0.25
    table[10, EOS], table[10, 12] = 0.55, 0.45
    table[11, 13] = table[12, EOS] = table[13, EOS] = 1.0
    model, src = forced_model(table.log()), sources([4, 2])
    kwargs = dict(beam_size=2, nbest=2, length_penalty=1.0, use_cache=use_cache)
    patient = beam_search(model, src, BOS, EOS, **kwargs)
    early = beam_search(model, src, BOS, EOS, early_stopping=True, **kwargs)
    assert [[h.tokens for h in hyps] for hyps in patient] == [[[11, 13], [10, 12]]] * 2
    assert [[h.tokens for h in hyps] for hyps in early] == [[[10], []]] * 2
    assert patient[0][0].score == pytest.approx(math.log(0.25) / 3, abs=1e-4)
    assert early[0][0].score == pytest.approx(math.log(0.4 * 0.55) / 2, abs=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 0.6])
def test_nbest_are_distinct_sorted_and_scored_by_the_model(length_penalty):
    model, src = random_model(eos_scale=3.0), sources(LENGTHS, seed=4)  # EOS likely enough that both kinds end
    a, b, nbest = 1.0, 3, 4
    got = beam_search(model, src, BOS, EOS, beam_size=5, nbest=nbest, length_penalty=length_penalty,
                      max_len_a=a, max_len_b=b)  # fmt: skip
    ended = {True: 0, False: 0}
    for s, hyps in zip(unpadded(src, LENGTHS), got):
        limit = int(a * len(s) + b)
        assert len(hyps) == nbest
        assert len({tuple(h.tokens) for h in hyps}) == nbest
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert EOS not in h.tokens and 0 < len(h.tokens) + 1 <= limit + 1 and len(h.tokens) <= limit
            with_eos = len(h.tokens) < limit  # a hypothesis as long as the limit was cut there, without EOS
            ended[with_eos] += 1
            length = len(h.tokens) + with_eos
            expected = sequence_logprob(model, s, h.tokens, with_eos) / length**length_penalty
            assert h.score == pytest.approx(expected, abs=1e-4)
    assert ended[True] and ended[False]  # both kinds of hypotheses were checked


def test_beam_edge_cases_and_autocast():
    model, src = random_model(), sources(LENGTHS)
    assert beam_search(model, src, BOS, EOS, max_len_a=0.0, max_len_b=0) == [[Hypothesis([], 0.0)]] * len(LENGTHS)
    with pytest.raises(ValueError, match="nbest"):
        beam_search(model, src, BOS, EOS, beam_size=2, nbest=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = beam_search(model, src, BOS, EOS, beam_size=3, nbest=2)
    assert all(len(hyps) == 2 for hyps in got)
    assert all(len(h.tokens) <= int(1.2 * n + 10) for hyps, n in zip(got, LENGTHS) for h in hyps)
    assert all(isinstance(t, int) for hyps in got for h in hyps for t in h.tokens)


def test_beam_reproduces_a_few_memorized_pairs(memorized):
    model, src, targets = memorized
    for use_cache in (True, False):
        got = beam_search(model, src, BOS, EOS, beam_size=4, use_cache=use_cache)
        assert [hyps[0].tokens for hyps in got] == targets
