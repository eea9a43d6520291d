"""Several models decoding as one: each encodes the source and keeps its own key/value caches, and at every step
the search sees the mean of their log-probabilities (Marian's ensembles; Hinton et al. 2015's geometric mean).
Greedy and beam search take an Ensemble wherever they take an EncoderDecoder."""

import torch
from torch import Tensor, nn

from ..model import DecoderCache, EncoderDecoder


class PerModel:
    """One value per model (an encoder output, a source layout) whose rows are selected together, as a tensor's
    are: x[index] holds each model's rows `index`."""

    def __init__(self, values):
        self.values = list(values)

    def __getitem__(self, index: Tensor) -> "PerModel":
        return PerModel(value[index] for value in self.values)


class EnsembleCache:
    """Each model's DecoderCache, reordered together."""

    def __init__(self, caches: list[DecoderCache]):
        self.caches = caches

    def __len__(self) -> int:
        return len(self.caches[0])

    def reorder(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(index)

    def reorder_targets(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.reorder_targets(index)

    def select_sources(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.select_sources(index)


class Ensemble(nn.Module):
    def __init__(self, models: list[EncoderDecoder]):
        super().__init__()
        if len({(m.pad_id, m.tgt_vocab_size) for m in models}) > 1:
            raise ValueError("the models of an ensemble need the same vocabulary (pad id and target vocabulary size)")
        self.models = nn.ModuleList(models)
        self.pad_id, self.tgt_vocab_size = models[0].pad_id, models[0].tgt_vocab_size
        self.max_target_positions = min(m.max_target_positions for m in models)

    def encode(self, src: Tensor) -> tuple[PerModel, PerModel]:
        encoded = [model.encode(src) for model in self.models]  # per model: (B, S, d) and the layout
        return PerModel(memory for memory, _ in encoded), PerModel(layout for _, layout in encoded)

    def decode(self, tgt: Tensor, memory: PerModel, src_layout: PerModel, cache: EnsembleCache | None = None) -> Tensor:
        """The mean of the models' log-probabilities (float32) for each position of tgt, (B, T, V): the logits of
        a model whose softmax is their normalised geometric mean."""
        caches = cache.caches if cache is not None else [None] * len(self.models)
        steps = zip(self.models, memory.values, src_layout.values, caches)
        lprobs = [torch.log_softmax(model.decode(tgt, m, layout, c).float(), dim=-1) for model, m, layout, c in steps]
        return torch.stack(lprobs).mean(dim=0)  # (B, T, V)

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([model.new_cache() for model in self.models])
