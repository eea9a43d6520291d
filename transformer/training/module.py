"""The LightningModule: label-smoothed loss per target token, AdamW, warmup schedules."""

import math
from dataclasses import asdict, dataclass

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from ..config_check import check_field_types
from ..model import ModelConfig, build_model

SCHEDULES = ("inverse_sqrt", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.98
    weight_decay: float = 0.01  # not applied to biases, norms and positions
    warmup_steps: int = 800
    schedule: str = "inverse_sqrt"  # the paper's; cosine decays to zero at the last step
    label_smoothing: float = 0.1

    def __post_init__(self):
        check_field_types(self, "optim")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")


def lr_factor(step: int, warmup: int, schedule: str, total: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): linear warmup, then decay."""
    step += 1
    if step <= warmup:
        return step / max(warmup, 1)
    if schedule == "inverse_sqrt":
        return math.sqrt(warmup / step) if warmup > 0 else 1 / math.sqrt(step)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return 0.5 * (1 + math.cos(math.pi * progress))


class TranslationModule(pl.LightningModule):
    """Takes plain values (a ModelConfig's and an OptimConfig's fields), so the checkpoint's
    hyperparameters rebuild it alone: TranslationModule.load_from_checkpoint(path)."""

    def __init__(self, model: dict, optim: dict):
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig(**model)
        self.optim_config = OptimConfig(**optim)
        self.model = build_model(self.model_config)
        self._val_nll, self._val_tokens = 0.0, 0  # sums over the validation set

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.model(src, tgt_in)

    def _loss_sum(self, batch: dict, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy summed over target tokens, number of target tokens); padding ignored."""
        logits = self.model(batch["src"], batch["tgt_in"]).flatten(0, 1).float()  # (B*T, V)
        target = batch["tgt_out"].flatten()
        pad = self.model_config.pad_id
        loss = F.cross_entropy(logits, target, ignore_index=pad, label_smoothing=label_smoothing, reduction="sum")
        return loss, target.ne(pad).sum()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss_sum, tokens = self._loss_sum(batch, self.optim_config.label_smoothing)
        loss = loss_sum / tokens.clamp(min=1)  # per target token
        self.log("train/loss", loss, prog_bar=True, batch_size=int(tokens))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        nll, tokens = self._loss_sum(batch, 0.0)  # unsmoothed, so that val/ppl is a perplexity
        self._val_nll += nll.item()
        self._val_tokens += int(tokens)

    def on_validation_epoch_end(self) -> None:
        sums = torch.tensor([self._val_nll, self._val_tokens], dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            sums = self.all_gather(sums).reshape(-1, 2).sum(0)
        self._val_nll, self._val_tokens = 0.0, 0
        loss = (sums[0] / sums[1].clamp(min=1)).item()  # NLL per target token over the whole set
        self.log_dict({"val/loss": loss, "val/ppl": math.exp(min(loss, 50))}, prog_bar=True)

    def configure_optimizers(self):
        cfg = self.optim_config
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (decay if p.dim() >= 2 and "positions" not in name else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
        )  # fmt: skip
        total = int(self.trainer.estimated_stepping_batches) if cfg.schedule == "cosine" else 0
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, cfg.warmup_steps, cfg.schedule, total)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @staticmethod
    def hyperparameters(model: ModelConfig, optim: OptimConfig) -> dict:
        return {"model": asdict(model), "optim": asdict(optim)}
