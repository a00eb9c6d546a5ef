"""Ferry's own Python API: engines, registrations, segments and transfers,
with context managers and exceptions.

    with ferry.Engine() as engine, engine.register(buf):
        with engine.open(peer_name) as seg:
            seg.write(buf, seg.buffers[0].addr)

Every call that blocks (starting, registering, opening, waiting) releases
the GIL. Errors raise :class:`ferry.FerryError` with Ferry's code, name and
message.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from . import _buffers
from .lib import _ferry

FerryError = _ferry.FerryError

#: A local buffer: an address (with a length), a torch tensor, an object
#: with __cuda_array_interface__, one exporting the buffer protocol, or a
#: Registration / Allocation of this package.
Local = object


def _error(code_name: str, message: str) -> FerryError:
    codes = {name: code for code, name in _ferry.error_codes()}
    e = FerryError(f"{message} [{code_name}]")
    e.code, e.name, e.message = codes[code_name], code_name, message
    return e


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer a peer registered, as its segment descriptor says."""

    addr: int
    nbytes: int
    location: str


@dataclass(frozen=True)
class Layout:
    """A pool of equal blocks (a KV cache's blocks of one layer): ``count``
    blocks of ``block_size`` bytes, block i at ``base + i * stride``. A
    local one comes from :meth:`Engine.register_layout`; a peer's from
    :attr:`Segment.layouts`. Transfers name its blocks by index."""

    id: int
    base: int
    block_size: int
    stride: int
    count: int


@dataclass(frozen=True)
class Status:
    """A batch's progress; ``error`` is the first failure as a FerryError."""

    total: int
    completed: int
    failed: int
    pending: int
    error: Optional[FerryError]

    @property
    def done(self) -> bool:
        return self.pending == 0

    @classmethod
    def _from(cls, t) -> "Status":
        total, completed, failed, pending, first = t
        err = None
        if first is not None:
            index, code, name, message = first
            err = FerryError(f"request {index}: {message} [{name}]")
            err.code, err.name, err.message = code, name, f"request {index}: {message}"
        return cls(total, completed, failed, pending, err)


class Registration:
    """Memory registered with an engine; unregistered by ``unregister()``,
    at the end of a ``with`` block, or when the engine closes. Holds the
    object (and its exported buffer) so that it cannot be freed or moved
    while peers may write it."""

    def __init__(self, engine: "Engine", memory: _buffers.Resolved, location: Optional[str]):
        self._engine = engine
        self._memory = memory
        self.location = location
        self.registered = True

    @property
    def addr(self) -> int:
        return self._memory.addr

    @property
    def nbytes(self) -> int:
        return self._memory.nbytes

    def __ferry_memory__(self) -> _buffers.Resolved:
        return self._memory

    def unregister(self) -> None:
        if self.registered:
            self.registered = False
            self._engine._forget(self)
            try:
                if not self._engine.closed:
                    self._engine._native.unregister_memory(self.addr)
            finally:
                self._memory.release()

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()

    def __repr__(self) -> str:
        where = self.location or "host"
        return f"<ferry.Registration {self.nbytes} bytes at {self.addr:#x} ({where})>"


class Allocation(Registration):
    """Host memory the engine allocated and registered (same-host peers may
    map it). ``view()`` is a writable memoryview of it; freed by ``free()``,
    at the end of a ``with`` block, or with the engine."""

    def view(self) -> memoryview:
        if not self.registered:
            raise _error("INVALID_ARGUMENT", "this allocation was freed")
        return _buffers.host_view(self.addr, self.nbytes)

    def free(self) -> None:
        if self.registered:
            self.registered = False
            self._engine._forget(self)
            if not self._engine.closed:
                self._engine._native.free_memory(self.addr)

    unregister = free

    def __repr__(self) -> str:
        return f"<ferry.Allocation {self.nbytes} bytes at {self.addr:#x}>"


def _notify(notify):
    """(name, message bytes) for the native module, or None."""
    if notify is None:
        return None
    name, msg = notify
    if not isinstance(msg, (bytes, bytearray, memoryview)):
        msg = str(msg).encode()
    return (str(name), bytes(msg))


def _resolve(obj, length=None, *, writable=False) -> _buffers.Resolved:
    own = getattr(obj, "__ferry_memory__", None)
    if own is not None:
        return _buffers.resolve(own(), length, writable=writable)
    return _buffers.resolve(obj, length, writable=writable)


Item = Union[Tuple[Local, int], Tuple[Local, int, Optional[int]]]

#: Buffers of transfers dropped while still in flight (never released).
_ABANDONED: list = []


