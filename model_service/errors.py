"""Errors that cross the model service's rooms: a leaf module, imported by all and importing none."""


class ModelLoadError(Exception):
    """A checkpoint that cannot be served: missing files, an unsupported architecture, bad tensors."""
