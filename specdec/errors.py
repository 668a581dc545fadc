"""Errors specdec raises on bad input. Each message is one readable line."""


class SpecDecError(Exception):
    """Base class: anything the user can fix by changing their input."""


class InvalidRequest(SpecDecError, ValueError):
    """A generation argument is out of range or malformed."""


class PromptTooLong(InvalidRequest):
    """The prompt does not fit the target's context window."""


class ModelLoadError(SpecDecError):
    """A model path is missing, unreadable or not a causal LM."""


class IncompatibleDraft(SpecDecError):
    """The draft cannot propose tokens in the target's vocabulary."""