class Transfer:
    """A submitted batch. ``wait()`` blocks (without the GIL) until every
    request finished and raises the first failure; ``done()`` polls. Leaving
    a ``with`` block waits."""

    def __init__(self, segment: "Segment", batch: int, keep: List[_buffers.Resolved]):
        self._segment = segment
        self._native = segment._engine._native
        self._batch = batch
        self._keep = keep
        self._result: Optional[Status] = None

    def status(self) -> Status:
        if self._result is not None:
            return self._result
        return Status._from(self._native.batch_status(self._batch))

    def done(self) -> bool:
        if self._result is not None:
            return True
        s = self.status()
        if s.done:
            self._finish(s)
        return s.done

    def wait(self, timeout: Optional[float] = None) -> Status:
        """Waits up to ``timeout`` seconds (default: twice the engine's
        timeout). Raises FerryError on a failed request or at the deadline."""
        if self._result is None:
            s = Status._from(self._native.wait(self._batch, timeout))
            if not s.done:
                raise _error(
                    "TIMEOUT",
                    f"{s.pending} of {s.total} requests still in flight after the wait",
                )
            self._finish(s)
        if self._result.error is not None:
            raise self._result.error
        return self._result

    def _finish(self, s: Status) -> None:
        self._result = s
        try:
            self._native.free_batch(self._batch)
        except FerryError:
            pass
        for r in self._keep:
            r.release()
        self._keep = []

    def __del__(self):
        # The memory must outlive the requests: a transfer dropped unwaited
        # is waited for (the GIL released) before its buffers are let go.
        if getattr(self, "_result", True) is None:
            try:
                s = Status._from(self._native.wait(self._batch, None))
            except Exception:
                s = None
            if s is not None and s.done:
                self._finish(s)
            else:  # still in flight: its buffers stay exported for good
                _ABANDONED.extend(self._keep)

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.wait()
        else:
            try:
                self.wait()
            except FerryError:
                pass


