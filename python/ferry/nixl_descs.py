"""NIXL's descriptor lists for ``ferry.nixl``: registration lists
(address, length, device id, meta info) and transfer lists (address,
length, device id), each with a memory type, held as one N x 3 uint64
array so that a list of 100,000 blocks is indexed by numpy, never walked
in Python per transfer. Also the one-time analysis that finds, in a
prepared list, the runs of equal-sized blocks at a fixed stride that
become Ferry block layouts.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import List, Optional

import numpy as np


class nixl_mem_t(enum.IntEnum):
    """NIXL's memory types (``nixl._bindings.nixl_mem_t``)."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG

#: The names NIXL's agent takes for memory types ("cpu"/"cuda" deprecated there).
MEM_TYPES = {
    "DRAM": DRAM_SEG,
    "VRAM": VRAM_SEG,
    "FILE": FILE_SEG,
    "BLOCK": BLK_SEG,
    "OBJ": OBJ_SEG,
    "cpu": DRAM_SEG,
    "cuda": VRAM_SEG,
}


class _DList:
    """An N x 3 uint64 array (address, length, device id) and a memory type."""

    _width = 3

    def __init__(self, mem_type, descs=None):
        self._type = nixl_mem_t(int(mem_type))
        self._rows = _rows(descs, self._width)
        self._meta: List[bytes] = [b""] * len(self._rows)

    def descCount(self) -> int:
        return len(self._rows)

    def isEmpty(self) -> bool:
        return len(self._rows) == 0

    def getType(self) -> nixl_mem_t:
        return self._type

    def __getitem__(self, i):
        a, n, d = (int(x) for x in self._rows[i])
        return (a, n, d)

    def __len__(self) -> int:  # NIXL's lists have no len(); ours does, harmlessly
        return len(self._rows)

    def clear(self) -> None:
        self._rows = np.zeros((0, 3), dtype=np.uint64)
        self._meta = []

    def addDesc(self, desc) -> None:
        row = np.array([[int(desc[0]), int(desc[1]), int(desc[2])]], dtype=np.uint64)
        self._rows = np.concatenate([self._rows, row])
        self._meta.append(_meta_bytes(desc[3]) if len(desc) > 3 else b"")

    append = addDesc

    def remDesc(self, i: int) -> None:
        self._rows = np.delete(self._rows, int(i), axis=0)
        del self._meta[int(i)]

    def rows(self) -> np.ndarray:
        """The N x 3 uint64 array itself (address, length, device id)."""
        return self._rows

    def __repr__(self) -> str:
        return f"<ferry.nixl.{type(self).__name__} {self._type.name} x{len(self._rows)}>"


class nixlXferDList(_DList):
    """A transfer descriptor list: (address, length, device id) rows."""


class nixlRegDList(_DList):
    """A registration descriptor list: (address, length, device id, meta)."""

    _width = 4

    def __init__(self, mem_type, descs=None):
        super().__init__(mem_type, None)
        if descs is None:
            return
        if isinstance(descs, np.ndarray):
            self._rows = _rows(descs, 3)
            self._meta = [b""] * len(self._rows)
        else:
            descs = list(descs)
            self._rows = _rows([d[:3] for d in descs], 3)
            self._meta = [_meta_bytes(d[3]) if len(d) > 3 else b"" for d in descs]

    def __getitem__(self, i):
        a, n, d = super().__getitem__(i)
        return (a, n, d, self._meta[i])

    def trim(self) -> nixlXferDList:
        """The same rows as a transfer list (meta info dropped)."""
        out = nixlXferDList(self._type)
        out._rows = self._rows.copy()
        out._meta = [b""] * len(out._rows)
        return out


def _meta_bytes(m) -> bytes:
    return m if isinstance(m, bytes) else str(m).encode()


def _rows(descs, width: int) -> np.ndarray:
    if descs is None:
        return np.zeros((0, 3), dtype=np.uint64)
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise ValueError(f"descriptor arrays are N x 3 (address, length, device id), not {descs.shape}")
        return np.ascontiguousarray(descs, dtype=np.uint64)
    rows = [tuple(int(x) for x in d[:3]) for d in descs]
    if any(len(r) != 3 for r in rows):
        raise ValueError("each descriptor is (address, length, device id)")
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def is_torch_tensor(obj) -> bool:
    """True for a torch.Tensor when torch is already imported (as NIXL checks)."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    return isinstance(tensor, type) and isinstance(obj, tensor)


def tensor_row(t):
    """(mem type, (address, length, device id)) of a contiguous tensor, or
    None when it is not contiguous."""
    if not t.is_contiguous():
        return None
    dev = t.get_device()
    mem = DRAM_SEG if dev == -1 else VRAM_SEG
    return mem, (int(t.data_ptr()), int(t.numel()) * int(t.element_size()), 0 if dev == -1 else int(dev))


@dataclass(frozen=True)
class Runs:
    """A prepared list cut into runs of equal blocks at a fixed stride:
    run r covers descriptors ``starts[r] .. starts[r] + counts[r] - 1``."""

    starts: np.ndarray  # int64, ascending, starts[0] == 0
    counts: np.ndarray
    bases: np.ndarray
    block_sizes: np.ndarray
    strides: np.ndarray
    devices: np.ndarray


def find_runs(rows: np.ndarray, max_runs: int) -> Optional[Runs]:
    """The runs of ``rows`` (greedy, each as long as it can be), or None
    when there would be more than ``max_runs`` (then the list is moved as
    addresses). Done once per prepared list; each step checks a growing
    window with numpy, so a run of n blocks costs O(n) array work and
    O(log n) Python steps."""
    n = len(rows)
    if n == 0:
        return None
    addr = rows[:, 0].astype(np.int64)
    size = rows[:, 1]
    dev = rows[:, 2]
    starts, counts, strides = [], [], []
    i = 0
    while i < n:
        if len(starts) >= max_runs:
            return None
        end = i + 1
        stride = int(size[i])
        if i + 1 < n and size[i + 1] == size[i] and dev[i + 1] == dev[i]:
            s = int(addr[i + 1] - addr[i])
            if s >= int(size[i]) and s > 0:
                stride, end, w = s, i + 2, 64
                while end < n:
                    hi = min(n, i + w)
                    k = np.arange(end - i, hi - i, dtype=np.int64)
                    ok = (addr[end:hi] == addr[i] + s * k) & (size[end:hi] == size[i]) & (dev[end:hi] == dev[i])
                    if not ok.all():
                        end += int(np.argmin(ok))
                        break
                    end = hi
                    w *= 2
        starts.append(i)
        counts.append(end - i)
        strides.append(stride)
        i = end
    st = np.array(starts, dtype=np.int64)
    return Runs(
        starts=st,
        counts=np.array(counts, dtype=np.int64),
        bases=addr[st],
        block_sizes=size[st].astype(np.int64),
        strides=np.array(strides, dtype=np.int64),
        devices=dev[st].astype(np.int64),
    )
