"""One side of vLLM 0.34.0's real Mooncake transfer code, unedited, with
``mooncake.engine`` resolving to Ferry (the venv's ferry-as-mooncake .pth):
``MooncakeConnectorWorker`` (vllm.distributed.kv_transfer.kv_connector.v1
.mooncake.mooncake_connector) — ``register_kv_caches``, the decode side's
``_build_pull_metadata`` (the layout and block ids a pull carries), the
prefill side's ``_prepare_transfer_regions`` + ``_build_transfer_params``
(block ids to addresses) and ``_send_blocks`` (the write), and
``unregister_kv_caches`` / ``restore_kv_caches`` (sleep / wake-up) — plus
the encoder-cache connector's ``MooncakeTransfer``
(vllm.distributed.ec_transfer.ec_connector.mooncake.transfer: its own
engine start, ``register_memory``, ``acquire_sources``, ``write``,
``release_sources``, ``close``).

    python vllm_peer.py target          # prints {"session", "meta", "ec_session", "ec_dst"};
                                        # then one JSON request a line on stdin, one answer each
    python vllm_peer.py initiator INFO  # for each stdin line, one round of sends to INFO's
                                        # target; one JSON line of results each
    python vllm_peer.py init            # the worker's engine start only: {"ok"} or {"raised"}

How the objects are made (say so wherever a result is quoted):

- The worker is made without its constructor (``__new__`` plus the
  attributes the registration and send paths read, with the values its
  constructor gives them): the constructor needs a running VllmConfig,
  the CUDA device (``torch.accelerator``), attention backends and the
  tensor-parallel groups. Its engine start is the constructor's three
  lines (``TransferEngine()``, ``initialize(get_ip(), "P2PHANDSHAKE",
  "rdma", "")``, ``get_rpc_port()``), on vLLM's own ``get_ip()``.
- Both workers register as ``kv_consumer``: for a producer,
  ``register_kv_caches`` ends by starting the ZMQ side channel and
  registering with the prefill's HTTP bootstrap server, which needs a
  running scheduler. The pull request that side channel would carry is
  the decode worker's own ``_build_pull_metadata`` output, msgpack-encoded
  as vLLM sends it and decoded with vLLM's decoder on the prefill side.
- ``kv_cache_config`` is vLLM's own ``KVCacheConfig`` / ``KVCacheGroupSpec``
  / ``FullAttentionSpec``; ``transfer_topo`` is vLLM's ``TransferTopology``.
- The KV caches are ``HostTensor``s: the torch stub has no tensors, so
  each layer's cache is a numpy array (real host memory) behind the few
  tensor methods vLLM reads — ``data_ptr()``, ``untyped_storage()
  .data_ptr()/.nbytes()``, ``shape``, ``ndim``, ``stride(i)``,
  ``element_size()``, ``nbytes``, ``is_contiguous()``, ``dtype``,
  indexing (a view). The layout is vLLM's block-major one,
  ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` per layer
  (K and V of a block adjacent), which vLLM registers as packed rows.
"""

import asyncio
import json
import sys

import msgspec
import numpy as np
import torch
import zmq
import zmq.asyncio

import mooncake.engine
from mooncake.engine import TransferEngine
from vllm.distributed.ec_transfer.ec_connector.mooncake.transfer import MooncakeTransfer
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import MooncakeKVConnectorStats
from vllm.utils.network_utils import get_ip
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

LAYERS = 2
BLOCKS = 32
BLOCK_SIZE = 4  # tokens per block
HEADS, HEAD_SIZE = 2, 8  # float16: 2 * 4 * 2 * 8 * 2 = 256 bytes per block per layer
EC_BYTES = 4096
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class _Storage:
    def __init__(self, base):
        self._base = base

    def data_ptr(self):
        return self._base.ctypes.data

    def nbytes(self):
        return self._base.nbytes


