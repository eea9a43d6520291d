"""Training: the LightningModule and its optimisation config."""

from .module import OptimConfig, TranslationModule, ValidationConfig

__all__ = ["OptimConfig", "TranslationModule", "ValidationConfig"]
