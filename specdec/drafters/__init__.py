from .base import Draft, Drafter, NoDrafter
from .chain import ChainDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["ChainDrafter", "Draft", "Drafter", "NoDrafter", "ModelDrafter", "NgramDrafter"]
