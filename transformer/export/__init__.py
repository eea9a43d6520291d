"""Deployment: a checkpoint as a CTranslate2 model folder."""

from .folder import write_model
from .spec import UnsupportedModel, checkpoint_spec, ctranslate2_spec, supported

__all__ = ["UnsupportedModel", "checkpoint_spec", "ctranslate2_spec", "supported", "write_model"]
