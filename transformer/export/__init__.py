"""Deployment: a checkpoint as a CTranslate2 model folder."""

from .folder import write_model
from .spec import UnsupportedModel, ctranslate2_spec, supported

__all__ = ["UnsupportedModel", "ctranslate2_spec", "supported", "write_model"]
