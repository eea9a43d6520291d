"""Training: the LightningModule and its optimisation config."""

from .config import OptimConfig, ValidationConfig
from .module import TranslationModule

__all__ = ["OptimConfig", "TranslationModule", "ValidationConfig"]
