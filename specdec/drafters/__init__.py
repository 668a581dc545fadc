from .base import Draft, Drafter, NoDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "NoDrafter", "ModelDrafter", "NgramDrafter"]
