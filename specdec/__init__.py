"""specdec: lossless speculative decoding for causal LMs."""
from .api import Chunk, GenerationResult, SpecDecoder
from .errors import IncompatibleDraft, InvalidRequest, ModelLoadError, PromptTooLong, SpecDecError
from .sampling import SamplingParams

__all__ = ["SpecDecoder", "GenerationResult", "Chunk", "SamplingParams", "SpecDecError", "InvalidRequest",
           "PromptTooLong", "ModelLoadError", "IncompatibleDraft"]
__version__ = "0.1.0"