class Segment:
    """A peer's memory, opened by name. Addresses are the peer's own (as it
    registered them; ``buffers`` lists them)."""

    def __init__(self, engine: "Engine", name: str, segment_id: int):
        self._engine = engine
        self.name = name
        self.id = segment_id

    @property
    def buffers(self) -> List[RemoteBuffer]:
        return [RemoteBuffer(*b) for b in self._engine._native.segment_buffers(self.id)]

    def refresh(self) -> None:
        """Re-reads the peer's buffers now (they are also re-read when a
        request falls outside the known ones)."""
        self._engine._native.refresh_segment(self.id)

    def route(self, local: Local, remote_addr: int, length: Optional[int] = None) -> Tuple[str, str]:
        """(transport, reason): what would carry this request, and why."""
        m = _resolve(local, length)
        return self._engine._native.route(self.id, m.addr, remote_addr, m.nbytes)

    def _requests(self, op: str, items: Iterable[Item]):
        writable = op == "read"
        keep, local, remote, lengths = [], [], [], []
        for item in items:
            obj, remote_addr = item[0], item[1]
            length = item[2] if len(item) > 2 else None
            m = _resolve(obj, length, writable=writable)
            keep.append(m)
            local.append(m.addr)
            remote.append(int(remote_addr))
            lengths.append(m.nbytes)
        return keep, local, remote, lengths

    def _transfer(self, op: str, items: Sequence[Item], transport: Optional[str], notify=None) -> None:
        keep, local, remote, lengths = self._requests(op, items)
        try:
            self._engine._native.transfer(op, self.id, local, remote, lengths, transport, _notify(notify))
        finally:
            for m in keep:
                m.release()

    def _submit(self, op: str, items: Sequence[Item], transport: Optional[str]) -> Transfer:
        keep, local, remote, lengths = self._requests(op, items)
        try:
            batch = self._engine._native.submit(op, self.id, local, remote, lengths, transport)
        except BaseException:
            for m in keep:
                m.release()
            raise
        return Transfer(self, batch, keep)

    @property
    def layouts(self) -> List[Layout]:
        """The block layouts the peer registered, as last fetched."""
        return [Layout(*t) for t in self._engine._native.segment_layouts(self.id)]

    @staticmethod
    def _layout_id(layout) -> int:
        return int(layout.id if isinstance(layout, Layout) else layout)

    def _blocks(self, op: str, local, local_ids, remote, remote_ids, transport, submit: bool):
        f = self._engine._native.submit_blocks if submit else self._engine._native.transfer_blocks
        return f(op, self.id, self._layout_id(local), local_ids, self._layout_id(remote), remote_ids, transport)

    def write_blocks(self, local_layout, local_ids, remote_layout, remote_ids, *, transport: Optional[str] = None) -> None:
        """Writes block ``local_ids[i]`` of ``local_layout`` to block
        ``remote_ids[i]`` of the peer's ``remote_layout``, and waits. The
        index lists are lists of ints or 1-D int64 arrays (numpy, CPU torch),
        read without a Python loop. An index out of range raises and moves
        nothing."""
        self._blocks("write", local_layout, local_ids, remote_layout, remote_ids, transport, False)

    def read_blocks(self, local_layout, local_ids, remote_layout, remote_ids, *, transport: Optional[str] = None) -> None:
        """Reads the peer's blocks into local ones (see ``write_blocks``)."""
        self._blocks("read", local_layout, local_ids, remote_layout, remote_ids, transport, False)

    def submit_write_blocks(self, local_layout, local_ids, remote_layout, remote_ids, *, transport: Optional[str] = None) -> Transfer:
        """Starts ``write_blocks``; returns at once. Request i of the
        transfer is block i. The layouts' memory must stay registered until
        it ends."""
        return Transfer(self, self._blocks("write", local_layout, local_ids, remote_layout, remote_ids, transport, True), [])

    def submit_read_blocks(self, local_layout, local_ids, remote_layout, remote_ids, *, transport: Optional[str] = None) -> Transfer:
        """Starts ``read_blocks``; returns at once."""
        return Transfer(self, self._blocks("read", local_layout, local_ids, remote_layout, remote_ids, transport, True), [])

    def write(self, src: Local, remote_addr: int, length: Optional[int] = None, *, transport: Optional[str] = None) -> None:
        """Copies ``src`` (registered local memory) to the peer at ``remote_addr``."""
        self._transfer("write", [(src, remote_addr, length)], transport)

    def read(self, dst: Local, remote_addr: int, length: Optional[int] = None, *, transport: Optional[str] = None) -> None:
        """Copies the peer's memory at ``remote_addr`` into ``dst`` (registered)."""
        self._transfer("read", [(dst, remote_addr, length)], transport)

    def write_batch(self, items: Sequence[Item], *, transport: Optional[str] = None, notify=None) -> None:
        """Writes many ``(src, remote_addr[, length])`` as one batch and waits.
        With ``notify=(name, msg)`` (str or bytes, at most 256 and 4096
        bytes) the peer's ``take_notifies()`` gets it once all of the batch's
        data is in its memory, never before; this returns once it has."""
        self._transfer("write", items, transport, notify)

    def notify(self, name: str, msg) -> None:
        """Sends a notification alone (see ``write_batch``) and waits until
        the peer has it."""
        n, m = _notify((name, msg))
        self._engine._native.send_notify(self.id, n, m)

    def read_batch(self, items: Sequence[Item], *, transport: Optional[str] = None) -> None:
        """Reads many ``(dst, remote_addr[, length])`` as one batch and waits."""
        self._transfer("read", items, transport)

    def submit_write(self, items: Sequence[Item], *, transport: Optional[str] = None) -> Transfer:
        """Starts a batch of writes; returns at once."""
        return self._submit("write", items, transport)

    def submit_read(self, items: Sequence[Item], *, transport: Optional[str] = None) -> Transfer:
        """Starts a batch of reads; returns at once."""
        return self._submit("read", items, transport)

    def close(self) -> None:
        if not self._engine.closed:
            self._engine._native.close_segment(self.id)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ferry.Segment {self.name!r}>"


_OPTION_NAMES = (
    "listen", "hostname", "metadata", "metadata_prefix", "name", "transports", "nics",
    "timeout_ms", "plugin_path", "auth_token",
)


