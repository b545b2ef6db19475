"""`RequestError`: an invalid request, as a ``ValueError`` that names the field at fault.

The engine, ``SamplingParams`` and the chat renderer raise it; the server turns it into an HTTP
400 in OpenAI's error format with ``param`` set from :attr:`RequestError.param` (no parsing of
the message).
"""

from __future__ import annotations

__all__ = ["RequestError"]


class RequestError(ValueError):
    """A request the engine refuses.

    Args:
        message: what is wrong, naming the field and the limit.
        param: the field at fault (``SamplingParams`` / ``add_request`` names: ``"max_tokens"``,
            ``"prompt"``, ``"messages"``, ...), or None when no single field is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
