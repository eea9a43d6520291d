"""An exponential moving average of the weights: updated after every optimizer step, validated with, checkpointed."""

import math

import torch
from torch import nn


class WeightAverage:
    """After optimizer step t, for every floating-point parameter: shadow <- shadow + w_t * (weights - shadow), with
    w_t = (1 - decay) / (1 - decay^t): the decay-weighted mean of the weights after steps 1..t, with no weight on
    the initial ones (the bias correction of Adam's moments). w_1 = 1, so it starts as the first step's weights;
    w_t -> 1 - decay, the plain exponential average, once decay^t is small. Early in a run that mean still holds
    the first, poor steps (at step 800 of decay 0.999, steps 1-400 weigh a third); with warmup, w_t is at least
    9 / (10 + t), the decay capped at (1 + t) / (10 + t) as TensorFlow's num_updates and timm's warm-up cap it: the
    average spans about the last tenth of the steps until that outgrows 1 / (1 - decay). The step count is the
    trainer's, so a resumed run needs no count of its own. `swap_in` puts the average in the model's place until
    `swap_out` (validation), leaving the training weights as they were."""

    def __init__(self, decay: float, warmup: bool = False):
        self.decay, self.warmup = decay, warmup
        self.shadow: dict[str, torch.Tensor] | None = None
        self._training: list[torch.Tensor] | None = None  # the weights while the average stands in
        self._aliases: dict[str, str] = {}  # a tied parameter's other names -> the name it is averaged under

    @staticmethod
    def _params(model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p for name, p in model.named_parameters() if p.is_floating_point()}

    @staticmethod
    def _tied_names(model: nn.Module) -> dict[str, str]:
        """Each further name of a tied parameter (shared embeddings, a tied output layer) -> its first name, the one
        named_parameters lists it under."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return {alias: first for first, *others in names.values() for alias in others}

    def _follow(self, params: dict[str, torch.Tensor]) -> None:
        """The average on the weights' device (a checkpoint's loads before the model moves)."""
        first = next(iter(params.values()))
        if next(iter(self.shadow.values())).device != first.device:
            self.shadow = {name: t.to(first.device) for name, t in self.shadow.items()}

    def weight(self, step: int) -> float:
        """w_t of optimizer step t (1-based)."""
        corrected = (1 - self.decay) / -math.expm1(step * math.log(self.decay))  # 1 - decay^t without cancellation
        return max(corrected, 9 / (10 + step)) if self.warmup else corrected

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Take in the weights after optimizer step `step` (1-based)."""
        params = self._params(model)
        if self.shadow is None:
            self.shadow = {name: p.detach().clone() for name, p in params.items()}
            self._aliases = self._tied_names(model)
            return
        self._follow(params)
        weight = self.weight(step)
        torch._foreach_lerp_(list(self.shadow.values()), [params[n].detach() for n in self.shadow], weight)

    @torch.no_grad()
    def swap_in(self, model: nn.Module) -> None:
        if self.shadow is None or self._training is not None:
            return
        params = self._params(model)
        self._follow(params)
        self._training = [params[n].detach().clone() for n in self.shadow]
        torch._foreach_copy_([params[n] for n in self.shadow], list(self.shadow.values()))

    @torch.no_grad()
    def swap_out(self, model: nn.Module) -> None:
        if self._training is None:
            return
        params = self._params(model)
        torch._foreach_copy_([params[n] for n in self.shadow], self._training)
        self._training = None

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The average under every name the model's state_dict gives a parameter: a tied one's under each of its
        names, so that loading it over the weights replaces all of them (one tensor, saved once)."""
        average = {name: t.detach().cpu().clone() for name, t in (self.shadow or {}).items()}
        tied = {alias: average[name] for alias, name in self._aliases.items() if name in average}
        return {prefix + name: t for name, t in {**average, **tied}.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], model: nn.Module, prefix: str = "") -> None:
        params = self._params(model)
        self.shadow = {name: state[prefix + name].to(p.device, p.dtype).clone() for name, p in params.items()}
        self._aliases = self._tied_names(model)