class HostTensor:
    """A torch.Tensor stand-in over a numpy array: the methods vLLM's
    registration reads, with torch's meanings (strides in elements)."""

    dtype = torch.float16

    def __init__(self, array, base=None):
        self.a = array
        self._base = array if base is None else base

    def data_ptr(self):
        return self.a.ctypes.data

    def untyped_storage(self):
        return _Storage(self._base)

    @property
    def shape(self):
        return tuple(self.a.shape)

    @property
    def ndim(self):
        return self.a.ndim

    def dim(self):
        return self.a.ndim

    def stride(self, dim=None):
        s = tuple(x // self.a.itemsize for x in self.a.strides)
        return s if dim is None else s[dim]

    def element_size(self):
        return self.a.itemsize

    @property
    def nbytes(self):
        return self.a.nbytes

    def is_contiguous(self):
        return bool(self.a.flags.c_contiguous)

    def __getitem__(self, item):
        return HostTensor(self.a[item], self._base)


def caches(fill):
    shape = (BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE)
    out = {}
    for i, name in enumerate(NAMES):
        a = (np.random.default_rng(i).integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
             if fill else np.zeros(shape, np.float16))
        out[name] = HostTensor(a)
    return out


def worker(engine_id):
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(NAMES), kv_cache_spec=spec)])
    w = mc.MooncakeConnectorWorker.__new__(mc.MooncakeConnectorWorker)
    # The constructor's engine start.
    w.engine = TransferEngine()
    w.hostname = get_ip()
    if w.engine.initialize(w.hostname, "P2PHANDSHAKE", "rdma", "") != 0:
        raise RuntimeError("Mooncake Transfer Engine initialization failed.")
    w.rpc_port = w.engine.get_rpc_port()
    # What the constructor sets that these paths read.
    w.engine_id = engine_id
    w.is_kv_producer, w.is_kv_consumer = False, True
    w.tp_rank, w.tp_size, w.pp_size, w.pp_rank = 0, 1, 1, 0
    w.block_len_per_layer, w.kv_block_len_per_layer = [], []
    w.registered_layer_names, w.registered_layer_indices, w.registered_group_indices = [], [], []
    w.region_shared_groups, w.region_row_offsets = [], []
    w.opaque_packed_storages = set()
    w.seen_base_addresses, w._kv_data_lens, w._kv_unregistered = [], [], False
    w._prepared_transfer_regions = {}
    w._layout_by_peer = mc.OrderedDict()
    w._kv_layout_id = 0
    w._acked_layout_peers = set()
    w.kv_caches_base_addr, w.device_kv_caches = [], {}
    w.xfer_stats = MooncakeKVConnectorStats()
    # What shutdown() (run by __del__) tears down; the receiver loop is
    # made but not started (nothing pulls through it here).
    w.async_zmq_ctx = zmq.asyncio.Context()
    w.receiver_loop = asyncio.new_event_loop()
    w.block_size = BLOCK_SIZE
    w.kv_cache_config = cfg
    w.use_mla = False
    w._physical_blocks_per_logical_kv_block = 1
    w._layer_specs = {n: spec for n in NAMES}
    w.transfer_topo = TransferTopology(tp_rank=0, tp_size=1, block_size=BLOCK_SIZE, engine_id=engine_id,
                                       is_mla=False, is_mamba=False, total_num_kv_heads=HEADS,
                                       attn_backends=[])
    return w


# Target blocks the decode side asks for, and the prefill blocks that fill
# them: two runs and a single (vLLM coalesces runs into one descriptor).
DST_BLOCKS = [10, 11, 12, 13, 20, 21, 5]
SRC_BLOCKS = [3, 4, 5, 6, 17, 18, 30]


