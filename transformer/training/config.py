"""What training is told: the optimiser and schedule, and how validation decodes and scores."""

from dataclasses import dataclass

from ..base.typecheck import check_field_types
from ..decoding import MAX_LEN_A, MAX_LEN_B

SCHEDULES = ("inverse_sqrt", "cosine")
BEST_METRICS = ("bleu", "chrf")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # the peak learning rate, reached at the end of the warmup
    beta1: float = 0.9  # AdamW's decay of the gradients' running mean
    beta2: float = 0.98  # AdamW's decay of their running square
    weight_decay: float = 0.01  # not applied to biases, norms and positions
    warmup_steps: int = 400  # linear warmup to lr; 800 would outlast the default run (5 epochs, ~625 steps)
    schedule: str = "inverse_sqrt"  # the paper's; cosine decays to zero where the run ends: last step or max_time
    label_smoothing: float = 0.1  # the share of the target's probability spread over the vocabulary
    ema_decay: float | None = None  # an exponential moving average of the weights, validated with and checkpointed
    ema_warmup: bool = False  # early on the average spans the last ~tenth of the steps, not all of them
    # R-Drop: each batch twice through the model (two dropout masks, twice the compute), their predictions pulled
    # together by alpha x their symmetric KL divergence (the paper's alpha: 5 for IWSLT, 0.3-1 for WMT); null: off
    rdrop_alpha: float | None = None

    def __post_init__(self):
        check_field_types(self, "optim")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"optim.ema_decay={self.ema_decay} must be between 0 and 1 (e.g. 0.999), or null")
        if self.ema_warmup and self.ema_decay is None:
            raise ValueError("optim.ema_warmup=true warms up an average that is off: set optim.ema_decay (e.g. 0.999)")
        if self.rdrop_alpha is not None and not self.rdrop_alpha >= 0:
            raise ValueError(f"optim.rdrop_alpha={self.rdrop_alpha} must be at least 0 (e.g. 5), or null for no R-Drop")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class ValidationConfig:
    bleu_every: int = 1  # greedy-decode and score every N validations; 0 never
    bleu_max_sentences: int | None = None  # decode only the validation sentences with index < N
    max_len_a: float = MAX_LEN_A  # hypotheses stop at a * source length + b tokens
    max_len_b: int = MAX_LEN_B  # b of that limit
    text_examples: int = 3  # source/reference/hypothesis triples shown in TensorBoard
    best_metric: str = "bleu"  # bleu or chrf (chrF++): what the best checkpoints are kept by (val/{best_metric})

    def __post_init__(self):
        check_field_types(self, "validation")
        if self.best_metric not in BEST_METRICS:
            raise ValueError(f"validation.best_metric={self.best_metric!r} is not one of {', '.join(BEST_METRICS)}")
        if self.bleu_max_sentences is not None and self.bleu_max_sentences < 1:
            raise ValueError(f"validation.bleu_max_sentences={self.bleu_max_sentences} must be at least 1, or null")
