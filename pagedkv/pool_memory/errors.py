"""The one error of pool memory: a pool a handle names cannot be mapped."""


class PoolMappingError(RuntimeError):
    """The pool named by a handle cannot be mapped; the message says why and what to fix."""
