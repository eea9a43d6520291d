"""Batched beam search: one encoder pass, then one decoder step per target token for all beams at once."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import DecoderCache, EncoderDecoder
from .source import MAX_LEN_A, MAX_LEN_B, max_target_lengths, select_encoded


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, without BOS and EOS
    score: float  # length-normalised log-probability used for ranking (see beam_search)


@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    bos_id: int,
    eos_id: int,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
    nbest: int = 1,
    use_cache: bool = True,
    early_stopping: bool = False,
    barred: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """The `nbest` best hypotheses per sentence of a batch of right-padded sources (B, S), best first.

    Each sentence keeps `beam_size` (K) live hypotheses. Every step scores all K * V one-token
    extensions by their summed log-probability (log_softmax in float32) and takes the best 2K:
    those among the first K that end with EOS are finished, and the best K that do not end with
    EOS stay live (as fairseq does), so a finished hypothesis never costs the beam a slot. On the
    first step only one beam per sentence is live, so the K beams start out distinct.

    Score of a finished hypothesis (GNMT/fairseq style):
        score = sum of the log-probabilities of its tokens / length ** length_penalty,
    where length counts the generated tokens including the EOS (the BOS is not counted);
    length_penalty=0 ranks by the raw sum, larger values favour longer hypotheses. Each sentence
    keeps its K best finished hypotheses.

    A sentence may generate at most int(max_len_a * src_len + max_len_b) tokens (EOS included),
    src_len being its own non-pad length, and never beyond the model's max_positions (as
    greedy_search). On the step that reaches that length, the best K candidates are finished
    as they are, with or without EOS; a hypothesis cut there is scored on its tokens alone (no
    EOS term), with length = that maximum.

    A sentence is done when it reaches its maximum length, or when it has K finished hypotheses
    and its best live one, scored at its current length, does not beat the worst of them (Hugging
    Face's early_stopping=False rule). For length_penalty <= 0 this is exact: no live hypothesis
    could still finish better, as log-probabilities only lower the sum. For length_penalty > 0 it
    is a heuristic (a longer hypothesis divides by a larger length). With early_stopping, a sentence
    is done as soon as it has K finished hypotheses (fairseq's and CTranslate2's rule, Hugging Face's
    early_stopping=True): fewer steps, and what an exported model decodes. Done sentences leave the
    batch; the search ends when none is left. A sentence whose maximum length is 0 gets one empty
    hypothesis with score 0.

    Hypotheses returned for a sentence are distinct; `tokens` holds no EOS (a hypothesis shorter
    than the maximum length ended with EOS). beam_size=1 gives greedy_search's tokens, for any
    length_penalty. `barred` ids (pad, BOS: SentencePiece.barred_ids) are never generated: their logits are
    -inf before the log-softmax, as CTranslate2 disables tokens (Hugging Face's generate sets their log-probabilities
    to -inf after it: the same hypotheses where a model gives them negligible probability, as a trained one does,
    having never seen them as labels). With use_cache each
    step feeds only the newest token and the decoder keeps its keys/values (reordered to follow
    the surviving beams); without, it feeds the whole prefix (slower, for checks). Put the model
    in eval mode first; an enclosing autocast applies as usual.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be at least 1")
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest={nbest} must be between 1 and beam_size={beam_size}")
    K, device = beam_size, src.device
    max_len, steps = max_target_lengths(model, src, max_len_a, max_len_b)  # (B,), int
    finished = Finished.start(max_len, K, steps)
    rows = max_len.gt(0).nonzero().squeeze(1)  # (n,) batch index of each unfinished sentence
    if len(rows) == 0:
        return finished.hypotheses(nbest)
    memory, src_layout = model.encode(src[rows])  # (n, S, d), n rows
    prefix = torch.full((len(rows), 1), bos_id, dtype=torch.long, device=device)  # (n*K, t + 1); n at t = 0
    scores = torch.full((len(rows), K), float("-inf"), device=device)  # (n, K) summed log-probabilities
    scores[:, 0] = 0.0  # one live beam per sentence on the first step
    cache = model.new_cache() if use_cache else None
    C = min(2 * K, K * model.tgt_vocab_size)  # candidates per sentence and step
    barred_ids = torch.tensor(barred, dtype=torch.long, device=device)  # (k,) once, not every step
    for t in range(steps):
        tgt = prefix[:, -1:] if use_cache else prefix
        logits = model.decode(tgt, memory, src_layout, cache)[:, -1]  # (n*K, V); (n, V) at t = 0
        if t == 0:
            logits, prefix = expand_to_beams(K, logits, prefix, cache)
        n = len(rows)
        logits = logits.float()  # (n*K, V)
        if barred:
            logits.index_fill_(1, barred_ids, float("-inf"))  # the step's own logits, used once
        top_scores, source, token = candidates(scores, logits.view(n, K, -1), C)  # (n, C) each, best first
        is_eos = token.eq(eos_id)

        # the best K candidates that end, with EOS or at the sentence's maximum length, join its finished
        ends = (is_eos | max_len[rows].eq(t + 1)[:, None]) & top_scores.isfinite()  # (n, C)
        ends[:, K:] = False  # only the best K candidates can finish (fairseq)
        ended = top_scores.masked_fill(~ends, float("-inf")) / float(t + 1) ** length_penalty  # (n, C)
        finished.merge(rows, candidate_tokens(prefix, source, token, is_eos), ended)

        scores, order, new_tokens = select_live(top_scores, source, token, is_eos, K)  # (n, K) each
        best_live = scores[:, 0] / float(t + 1) ** length_penalty  # (n,) at its current length
        worst = finished.worst(rows)  # (n,) -inf until K have finished
        going = (worst.isinf() if early_stopping else best_live.gt(worst)) & max_len[rows].gt(t + 1)  # (n,)
        keep = going.nonzero().squeeze(1)  # (n',) sentences going on
        if len(keep) == 0:
            break
        if len(keep) < n:  # drop finished sentences from the batch
            rows, scores, order, new_tokens = rows[keep], scores[keep], order[keep], new_tokens[keep]
            memory, src_layout = select_encoded(memory, src_layout, keep)
            if cache is not None:
                cache.select_sources(keep)
        order = order.view(-1)  # (n'*K,) rows of prefix to extend
        prefix = torch.cat([prefix[order], new_tokens.view(-1, 1)], dim=1)  # (n'*K, t + 2)
        if cache is not None:
            cache.reorder_targets(order)
    return finished.hypotheses(nbest)


def expand_to_beams(K: int, logits: Tensor, prefix: Tensor, cache: DecoderCache | None):
    """After the first step, which ran once per sentence (n rows) so that its K beams start out distinct: each
    row repeated K times, (n*K, ...), in the logits, the prefix and the self-attention cache. The encoder output
    and the cross-attention cache keep one row per sentence, which its K beams share (EncoderDecoder.decode)."""
    beams = torch.arange(logits.size(0), device=logits.device).repeat_interleave(K)  # (n*K,)
    if cache is not None:
        cache.reorder_targets(beams)
    return logits[beams], prefix[beams]


def candidates(scores: Tensor, logits: Tensor, C: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best C one-token extensions per sentence over its K beams x V tokens (logits (n, K, V), float32), best
    first: their summed log-probabilities, the prefix row each extends (sentence * K + beam) and the new token; each
    (n, C). A top-k over all K*V costs several passes; instead each beam's vocabulary is cut into chunks of c tokens,
    and the best C extensions all lie in the C chunks with the best maxima (a chunk outside them has C better
    extensions elsewhere), so one max pass and a top-k over C*c values find them."""
    n, K, V = logits.shape
    lprobs = torch.log_softmax(logits, dim=-1)  # (n, K, V)
    c = next((c for c in range(64, 15, -1) if V % c == 0), V)  # tokens per chunk, V // c chunks per beam
    m = V // c
    if K * m < C or c == V:  # too few chunks to cut: one top-k over everything
        top_scores, top_idx = lprobs.add_(scores[:, :, None]).view(n, K * V).topk(C, dim=1)  # (n, C) each
    else:
        chunks = lprobs.view(n, K * m, c)  # (n, K*m, c)
        chunk_best = (chunks.amax(dim=-1).view(n, K, m) + scores[:, :, None]).view(n, K * m)  # (n, K*m)
        best = chunk_best.topk(C, dim=1).indices  # (n, C) chunks holding the best C extensions
        picked = chunks.gather(1, best[:, :, None].expand(-1, -1, c)) + scores.gather(1, best // m)[:, :, None]
        top_scores, pos = picked.view(n, C * c).topk(C, dim=1)  # (n, C) each, pos into the picked chunks
        top_idx = best.gather(1, pos // c) * c + pos % c  # (n, C) index into K*V
    beam, token = top_idx // V, top_idx % V  # (n, C) source beam and new token of each candidate
    source = torch.arange(n, device=logits.device)[:, None] * K + beam  # (n, C) rows of prefix
    return top_scores, source, token


def candidate_tokens(prefix: Tensor, source: Tensor, token: Tensor, is_eos: Tensor) -> Tensor:
    """The generated ids (n, C, t + 1) of each candidate (n, C) at step t: the prefix row (n*K, t + 1) it extends
    without BOS, then its new token (-1 for EOS, which is not a token of the hypothesis)."""
    seqs = torch.cat([prefix[source][:, :, 1:], token[:, :, None]], dim=2)  # (n, C, t + 1)
    seqs[:, :, -1].masked_fill_(is_eos, -1)
    return seqs


def select_live(top_scores: Tensor, source: Tensor, token: Tensor, is_eos: Tensor, K: int):
    """The best K candidates (of C, best first) that do not end with EOS: their summed log-probabilities, the
    prefix rows they extend and their new tokens; each (n, K)."""
    C = top_scores.size(1)
    live_scores = top_scores.masked_fill(is_eos, float("-inf"))  # (n, C)
    pick = (is_eos.long() * C + torch.arange(C, device=token.device)).topk(K, dim=1, largest=False).indices  # (n, K)
    return live_scores.gather(1, pick), source.gather(1, pick), token.gather(1, pick)


@dataclass
class Finished:
    """Each sentence's K best finished hypotheses, best first."""

    scores: Tensor  # (B, K) length-normalised; -inf: none yet
    tokens: Tensor  # (B, K, steps) generated ids, -1 after the end

    @classmethod
    def start(cls, max_len: Tensor, K: int, steps: int) -> "Finished":
        B, device = max_len.size(0), max_len.device
        scores = torch.full((B, K), float("-inf"), device=device)  # (B, K)
        tokens = torch.full((B, K, max(steps, 1)), -1, dtype=torch.long, device=device)  # (B, K, steps)
        scores[max_len.eq(0), 0] = 0.0  # no tokens allowed: one empty hypothesis
        return cls(scores, tokens)

    def merge(self, rows: Tensor, seqs: Tensor, ended: Tensor) -> None:
        """Candidates (n, C, t + 1) scored `ended` (n, C; -inf: not ending) join the finished of sentences rows
        (n,), all sentences at once; each keeps its K best."""
        K, steps = self.scores.size(1), self.tokens.size(2)
        seqs = F.pad(seqs, (0, steps - seqs.size(2)), value=-1)  # (n, C, steps)
        merged = torch.cat([self.scores[rows], ended], dim=1)  # (n, K + C): finished first, so ties keep them
        order = merged.sort(dim=1, descending=True, stable=True).indices[:, :K]  # (n, K)
        self.scores[rows] = merged.gather(1, order)
        all_tokens = torch.cat([self.tokens[rows], seqs], dim=1)  # (n, K + C, steps)
        self.tokens[rows] = all_tokens.gather(1, order[:, :, None].expand(-1, -1, all_tokens.size(2)))

    def worst(self, rows: Tensor) -> Tensor:
        """The worst kept score of sentences rows (n,): -inf until they have K."""
        return self.scores[rows, -1]  # (n,)

    def hypotheses(self, nbest: int) -> list[list[Hypothesis]]:
        results, inf = [], float("inf")
        for scores_b, tokens_b in zip(self.scores[:, :nbest].tolist(), self.tokens[:, :nbest].tolist()):
            results.append(
                [Hypothesis([x for x in seq if x >= 0], s) for s, seq in zip(scores_b, tokens_b) if s > -inf]
            )
        return results
