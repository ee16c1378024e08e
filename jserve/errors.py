"""Exceptions jserve raises for bad input, each with a message that names the file and what was expected."""

import reprlib


class JServeError(Exception):
    """Base class for jserve's own errors."""


class ModelLoadError(JServeError):
    """A model could not be found, read or assembled."""


class WeightUpdateError(JServeError, ValueError):
    """New weights that do not fit the model (a name it has no parameter for, another shape): nothing changed."""


class EngineAsleepError(JServeError, RuntimeError):
    """A request for an engine that sleep() put to sleep (wake_up() first), or whose weights sleep(level=2)
    dropped (update_weights() first)."""


class RequestError(JServeError, ValueError):
    """A request refused for one of its values; `param` names the field it came in (None: no single field).

    A ValueError, so callers that catch those still do; the server reports `param` in its 400s, so the field
    travels as data and nothing has to guess it from the message.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


_SHORT = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 6, 6, 3


def short_repr(value: object) -> str:
    """A value for an error message, cut short: one from a client may be megabytes long or deeply nested."""
    return _SHORT.repr(value)
