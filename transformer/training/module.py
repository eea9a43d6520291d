"""The LightningModule: label-smoothed loss per target token, AdamW, warmup schedules, validation BLEU."""

import math
from dataclasses import asdict

import pytorch_lightning as pl
import torch

from ..data import TranslationDataModule
from ..model import ModelConfig, RuntimeConfig, build_model
from ..model.loss import batch_loss_sum
from .config import OptimConfig, ValidationConfig
from .ema import WeightAverage
from .exact_resume import ExactResume
from .progress import in_place_of
from .schedule import lr_multiplier
from .scoring import BleuScorer, Score
from .steps import StepLedger


class TranslationModule(pl.LightningModule):
    """Takes plain values (the fields of a ModelConfig, an OptimConfig, a ValidationConfig and a RuntimeConfig), so
    the checkpoint's hyperparameters rebuild it alone: TranslationModule.load_from_checkpoint(path)."""

    def __init__(self, model: dict, optim: dict, validation: dict | None = None, runtime: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig.from_dict(model)
        self.optim_config = OptimConfig(**optim)
        self.validation_config = ValidationConfig(**(validation or {}))
        self.runtime_config = RuntimeConfig(**(runtime or {}))
        self.model = build_model(self.model_config, self.runtime_config)
        self.ledger = StepLedger()  # the optimizer steps' tokens, figures, reads and stop request, on the host
        self.validations = 0  # completed validation runs, for bleu_every
        self.scorers: dict[str, BleuScorer] = {}  # validation BLEU per dev set, the main one first; set in setup()
        self.last_score: Score | None = None  # the main dev set's
        self._val_sums: dict[int, list] = {}  # per dev set (dataloader index): [NLL, target tokens] so far
        decay = self.optim_config.ema_decay
        self.weight_average = None if decay is None else WeightAverage(decay, self.optim_config.ema_warmup)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.model(src, tgt_in)

    def _loss_sum(self, batch: dict, label_smoothing: float, rdrop_alpha: float | None = None
                  ) -> tuple[torch.Tensor, int]:  # fmt: skip
        """(cross-entropy summed over target tokens, number of target tokens); padding ignored, and nothing waits on
        the device: the collator's host facts describe the batch. With rdrop_alpha, R-Drop's loss (model/loss.py)."""
        return batch_loss_sum(self.model, batch, label_smoothing, rdrop_alpha)

    # Training

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """The loss summed over target tokens: configure_gradient_clipping divides the gradients by the target tokens
        of the whole optimizer step, all micro-batches and ranks (fairseq's way), not by each micro-batch's."""
        loss_sum, _ = self._loss_sum(batch, self.optim_config.label_smoothing, self.optim_config.rdrop_alpha)
        self.ledger.add_micro_batch(loss_sum, batch["tgt_tokens"], batch_idx, batch["index"][:8])
        return loss_sum

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The step; then the weights' average takes it in, before any callback can checkpoint this batch."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.ledger.after_optimizer_step()
        if self.weight_average is not None:
            # step t is counted in global_step only once this hook returns: inside it, global_step is t - 1
            self.weight_average.update(self.model, self.trainer.global_step + 1)

    def on_fit_start(self) -> None:
        fp16 = self._grad_scaler is not None
        self.ledger.start(self.trainer.log_every_n_steps or 50, self.trainer.world_size, fp16, self.global_step)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning calls this once per optimizer step, clipping or not, before the step: the gradients become
        gradients per target token of the whole step, all micro-batches and ranks (fairseq's way), whose norm the
        step's figures keep, then are clipped by global norm (Trainer's gradient_clip_val). Nothing here waits on the
        device: a non-finite norm makes the optimizer skip the step on the device, and the figures are read with the
        interval's other steps (StepLedger)."""
        scaler = self._grad_scaler
        if scaler is not None:  # Lightning leaves a fused optimizer's gradients scaled; its step would unscale them
            scaler.unscale_(optimizer)  # here instead, before they are measured (the scaler's step then knows)
        params = [p for p in self.parameters() if p.grad is not None]
        # Lightning divided each micro-batch's loss by accumulate_grad_batches, and DDP averages over ranks
        scale, agreed = self.ledger.totals(self.trainer.accumulate_grad_batches * self.trainer.world_size, self.device)
        torch._foreach_mul_([p.grad for p in params], scale)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        self.ledger.skip_if_not_finite(optimizer, norm)
        self.ledger.close_step(self.global_step, self.current_epoch, norm, agreed)
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if self.ledger.due(self.global_step + 1):
            self.ledger.read()

    @property
    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16's gradient scaler (16-mixed), or None."""
        return getattr(self.trainer.precision_plugin, "scaler", None)

    # Validation: loss and perplexity over the whole split; BLEU and chrF from greedy decoding

    def setup(self, stage: str) -> None:
        """BLEU is scored against each of the data module's dev sets (scorers set before fit are kept)."""
        data = self.trainer.datamodule
        if not self.scorers and isinstance(data, TranslationDataModule):
            for name, split in data.validation_sets.items():
                sources, references = list(split["src"]), list(split["tgt"])
                self.scorers[name] = BleuScorer(data.tgt_tokenizer, sources, references, self.validation_config)

    def _scoring(self) -> bool:
        every = self.validation_config.bleu_every
        if not self.scorers or every <= 0 or self.trainer.sanity_checking:
            return False
        return self.validations % every == 0

    def on_validation_epoch_start(self) -> None:
        if self.weight_average is not None:  # validation scores the average; training goes on from its weights
            self.weight_average.swap_in(self.model)

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        nll, _ = self._loss_sum(batch, 0.0)  # unsmoothed, so that val/ppl is a perplexity
        sums = self._val_sums.setdefault(dataloader_idx, [0.0, 0])
        sums[0] = sums[0] + nll.double()  # summed on the device: no batch waits for it
        sums[1] += batch["tgt_tokens"]
        if self._scoring():
            list(self.scorers.values())[dataloader_idx].add(self.model, batch["src"], batch["index"])

    @staticmethod
    def validation_metrics(dev_sets: list[str]) -> list[str]:
        """The names on_validation_epoch_end logs for these dev sets (the main one first)."""
        kinds = ("loss", "ppl", "bleu", "chrf")
        per_set = [f"val/{name}/{k}" for name in dev_sets for k in kinds] if len(dev_sets) > 1 else []
        return [f"val/{k}" for k in kinds] + per_set

    def on_validation_epoch_end(self) -> None:
        """val/loss, val/ppl, val/bleu and val/chrf of the main dev set; with several, val/{name}/... of each too."""
        names = list(self.scorers) or ["main"]
        for i, name in enumerate(names):
            nll, tokens = self._val_sums.get(i, [0.0, 0])
            sums = torch.zeros(2, dtype=torch.float64, device=self.device)
            sums[0] += nll
            sums[1] += tokens
            if self.trainer.world_size > 1:
                sums = self.all_gather(sums).reshape(-1, 2).sum(0)
            loss = (sums[0] / sums[1].clamp(min=1)).item()  # NLL per target token over the whole set
            metrics = {"loss": loss, "ppl": math.exp(min(loss, 50))}
            score = self.scorers[name].score(self.trainer.world_size) if self._scoring() else None
            if score is not None:
                metrics |= {"bleu": score.bleu, "chrf": score.chrf}
                if i == 0:
                    self.last_score = score  # TensorBoardSamples shows its examples and signature
            if i == 0:
                self.log_dict({f"val/{k}": v for k, v in metrics.items()}, prog_bar=True)
            if len(names) > 1:
                self.log_dict({f"val/{name}/{k}": v for k, v in metrics.items()})
        self._val_sums = {}
        if not self.trainer.sanity_checking:
            self.validations += 1
        if self.weight_average is not None:  # before any checkpoint is written (on_validation_end)
            self.weight_average.swap_out(self.model)

    # Optimisation

    def configure_optimizers(self):
        cfg = self.optim_config
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (decay if p.dim() >= 2 and "positions" not in name else no_decay).append(p)
        # fused: one kernel per parameter group and its step count on the device; the default (for-each on a GPU,
        # one tensor at a time on a CPU, reading every step count into Python) took 4x as long on a CPU
        # (tools/bench_optimizer.py)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True,
        )  # fmt: skip
        multiplier = lr_multiplier(cfg.schedule, cfg.warmup_steps, self.trainer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # Checkpoints: the tokenizers, so that a checkpoint translates alone; what exact resume needs (ExactResume)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.ledger.read()  # a non-finite step since the last read stops training here, before this checkpoint
        checkpoint["precision"] = str(self.trainer.precision)  # evaluation decodes as validation did
        if self.weight_average is not None and self.weight_average.shadow is not None:
            checkpoint["ema_state_dict"] = self.weight_average.state_dict(prefix="model.")  # as state_dict's names
        data = getattr(self.trainer, "datamodule", None)
        if isinstance(data, TranslationDataModule):
            checkpoint.update(data.checkpoint_extras())  # "tokenizers", and "data" for evaluate's defaults

    def on_train_end(self) -> None:
        self.ledger.read()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for state in checkpoint.get("optimizer_states", []):  # loading keeps the saved groups' settings: a checkpoint
            for group in state["param_groups"]:  # of an unfused AdamW (before e1fbc86) would resume unfused, and
                group["fused"], group["foreach"] = True, None  # fp16's scaler would hand it what only fused takes
        if self.weight_average is not None and "ema_state_dict" in checkpoint:
            self.weight_average.load_state_dict(checkpoint["ema_state_dict"], self.model, prefix="model.")

    def configure_callbacks(self) -> list[pl.Callback]:
        """ExactResume: whatever callbacks a config lists, a resumed run continues exactly. Our bar in place of the
        default one Lightning picked (tqdm, or Rich where installed), which would read the step's loss from the device
        at every refresh and show no tokens per second."""
        bar = in_place_of(self.trainer.progress_bar_callback)
        return [ExactResume(), *([bar] if bar is not None else [])]

    @staticmethod
    def hyperparameters(model: ModelConfig, optim: OptimConfig, validation: ValidationConfig | None = None,
                        runtime: RuntimeConfig | None = None) -> dict:  # fmt: skip
        return {"model": asdict(model), "optim": asdict(optim), "validation": asdict(validation or ValidationConfig()),
                "runtime": asdict(runtime or RuntimeConfig())}  # fmt: skip
