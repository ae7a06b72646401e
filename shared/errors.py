"""Errors that cross module boundaries and become 4xx answers at the gateway."""


class InvalidRequest(ValueError):
    """A request that must be refused before admission. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class Overloaded(Exception):
    """A request refused because the server is too busy right now, not for what it asks: the same request
    succeeds later, so the gateway answers 503 (which clients retry), never a 400."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
