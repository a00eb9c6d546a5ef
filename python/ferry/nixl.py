"""NIXL's Python agent (``nixl._api``) on Ferry: ``nixl_agent`` and
``nixl_agent_config`` with the calls serving stacks make (vLLM's
NixlConnector, Dynamo), the same arguments, return values and transfer
states ("DONE", "PROC", "ERR").

    from ferry.nixl import nixl_agent, nixl_agent_config   # was: from nixl._api import ...

or, with no edit to the stack, ``ferry.nixl.install()`` (or
FERRY_NIXL_ALIAS=1 with the ``ferry-nixl.pth`` hook, see
``ferry.as_nixl``) makes ``nixl._api`` resolve to this module.

Under it is one ``ferry.Engine`` per agent. Prepared descriptor lists whose
descriptors are equal blocks at a fixed stride (a KV cache's blocks, layer
by layer) become Ferry block layouts, so ``make_prepped_xfer`` with index
arrays is one ``submit_*_blocks`` per pair of layouts touched, the indices
handed to the native module as arrays; other lists move as address arrays.
Either way no Python code runs per block. docs/python.md ("vLLM's
NixlConnector on Ferry") lists what maps to what and every difference.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import nixl_metadata
from ._engine import Engine, FerryError, Layout, Segment, Transfer
from .nixl_descs import (  # noqa: F401  (re-exported as NIXL's names)
    BLK_SEG,
    DRAM_SEG,
    FILE_SEG,
    MEM_TYPES,
    OBJ_SEG,
    VRAM_SEG,
    Runs,
    find_runs,
    is_torch_tensor,
    nixl_mem_t,
    nixlRegDList,
    nixlXferDList,
    tensor_row,
)

logger = logging.getLogger("ferry.nixl")

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"

#: NIXL backends whose job Ferry's transports do (selection stays Ferry's).
_NETWORK_BACKENDS = ("UCX", "UCX_MO", "LIBFABRIC", "GPUNETIO", "UCCL", "Mooncake", "MOONCAKE")
#: NIXL backends Ferry has no counterpart for (storage).
_STORAGE_BACKENDS = ("GDS", "GDS_MT", "POSIX", "OBJ", "AZURE_BLOB", "INFINIA", "GUSLI", "HF3FS")

#: Notification names on Ferry's wire: a NIXL message, a metadata push.
_NOTIF = "nixl:"
_MD_PUSH = "nixl-md:"

#: Most runs a prepared list may have and still become block layouts.
_MAX_LAYOUTS = 4096


class nixlError(Exception):
    """Base of the errors below (NIXL's are plain Exceptions too)."""


class nixlBackendError(nixlError): pass  # noqa: E701
class nixlInvalidParamError(nixlError): pass  # noqa: E701
class nixlNotFoundError(nixlError): pass  # noqa: E701
class nixlNotAllowedError(nixlError): pass  # noqa: E701
class nixlNotSupportedError(nixlError): pass  # noqa: E701
class nixlMismatchError(nixlError): pass  # noqa: E701
class nixlRepostActiveError(nixlError): pass  # noqa: E701
class nixlNotPostedError(nixlError): pass  # noqa: E701
class nixlUnknownError(nixlError): pass  # noqa: E701
class nixlNoTelemetryError(nixlError): pass  # noqa: E701


class nixlXferTelemetry:
    """NIXL's per-request telemetry (``get_xfer_telemetry`` with
    ``capture_telemetry=True``, as vLLM's NixlConnector makes its agent):
    times in microseconds (``startTime`` since the epoch), the bytes and
    descriptors of the request's last posting. Ferry's own figures:
    ``get_engine().metrics()``."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime, self.postDuration, self.xferDuration = startTime, postDuration, xferDuration
        self.totalBytes, self.descCount = totalBytes, descCount


def _raise(exc_type, what: str, cause: Optional[BaseException] = None):
    logger.error("%s", what)
    if cause is not None:
        raise exc_type(what) from cause
    raise exc_type(what)


def _from_ferry(e: FerryError, what: str):
    kind = {
        "NOT_FOUND": nixlNotFoundError,
        "INVALID_ARGUMENT": nixlInvalidParamError,
        "UNSUPPORTED": nixlNotSupportedError,
        "PERMISSION": nixlNotAllowedError,
    }.get(getattr(e, "name", ""), nixlBackendError)
    _raise(kind, f"{what}: {e}", e)


def _name(agent) -> str:
    """An agent name given as str or bytes (add_remote_agent returns bytes)."""
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


def _as_bytes(msg) -> bytes:
    return msg if isinstance(msg, bytes) else bytes(msg) if isinstance(msg, (bytearray, memoryview)) else str(msg).encode()


class nixl_thread_sync_t(int):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_agent_config:
    """NIXL's agent configuration. ``backends`` names NIXL backends: network
    ones (UCX, LIBFABRIC, ...) are all Ferry's transports, chosen per peer;
    storage ones (GDS, POSIX, OBJ, ...) are not supported. With
    ``enable_listen_thread`` the engine's control listener takes
    ``listen_port`` (peers then fetch this agent's metadata from
    ``host:listen_port``). Threads and sync modes are Ferry's own."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list = ["UCX"],  # noqa: B006 (NIXL's signature)
        sync_mode=None,
    ):
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixl_prepped_dlist_handle:
    """A prepared descriptor list; ``release()`` frees it (and its layouts)."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent, value: int):
        self._handle, self._agent, self._released = int(value), agent, False

    def release(self):
        if not self._released:
            self._released = True
            self._agent._release_dlist(self._handle)

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"


class nixl_xfer_handle:
    """A transfer request; post it with ``transfer()``, as often as wanted."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent, value: int):
        self._handle, self._agent, self._released = int(value), agent, False

    def release(self):
        if not self._released:
            self._agent._release_xfer(self._handle)
            self._released = True

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"