def target():
    w = worker("decode")
    kv = caches(fill=False)
    w.register_kv_caches(kv)
    ec = MooncakeTransfer(get_ip(), "rdma")
    ec_dst = HostTensor(np.zeros(EC_BYTES, np.uint8))
    assert ec.register_memory(ec_dst) == 0
    pull = {"req-1": mc.PullReqMeta(d_req_id="req-1", transfer_id="xfer-1", local_block_ids=[DST_BLOCKS],
                                    remote_engine_id="prefill", remote_bootstrap_addr="")}
    meta = w._build_pull_metadata(pull, include_layout=True)
    print(json.dumps({"session": f"{w.hostname}:{w.rpc_port}",
                      "meta": msgspec.msgpack.Encoder().encode(meta).hex(),
                      "ec_session": ec.local_session(), "ec_dst": ec_dst.data_ptr()}), flush=True)
    src = caches(fill=True)
    for line in sys.stdin:
        req = json.loads(line)
        if "check" in req:
            # [layer, dst_block, src_block]: the whole block, K and V.
            # Compared as bits (random float16 bits include NaNs).
            ok = [bool(np.array_equal(kv[NAMES[layer]].a[d].view(np.uint16),
                                      src[NAMES[layer]].a[s].view(np.uint16)))
                  for layer, d, s in req["check"]]
            # Blocks nobody asked for stay zero.
            untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
            ok.append(all(not kv[n].a[untouched].any() for n in NAMES))
            ec_ok = bool(np.array_equal(ec_dst.a, np.frombuffer(bytes(req["ec"]), np.uint8)))
            print(json.dumps({"ok": ok, "ec": ec_ok}), flush=True)
        elif "sleep" in req:
            # vLLM's sleep / wake-up: the worker unregisters its KV caches
            # and registers the same memory again.
            for _ in range(req["sleep"]):
                w.unregister_kv_caches()
                w.restore_kv_caches()
            for t in kv.values():
                t.a[:] = 0
            ec_dst.a[:] = 0
            print(json.dumps({"ok": True, "unregistered": w._kv_unregistered}), flush=True)
    ec.close()


def initiator(info):
    w = worker("prefill")
    kv = caches(fill=True)
    w.register_kv_caches(kv)
    meta = msgspec.msgpack.Decoder(mc.MooncakeXferMetadata).decode(bytes.fromhex(info["meta"]))
    ec = MooncakeTransfer(get_ip(), "rdma")
    for rnd, _ in enumerate(sys.stdin):
        local, remote, err = w._prepare_transfer_regions(meta)
        assert err is None, err
        send = mc.SendBlockMeta(p_req_id="req-1", transfer_id="xfer-1", local_block_ids=[SRC_BLOCKS],
                                ready=asyncio.Event())
        src, dst, lens, err_reqs, err_msg = asyncio.run(
            w._build_transfer_params([("req-1", send)], meta, local, remote))
        assert not err_reqs, err_msg
        ret = w._send_blocks(f"{meta.remote_hostname}:{meta.remote_port}", src, dst, lens)
        # An address past the target's caches: vLLM's failure path.
        bad = w._send_blocks(f"{meta.remote_hostname}:{meta.remote_port}", src[:1],
                             [dst[0] + (1 << 40)], lens[:1])
        # The encoder cache: a fresh source tensor, registered for the write only.
        payload = np.random.default_rng(1000 + rnd).integers(0, 256, EC_BYTES, dtype=np.uint8)
        t = HostTensor(payload)
        addrs = ec.acquire_sources([t])
        ec.write(info["ec_session"], addrs, [info["ec_dst"]], [t.nbytes])
        released = ec.release_sources(addrs)
        print(json.dumps({"send": ret, "out_of_range": bad, "descriptors": len(src),
                          "bytes": int(sum(lens)), "ec_released": released,
                          "ec": payload.tolist(),
                          "check": [[layer, d, s] for layer in range(LAYERS)
                                    for d, s in zip(DST_BLOCKS, SRC_BLOCKS)],
                          "stats": w.xfer_stats.data.get("num_failed_transfers", None)}), flush=True)
    ec.close()


def main():
    assert mooncake.engine.__name__ == "ferry.mooncake", mooncake.engine
    assert mc.TransferEngine is TransferEngine, mc.TransferEngine
    role = sys.argv[1]
    if role == "init":
        try:
            worker("init")
            print(json.dumps({"ok": True}), flush=True)
        except Exception as e:  # noqa: BLE001 - what vLLM raises is the result
            print(json.dumps({"raised": f"{type(e).__name__}: {e}"}), flush=True)
    elif role == "target":
        target()
    else:
        initiator(json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
