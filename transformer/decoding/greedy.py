"""Batched greedy decoding: one encoder pass, then one decoder step per target token."""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..model import EncoderDecoder
from .source import MAX_LEN_A, MAX_LEN_B, max_target_lengths, select_encoded


@torch.no_grad()
def greedy_search(
    model: EncoderDecoder,
    src: Tensor,
    bos_id: int,
    eos_id: int,
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
    use_cache: bool = True,
    next_token: Callable[[Tensor], Tensor] | None = None,
    barred: Sequence[int] = (),
) -> list[list[int]]:
    """Most likely next token at each step, for a batch of right-padded sources (B, S).

    Returns per sentence, in batch order, the generated ids without the leading BOS and without
    the EOS (cut at the first one). Each sentence stops at EOS or after int(max_len_a * src_len +
    max_len_b) tokens, src_len being its own non-pad length (and never beyond the model's
    max_positions). With use_cache each step feeds only the new token and the decoder keeps its
    keys/values; without, it feeds the whole prefix (slower, for checks). Finished sentences
    leave the batch. Put the model in eval mode first; an enclosing autocast applies as usual.
    `next_token`: logits (n, V) -> the tokens (n,) chosen; the most likely by default, sampling.sampled_token to
    sample. `barred`: ids never generated (pad, BOS: SentencePiece.barred_ids), their logits -inf.
    """
    B = src.size(0)
    memory, src_layout = model.encode(src)  # (B, S, d), B rows
    max_len, steps = max_target_lengths(model, src, max_len_a, max_len_b)  # (B,), int

    out = torch.full((B, steps), eos_id, dtype=torch.long, device=src.device)  # (B, steps) generated ids
    rows = torch.arange(B, device=src.device)  # (n,) batch index of each unfinished sentence
    prefix = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)  # (n, t + 1)
    cache = model.new_cache() if use_cache else None
    barred_ids = torch.tensor(barred, dtype=torch.long, device=src.device)  # (k,) once, not every step
    for t in range(steps):
        tgt = prefix[:, -1:] if use_cache else prefix
        logits = model.decode(tgt, memory, src_layout, cache)[:, -1]  # (n, V)
        if barred:
            logits.index_fill_(1, barred_ids, float("-inf"))  # the step's own logits, used once
        token = logits.argmax(dim=-1) if next_token is None else next_token(logits)  # (n,)
        out[rows, t] = token
        prefix = torch.cat([prefix, token[:, None]], dim=1)
        keep = (token.ne(eos_id) & max_len[rows].gt(t + 1)).nonzero().squeeze(1)  # (n',) rows still going
        if len(keep) == 0:
            break
        if len(keep) < len(rows):  # drop finished sentences from the batch
            rows, prefix = rows[keep], prefix[keep]
            memory, src_layout = select_encoded(memory, src_layout, keep)
            if cache is not None:
                cache.reorder(keep)

    results = []
    for ids, n in zip(out.tolist(), max_len.tolist()):
        ids = ids[:n]
        results.append(ids[: ids.index(eos_id)] if eos_id in ids else ids)
    return results