@dataclass
class _Prepped:
    """A prepared list: its rows, the peer (None: local) and, when its
    runs are block layouts, for each run its layout id and first block."""

    rows: np.ndarray
    mem_type: nixl_mem_t
    agent: Optional[str]
    runs: Optional[Runs] = None
    layout_ids: Optional[np.ndarray] = None
    first_blocks: Optional[np.ndarray] = None
    owned_layouts: List[int] = field(default_factory=list)

    def blocks(self, idx: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(layout id, block index) of each descriptor index, vectorized."""
        r = np.searchsorted(self.runs.starts, idx, side="right") - 1
        return self.layout_ids[r], idx - self.runs.starts[r] + self.first_blocks[r]


@dataclass
class _Xfer:
    """A transfer request: what to submit each time it is posted."""

    op: str
    agent: str
    notif: bytes
    #: [(local layout, local ids, remote layout, remote ids)], or None
    groups: Optional[list]
    #: (local addresses, remote addresses, lengths) when not by layouts
    addrs: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]
    running: List[Transfer] = field(default_factory=list)
    state: str = "INIT"  # INIT, PROC, DONE, ERR
    notif_due: bool = False
    #: telemetry: bytes and descriptors, start (epoch us), post and transfer durations (us)
    nbytes: int = 0
    ndescs: int = 0
    times: Tuple[int, int, int] = (0, 0, 0)


class nixl_agent:
    """NIXL's agent on a Ferry engine. ``agent_name`` is the name peers see
    (in notifications, ``add_remote_agent``'s result) and, with a metadata
    store (FERRY_METADATA=etcd://...), the engine's segment name there."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False):
        conf = nixl_conf or nixl_agent_config()
        self.name = agent_name
        self._etcd = bool(os.environ.get("FERRY_METADATA", "").strip())
        options = {}
        if self._etcd:
            options["name"] = agent_name
        if conf.enable_listen:
            host = os.environ.get("FERRY_LISTEN", "127.0.0.1:0").rsplit(":", 1)[0]
            options["listen"] = f"{host}:{int(conf.port)}"
        try:
            self._engine = Engine(**options)
        except FerryError as e:
            _from_ferry(e, "nixl_agent: the Ferry engine did not start")
        self._token = nixl_metadata.cluster_token()
        self._telemetry = bool(conf.capture_telemetry)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._remotes: Dict[str, Segment] = {}
        self._dlists: Dict[int, _Prepped] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._regs: Dict[Tuple[int, int], object] = {}
        self._inbox: Dict[str, List[bytes]] = {}
        self.notifs: Dict[str, List[bytes]] = {}
        self._leaked_xfer_handles: list = []
        names = list(self.plugin_list) if instantiate_all else list(conf.backends or [])
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        storage = [b for b in names if b in _STORAGE_BACKENDS]
        unknown = [b for b in names if b not in _NETWORK_BACKENDS and b not in _STORAGE_BACKENDS]
        for b in names:
            if b in _NETWORK_BACKENDS:
                self.create_backend(b)
        logger.info(
            "ferry.nixl agent %r: NIXL backends %s are served by Ferry's transports %s, chosen per "
            "peer%s%s", agent_name, [b for b in names if b in _NETWORK_BACKENDS], self._engine.transports,
            f"; storage backends {storage} are not supported and ignored" if storage else "",
            f"; unknown backends {unknown} ignored" if unknown else "",
        )

    plugin_list = ["UCX"]

    # -- backends (all of them Ferry's engine) ---------------------------

    def get_plugin_list(self) -> list:
        return list(self.plugin_list)

    def create_backend(self, backend: str, initParams: dict = {}):  # noqa: B006
        if backend in _STORAGE_BACKENDS:
            _raise(nixlNotSupportedError, f"backend {backend}: Ferry moves memory, not storage (GDS, files, objects)")
        self.backends[backend] = id(self._engine)
        self.backend_mems[backend] = ["DRAM", "VRAM"]
        self.backend_options[backend] = {}

    def get_plugin_mem_types(self, backend: str) -> list:
        return ["DRAM", "VRAM"] if backend in _NETWORK_BACKENDS else []

    def get_plugin_params(self, backend: str) -> dict:
        return {}

    def get_backend_mem_types(self, backend: str) -> list:
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend: str) -> dict:
        return self.backend_options.get(backend, {})

    def _check_backends(self, backends) -> None:
        for b in backends or []:
            if b not in self.backends:
                raise KeyError(b)  # NIXL: self.backends[name]

    # -- descriptor lists ------------------------------------------------

    def get_reg_descs(self, descs, mem_type: Optional[str] = None):
        """A registration list from 4-tuples (with ``mem_type``), an N x 3
        array (with ``mem_type``), a tensor or a list of tensors; None (and
        an error logged) for anything else, as NIXL."""
        return self._descs(descs, mem_type, nixlRegDList, 4)

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None):
        """A transfer list from 3-tuples or an N x 3 array (with
        ``mem_type``), a tensor or a list of tensors."""
        return self._descs(descs, mem_type, nixlXferDList, 3)

    def _descs(self, descs, mem_type, kind, width):
        if isinstance(descs, kind):
            return descs
        other = nixlXferDList if kind is nixlRegDList else nixlRegDList
        if isinstance(descs, other) and type(descs) is not kind:
            logger.error("%s type detected, please use %s", other.__name__, kind.__name__)
            return None
        if is_torch_tensor(descs):
            row = tensor_row(descs)
            if row is None:
                logger.error("Please use a list of contiguous Tensors")
                return None
            mem, r = row
            return kind(mem, [r + ("",)] if width == 4 else [r])
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
                return None
            return kind(MEM_TYPES[mem_type], descs)
        if len(descs) and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if len(descs[0]) != width:
                logger.error("%d-tuple list needed for %s", width, "registration" if width == 4 else "transfer")
                return None
            return kind(MEM_TYPES[mem_type], descs)
        if len(descs) and is_torch_tensor(descs[0]):
            rows = []
            for t in descs:
                if t.device != descs[0].device:
                    return None
                row = tensor_row(t)
                if row is None:
                    logger.error("Please use a list of contiguous Tensors")
                    return None
                rows.append(row[1])
            return kind(tensor_row(descs[0])[0], np.array(rows, dtype=np.uint64).reshape(-1, 3))
        return None

    # -- memory ------------------------------------------------------------

    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends: list = []):  # noqa: B006
        """Registers every region with the engine (DRAM: host memory; VRAM:
        ``cuda:<device id>``). Returns the registration list."""
        self._check_backends(backends)
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            _raise(nixlInvalidParamError, "register_memory: no descriptors (see the error above)")
        if descs.getType() not in (DRAM_SEG, VRAM_SEG):
            _raise(nixlNotSupportedError, f"register_memory: {descs.getType().name} is storage; Ferry registers DRAM and VRAM")
        done = []
        try:
            for addr, length, dev in descs.rows().tolist():
                key = (int(addr), int(length))
                if key in self._regs:
                    continue
                loc = f"cuda:{dev}" if descs.getType() == VRAM_SEG else None
                self._regs[key] = self._engine.register(int(addr), int(length), location=loc)
                done.append(key)
        except FerryError as e:
            for key in done:
                self._regs.pop(key).unregister()
            _from_ferry(e, "register_memory")
        return descs

    def deregister_memory(self, dereg_list, backends: list = []):  # noqa: B006
        self._check_backends(backends)
        for addr, length, _dev in dereg_list.rows().tolist():
            reg = self._regs.pop((int(addr), int(length)), None)
            if reg is None:
                _raise(nixlNotFoundError, f"deregister_memory: {int(addr):#x}+{int(length)} is not registered")
            reg.unregister()

    # -- metadata ------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """Ferry's blob (``ferry.nixl_metadata``): name, segment, proof."""
        segment = self.name if self._etcd else self._engine.segment_name
        return nixl_metadata.build(self.name, segment, self._token)

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool = False, backends: list = []) -> bytes:  # noqa: B006
        """The whole blob: registrations travel in the segment descriptor."""
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Checks the blob's proof, opens the agent's segment (Ferry's
        authenticated handshake) and returns the agent's name, as bytes
        (as NIXL's binding does; every call taking an agent name takes
        bytes or str)."""
        try:
            agent, segment = nixl_metadata.parse(metadata, self._token)
        except nixl_metadata.MetadataError as e:
            _raise(nixlMismatchError, f"add_remote_agent: {e}", e)
        self._open_remote(agent, segment)
        return agent.encode()

    def _open_remote(self, agent: str, segment: str) -> None:
        old = self._remotes.get(agent)
        if old is not None and old.name == segment:
            return
        try:
            seg = self._engine.open(segment)
        except FerryError as e:
            _from_ferry(e, f"add_remote_agent: agent {agent!r} (segment {segment!r}) cannot be reached")
        with self._lock:
            self._remotes[agent] = seg

    def remove_remote_agent(self, agent: str):
        agent = _name(agent)
        with self._lock:
            seg = self._remotes.pop(agent, None)
        if seg is None:
            _raise(nixlNotFoundError, f"remove_remote_agent: {agent!r} is not a known agent")
        seg.close()

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """With a metadata store the engine has published its segment
        already; to a peer (``ip_addr``), the blob goes as a notification to
        its listener (an agent with ``enable_listen_thread``)."""
        if not ip_addr:
            if not self._etcd:
                _raise(nixlInvalidParamError, "send_local_metadata: no metadata store (set FERRY_METADATA=etcd://host:port) and no peer address")
            return
        self._push_metadata(ip_addr, port)

    def send_partial_agent_metadata(self, descs, inc_conn_info: bool = False, backends: list = [], ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""):  # noqa: B006
        self.send_local_metadata(ip_addr, port)

    def _push_metadata(self, ip_addr: str, port: int) -> None:
        try:
            seg = self._engine.open(f"{ip_addr}:{int(port)}")
            try:
                seg.notify(_MD_PUSH + self.name, self.get_agent_metadata())
            finally:
                seg.close()
        except FerryError as e:
            _from_ferry(e, f"send_local_metadata to {ip_addr}:{port}")

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""):
        """Opens the agent's segment: by its name in the metadata store, or
        at ``ip_addr:port`` (its listener). ``check_remote_metadata`` then
        reads True."""
        segment = f"{ip_addr}:{int(port)}" if ip_addr else remote_agent
        if not ip_addr and not self._etcd:
            _raise(nixlInvalidParamError, "fetch_remote_metadata: no metadata store (FERRY_METADATA=etcd://...) and no peer address")
        try:
            self._open_remote(remote_agent, segment)
        except nixlError:
            pass  # NIXL's fetch is asynchronous: check_remote_metadata says False

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        logger.info("ferry.nixl: invalidate_local_metadata: peers see this agent until it closes")

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        self._poll_notifs()
        return _name(agent) in self._remotes

    # -- prepared lists and transfers ---------------------------------------

    def prep_xfer_dlist(self, agent_name: str, xfer_list, mem_type: Optional[str] = None, backends: list = []):  # noqa: B006
        self._check_backends(backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            xfer_list = _expand_strided(xfer_list, mem_type)
            mem_type = mem_type or "DRAM"
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            _raise(nixlInvalidParamError, "prep_xfer_dlist: no descriptors (see the error above)")
        agent_name = _name(agent_name)
        local = agent_name in (NIXL_INIT_AGENT, "")
        p = _Prepped(descs.rows(), descs.getType(), None if local else agent_name)
        if local:
            self._layouts_local(p)
        else:
            self._layouts_remote(p, self._segment(agent_name, "prep_xfer_dlist"))
        h = next(self._ids)
        with self._lock:
            self._dlists[h] = p
        return nixl_prepped_dlist_handle(self, h)

    def _layouts_local(self, p: _Prepped) -> None:
        runs = find_runs(p.rows, max(1, min(_MAX_LAYOUTS, len(p.rows) // 4)))
        if runs is None:
            return
        ids = []
        try:
            for base, size, stride, count in zip(runs.bases.tolist(), runs.block_sizes.tolist(), runs.strides.tolist(), runs.counts.tolist()):
                ids.append(self._engine.register_layout(int(base), int(size), int(count), stride=int(stride)).id)
        except FerryError as e:  # memory not registered, say: move by addresses
            logger.debug("ferry.nixl: prepared list stays addresses (%s)", e)
            for lid in ids:
                self._engine.unregister_layout(lid)
            return
        p.runs, p.owned_layouts = runs, ids
        p.layout_ids = np.array(ids, dtype=np.int64)
        p.first_blocks = np.zeros(len(ids), dtype=np.int64)

    def _layouts_remote(self, p: _Prepped, seg: Segment) -> None:
        runs = find_runs(p.rows, _MAX_LAYOUTS)
        if runs is None:
            return
        found = self._match(runs, seg.layouts)
        if found is None:
            seg.refresh()  # the peer may have prepared its lists since we opened it
            found = self._match(runs, seg.layouts)
        if found is not None:
            p.runs, (p.layout_ids, p.first_blocks) = runs, found

    @staticmethod
    def _match(runs: Runs, layouts: List[Layout]):
        """Each run's (layout, first block) among the peer's layouts, or None."""
        by_shape: Dict[Tuple[int, int], List[Layout]] = {}
        for lay in layouts:
            by_shape.setdefault((lay.block_size, lay.stride), []).append(lay)
        ids, firsts = [], []
        for base, size, stride, count in zip(runs.bases.tolist(), runs.block_sizes.tolist(), runs.strides.tolist(), runs.counts.tolist()):
            cands = by_shape.get((size, stride), []) if count > 1 else [x for x in layouts if x.block_size == size]
            hit = None
            for lay in cands:
                off = base - lay.base
                if off >= 0 and off % lay.stride == 0 and off // lay.stride + count <= lay.count:
                    hit = (lay.id, off // lay.stride)
                    break
            if hit is None:
                return None
            ids.append(hit[0])
            firsts.append(hit[1])
        return np.array(ids, dtype=np.int64), np.array(firsts, dtype=np.int64)

    def _segment(self, agent, what: str) -> Segment:
        agent = _name(agent)
        seg = self._remotes.get(agent)
        if seg is None and agent == self.name:  # loopback
            self._open_remote(agent, self.name if self._etcd else self._engine.segment_name)
            seg = self._remotes[agent]
        if seg is None:
            self._poll_notifs()
            seg = self._remotes.get(agent)
        if seg is None:
            _raise(nixlNotFoundError, f"{what}: no metadata for agent {agent!r} (add_remote_agent first)")
        return seg

    def make_prepped_xfer(self, operation: str, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          notif_msg: bytes = b"", backends: list = [], skip_desc_merge: bool = False):  # noqa: B006
        op = self._op(operation)
        self._check_backends(backends)
        lp, rp = self._dlist(local_xfer_side), self._dlist(remote_xfer_side)
        if lp.agent is not None or rp.agent is None:
            _raise(nixlInvalidParamError, "make_prepped_xfer: invalid sides (local must be local, remote must be remote)")
        li = np.ascontiguousarray(local_indices, dtype=np.int64).ravel()
        ri = np.ascontiguousarray(remote_indices, dtype=np.int64).ravel()
        if len(li) != len(ri):
            _raise(nixlInvalidParamError, f"make_prepped_xfer: {len(li)} local indices but {len(ri)} remote ones")
        for idx, p, side in ((li, lp, "local"), (ri, rp, "remote")):
            if len(idx) and (idx.min() < 0 or idx.max() >= len(p.rows)):
                _raise(nixlInvalidParamError, f"make_prepped_xfer: a {side} index is outside the {len(p.rows)} prepared descriptors")
        lens = lp.rows[li, 1]
        if not np.array_equal(lens, rp.rows[ri, 1]):
            _raise(nixlInvalidParamError, "make_prepped_xfer: local and remote descriptors differ in length")
        x = _Xfer(op, rp.agent, _as_bytes(notif_msg), None, None, nbytes=int(lens.sum()), ndescs=len(li))
        if lp.runs is not None and rp.runs is not None:
            x.groups = _group(*lp.blocks(li), *rp.blocks(ri))
        else:
            x.addrs = (lp.rows[li, 0], rp.rows[ri, 0], np.ascontiguousarray(lens))
        return self._new_xfer(x)

    def initialize_xfer(self, operation: str, local_descs, remote_descs, remote_agent: str, notif_msg: bytes = b"", backends: list = []):  # noqa: B006
        op = self._op(operation)
        self._check_backends(backends)
        self._segment(remote_agent, "initialize_xfer")
        lr, rr = local_descs.rows(), remote_descs.rows()
        if len(lr) != len(rr) or not np.array_equal(lr[:, 1], rr[:, 1]):
            _raise(nixlInvalidParamError, "initialize_xfer: the lists differ in count or lengths")
        x = _Xfer(op, _name(remote_agent), _as_bytes(notif_msg), None, (lr[:, 0].copy(), rr[:, 0].copy(), lr[:, 1].copy()),
                  nbytes=int(lr[:, 1].sum()), ndescs=len(lr))
        return self._new_xfer(x)

    def _new_xfer(self, x: _Xfer):
        h = next(self._ids)
        with self._lock:
            self._xfers[h] = x
        return nixl_xfer_handle(self, h)

    @staticmethod
    def _op(operation: str) -> str:
        if operation not in ("WRITE", "READ"):
            raise KeyError(operation)  # NIXL: self.nixl_ops[operation]
        return operation.lower()

    def _dlist(self, h) -> _Prepped:
        p = self._dlists.get(getattr(h, "_handle", -1))
        if p is None or getattr(h, "_released", False):
            _raise(nixlInvalidParamError, f"{h!r} is not a prepared list of this agent")
        return p

    def _xfer(self, h) -> _Xfer:
        x = self._xfers.get(getattr(h, "_handle", -1))
        if x is None or getattr(h, "_released", False):
            _raise(nixlInvalidParamError, f"{h!r} is not a transfer of this agent")
        return x

    def transfer(self, handle, notif_msg: bytes = b"") -> str:
        """Submits the request (one native call per pair of layouts, or one
        for the addresses) and returns "PROC" (or "DONE"/"ERR")."""
        x = self._xfer(handle)
        self._update(x)
        if x.state == "PROC":
            _raise(nixlRepostActiveError, "transfer: this request is still in flight")
        if notif_msg:
            x.notif = _as_bytes(notif_msg)
        seg = self._segment(x.agent, "transfer")
        x.running, x.notif_due = [], bool(x.notif)
        t0 = time.monotonic_ns()
        try:
            if x.groups is not None:
                submit = seg.submit_write_blocks if x.op == "write" else seg.submit_read_blocks
                x.running = [submit(lid, lids, rid, rids) for lid, lids, rid, rids in x.groups]
            elif len(x.addrs[0]):
                batch = self._engine._native.submit(x.op, seg.id, *x.addrs, None, True)
                x.running = [Transfer(seg, batch, [])]
        except FerryError as e:
            logger.error("ferry.nixl: transfer to %r: %s", x.agent, e)
            x.state = "ERR"
            return "ERR"
        x.times = (time.time_ns() // 1000, (time.monotonic_ns() - t0) // 1000, t0)
        x.state = "PROC"
        return self._update(x)

    def _update(self, x: _Xfer) -> str:
        if x.state != "PROC":
            return x.state
        for t in x.running:
            if not t.done():
                return "PROC"
        errors = [t.status().error for t in x.running if t.status().error is not None]
        if errors:
            logger.error("ferry.nixl: transfer to %r failed: %s", x.agent, errors[0])
            x.state = "ERR"
            return "ERR"
        if x.notif_due:  # after the data, as NIXL's notifications are
            x.notif_due = False
            try:
                self._segment(x.agent, "notification").notify(_NOTIF + self.name, x.notif)
            except (FerryError, nixlError) as e:
                logger.error("ferry.nixl: notification to %r: %s", x.agent, e)
                x.state = "ERR"
                return "ERR"
        start, post, t0 = x.times
        x.times = (start, post, (time.monotonic_ns() - t0) // 1000)  # t0 -> the transfer's duration
        x.state = "DONE"
        return "DONE"

    def check_xfer_state(self, handle) -> str:
        return self._update(self._xfer(handle))

    def get_xfer_telemetry(self, handle) -> nixlXferTelemetry:
        """The request's last posting: with ``capture_telemetry`` only, as
        NIXL (else nixlNoTelemetryError). Durations are wall time seen by
        this agent: the submission, and post to the DONE it observed."""
        x = self._xfer(handle)
        if not self._telemetry:
            raise nixlNoTelemetryError("telemetry capture is off (nixl_agent_config(capture_telemetry=True) turns it on)")
        start, post, xfer = x.times if x.state == "DONE" else (*x.times[:2], 0)
        return nixlXferTelemetry(start, post, xfer, x.nbytes, x.ndescs)

    def release_xfer_handle(self, handle):
        handle.release()

    def _release_xfer(self, h: int) -> None:
        x = self._xfers.get(h)
        if x is None:
            return
        # Ferry cannot cancel a request in flight: its memory must outlive
        # it, so the release waits for it (NIXL would abort it).
        for t in x.running:
            try:
                t.wait()
            except FerryError:
                pass
        with self._lock:
            self._xfers.pop(h, None)

    def release_dlist_handle(self, handle):
        handle.release()

    def _release_dlist(self, h: int) -> None:
        with self._lock:
            p = self._dlists.pop(h, None)
        if p is not None and not self._engine.closed:
            for lid in p.owned_layouts:
                self._engine.unregister_layout(lid)

    # -- notifications ----------------------------------------------------------

    def _poll_notifs(self) -> None:
        for _peer, name, msg in self._engine.take_notifies():
            if name.startswith(_MD_PUSH):
                try:
                    agent, segment = nixl_metadata.parse(msg, self._token)
                    self._open_remote(agent, segment)
                except (nixl_metadata.MetadataError, nixlError) as e:
                    logger.error("ferry.nixl: metadata pushed by %r refused: %s", name[len(_MD_PUSH):], e)
                continue
            agent = name[len(_NOTIF):] if name.startswith(_NOTIF) else name
            self._inbox.setdefault(agent, []).append(bytes(msg))

    def _take_inbox(self) -> Dict[str, List[bytes]]:
        self._poll_notifs()
        out, self._inbox = self._inbox, {}
        return out

    def get_new_notifs(self, backends: list = []) -> Dict[str, List[bytes]]:  # noqa: B006
        self._check_backends(backends)
        return self._take_inbox()

    def update_notifs(self, backends: list = []) -> Dict[str, List[bytes]]:  # noqa: B006
        self._check_backends(backends)
        for agent, msgs in self._take_inbox().items():
            self.notifs.setdefault(agent, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: list = [], tag_is_prefix=True) -> bool:  # noqa: B006
        self.update_notifs(backends)
        for msg in self.notifs.get(remote_agent_name, []):
            if (tag_is_prefix and msg.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in msg):
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None):
        if backend is not None:
            self._check_backends([backend])
        seg = self._segment(remote_agent_name, "send_notif")
        try:
            seg.notify(_NOTIF + self.name, _as_bytes(notif_msg))
        except FerryError as e:
            _from_ferry(e, f"send_notif to {remote_agent_name!r}")

    # -- Ferry's extras ---------------------------------------------------------

    def get_engine(self) -> Engine:
        """The ``ferry.Engine`` under this agent."""
        return self._engine

    def close(self) -> None:
        self._engine.close()


def _expand_strided(arr: np.ndarray, mem_type) -> np.ndarray:
    """NIXL's N x 5 (address, len, device, stride, count) as N x 3 rows."""
    if mem_type is None:
        raise ValueError("Please specify a mem type for strided descriptors")
    a = arr.astype(np.uint64)
    counts = a[:, 4].astype(np.int64)
    rep = np.repeat(np.arange(len(a)), counts)
    k = np.arange(int(counts.sum()), dtype=np.uint64) - np.repeat(np.cumsum(counts) - counts, counts).astype(np.uint64)
    return np.stack([a[rep, 0] + k * a[rep, 3], a[rep, 1], a[rep, 2]], axis=1)


