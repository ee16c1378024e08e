"""Exceptions jserve raises for bad input, each with a message that names the file and what was expected."""


class JServeError(Exception):
    """Base class for jserve's own errors."""


class ModelLoadError(JServeError):
    """A model could not be found, read or assembled."""
