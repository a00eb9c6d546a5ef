"""A drop-in for Mooncake's Python ``TransferEngine``: the methods serving
stacks (SGLang, vLLM, ...) call, with the same arguments in the same order
and the same return conventions: 0 on success and a negative code on
failure (Ferry's error code, see ``ferry.error_codes()``), batch ids that
are never 0, 0 for a failed allocation. Switching is an import change::

    from ferry import TransferEngine   # was: from mooncake.engine import TransferEngine

The differences are listed in docs/python.md. In short: ``protocol`` is a
preference the engine honours when that transport can serve a peer (else it
picks one that can, instead of failing); ``device_name`` filters NICs; a
target serves only memory it registered; an engine other hosts can reach
needs FERRY_AUTH_TOKEN. Notifications (``TransferNotify``, ``get_notifies``)
work as in Mooncake, on every transport. The message of the last failure is
in ``last_error`` and is logged to the "ferry" logger.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import logging
import itertools
import operator
import sys
import threading
from typing import Dict, List, Optional

from . import _buffers
from ._engine import Engine, FerryError, Status, _error
from .lib import _ferry

log = logging.getLogger("ferry")

_CODES = {name: code for code, name in _ferry.error_codes()}

#: Ids of batches that failed before anything moved start here, far above
#: the engine's own (counted from 1), and below 2**64-1 (LMCache's
#: INVALID_BATCH_ID).
_FAILED_BATCH_IDS = 1 << 62


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode: ``TransferOpcode.Read``/``.Write``, also reachable
    as ``TransferEngine.TransferOpcode`` and as the module's ``Read`` and
    ``Write`` (as Mooncake exports them). ``READ``/``WRITE`` are aliases."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A short message a transfer carries to its target, as in Mooncake: the
    target's ``get_notifies()`` returns it once all of the transfer's data
    is in its memory (never before). ``name`` is at most 256 bytes and
    ``msg`` at most 4096 (UTF-8); ``msg`` may also be bytes."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def _wire(self):
        msg = self.msg if isinstance(self.msg, (bytes, bytearray)) else str(self.msg).encode()
        return (str(self.name), bytes(msg))

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)


def _split_host_port(local_hostname: str):
    """("host", port or 0) from "host", "host:port", "[v6]:port" or "v6"."""
    text = local_hostname.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""  # a bare name, or an IPv6 address without a port
    if port and not port.isdigit():
        raise ValueError(f"local_hostname {local_hostname!r}: the port must be a number")
    return host, int(port or 0)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    """0.0.0.0 or :: (LMCache's ``listen_url=0.0.0.0:port``): every
    interface, which no peer can dial."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _listen_address(host: str, port: int) -> str:
    """Where to listen for peers that will dial ``host``: that address when
    it is one, loopback for "localhost", every interface for a name or a
    wildcard."""
    if host in ("localhost", ""):
        return f"127.0.0.1:{port}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"0.0.0.0:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _advertised(host: str) -> Optional[str]:
    """The host part of this engine's segment name: the host given, never a
    wildcard (None then: the engine advertises the source address of its
    route out, which peers on other hosts can dial)."""
    if not host:
        return "127.0.0.1"
    return None if _is_wildcard(host) else host


def _no_token_error(local_hostname: str) -> FerryError:
    """The first message a SGLang or vLLM deployment meets: one line saying
    what to set and why (Mooncake has no authentication; Ferry does)."""
    return _error(
        "PERMISSION",
        f"local_hostname {local_hostname.strip()!r} is reachable from other hosts, and Ferry lets "
        "no one reach registered memory without the cluster's secret: set FERRY_AUTH_TOKEN "
        "(or FERRY_AUTH_TOKEN_FILE) to the same secret in every process, or FERRY_AUTH=off "
        "on a trusted network",
    )


def _location(location) -> Optional[str]:
    """Mooncake's ``location`` argument: "*" (or "") means "find it"."""
    text = (location or "").strip()
    return None if text in ("", "*") else text


class TransferEngine:
    """Mooncake's ``TransferEngine`` on Ferry. Create, ``initialize``, then
    register memory and transfer by segment name ("host:rpc_port" with
    P2PHANDSHAKE, the peer's local_hostname with etcd)."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._engine: Optional[Engine] = None
        self._segments: Dict[str, int] = {}
        self._managed: Dict[int, object] = {}
        self._registered: Dict[int, _buffers.Resolved] = {}
        self._lock = threading.Lock()
        #: The message of the last failure (Ferry's words), or None.
        self.last_error: Optional[str] = None
        #: Why initialize() failed, for the calls that need a started engine.
        self._init_error: Optional[str] = None
        #: Batches that failed before anything moved: id -> the error. Their
        #: status reads -1, as Mooncake's batches that fail do.
        self._failed: Dict[int, FerryError] = {}
        self._failed_ids = itertools.count(_FAILED_BATCH_IDS)

    # -- errors ---------------------------------------------------------

    def _fail(self, e: BaseException, what: str) -> int:
        if isinstance(e, FerryError):
            code = getattr(e, "code", _CODES["INTERNAL"])
        elif isinstance(e, (ValueError, TypeError, OverflowError, BufferError)):
            code = _CODES["INVALID_ARGUMENT"]
        else:
            raise e
        self.last_error = f"{what}: {e}"
        log.error("%s", self.last_error)
        return int(code) if int(code) < 0 else -1

    def _fail_loudly(self, e: BaseException, what: str) -> int:
        """``_fail`` for a failure that stops a deployment (the engine did
        not start): also one line on stderr at error level, whatever the
        logging setup, where an operator looks first. Once: the "ferry"
        logger gets it only when a handler is configured (else Python's
        last-resort handler would print it a second time)."""
        if isinstance(e, FerryError):
            code = getattr(e, "code", _CODES["INTERNAL"])
        elif isinstance(e, (ValueError, TypeError, OverflowError, BufferError)):
            code = _CODES["INVALID_ARGUMENT"]
        else:
            raise e
        self.last_error = f"{what}: {e}"
        if log.hasHandlers():
            log.error("%s", self.last_error)
        print(f"ferry: ERROR: {self.last_error}", file=sys.stderr, flush=True)
        return int(code) if int(code) < 0 else -1

    def _not_started(self, what: str) -> FerryError:
        """The error of a call that needs a started engine, with the reason
        initialize() failed when it did."""
        if self._init_error is not None:
            return _error(
                "INVALID_ARGUMENT",
                f"the engine did not start (initialize failed: {self._init_error})",
            )
        return _error("INVALID_ARGUMENT", "the engine is not initialized: call initialize() first")

    def _native(self):
        if self._engine is None:
            raise self._not_started("")
        return self._engine._native

    # -- initialization ---------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Starts the engine. ``metadata_server``: "P2PHANDSHAKE" (a segment
        is named "host:rpc_port"), or etcd as "etcd://host:port" or
        "host:port" (a segment is named by its ``local_hostname``).
        ``protocol``: the transport preferred ("tcp", "rdma", ...).
        ``device_name``: comma-separated NICs to use ("" = all)."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str) -> int:
        try:
            if self._engine is not None:
                raise _error("INVALID_ARGUMENT", "initialize() was already called on this engine")
            host, port = _split_host_port(local_hostname)
            server = (metadata_server or "").strip()
            kind = (metadata_type or "").strip().lower()
            options = dict(listen=_listen_address(host, port))
            advertised = _advertised(host)
            if advertised is not None:
                options["hostname"] = advertised
            if server.upper() == "P2PHANDSHAKE" or kind == "p2p":
                pass
            elif server.startswith("etcd://") or (kind in ("", "etcd") and server and "://" not in server):
                options["metadata"] = server if server.startswith("etcd://") else f"etcd://{server}"
                options["name"] = local_hostname.strip()
            elif not server:
                raise _error("INVALID_ARGUMENT", "metadata_server is empty: pass \"P2PHANDSHAKE\" or an etcd address")
            else:
                raise _error(
                    "UNSUPPORTED",
                    f"metadata server {server!r} ({kind or 'by its scheme'}): Ferry finds segments "
                    "peer to peer (P2PHANDSHAKE) or through etcd (etcd://host:port)",
                )
            if device_name and device_name.strip():
                options["nics"] = device_name.strip()
            try:
                self._engine = Engine(prefer=(protocol or "").strip() or None, **options)
            except FerryError as e:
                if getattr(e, "name", None) == "PERMISSION" and not _is_loopback(host):
                    raise _no_token_error(local_hostname) from e
                raise
            self._init_error = None
            return 0
        except BaseException as e:
            rc = self._fail_loudly(e, "initialize")
            if self._engine is None:
                self._init_error = str(e)
            return rc

    def get_rpc_port(self) -> int:
        """The port of this engine's control listener: with P2PHANDSHAKE,
        peers name this engine "<local_hostname>:<rpc port>". An int, as
        Mooncake's: a negative code when the engine did not start, with
        the reason initialize() failed on stderr and in ``last_error`` (a
        caller that ignored initialize's result, as SGLang's R-fork does,
        would otherwise build the name "IP:-1" and fail later, elsewhere)."""
        try:
            return self._native().control_port()
        except BaseException as e:
            return self._fail_loudly(e, "get_rpc_port")

    def get_engine(self) -> Engine:
        """The underlying ``ferry.Engine`` (Ferry's own API)."""
        self._native()
        return self._engine

    def metrics(self) -> dict:
        """Ferry's extension: the engine's metrics (``ferry.Engine.metrics``)."""
        return self.get_engine().metrics()

    def get_session_id(self) -> str:
        """This engine's segment name, as peers open it ("host:port" with
        P2PHANDSHAKE: never a wildcard). Raises FerryError, with the reason
        initialize() failed, when the engine did not start (there is no
        name to return)."""
        try:
            return self._native().segment_name()
        except BaseException as e:
            self._fail_loudly(e, "get_session_id")
            raise

    def close(self) -> None:
        """Stops the engine (Mooncake stops it when the object goes)."""
        if self._engine is not None:
            self._engine.close()

    # -- memory -----------------------------------------------------------

    def register_memory(self, buffer_addr, capacity: int, location: str = "*") -> int:
        """Registers ``[buffer_addr, buffer_addr + capacity)``; host memory or
        GPU memory. ``location`` ("cpu:0", "cuda:1"; "*" or "": let the
        engine find it, asking the device plugin) says where it is."""
        try:
            addr = _buffers.address_of(buffer_addr)
            m = _buffers.resolve(buffer_addr, capacity, writable=True) if addr is None else None
            addr = m.addr if m is not None else addr
            where = _location(location) or (m.location if m else None)
            self._native().register_memory(addr, operator.index(capacity), where)
            if m is not None:
                with self._lock:
                    self._registered[addr] = m
            return 0
        except BaseException as e:
            return self._fail(e, "register_memory")

    def unregister_memory(self, buffer_addr) -> int:
        try:
            addr = _buffers.address_of(buffer_addr)
            addr = _buffers.resolve(buffer_addr).addr if addr is None else addr
            self._native().unregister_memory(int(addr))
            with self._lock:
                m = self._registered.pop(int(addr), None)
            if m is not None:
                m.release()
            return 0
        except BaseException as e:
            return self._fail(e, "unregister_memory")

    def batch_register_memory(self, buffer_addresses: List[int], capacities: List[int], location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            return self._fail(ValueError(f"{len(buffer_addresses)} addresses but {len(capacities)} capacities"), "batch_register_memory")
        for addr, cap in zip(buffer_addresses, capacities):
            rc = self.register_memory(addr, cap, location)
            if rc != 0:
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: List[int]) -> int:
        result = 0
        for addr in buffer_addresses:
            rc = self.unregister_memory(addr)
            result = result or rc
        return result

    def allocate_managed_buffer(self, length: int) -> int:
        """Host memory the engine allocates and registers; its address, or 0."""
        try:
            self._native()
            a = self._engine.allocate(int(length))
            with self._lock:
                self._managed[a.addr] = a
            return a.addr
        except BaseException as e:
            self._fail(e, "allocate_managed_buffer")
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        try:
            with self._lock:
                a = self._managed.pop(int(buffer_addr), None)
            if a is None:
                raise _error("NOT_FOUND", f"{int(buffer_addr):#x} was not returned by allocate_managed_buffer")
            a.free()
            return 0
        except BaseException as e:
            return self._fail(e, "free_managed_buffer")

    def write_bytes_to_buffer(self, dest_address: int, src_ptr, length: int) -> int:
        """Copies ``length`` bytes of ``src_ptr`` (bytes, or a str as UTF-8,
        as Mooncake takes it) to host memory at ``dest_address``. Unlike
        Mooncake, a ``length`` past the end of ``src_ptr`` is refused
        instead of copying whatever follows it."""
        try:
            data = src_ptr.encode("utf-8") if isinstance(src_ptr, str) else bytes(src_ptr)
            if length < 0 or length > len(data):
                raise ValueError(f"length {length} is outside the {len(data)} bytes given")
            ctypes.memmove(int(dest_address), data, int(length))
            return 0
        except BaseException as e:
            return self._fail(e, "write_bytes_to_buffer")

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of host memory at ``source_address``."""
        return ctypes.string_at(int(source_address), int(length))

    # -- segments ---------------------------------------------------------

    def _segment(self, name: str) -> int:
        seg = self._segments.get(name)
        if seg is None:
            seg = self._native().open_segment(name)
            with self._lock:
                self._segments[name] = seg
        return seg

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first buffer the peer registered, or 0."""
        try:
            first = self._native().first_buffer(self._segment(segment_name))
            return first[0] if first else 0
        except BaseException as e:
            self._fail(e, "get_first_buffer_address")
            return 0

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers (its descriptor is re-read), else a code."""
        try:
            self._native().refresh_segment(self._segment(peer_server_name))
            return 0
        except BaseException as e:
            with self._lock:
                self._segments.pop(peer_server_name, None)
            return self._fail(e, "send_probe")

    def get_notifies(self) -> list:
        """The notifications peers sent since the last call, oldest first, as
        ``TransferNotify`` (taking them empties the queue, as Mooncake's). At
        most 1024 wait: past that a sender's new one is refused and its
        transfer fails with BUSY (counted in ``notifies_dropped()``)."""
        try:
            return [
                TransferNotify(name, msg.decode("utf-8", errors="replace"))
                for _peer, name, msg in self._native().take_notifies()
            ]
        except BaseException as e:
            self._fail(e, "get_notifies")
            return []

    def notifies_dropped(self) -> int:
        """Notifications refused because the queue was full (Ferry only)."""
        return self._native().notifies_dropped()

    # -- transfers --------------------------------------------------------

    @staticmethod
    def _as_list(values) -> list:
        """A list of ints from a list, tuple or array of integers."""
        if isinstance(values, (list, tuple)):
            return [operator.index(v) for v in values]
        return _ferry.int_list(values)

    @staticmethod
    def _objects(op: str, buffers, peers, lengths):
        """The slow path, for local buffers given as objects (a list holding
        a bytearray, a tensor...): each item is an address when it is an
        integer (``_buffers.address_of``), else memory to resolve. Returns
        (local addresses, remote addresses, lengths, what keeps the objects
        exported meanwhile)."""
        lengths = TransferEngine._as_list(lengths)
        if len(buffers) != len(peers) or len(buffers) != len(lengths):
            raise ValueError(
                f"{len(buffers)} local buffers, {len(peers)} peer addresses and {len(lengths)} "
                "lengths: one of each per request"
            )
        local, keep = [], []
        for b, n in zip(buffers, lengths):
            addr = _buffers.address_of(b)
            if addr is None:
                m = _buffers.resolve(b, n, writable=op == "read")
                keep.append(m)
                addr = m.addr
            local.append(addr)
        return local, peers, lengths, keep

    def _call(self, sync: bool, op: str, target: str, buffers, peers, lengths, *extra):
        """The native transfer (``sync``) or submit on these requests. Lists
        of ints and integer arrays go to it as they are (it converts and
        checks every number, with no Python loop); a list holding objects
        that are not integers (buffers) takes the slow path. Zero-length
        requests are dropped: Mooncake completes them at once, touching
        nothing (the peer is still opened, so an unknown one fails)."""
        method = self._native().transfer if sync else self._native().submit
        segment = self._segment(target)
        try:
            return method(op, segment, buffers, peers, lengths, *extra, drop_empty=True)
        except TypeError:
            if not isinstance(buffers, (list, tuple)):
                raise  # an array of addresses with the wrong items: said as it is
        local, peers, lengths, keep = self._objects(op, buffers, peers, lengths)
        try:
            return method(op, segment, local, peers, lengths, *extra, drop_empty=True)
        finally:
            if sync:  # a batch submitted keeps them until it ends (Mooncake's rule)
                for m in keep:
                    m.release()

    def _sync(self, op: str, target: str, buffers, peers, lengths, hint: str, notify=None) -> int:
        try:
            wire = notify._wire() if notify is not None else None
            self._call(True, op, target, buffers, peers, lengths, hint or None, wire)
            return 0
        except BaseException as e:
            return self._fail(e, f"{op} to {target}")

    def _async(self, op: str, target: str, buffers, peers, lengths, hint: str) -> int:
        # Like Mooncake, the caller keeps the memory alive until the batch ends.
        return self._call(False, op, target, buffers, peers, lengths, hint or None)

    @staticmethod
    def _op(opcode) -> str:
        return "read" if int(opcode) == TransferOpcode.Read else "write"

    def transfer_sync_write(self, target_hostname: str, buffer, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        return self._sync("write", target_hostname, [buffer], [peer_buffer_address], [length], transport_hint)

    def transfer_sync_read(self, target_hostname: str, buffer, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        return self._sync("read", target_hostname, [buffer], [peer_buffer_address], [length], transport_hint)

    def transfer_sync(self, target_hostname: str, buffer, peer_buffer_address: int, length: int, opcode, notify=None, transport_hint: str = "") -> int:
        return self._sync(self._op(opcode), target_hostname, [buffer], [peer_buffer_address], [length], transport_hint, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "") -> int:
        return self._sync("write", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "") -> int:
        return self._sync("read", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)

    def batch_transfer_sync(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], opcode, notify=None, transport_hint: str = "") -> int:
        return self._sync(self._op(opcode), target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, notify)

    def _submit(self, op: str, target: str, buffers, peers, lengths, hint: str) -> int:
        """Mooncake's asynchronous rule: 0 when nothing could be submitted
        for the reasons Mooncake returns 0 (the list lengths differ, the peer
        cannot be opened); any other failure before anything moves (an
        address outside the peer's memory, a known peer that died) gives a
        batch id whose status then reads -1, as Mooncake's do when they
        fail in flight. The reason is in ``last_error`` either way."""
        try:
            sizes = (len(buffers), len(peers), len(lengths))
            if len(set(sizes)) != 1:
                raise ValueError(
                    f"{sizes[0]} local buffers, {sizes[1]} peer addresses and {sizes[2]} lengths: "
                    "one of each per request"
                )
            self._segment(target)
        except BaseException as e:
            self._fail(e, f"{op} to {target}")
            return 0
        try:
            return self._async(op, target, buffers, peers, lengths, hint)
        except BaseException as e:
            self._fail(e, f"{op} to {target}")
            error = e if isinstance(e, FerryError) else _error("INVALID_ARGUMENT", str(e))
            with self._lock:
                batch = next(self._failed_ids)
                self._failed[batch] = error
            return batch

    def _take_failed(self, batch_id: int) -> Optional[FerryError]:
        with self._lock:
            return self._failed.pop(int(batch_id), None)

    def transfer_submit_write(self, target_hostname: str, buffer, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        """Starts a write; its batch id, or 0 (as ``batch_transfer_async_write``)."""
        return self._submit("write", target_hostname, [buffer], [peer_buffer_address], [length], transport_hint)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed, -2 timed out; a finished batch
        is freed (its id is then unknown)."""
        failed = self._take_failed(batch_id)
        if failed is not None:
            self._fail(failed, f"batch {batch_id}")
            return -1
        try:
            s = Status._from(self._native().batch_status(int(batch_id)))
            if not s.done:
                return 0
            self._native().free_batch(int(batch_id))
            if s.error is None:
                return 1
            self._fail(s.error, f"batch {batch_id}")
            return -2 if s.error.name == "TIMEOUT" else -1
        except BaseException as e:
            self._fail(e, "transfer_check_status")
            return -1

    def _batch_async(self, op: str, target: str, buffers, peers, lengths, hint: str) -> int:
        return self._submit(op, target, buffers, peers, lengths, hint)

    def batch_transfer_async_write(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "") -> int:
        """Starts a batch of writes; its id, or 0 when the lists' lengths
        differ or the peer cannot be opened (other failures: an id whose
        status reads -1, as Mooncake's)."""
        return self._batch_async("write", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)

    def batch_transfer_async_read(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "") -> int:
        """Starts a batch of reads; as ``batch_transfer_async_write``."""
        return self._batch_async("read", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)

    def batch_transfer_async(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], opcode, transport_hint: str = "") -> int:
        return self._batch_async(self._op(opcode), target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint)

    def get_batch_transfer_status(self, batch_ids: List[int]) -> int:
        """Waits for every batch (without the GIL) and frees them: 0 if all
        succeeded, -1 if any failed or did not finish in time."""
        result = 0
        for b in batch_ids:
            failed = self._take_failed(b)
            if failed is not None:
                self._fail(failed, f"batch {b}")
                result = -1
                continue
            try:
                s = Status._from(self._native().wait(int(b), None))
                if not s.done:
                    raise _error("TIMEOUT", f"batch {b}: {s.pending} of {s.total} requests still in flight")
                self._native().free_batch(int(b))
                if s.error is not None:
                    raise s.error
            except BaseException as e:
                self._fail(e, "get_batch_transfer_status")
                result = -1
        return result