def _group(llay: np.ndarray, lblk: np.ndarray, rlay: np.ndarray, rblk: np.ndarray) -> list:
    """Requests grouped by (local layout, remote layout): one native call
    per group, the blocks of each as int64 arrays (order within kept)."""
    if len(llay) == 0:
        return []
    # Most postings are one pair of layouts: no sort at all. Otherwise one
    # int64 key a pair from the dense ranks of each side, not
    # np.unique(axis=0), which sorts rows as records (8 ms for 16,384).
    if llay.min() == llay.max() and rlay.min() == rlay.max():
        return [(int(llay[0]), np.ascontiguousarray(lblk), int(rlay[0]), np.ascontiguousarray(rblk))]
    lrank = np.unique(llay, return_inverse=True)[1].ravel()
    rrank = np.unique(rlay, return_inverse=True)[1].ravel()
    key = lrank * (int(rrank.max()) + 1) + rrank
    order = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    return [
        (int(llay[g[0]]), np.ascontiguousarray(lblk[g]), int(rlay[g[0]]), np.ascontiguousarray(rblk[g]))
        for g in np.split(order, cuts)
    ]


# -- the alias: nixl._api -> ferry.nixl, on request only ----------------------

_ALIASES = ("nixl", "nixl_rocm")


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``nixl``, ``nixl._api`` and ``nixl._bindings`` (and
    ``nixl_rocm``'s) to this module."""

    def find_spec(self, fullname, path=None, target=None):
        top, _, sub = fullname.partition(".")
        if top in _ALIASES and sub in ("", "_api", "_bindings"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=not sub)
        return None

    def create_module(self, spec):
        if "." in spec.name:
            return sys.modules[__name__]
        import types

        pkg = types.ModuleType(spec.name, "ferry.nixl standing in for NIXL (ferry.nixl.install)")
        pkg.__path__ = []
        return pkg

    def exec_module(self, module):
        if "." not in module.__name__:
            me = sys.modules[__name__]
            for n in ("nixl_agent", "nixl_agent_config", "nixl_prepped_dlist_handle", "nixl_xfer_handle"):
                setattr(module, n, getattr(me, n))
            module._api = module._bindings = me
            module.__ferry__ = True


def _real_nixl_installed(name: str) -> bool:
    finder = [f for f in sys.meta_path if not isinstance(f, _AliasFinder)]
    for f in finder:
        try:
            spec = f.find_spec(name, None)
        except Exception:  # a finder that cannot answer does not count
            continue
        # A bare directory named nixl on sys.path (a namespace package) is not NIXL.
        if spec is not None and spec.origin not in (None, "namespace"):
            return True
    return False


def install(force: bool = False) -> bool:
    """Makes ``import nixl._api`` (and ``nixl_rocm._api``) give this module,
    in this process. A real NIXL installed (or imported) is left alone,
    with one warning, unless ``force``: returns whether the alias is in."""
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return True
    for name in _ALIASES:
        if not force and (name in sys.modules or _real_nixl_installed(name)):
            logger.warning(
                "ferry.nixl.install: a real %s is installed here; it is left as it is (pass force=True "
                "or FERRY_NIXL_ALIAS=force to run it on Ferry anyway)", name,
            )
            return False
    sys.meta_path.insert(0, _AliasFinder())
    return True
