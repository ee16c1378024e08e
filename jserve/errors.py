"""Exceptions jserve raises for bad input, each with a message that names the file and what was expected."""

import reprlib


class JServeError(Exception):
    """Base class for jserve's own errors."""


class ModelLoadError(JServeError):
    """A model could not be found, read or assembled."""


_SHORT = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 6, 6, 3


def short_repr(value: object) -> str:
    """A value for an error message, cut short: one from a client may be megabytes long or deeply nested."""
    return _SHORT.repr(value)
