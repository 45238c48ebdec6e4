"""Python values as one uint8 tensor of JSON and raw tensor bytes, so that what ranks send each other (state dicts,
settings, reports, errors) is never unpickled: bytes from a peer can only ever become data.

The tensor holds 8 bytes (little-endian) giving the length L of a UTF-8 JSON header, the header, then the bytes of
every tensor of the value in the header's order. In the header, JSON's null, true, false, integers and strings
stand for themselves and a finite float for itself; every other value is an object with one tag:
``{"list": [...]}``, ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}`` (keys of any supported kind, order
kept), ``{"set": [...]}``, ``{"float": "nan" | "inf" | "-inf"}``, ``{"tensor": [dtype, shape]}`` (its bytes
follow the header), ``{"dtype": name}``, ``{"device": name}``, ``{"size": [...]}``, ``{"bytes": base64}``, and
``{"error": [type, message]}`` for an exception, which arrives as the class of that qualified name if the
receiving process has one that takes a message, else as a RuntimeError naming the type. A module's state dict
keeps its ``_metadata``. Anything else is refused with a TypeError naming its type, on the sender.

Tensors arrive on the CPU, contiguous, with their dtype and shape (not their ``requires_grad``).
"""

from __future__ import annotations

import base64
import builtins
import collections
import json
import math
from typing import Any

import numpy as np
import torch

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


def encode(value: Any) -> torch.Tensor:
    """`value` as a uint8 tensor (see the module doc for what it may hold).

    Raises:
        TypeError: `value` holds something other than the module doc's kinds, naming its type.
    """
    tensors: list[torch.Tensor] = []
    header = json.dumps(_to_json(value, tensors), allow_nan=False, separators=(",", ":")).encode()
    parts = [torch.tensor(list(len(header).to_bytes(8, "little")), dtype=torch.uint8)]
    parts.append(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    parts += [_raw_bytes(t) for t in tensors]
    return torch.cat(parts)


def decode(data: torch.Tensor) -> Any:
    """The value `encode` made `data` of.

    Raises:
        ValueError: `data` is not what `encode` makes (truncated, or an unknown tag or dtype).
    """
    raw = data.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    if len(raw) < 8:
        raise ValueError(f"wire_format.decode: {len(raw)} bytes, fewer than the header's length field")
    length = int.from_bytes(raw[:8], "little")
    if 8 + length > len(raw):
        raise ValueError(f"wire_format.decode: a header of {length} bytes in {len(raw)} bytes")
    reader = _TensorReader(raw, 8 + length)
    value = _from_json(json.loads(raw[8 : 8 + length].decode()), reader)
    if reader.offset != len(raw):
        raise ValueError(f"wire_format.decode: {len(raw) - reader.offset} bytes left after the value")
    return value


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _to_json(value: Any, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # (an IntEnum or a bool subclass becomes its number)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"float": repr(float(value))}
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError(f"wire_format: cannot send a {value.layout} tensor; send a dense one")
        tensors.append(value)
        return {"tensor": [str(value.dtype).removeprefix("torch."), list(value.shape)]}
    if isinstance(value, np.generic):
        return _to_json(value.item(), tensors)
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, (list, tuple, set, frozenset)):
        tag = "tuple" if isinstance(value, tuple) else "list" if isinstance(value, list) else "set"
        return {tag: [_to_json(v, tensors) for v in value]}
    if isinstance(value, dict):
        encoded: dict[str, Any] = {"dict": [[_to_json(k, tensors), _to_json(v, tensors)] for k, v in value.items()]}
        metadata = getattr(value, "_metadata", None)  # a module state dict's per-module versions
        if metadata is not None:
            encoded["metadata"] = _to_json(dict(metadata), tensors)
        return encoded
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, BaseException):
        return {"error": [f"{type(value).__module__}.{type(value).__qualname__}", str(value)]}
    raise TypeError(
        f"wire_format: cannot send a {type(value).__module__}.{type(value).__qualname__} between ranks (tensors, "
        "numbers, strings, bytes, lists, tuples, sets, dicts, dtypes, devices and exceptions only): convert it "
        "to those first"
    )


class _TensorReader:
    def __init__(self, raw: bytes, offset: int) -> None:
        self.raw, self.offset = raw, offset

    def take(self, dtype_name: str, shape: list[int]) -> torch.Tensor:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"wire_format.decode: a tensor of dtype {dtype_name!r} and shape {shape!r}")
        count = math.prod(shape)
        size = count * torch.empty(0, dtype=dtype).element_size()
        if self.offset + size > len(self.raw):
            raise ValueError("wire_format.decode: the tensors' bytes are truncated")
        chunk = bytearray(self.raw[self.offset : self.offset + size])
        self.offset += size
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(chunk, dtype=torch.uint8).view(dtype).reshape(shape)


def _from_json(value: Any, reader: _TensorReader) -> Any:
    if not isinstance(value, (dict, list)):
        return value
    if isinstance(value, list) or not value or len(value) > 2:
        raise ValueError(f"wire_format.decode: an untagged value {str(value)[:80]}")
    tag, body = next(iter(value.items()))
    if tag in ("list", "tuple", "set"):
        items = [_from_json(v, reader) for v in body]
        return items if tag == "list" else tuple(items) if tag == "tuple" else set(items)
    if tag == "dict":
        pairs = [(_from_json(k, reader), _from_json(v, reader)) for k, v in body]
        if "metadata" not in value:
            return dict(pairs)
        state = collections.OrderedDict(pairs)
        state._metadata = _from_json(value["metadata"], reader)  # type: ignore[attr-defined]
        return state
    if tag == "tensor":
        return reader.take(*body)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "size":
        return torch.Size(body)
    if tag == "dtype" and body in _DTYPES:
        return _DTYPES[body]
    if tag == "device":
        return torch.device(body)
    if tag == "bytes":
        return base64.b64decode(body)
    if tag == "error":
        return _exception(*body)
    raise ValueError(f"wire_format.decode: unknown tag {tag!r}")


def _exception(name: str, message: str) -> BaseException:
    """An exception of the class named `name` with `message`, if this process has such a class (imported already:
    nothing is imported or run but the class's constructor); else a RuntimeError naming the type."""
    module, _, qualname = name.rpartition(".")
    found = getattr(builtins, qualname, None) if module == "builtins" else _loaded_exception(module, qualname)
    if isinstance(found, type) and issubclass(found, BaseException):
        try:
            return found(message)
        except Exception:  # a constructor that wants more than a message
            pass
    return RuntimeError(f"{name}: {message}")


def _loaded_exception(module: str, qualname: str) -> type | None:
    import sys

    obj: Any = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None
