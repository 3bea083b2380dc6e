"""User-facing errors: each carries a one-line message naming the problem."""


class TokenhaulError(Exception):
    """Base class: the CLI prints these as one line, never as a traceback."""


class ModelError(TokenhaulError):
    """Unknown, missing, corrupted or unsupported model."""


class RequestError(TokenhaulError, ValueError):
    """A request that cannot be served: empty or too-long prompt, bad sampling parameters."""


class CapacityError(RequestError):
    """A request that can never fit the KV cache budget."""
