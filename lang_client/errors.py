"""Errors raised by the DSL."""


class LangError(RuntimeError):
    pass


class NotSupportedError(LangError):
    """A primitive the chosen backend or model cannot serve (images, regex on hosted APIs...)."""


class TracingError(LangError):
    """The program cannot be turned into a static IR (it reads generated values in Python)."""


class BackendError(LangError):
    """The server answered with an error."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
