"""Dataclass records filled from another object's attributes of the same names: parsed flags, a proto message."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def record_from(cls: type[T], source: object, prefix: str = "", **given: Any) -> T:
    """``cls(**given)`` with each of its other fields read from ``source`` as the attribute
    ``prefix + name`` (``--kv-events-replay-buffer-bytes`` is ``args.kv_events_replay_buffer_bytes``).
    A field that ``source`` lacks is an AttributeError naming it: a new field needs its flag."""
    values = {field.name: getattr(source, prefix + field.name)
              for field in dataclasses.fields(cls) if field.name not in given}
    return cls(**values, **given)