class Engine:
    """A Ferry engine: a control listener peers find it by, the transports
    this host supports, and the memory registered with it.

    Options are the engine's settings (docs/configuration.md); FERRY_*
    variables apply first and these override them. A listener other hosts
    can reach needs ``auth_token`` (or FERRY_AUTH_TOKEN; docs/security.md). ``settings`` takes any
    other key, engine or plugin, e.g. ``{"gpu_direct": "off", "staging_depth": 8,
    "tcp.connections": 8}``. A value a key does not accept raises
    ``FerryError`` (``INVALID_ARGUMENT``) with the reason. ``prefer`` names a transport
    to use whenever it can serve a request (else the engine's choice).
    """

    def __init__(
        self,
        *,
        listen: Optional[str] = None,
        hostname: Optional[str] = None,
        metadata: Optional[str] = None,
        metadata_prefix: Optional[str] = None,
        name: Optional[str] = None,
        transports: Optional[str] = None,
        nics: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        plugin_path: Optional[str] = None,
        auth_token: Optional[str] = None,
        prefer: Optional[str] = None,
        settings: Optional[dict] = None,
    ):
        values = dict(
            listen=listen,
            hostname=hostname,
            metadata=metadata,
            metadata_prefix=metadata_prefix,
            name=name,
            transports=transports,
            nics=nics,
            timeout_ms=timeout_ms,
            plugin_path=plugin_path,
            auth_token=auth_token,
        )
        # metadata before metadata_prefix: the prefix needs a store.
        options = [(k, str(values[k])) for k in _OPTION_NAMES if values[k] is not None]
        options += [(str(k), str(v)) for k, v in (settings or {}).items()]
        self._native = _ferry.NativeEngine(options, prefer)
        self._lock = threading.Lock()
        self._owned: dict = {}

    @property
    def segment_name(self) -> str:
        """The name peers open this engine by."""
        return self._native.segment_name()

    @property
    def port(self) -> int:
        """The control listener's port (Mooncake's RPC port)."""
        return self._native.control_port()

    @property
    def transports(self) -> List[str]:
        return self._native.transports()

    @property
    def preferred_transport(self) -> Optional[str]:
        return self._native.preferred

    @property
    def closed(self) -> bool:
        return self._native.closed

    def metrics(self) -> dict:
        """What this engine moved, where, how fast, and what failed: flows
        (bytes and requests per transport, device, peer, op and memory,
        failures by error code), latency histograms, refused submits, route
        changes, registered memory, plugins' counters (docs/metrics.md)."""
        return json.loads(self._native.metrics_json())

    def register(self, obj: Local, length: Optional[int] = None, *, location: Optional[str] = None) -> Registration:
        """Registers ``obj``'s memory so it can be a local buffer and peers
        can read and write it. ``location`` ("cpu:N", "cuda:N") is found
        from the object or by the engine when not given."""
        m = _resolve(obj, length, writable=True)
        loc = location or m.location
        try:
            self._native.register_memory(m.addr, m.nbytes, loc)
        except BaseException:
            m.release()
            raise
        reg = Registration(self, m, loc)
        with self._lock:
            self._owned[id(reg)] = reg
        return reg

    def register_layout(self, memory, block_size: int, count: Optional[int] = None, *, stride: Optional[int] = None) -> Layout:
        """Registers a block layout over registered memory and publishes
        it: ``memory`` is a Registration, a registered object (tensor,
        array) or an address; blocks of ``block_size`` bytes every
        ``stride`` (default: ``block_size``), ``count`` of them (default:
        as many as fit). Peers then name its blocks by index."""
        if isinstance(memory, int):
            if count is None:
                raise TypeError("a layout at a raw address needs its count")
            base, nbytes = memory, None
        else:
            m = _resolve(memory)
            base, nbytes = m.addr, m.nbytes
            m.release()
        stride = int(stride or block_size)
        if count is None:
            count = (nbytes - int(block_size)) // stride + 1 if nbytes >= int(block_size) else 0
        lid = self._native.register_layout(int(base), int(block_size), stride, int(count))
        return Layout(lid, int(base), int(block_size), stride, int(count))

    def unregister_layout(self, layout) -> None:
        """Withdraws a layout (peers naming it are refused from then on)."""
        self._native.unregister_layout(int(layout.id if isinstance(layout, Layout) else layout))

    def allocate(self, nbytes: int, *, numa_node: Optional[int] = None) -> Allocation:
        """Allocates and registers ``nbytes`` of host memory."""
        addr = self._native.allocate_memory(int(nbytes), numa_node)
        a = Allocation(self, _buffers.Resolved(addr, int(nbytes), None), None)
        with self._lock:
            self._owned[id(a)] = a
        return a

    def _forget(self, reg: Registration) -> None:
        with self._lock:
            self._owned.pop(id(reg), None)

    def take_notifies(self) -> List[Tuple[str, str, bytes]]:
        """Notifications peers sent since the last call, oldest first, as
        (sender segment, name, message). At most 1024 wait; past that a new
        one is refused (its sender's transfer fails with BUSY) and counted in
        ``notifies_dropped``."""
        return [(p, n, bytes(m)) for p, n, m in self._native.take_notifies()]

    @property
    def notifies_dropped(self) -> int:
        return self._native.notifies_dropped()

    def open(self, name: str) -> Segment:
        """Opens a peer's segment by name ("host:port", or a name in etcd)."""
        return Segment(self, name, self._native.open_segment(name))

    def close(self) -> None:
        """Stops the engine; its registrations and allocations end with it."""
        with self._lock:
            owned = list(self._owned.values())
            self._owned.clear()
        self._native.close()
        for r in owned:
            r.registered = False
            r._memory.release()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<ferry.Engine (closed)>"
        return f"<ferry.Engine {self.segment_name!r} transports={self.transports}>"
