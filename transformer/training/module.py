"""The LightningModule: label-smoothed loss per target token, AdamW, warmup schedules, validation BLEU."""

import math
import random
from dataclasses import asdict

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from sacrebleu.metrics import BLEU, CHRF

from ..decoding import greedy_search
from ..model import ModelConfig, build_model
from ..model.loss import loss_sum
from .config import OptimConfig, ValidationConfig
from .errors import TrainingError


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
    """Takes plain values (the fields of a ModelConfig, an OptimConfig and a ValidationConfig), so the
    checkpoint's hyperparameters rebuild it alone: TranslationModule.load_from_checkpoint(path)."""

    def __init__(self, model: dict, optim: dict, validation: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig(**model)
        self.optim_config = OptimConfig(**optim)
        self.validation_config = ValidationConfig(**(validation or {}))
        self.model = build_model(self.model_config)
        self.validations = 0  # completed validation runs, for bleu_every
        self.translations: list[tuple[str, str, str]] = []  # (source, reference, hypothesis) of the last scoring
        self._val_nll, self._val_tokens, self._hypotheses = 0.0, 0, {}
        self._rng_to_restore = None
        self.skipped_steps, self._skipped_in_a_row = 0, 0  # fp16 steps the gradient scaler skipped

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.model(src, tgt_in)

    def _loss_sum(self, batch: dict, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy summed over target tokens, number of target tokens); padding ignored."""
        return loss_sum(self.model, batch["src"], batch["tgt_in"], batch["tgt_out"], label_smoothing)

    # Training

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        if self._rng_to_restore is not None:  # resumed: dropout continues the interrupted run's random stream
            _set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss_sum, tokens = self._loss_sum(batch, self.optim_config.label_smoothing)
        loss = loss_sum / tokens.clamp(min=1)  # per target token
        self.log("train/loss", loss, prog_bar=True, batch_size=int(tokens))
        self._last_batch = (batch_idx, loss.detach(), batch["index"][:8].tolist())  # named if gradients blow up
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by global norm (Trainer's gradient_clip_val) and log the norm before clipping. Runs once per
        optimizer step, before the step: a non-finite norm stops training before any weight changes."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if not torch.isfinite(norm):
            self._non_finite_gradients(norm)
            return
        self._skipped_in_a_row = 0
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.log("train/grad_norm", norm)

    def _non_finite_gradients(self, norm: torch.Tensor) -> None:
        """fp16: the gradient scaler skips this step and lowers its scale (counted, and reported when it keeps
        happening). bf16 and fp32 have no such remedy: stop, naming the step and its examples."""
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:  # 16-mixed with a grad scaler
            self.skipped_steps += 1
            self._skipped_in_a_row += 1
            self.log("train/skipped_steps", float(self.skipped_steps))
            if self._skipped_in_a_row == 100:
                rank_zero_warn(
                    f"the fp16 gradient scaler has skipped 100 steps in a row (step {self.global_step}): gradients "
                    "overflow persistently; try trainer.precision=bf16-mixed or a lower optim.lr"
                )
            return
        batch = self._last_batch
        raise TrainingError(
            f"non-finite gradient norm ({norm.item()}) at step {self.global_step} (epoch {self.current_epoch}, "
            f"batch {batch[0]}, loss {batch[1]:.4g}, examples {batch[2]}); no weights were updated and no "
            "checkpoint written from it: resume from last.ckpt with a lower optim.lr or trainer.precision=32"
        )

    # Validation: loss and perplexity over the whole split; BLEU and chrF from greedy decoding

    def _scoring(self) -> bool:
        every = self.validation_config.bleu_every
        return every > 0 and not self.trainer.sanity_checking and self.validations % every == 0

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        nll, tokens = self._loss_sum(batch, 0.0)  # unsmoothed, so that val/ppl is a perplexity
        self._val_nll += nll.item()
        self._val_tokens += int(tokens)
        if self._scoring():
            limit = self.validation_config.bleu_max_sentences
            rows = torch.arange(len(batch["index"])) if limit is None else torch.nonzero(batch["index"] < limit)[:, 0]
            if len(rows):
                hypotheses = self.translate_ids(batch["src"][rows])
                self._hypotheses.update(zip(batch["index"][rows].tolist(), hypotheses))

    def translate_ids(self, src: torch.Tensor) -> list[list[int]]:
        """Greedy translations of a padded source batch, as target ids without BOS/EOS."""
        tok, cfg = self.trainer.datamodule.data.tgt_tokenizer, self.validation_config
        return greedy_search(self.model, src, tok.bos_id, tok.eos_id, cfg.max_len_a, cfg.max_len_b)

    def on_validation_epoch_end(self) -> None:
        sums = torch.tensor([self._val_nll, self._val_tokens], dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            sums = self.all_gather(sums).reshape(-1, 2).sum(0)
        self._val_nll, self._val_tokens = 0.0, 0
        loss = (sums[0] / sums[1].clamp(min=1)).item()  # NLL per target token over the whole set
        self.log_dict({"val/loss": loss, "val/ppl": math.exp(min(loss, 50))}, prog_bar=True)
        hypotheses = self._gather(self._hypotheses) if self._scoring() else {}
        if hypotheses:  # none when limit_val_batches left out every sentence below bleu_max_sentences
            bleu, chrf = self._score(hypotheses)
            self.log_dict({"val/bleu": bleu, "val/chrf": chrf}, prog_bar=True)
        self._hypotheses = {}
        if not self.trainer.sanity_checking:
            self.validations += 1

    def _gather(self, hypotheses: dict[int, list[int]]) -> dict[int, list[int]]:
        if self.trainer.world_size == 1:
            return hypotheses
        parts = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(parts, hypotheses)
        return {i: h for part in parts for i, h in part.items()}

    def _score(self, hypotheses: dict[int, list[int]]) -> tuple[float, float]:
        """Corpus BLEU and chrF of the detokenized hypotheses against the raw references (sacreBLEU defaults)."""
        data = self.trainer.datamodule
        split = data.data.splits[data.cfg.valid_split]
        index = sorted(hypotheses)
        texts = data.data.tgt_tokenizer.decode([hypotheses[i] for i in index])
        chosen = split.select(index)
        bleu, chrf = BLEU(), CHRF()
        bleu_score = bleu.corpus_score(texts, [chosen["tgt"]]).score
        chrf_score = chrf.corpus_score(texts, [chosen["tgt"]]).score
        self.bleu_signature = str(bleu.get_signature())
        shown = range(min(self.validation_config.text_examples, len(index)))
        self.translations = [(chosen[i]["src"], chosen[i]["tgt"], texts[i]) for i in shown]
        return bleu_score, chrf_score

    # Optimisation

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

    # Checkpoints: random state for exact resume, and the tokenizers, so that a checkpoint translates alone

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rng"] = _rng_state()
        checkpoint["validations"] = self.validations
        checkpoint["skipped_steps"] = self.skipped_steps
        checkpoint["precision"] = str(self.trainer.precision)  # evaluation decodes as validation did
        data = getattr(self.trainer, "datamodule", None)
        if data is not None:
            src, tgt = data.data.src_tokenizer, data.data.tgt_tokenizer
            checkpoint["tokenizers"] = {"src": src.path.read_bytes(), "tgt": tgt.path.read_bytes()}
            checkpoint["data"] = asdict(data.cfg)  # which corpus and languages, for evaluate's defaults

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._rng_to_restore = checkpoint.get("rng")
        self.validations = checkpoint.get("validations", 0)
        self.skipped_steps = checkpoint.get("skipped_steps", 0)

    @staticmethod
    def hyperparameters(model: ModelConfig, optim: OptimConfig, validation: ValidationConfig | None = None) -> dict:
        return {"model": asdict(model), "optim": asdict(optim), "validation": asdict(validation or ValidationConfig())}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
