"""One GGUF file opened for loading: its metadata and its tensors, read with `gguf`.

GGUF (llama.cpp's format, what Ollama, LM Studio and llama.cpp users have on disk) holds the
config, the tokenizer and the weights in one file. This module only finds and opens it and
answers "what does the metadata say"; gguf_config, gguf_tokenizer and gguf_weights turn that
into pagedkv's ModelConfig, tokenizer and Llama weights.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from model_service.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"


def is_gguf_spec(spec: str | Path) -> bool:
    """A .gguf file, or a directory with a .gguf file and no config.json (a Hugging Face
    checkpoint directory may also carry a GGUF export beside its safetensors)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.suffix.lower() == GGUF_SUFFIX
    return path.is_dir() and not (path / "config.json").is_file() and any(_gguf_files(path))


def resolve_gguf_path(spec: str | Path) -> Path:
    """The .gguf file `spec` names: the file itself, or the only one in a directory."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a directory")
    found = sorted(_gguf_files(path))
    if len(found) != 1:
        names = ", ".join(file.name for file in found) or "none"
        raise ModelLoadError(
            f"{path} must hold exactly one {GGUF_SUFFIX} file to serve, it holds {len(found)} ({names}); "
            "give the file's path instead"
        )
    return found[0]


def _gguf_files(directory: Path):
    return (child for child in directory.iterdir() if child.is_file() and child.suffix.lower() == GGUF_SUFFIX)


class GGUFFile:
    """Metadata by key (`value`, `require`) and tensors by name, of one opened file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._reader = _FastGGUFReader(self.path)
        except Exception as error:  # the reader raises ValueError, KeyError, struct errors...
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {error}") from None
        self.tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def value(self, key: str, default: Any = None) -> Any:
        """A scalar, string or list (arrays) value, or `default` when the file lacks `key`."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as error:
            raise ModelLoadError(f"{self.path}: cannot read metadata {key}: {error}") from None

    def require(self, key: str) -> Any:
        value = self.value(key)
        if value is None:
            raise ModelLoadError(f"{self.path} lacks the metadata key {key}, which a model of this kind needs")
        return value


class _FastGGUFReader(gguf.GGUFReader):
    """gguf's reader, with arrays in the metadata kept as where they lie in the file (an
    _ArrayField, decoded when asked for) and its parse slicing a plain ndarray view of its
    memory map (a numpy.memmap slice costs far more than a plain one: its __array_finalize__).
    gguf parses an array into numpy views, one or two per element, each holding the views
    it was cut from: opening a file with a large vocabulary (SmolLM2's: 49,152 tokens, their
    types, 48,900 merges) held tens of MB of resident memory for as long as it was open, and
    took most of a second; kept as they lie, they cost next to nothing until read. Everything else (scalars, strings, the tensors, which stay memory-mapped) is
    gguf's own parse."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(int(count)):
            key_length, key = self._get_str(offs)
            value_offset = offs + int(key_length.nbytes + key.nbytes)
            value_type = GGUFValueType(int(self._get(value_offset, np.uint32)[0]))
            item_type = (GGUFValueType(int(self._get(value_offset + 4, np.uint32)[0]))
                         if value_type == GGUFValueType.ARRAY else None)
            if item_type is None or item_type == GGUFValueType.ARRAY:  # arrays of arrays: gguf's parse
                offs = super()._build_fields(offs, 1)
                continue
            field = _ArrayField(offs, str(bytes(key), encoding="utf-8"), [value_type, item_type], self.data,
                                value_offset + 4 + 4 + 8, int(self._get(value_offset + 8, np.uint64)[0]),
                                self._struct_order())
            self._push_field(field, skip_sum=True)
            offs = field.end
        return offs

    def _struct_order(self) -> str:
        host_little = sys.byteorder == "little"
        return "<" if host_little == (self.byte_order == "I") else ">"


class _ArrayField:
    """One array of scalars or strings in a GGUF file's metadata: where it lies, decoded by
    contents() (what ReaderField.contents() returns for it: a list)."""

    def __init__(self, offset: int, name: str, types: list[GGUFValueType], data: np.ndarray, start: int,
                 count: int, order: str) -> None:
        self.offset, self.name, self.types = offset, name, types
        self._data, self._start, self._count, self._order = data, start, count, order
        if types[1] == GGUFValueType.STRING:
            self.end = self._walk_strings(lambda position, length: None)
        else:
            self._dtype = np.dtype(gguf.GGUFReader.gguf_scalar_to_np[types[1]]).newbyteorder(order)
            self.end = start + self._dtype.itemsize * count
        if self.end > len(data):
            raise ValueError(f"{name}: its {count} items run past the end of the file")

    def contents(self) -> list:
        if self.types[1] != GGUFValueType.STRING:
            return self._data[self._start:self.end].view(self._dtype).tolist()
        values: list[str] = []
        self._walk_strings(lambda position, length: values.append(
            str(self._data[position:position + length].tobytes(), encoding="utf-8")))
        return values

    def _walk_strings(self, visit) -> int:
        """Calls visit(position, length) for each string's bytes; returns where the array ends.
        struct raises on a length read past the end of the file."""
        length_format, data = f"{self._order}Q", self._data
        position = self._start
        for _ in range(self._count):
            (length,) = struct.unpack_from(length_format, data, position)
            visit(position + 8, length)
            position += 8 + length
        return position
