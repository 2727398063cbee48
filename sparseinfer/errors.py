"""Project error types: user-facing problems carry a message that says what is wrong and what to do."""


class SparseInferError(Exception):
    """Base class of errors shown to users as one line (no traceback unless --verbose)."""


class ModelFormatError(SparseInferError):
    """The model file or folder is missing, truncated, foreign or unsupported."""


class UnsupportedError(ModelFormatError):
    """An architecture, tensor type or feature we do not implement."""


class ContextOverflowError(SparseInferError):
    """The prompt (plus requested tokens) does not fit in the context window."""


class SparsityPackError(SparseInferError):
    """A sparsity pack is missing, corrupt, or belongs to another model."""
