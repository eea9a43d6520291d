"""A trained checkpoint as a translator: its model, its own tokenizers, length-bucketed batched search."""

import contextlib
import warnings

import numpy as np
import torch

from ..base.errors import first_line
from ..data.batching import TokenBatchSampler
from ..data.tokenizer import SentencePiece
from ..decoding import Ensemble, Hypothesis, beam_search, greedy_search, sampled_token
from ..model import ModelConfig, RuntimeConfig, build_model, use_deterministic_algorithms
from ..model.kernels.rules import check_backend
from ..training.resume import load_checkpoint
from .interface import PRECISIONS, SearchConfig, check_nbest, decoded_nbest


class CheckpointTranslator:
    """Everything comes from the checkpoint: model config and weights, tokenizers, and the data config
    (corpus and languages) it was trained with."""

    def __init__(self, checkpoint: dict, path: str = "checkpoint", device: str = "cpu",
                 runtime: RuntimeConfig | None = None, ema: bool = False):  # fmt: skip
        """`runtime`: how this model runs here (attention backend, ...), whatever the training chose. `ema`: the
        weights' moving average (optim.ema_decay) instead of the weights."""
        hparams = checkpoint["hyper_parameters"]
        if "tokenizers" not in checkpoint:
            raise ValueError(f"{path} holds no tokenizers (it was not written by training); use a training checkpoint")
        if ema and "ema_state_dict" not in checkpoint:
            raise ValueError(
                f"ckpt_path={path} holds no weight average (trained without optim.ema_decay); drop ema=true"
            )
        self.model_config = ModelConfig.from_dict(hparams["model"])
        self.model_configs = [self.model_config]  # an ensemble's: every model's
        self.runtime = runtime or RuntimeConfig()
        if self.runtime.deterministic:
            use_deterministic_algorithms()
        # the average covers the parameters; buffers (none that training changes) come from the weights
        states = [checkpoint["state_dict"]] + ([checkpoint["ema_state_dict"]] if ema else [])
        weights = {k.removeprefix("model."): v for state in states for k, v in state.items() if k.startswith("model.")}
        self.model = build_model(self.model_config, self.runtime, weights)
        self.model.to(device).eval()
        self.src_tokenizer = SentencePiece(model=checkpoint["tokenizers"]["src"])
        self.tgt_tokenizer = SentencePiece(model=checkpoint["tokenizers"]["tgt"])
        self.data = checkpoint.get("data", {})
        self.trained_precision = "bf16" if "bf16" in checkpoint.get("precision", "32") else "32"
        self.device = torch.device(device)
        self.max_source_tokens = self.model_config.max_positions - 1  # one position for EOS

    @classmethod
    def from_path(cls, path: str, device: str = "cpu", runtime: RuntimeConfig | None = None,
                  ema: bool = False) -> "CheckpointTranslator":  # fmt: skip
        checkpoint = load_checkpoint(path)
        try:
            return cls(checkpoint, path, device, runtime, ema)
        except (KeyError, TypeError, RuntimeError) as e:
            reason = first_line(e, 200)
            raise ValueError(f"ckpt_path={path} is not a usable checkpoint of this project ({reason})") from None

    @classmethod
    def ensemble(cls, paths: list[str], device: str = "cpu", runtime: RuntimeConfig | None = None,
                 ema: bool = False) -> "CheckpointTranslator":  # fmt: skip
        """Several checkpoints decoding as one (decoding/ensemble.py): the first one's tokenizers and data config,
        which every other must share."""
        members = [cls.from_path(path, device, runtime, ema) for path in paths]
        first = members[0]
        for path, member in zip(paths[1:], members[1:]):
            for side in ("src", "tgt"):
                ours, theirs = (getattr(m, f"{side}_tokenizer").sp.serialized_model_proto() for m in (first, member))
                if ours != theirs:
                    raise ValueError(
                        f"ckpt_path: {path} has another {side} tokenizer than {paths[0]}; an ensemble needs models "
                        "trained on the same data cache's sentencepiece models"
                    )
        first.model = Ensemble([m.model for m in members])
        first.model_configs = [m.model_config for m in members]
        first.max_source_tokens = min(m.max_source_tokens for m in members)
        return first

    def translate(self, texts: list[str], search: SearchConfig, precision: str = "32", target_lengths=None,
                  tag: str | None = None) -> list[str]:  # fmt: skip
        """One translation per text, in order; empty texts give empty translations. `target_lengths`: see search.
        `tag`: a corpus tag the model was trained with (e.g. <news>), put before every source as in training."""
        return [h[0][1] if h else "" for h in self.translate_nbest(texts, search, 1, precision, target_lengths, tag)]

    def translate_nbest(self, texts: list[str], search: SearchConfig, nbest: int, precision: str = "32",
                        target_lengths=None, tag: str | None = None) -> list[list[tuple[float, str]]]:  # fmt: skip
        """Up to nbest (score, translation) per text, best first (beam search's scores; nbest=1 with beam_size=1:
        greedy's translation, unscored); an empty text gives [(0.0, "")]."""
        ids = self.src_tokenizer.encode(texts, tag)
        longest = self.max_source_tokens
        for length in [len(s) for s in ids if len(s) > longest]:
            message = f"an input of {length} tokens was translated up to its first {longest} (model.max_positions)"
            warnings.warn(message, stacklevel=2)
        found = self.search([s[:longest] for s in ids], search, precision, target_lengths, nbest)
        return decoded_nbest(self.tgt_tokenizer, texts, [[(h.score, h.tokens) for h in hyps] for hyps in found])

    def search(self, sources: list[list[int]], search: SearchConfig, precision: str = "32", target_lengths=None,
               nbest: int = 1):  # fmt: skip
        """The nbest best hypotheses per source (ids without EOS), in input order, decoded in the batches `batches`
        makes."""
        check_nbest(nbest, search)
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        for model_config in self.model_configs:
            check_backend(model_config, self.runtime, self.device.type, precision == "bf16", training=False)
        results: list = [None] * len(sources)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        )
        generator = torch.Generator(self.device).manual_seed(search.seed) if search.sampling_topk else None
        for batch, src in self.batches(sources, search, target_lengths):
            with autocast:
                found = self._search(src, search, nbest, generator)
            for i, hypotheses in zip(batch, found):
                results[i] = hypotheses
        return results

    def batches(self, sources: list[list[int]], search: SearchConfig, target_lengths=None):
        """(indices into sources, src (B, S) on the device: ids + EOS, right-padded) for each batch search decodes.
        Batches are length-sorted and hold up to search.max_tokens // beam_size padded tokens (beam search decodes
        beam_size rows per sentence, and larger batches run slower on CPU: the output layer's logits outgrow the
        caches), packed by the data module's TokenBatchSampler: by the sources, or, given each reference's length
        as batched (BOS + target, see example_lengths), by both sides as validation packs pairs (bf16 rounding
        depends on batch shapes, so a validation split then decodes exactly as in training)."""
        max_tokens = max(search.max_tokens // search.beam_size, 1)
        eos, pad = self.src_tokenizer.eos_id, self.model.pad_id
        source_lengths = [len(s) + 1 for s in sources]  # with EOS
        lengths = np.stack([source_lengths, source_lengths if target_lengths is None else target_lengths], axis=1)
        max_tokens = max(max_tokens, int(lengths.max(initial=0)))  # one overlong pair: a batch of its own
        for batch in TokenBatchSampler(lengths, max_tokens, shuffle=False).all_batches(0):
            batch = batch.tolist()
            longest = max(len(sources[i]) for i in batch) + 1
            src = torch.full((len(batch), longest), pad, dtype=torch.long)  # (B, S) right-padded
            for row, i in enumerate(batch):
                src[row, : len(sources[i]) + 1] = torch.tensor(sources[i] + [eos])
            yield batch, src.to(self.device)

    def _search(self, src: torch.Tensor, search: SearchConfig, nbest: int = 1, generator=None):
        tok = self.tgt_tokenizer
        bos, eos, barred = tok.bos_id, tok.eos_id, tok.barred_ids
        if search.beam_size == 1:  # the same function as validation, so that scores match it (unscored)
            # pad and BOS are barred by greedy_search before a draw; sampling bars the byte pieces besides
            never = tok.byte_ids
            draw = sampled_token(search.sampling_topk, search.temperature, generator, never) if generator else None
            found = greedy_search(self.model, src, bos, eos, search.max_len_a, search.max_len_b, search.use_cache,
                                  draw, barred)  # fmt: skip
            return [[Hypothesis(tokens, float("nan"))] for tokens in found]
        return beam_search(
            self.model, src, bos, eos, beam_size=search.beam_size, length_penalty=search.length_penalty,
            max_len_a=search.max_len_a, max_len_b=search.max_len_b, use_cache=search.use_cache,
            early_stopping=search.early_stopping, nbest=nbest, barred=barred,
        )  # fmt: skip
