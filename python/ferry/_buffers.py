"""What memory a Python object is: its address, size and location.

Accepted, in this order:

- an integer: an ``int`` or any object with ``__index__`` (numpy integer
  scalars, 0-d integer arrays): an address; the length must be given.
  Integers are never taken as memory, even those that export a buffer (a
  numpy scalar does: its 8 bytes would be moved instead of the memory at
  the address);
- an object with ``data_ptr()`` (a torch tensor): ``data_ptr()``,
  ``numel() * element_size()``, and ``cuda:N`` from ``tensor.device``;
- an object with ``__cuda_array_interface__`` (CuPy, Numba, ...): the
  pointer and shape; the engine asks the device plugin which GPU it is on;
- an object exporting the buffer protocol (numpy, bytearray, mmap,
  memoryview, an engine allocation): held exported while in use, so it
  cannot be resized or freed under a transfer.

Only contiguous memory is accepted; a strided view is refused with the
reason, not silently copied.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Any, Optional

from .lib import _ferry


@dataclass
class Resolved:
    addr: int
    nbytes: int
    #: "cuda:N", or None for host memory and for memory the engine should
    #: classify itself.
    location: Optional[str]
    #: What keeps the memory alive and exported while Ferry may touch it.
    keep: Any = None

    def release(self) -> None:
        if isinstance(self.keep, _ferry.BufferView):
            self.keep.release()


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _from_tensor(obj) -> Resolved:
    if callable(getattr(obj, "is_contiguous", None)) and not obj.is_contiguous():
        raise ValueError(
            "the tensor is not contiguous: Ferry moves one contiguous range per "
            "request; pass tensor.contiguous() or one request per contiguous piece"
        )
    nbytes = int(obj.numel()) * int(obj.element_size())
    location = None
    device = getattr(obj, "device", None)
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        index = device.index
        if index is None:  # "cuda" means the current device
            import torch  # only reachable with torch tensors

            index = torch.cuda.current_device()
        location = f"cuda:{index}"
    return Resolved(int(obj.data_ptr()), nbytes, location, keep=obj)


def _from_cuda_array_interface(obj, cai: dict, writable: bool) -> Resolved:
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise ValueError("the array is read-only (__cuda_array_interface__ says so)")
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for d in reversed(shape):
            expected.append(step)
            step *= int(d)
        if tuple(int(s) for s in strides) != tuple(reversed(expected)) and _prod(shape) > 1:
            raise ValueError("the array is not C-contiguous (its strides say so)")
    # No device ordinal in the interface: the engine asks the device plugin.
    return Resolved(int(ptr or 0), _prod(shape) * itemsize, None, keep=obj)


def address_of(obj) -> Optional[int]:
    """``obj`` as an address when it is an integer (``int``, or an object
    whose ``__index__`` succeeds: numpy integer scalars, 0-d integer
    arrays), else None (memory to resolve). A bool is refused."""
    if type(obj) is int:
        return obj
    if isinstance(obj, bool):
        raise TypeError("expected an address or a buffer, not a bool")
    if isinstance(obj, int):
        return int(obj)
    if getattr(type(obj), "__index__", None) is None:
        return None
    try:
        return operator.index(obj)
    except TypeError:
        return None  # e.g. a float array, or one of several items: memory


def resolve(obj, length: Optional[int] = None, *, writable: bool = False) -> Resolved:
    """The memory behind ``obj``; ``length`` may shorten it (or gives the
    size of a raw address). ``writable`` refuses read-only memory."""
    addr = address_of(obj)
    if addr is not None:
        if length is None:
            raise TypeError("a raw address needs a length")
        if addr < 0:
            raise OverflowError(f"address {addr} is negative")
        return _check_length(Resolved(addr, int(length), None), length)
    if isinstance(obj, Resolved):
        return _check_length(obj, length)
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "element_size", None)):
        return _check_length(_from_tensor(obj), length)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _check_length(_from_cuda_array_interface(obj, cai, writable), length)
    try:
        view = _ferry.BufferView(obj, writable)
    except BufferError:
        raise
    except TypeError as e:
        raise TypeError(
            f"{type(obj).__name__} is not memory Ferry can move: pass an address and a "
            "length, a torch tensor, an object with __cuda_array_interface__, or one "
            "that exports the buffer protocol"
        ) from e
    return _check_length(Resolved(view.addr, view.nbytes, None, keep=view), length)


def _check_length(r: Resolved, length: Optional[int]) -> Resolved:
    if length is None:
        return r
    length = int(length)
    if length < 0 or length > r.nbytes:
        raise ValueError(f"length {length} is outside the object's {r.nbytes} bytes")
    return Resolved(r.addr, length, r.location, r.keep)


def host_view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of host memory at ``addr`` (an engine
    allocation), for numpy.frombuffer, slicing and copying."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
