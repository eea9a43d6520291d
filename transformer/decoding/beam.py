"""Batched beam search: one encoder pass, then one decoder step per target token for all beams at once."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import EncoderDecoder


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
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    nbest: int = 1,
    use_cache: bool = True,
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
    is a heuristic (a longer hypothesis divides by a larger length). fairseq's rule, stop at K
    finished, is not used: junk beams that end early would stop the search before a good live
    beam ends. Done sentences leave the batch; the search ends when none is left. A sentence
    whose maximum length is 0 gets one empty hypothesis with score 0.

    Hypotheses returned for a sentence are distinct; `tokens` holds no EOS (a hypothesis shorter
    than the maximum length ended with EOS). beam_size=1 gives greedy_search's tokens, for any
    length_penalty. Like greedy_search, no token is barred (not even pad). With use_cache each
    step feeds only the newest token and the decoder keeps its keys/values (reordered to follow
    the surviving beams); without, it feeds the whole prefix (slower, for checks). Put the model
    in eval mode first; an enclosing autocast applies as usual.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be at least 1")
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest={nbest} must be between 1 and beam_size={beam_size}")
    B, K, device = src.size(0), beam_size, src.device
    src_len = src.ne(model.pad_id).sum(dim=1)  # (B,)
    max_len = (src_len.double() * max_len_a + max_len_b).long()  # float64, int(): as Python computes it
    max_len = max_len.clamp(0, model.tgt_embed.max_positions)  # (B,)
    steps = int(max_len.max()) if B else 0

    # Finished hypotheses per sentence, best first: scores (-inf: none yet), tokens (-1 after the end), lengths.
    fin_scores = torch.full((B, K), float("-inf"), device=device)  # (B, K)
    fin_tokens = torch.full((B, K, max(steps, 1)), -1, dtype=torch.long, device=device)  # (B, K, steps)
    fin_scores[max_len.eq(0), 0] = 0.0  # no tokens allowed: one empty hypothesis

    rows = max_len.gt(0).nonzero().squeeze(1)  # (n,) batch index of each unfinished sentence
    if len(rows):
        memory, src_padding = model.encode(src[rows])  # (n, S, d), (n, S) or None
    n = len(rows)
    prefix = torch.full((n, 1), bos_id, dtype=torch.long, device=device)  # (n*K, t + 1) BOS + tokens; n at t = 0
    scores = torch.full((n, K), float("-inf"), device=device)  # (n, K) summed log-probabilities
    scores[:, 0] = 0.0  # one live beam per sentence on the first step
    cache = model.new_cache() if use_cache else None
    C = min(2 * K, K * model.output.out_features)  # candidates per sentence and step
    for t in range(steps if n else 0):
        n = len(rows)
        tgt = prefix[:, -1:] if use_cache else prefix
        logits = model.decode(tgt, memory, src_padding, cache)[:, -1]  # (n*K, V); (n, V) at t = 0
        if t == 0:  # the encoder output was projected once per sentence; now each sentence gets K beams
            beams = torch.arange(n, device=device).repeat_interleave(K)  # (n*K,)
            logits, prefix, memory = logits[beams], prefix[beams], memory[beams]
            src_padding = None if src_padding is None else src_padding[beams]
            if cache is not None:
                cache.reorder(beams)
        lprobs = torch.log_softmax(logits.float(), dim=-1).view(n, K, -1)  # (n, K, V)
        V = lprobs.size(-1)
        cand = (scores[:, :, None] + lprobs).view(n, K * V)
        top_scores, top_idx = cand.topk(C, dim=1)  # (n, C), best first
        beam, token = top_idx // V, top_idx % V  # (n, C) source beam and new token of each candidate
        is_eos = token.eq(eos_id)
        at_limit = max_len[rows].eq(t + 1)[:, None]  # (n, 1) this step reaches the sentence's maximum length
        ends = (is_eos | at_limit) & top_scores.isfinite()
        ends[:, K:] = False  # only the best K candidates can finish (fairseq)

        # finish: merge the ending candidates into each sentence's K best finished, all sentences at once
        source = torch.arange(n, device=device)[:, None] * K + beam  # (n, C) rows of prefix
        seqs = torch.cat([prefix[source][:, :, 1:], token[:, :, None]], dim=2)  # (n, C, t + 1)
        seqs[:, :, t].masked_fill_(is_eos, -1)  # an EOS is not a token of the hypothesis
        seqs = F.pad(seqs, (0, fin_tokens.size(2) - t - 1), value=-1)  # (n, C, steps)
        ended = top_scores.masked_fill(~ends, float("-inf")) / float(t + 1) ** length_penalty  # (n, C)
        merged = torch.cat([fin_scores[rows], ended], dim=1)  # (n, K + C): finished first, so ties keep them
        order = merged.sort(dim=1, descending=True, stable=True).indices[:, :K]  # (n, K)
        fin_scores[rows] = merged.gather(1, order)
        all_tokens = torch.cat([fin_tokens[rows], seqs], dim=1)  # (n, K + C, steps)
        fin_tokens[rows] = all_tokens.gather(1, order[:, :, None].expand(-1, -1, all_tokens.size(2)))

        # the best K candidates that do not end with EOS stay live
        live_scores = top_scores.masked_fill(is_eos, float("-inf"))
        pick = (is_eos.long() * C + torch.arange(C, device=device)).topk(K, dim=1, largest=False).indices  # (n, K)
        scores = live_scores.gather(1, pick)  # (n, K)
        order = source.gather(1, pick)  # (n, K) rows of prefix to extend
        new_tokens = token.gather(1, pick)  # (n, K)

        best_live = scores[:, 0] / float(t + 1) ** length_penalty  # (n,) at its current length
        going = best_live.gt(fin_scores[rows, K - 1]) & max_len[rows].gt(t + 1)  # worst kept: -inf until K
        keep = going.nonzero().squeeze(1)  # (n',) sentences going on
        if len(keep) == 0:
            break
        if len(keep) < n:  # drop finished sentences from the batch
            rows, scores, order, new_tokens = rows[keep], scores[keep], order[keep], new_tokens[keep]
            beams_kept = (keep[:, None] * K + torch.arange(K, device=device)).view(-1)  # (n'*K,)
            memory = memory[beams_kept]
            src_padding = None if src_padding is None else src_padding[beams_kept]
        order = order.view(-1)
        prefix = torch.cat([prefix[order], new_tokens.view(-1, 1)], dim=1)
        if cache is not None:
            cache.reorder(order)

    results, inf = [], float("inf")
    for scores_b, tokens_b in zip(fin_scores[:, :nbest].tolist(), fin_tokens[:, :nbest].tolist()):
        results.append([Hypothesis([x for x in seq if x >= 0], s) for s, seq in zip(scores_b, tokens_b) if s > -inf])
    return results
