"""One side of vLLM 0.34.0's NixlConnector transfer code, unedited, on
``ferry.nixl``: ``ferry.nixl.install()`` runs before vLLM is imported, so
``vllm.distributed.nixl_utils`` loads ``nixl._api`` and gets Ferry's agent.

The prefill side (P, the producer) registers host-memory KV caches with
``NixlConnectorWorker.register_kv_caches`` and serves its handshake
payload with vLLM's own side-channel listener
(``NixlBaseConnectorScheduler._nixl_handshake_listener``, a static method,
on a ZMQ port). The decode side (D) registers its caches and runs
``start_load_kv`` with a request to pull: vLLM's background handshake
(``_nixl_handshake`` over ZMQ: compatibility hash, ``NixlAgentMetadata``
decode, ``add_remote_agent``, which prepares the peer's descriptors with
``prep_xfer_dlist``), then on the next ``start_load_kv`` the read
(``_read_blocks_for_req`` -> ``_read_blocks``: block ids to descriptor ids,
``make_prepped_xfer("READ", ...)`` with the notification, ``transfer``);
``get_finished`` polls ``check_xfer_state`` (and ``get_xfer_telemetry``)
until the request is done. D checks the bytes it received (the destination
of a READ). P's ``get_finished`` -> ``_get_new_notifs`` must report the
request as sent (the notification vLLM's read carries, ``req:1``).

    python vllm_nixl_peer.py prefill      # prints {"host", "port"}; answers one JSON line a request
    python vllm_nixl_peer.py decode INFO  # one JSON line of results a stdin line

How the objects are made (say so wherever a result is quoted):

- The workers are ``NixlConnectorWorker`` (vLLM's pull worker) made
  without its constructor: ``__new__`` plus the attributes the
  registration, handshake, read and completion paths read, with the values
  its constructor gives them for one TP rank, no MLA, no Mamba, full
  attention (``worker()`` below lists them). The constructor needs a
  running VllmConfig (a model's HF config), the tensor-parallel groups and
  the attention backends. Its agent is the constructor's:
  ``NixlWrapper(uuid4, nixl_agent_config(num_threads=4, capture_telemetry=True))``.
- ``current_platform.set_device`` is a no-op (see the comment below).
- ``vllm_config`` is a namespace with the fields the compatibility hash
  reads (model name, dtype, heads, head size, layers, cache dtype).
- ``kv_cache_config`` is vLLM's own ``KVCacheConfig`` / ``KVCacheGroupSpec``
  / ``FullAttentionSpec``.
- The caches are vllm_peer.HostTensor (numpy memory behind the tensor
  methods vLLM reads), in vLLM 0.34's per-layer layout
  ``(num_blocks, block_size, num_kv_heads, 2 * head_size)`` (LBNHC: K and V
  in the content dimension, a block one contiguous page).
"""

import json
import os
import sys
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import ferry.nixl

#: How vLLM gets Ferry's agent: "alias" (ferry.nixl.install(), nixl._api is
#: ferry.nixl) or "connector" (FerryNixlConnector through vLLM's factory
#: and kv_connector_module_path="ferry.nixl_vllm"; nixl._api untouched);
#: "nixl": no Ferry at all, vLLM on the real NIXL installed (the baseline
#: of the GPU run).
VIA = os.environ.get("FERRY_NIXL_VIA", "alias")
#: FERRY_NIXL_DEVICE=cuda:0: the KV caches are torch tensors on that GPU, a
#: larger model's shape, and D times its reads (tests/gpu/nixl.sh on the
#: H200); unset: host memory, as above.
DEVICE = os.environ.get("FERRY_NIXL_DEVICE", "")
# On the GPU machine vLLM's pure-Python tree and its small dependencies
# come from a carried folder, after the machine's own packages (torch).
for _extra in filter(None, os.environ.get("FERRY_APPEND_PATH", "").split(os.pathsep)):
    sys.path.append(_extra)
import heavy_stubs  # noqa: E402,F401  (the clients venv's .pth imports it too; see there)

if VIA == "alias":
    assert ferry.nixl.install(), "a real NIXL is installed here: the alias stays out"

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm.distributed.nixl_utils as nixl_utils  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlBaseConnectorScheduler,
    NixlConnectorMetadata,
    NixlConnectorWorker,
    NixlKVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta  # noqa: E402
from vllm.utils.network_utils import get_ip, get_open_port  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from vllm.platforms import current_platform  # noqa: E402

# The one platform stand-in: with no accelerator vLLM resolves the
# "unspecified" platform, whose set_device raises; _nixl_handshake calls it
# for the caches' device. Here it does what vLLM's CPU platform does for
# host memory (torch.cpu.set_device: nothing). vLLM's CPU platform itself
# cannot load here: it imports its compiled CPU kernels at first use.
assert DEVICE or type(current_platform).__name__ == "UnspecifiedPlatform", current_platform
if type(current_platform).__name__ == "UnspecifiedPlatform":
    current_platform.set_device = lambda device: None

if DEVICE:
    # 8 layers of 4,096 blocks of 16 tokens x 8 KV heads x 128 (K and V):
    # 64 KiB a block a layer; D reads 1,024 shuffled blocks (512 MiB).
    LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 8, 4096, 16, 8, 128
    _n = int(os.environ.get("FERRY_NIXL_READ_BLOCKS", "1024"))
    DST_BLOCKS = np.random.default_rng(1).permutation(BLOCKS)[:_n].tolist()
    SRC_BLOCKS = np.random.default_rng(2).permutation(BLOCKS)[:_n].tolist()
else:
    LAYERS = 4
    BLOCKS = 64
    BLOCK_SIZE = 16  # tokens per block
    HEADS, HEAD_SIZE = 2, 16  # float16: 16 * 2 * 32 * 2 = 2 KiB per block per layer
    # The blocks D pulls and where P holds them: runs, singles, out of order.
    DST_BLOCKS = [40, 41, 42, 43, 7, 63, 0, 20, 21, 9]
    SRC_BLOCKS = [3, 4, 5, 6, 60, 1, 33, 17, 18, 50]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
BLOCK_BYTES = BLOCK_SIZE * HEADS * 2 * HEAD_SIZE * 2  # a block of one layer, float16

if not DEVICE:
    from vllm_peer import HostTensor  # noqa: E402

    class Tensor(HostTensor):
        """vllm_peer.HostTensor plus what the NIXL registration reads."""

        device = SimpleNamespace(type="cpu")

        def get_device(self):
            return -1

        def __getitem__(self, item):
            return Tensor(self.a[item], self._base)


def caches(fill):
    shape = (BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
    if DEVICE:
        def one(i):
            if not fill:
                return torch.zeros(shape, dtype=torch.float16, device=DEVICE)
            g = torch.Generator(device=DEVICE)
            g.manual_seed(i)
            return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=DEVICE, generator=g).view(torch.float16)

        return {name: one(i) for i, name in enumerate(NAMES)}
    return {name: Tensor(np.random.default_rng(i).integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
                         if fill else np.zeros(shape, np.float16))
            for i, name in enumerate(NAMES)}


def check(kv, src):
    """(per-block or per-layer equality, untouched blocks still zero)."""
    if DEVICE:
        di = torch.as_tensor(DST_BLOCKS, device=DEVICE)
        si = torch.as_tensor(SRC_BLOCKS, device=DEVICE)
        rest = torch.ones(BLOCKS, dtype=torch.bool, device=DEVICE)
        rest[di] = False
        ok = [bool(torch.equal(kv[n][di].view(torch.int16), src[n][si].view(torch.int16))) for n in NAMES]
        return ok, all(not bool(kv[n][rest].view(torch.int16).any()) for n in NAMES)
    ok = [bool(np.array_equal(kv[n].a[d].view(np.uint16), src[n].a[s].view(np.uint16)))
          for n in NAMES for d, s in zip(DST_BLOCKS, SRC_BLOCKS)]
    untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
    return ok, all(not kv[n].a[untouched].any() for n in NAMES)


def vllm_config():
    model = SimpleNamespace(model="ferry/tiny", dtype=torch.float16, use_mla=False,
                            get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HEAD_SIZE,
                            get_total_num_hidden_layers=lambda: LAYERS)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
                           speculative_config=None)


def worker(engine_id):
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(NAMES), kv_cache_spec=spec)])
    w = NixlConnectorWorker.__new__(NixlConnectorWorker)
    vc = vllm_config()
    # The constructor's agent.
    w.nixl_wrapper = nixl_utils.NixlWrapper(str(uuid.uuid4()),
                                            nixl_utils.nixl_agent_config(num_threads=4, capture_telemetry=True))
    # What the constructor sets, for TP 1, no MLA, no Mamba, full attention.
    w.vllm_config, w.model_config, w.kv_cache_config = vc, vc.model_config, cfg
    w.kv_transfer_config = SimpleNamespace(enable_permute_local_kv=False)
    w.nixl_backends = ["UCX"]
    w._lease_extension, w._bidirectional_kv_xfer_enabled = 20, False
    w.block_size, w.num_blocks, w._logical_num_blocks = BLOCK_SIZE, BLOCKS, BLOCKS
    w._layer_specs = {n: spec for n in NAMES}
    w._is_hma_required = w._has_mamba = w._is_csa_linear = w.use_mla = False
    w._conv_decomp, w._ple_group_index, w._mamba_ssm_size = None, None, (0, 0)
    w._remote_agents = defaultdict(dict)
    w._failed_remote_engines, w._invalid_remote_engines = set(), set()
    w._invalid_engine_backoff, w._engine_clock_offset = {}, {}
    w.engine_id = engine_id
    w.tp_rank, w.world_size, w.pcp_size, w.dcp_size, w.pcp_rank, w.pp_size = 0, 1, 1, 1, 0, 1
    w.pcp_dcp_sharded, w.transfer_tp_size, w.transfer_tp_rank, w.dcp_rank = False, 1, 0, 0
    w.enable_permute_local_kv = w.enable_heterogeneous_attn_post_process = False
    w.device_type, w.kv_buffer_device, w.nixl_memory_type = ("cuda", "cuda", "VRAM") if DEVICE else ("cpu", "cpu", "DRAM")
    w.device_kv_caches, w.host_xfer_buffers, w.use_host_buffer, w.copy_blocks = {}, {}, False, None
    w.device_id = 0
    w.kv_caches_base_addr = defaultdict(dict)
    w.num_regions, w.region_mem_types, w.region_group_ids, w.region_names, w.region_num_blocks = 0, [], [], [], []
    w._mixed_mem_types = w._skip_dram_xfer = False
    w._desc_is_dram_by_block_size, w._desc_pos_by_block_size, w._dram_src_handles_by_block_size = {}, {}, {}
    w._hb_handshake_notif_only = False
    w.src_xfer_handles_by_block_size, w.src_blocks_data_by_block_size = {}, {}
    w.src_xfer_handles_by_tp_ratio, w._dram_src_handles_by_tp_ratio = {}, {}
    w.dst_xfer_side_handles = defaultdict(dict)
    w.dst_num_blocks, w.dst_region_num_blocks, w.dst_region_group_ids = {}, {}, {}
    w._dst_pairs, w.dst_region_mem_types, w._registered_descs, w._kv_unregistered = {}, {}, [], False
    w._recving_metadata, w._recving_transfers = {}, defaultdict(list)
    w._reqs_to_send, w._replicated_pcp_done_sending, w._reqs_to_process = {}, set(), set()
    w._invalid_block_ids, w._failed_recv_reqs = bw.queue.Queue(), bw.queue.Queue()
    w._recv_failures, w._pending_recv_notifs = set(), {}
    w.xfer_handshake_metadata = None
    w._handshake_initiation_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-nixl-handshake-initiator")
    w._ready_requests = bw.queue.Queue()
    w._handshake_futures, w._handshake_lock = {}, threading.RLock()
    w._engine_last_active, w._engine_ttl, w._engine_by_address = {}, 3600.0, {}
    w.attn_backends, w.backend_name = [], "FLASH_ATTN"
    w.kv_cache_layout = w.host_buffer_kv_cache_layout = "LBNHC"
    w.compat_hash, w.transfer_topo = None, None
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = NixlKVConnectorStats()
    w._physical_blocks_per_logical_kv_block = 1
    w._group_spec_types = (FullAttentionSpec,)
    w._dcp_replicated_groups = set()
    w._region_is_mla, w._head_sharded_draft_regions, w._ssm_region_indices = [], set(), []
    w._group_region_indices, w._ple_region_index, w._ple_block_len = [], None, None
    w.block_len_per_layer, w.block_stride_per_layer = [], []
    w._has_packed_cache = False
    w.region_members, w._regions_by_layer, w._packed_member_layouts = [], {}, {}
    w.tp_mappings, w._head_sharded_draft_kv_heads, w.draft_tp_mappings = {}, None, {}
    w.enforce_compat_hash = True
    # NixlPullConnectorWorker.__init__
    w._remote_registration_generations = {}
    return w


# -- FERRY_NIXL_VIA=connector: vLLM's own constructor, through its factory --


class _Backend:
    """The attention backend the worker asks the model's layers for (there
    is no model here): FLASH_ATTN by name, as worker() above says."""

    @staticmethod
    def get_name():
        return "FLASH_ATTN"

    @classmethod
    def full_cls_name(cls):
        return "vllm_nixl_peer._Backend"


def connector_worker(engine_id):
    """The worker FerryNixlConnector's constructor makes (vLLM's
    NixlConnector.__init__ and NixlBaseConnectorWorker.__init__, run
    whole), the class found by vLLM's KVConnectorFactory from
    kv_connector_module_path. Stand-ins for what a model and a launched
    vLLM would give: a one-rank TP group, the CPU platform's answers (a
    CPU device, no cores reserved, no platform NIXL memory type: DRAM from
    kv_buffer_device), the attention backend and the kernel block size
    (vLLM reads both from the model's attention layers) and the KV layout
    (LBNHC, as worker() above)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    parallel_state._TP = SimpleNamespace(rank_in_group=0, world_size=1)
    if type(current_platform).__name__ == "UnspecifiedPlatform":
        # The platform a launched vLLM would resolve: CUDA for caches on a
        # GPU (vLLM is not installed as a package, so it finds none).
        current_platform.device_type = "cuda" if DEVICE else "cpu"
        current_platform.discover_numa_topology = lambda: []
        current_platform.get_nixl_memory_type = lambda: None
    bw.get_current_attn_backends = lambda vllm_config, layer_names=None: [_Backend]
    bw.NixlBaseConnectorWorker._sync_block_size_with_kernel = lambda self: None

    ktc = KVTransferConfig(kv_connector="FerryNixlConnector", kv_connector_module_path="ferry.nixl_vllm",
                           kv_role="kv_producer" if engine_id == "prefill" else "kv_consumer",
                           engine_id=engine_id, kv_buffer_device="cuda" if DEVICE else "cpu")
    cls = KVConnectorFactory.get_connector_class(ktc)
    import ferry.nixl_vllm

    assert cls is ferry.nixl_vllm.FerryNixlConnector, cls
    vc = vllm_config()
    vc.kv_transfer_config = ktc
    vc.model_config.enable_sleep_mode = False
    vc.cache_config.block_size = BLOCK_SIZE
    vc.cache_config.get_resolved_kv_cache_layout = lambda: SimpleNamespace(name="LBNHC")
    vc.parallel_config = SimpleNamespace(prefill_context_parallel_size=1, decode_context_parallel_size=1,
                                         tensor_parallel_size=1, pipeline_parallel_size=1)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(NAMES), kv_cache_spec=spec)])
    connector = cls(vc, KVConnectorRole.WORKER, cfg)
    # The swap is over: vLLM's module holds what it held (no NIXL here).
    assert bw.NixlWrapper is None and bw.nixl_agent_config is None, (bw.NixlWrapper, bw.nixl_agent_config)
    return connector.connector_worker


def make_worker(engine_id):
    return connector_worker(engine_id) if VIA == "connector" else worker(engine_id)


def prefill():
    w = make_worker("prefill")
    kv = caches(fill=True)
    w.register_kv_caches(kv)
    host, port = get_ip(), get_open_port()
    data = {(0, 0): msgspec.msgpack.Encoder().encode(w.xfer_handshake_metadata)}
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                                args=(data, ready, stop, host, port), daemon=True)
    listener.start()
    ready.wait()
    print(json.dumps({"host": host, "port": port}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        # The scheduler's word that req_id's blocks wait for a reader.
        meta = NixlConnectorMetadata()
        meta.reqs_in_batch = {req["req"]}
        meta.reqs_to_send = {req["req"]: time.perf_counter() + 600}
        w.start_load_kv(meta)
        sent, deadline = set(), time.monotonic() + 60
        while req["req"] not in sent and time.monotonic() < deadline:
            sent |= w.get_finished()[0]
            time.sleep(0.01)
        print(json.dumps({"sent": sorted(sent), "pending": sorted(w._reqs_to_send)}), flush=True)
    stop.set()
    w.shutdown()


def decode(info):
    w = make_worker("decode")
    kv = caches(fill=False)
    w.register_kv_caches(kv)
    src = caches(fill=True)  # what P holds (same seeds): the bytes that must land
    for line in sys.stdin:
        req_id = json.loads(line)["req"]
        meta = NixlConnectorMetadata()
        meta.reqs_to_recv[req_id] = ReqMeta(
            local_block_ids=[list(DST_BLOCKS)], local_physical_block_ids=[list(DST_BLOCKS)], tp_size=1,
            awaiting_kvs=True,
            remote=RemoteMeta(block_ids=[list(SRC_BLOCKS)], host=info["host"], port=info["port"],
                              engine_id="prefill", request_id=req_id))
        handshake_was_needed = "prefill" not in w._remote_agents
        t0 = time.perf_counter()
        w.start_load_kv(meta)  # the handshake runs in vLLM's background thread
        done, failed, steps, deadline = set(), set(), 0, time.monotonic() + 60
        while req_id not in done and time.monotonic() < deadline:
            w.start_load_kv(NixlConnectorMetadata())  # a later step posts the read once the handshake is in
            r = w.get_transfer_results()
            done |= r.finished_recving
            failed |= r.failed_recving
            steps += 1
            if not DEVICE:  # on the GPU D spins, as a timed step loop would
                time.sleep(0.005)
        seconds = time.perf_counter() - t0
        ok, untouched_zero = check(kv, src)
        stats = w.xfer_stats.data
        print(json.dumps({
            "done": sorted(done), "failed": sorted(failed), "handshake": handshake_was_needed,
            "remote_agents": {e: [ferry.nixl._name(n) for n in a.values()] for e, a in w._remote_agents.items()},
            "ok": ok, "untouched_zero": untouched_zero,
            "seconds": seconds, "gbps": len(DST_BLOCKS) * LAYERS * BLOCK_BYTES / seconds / 1e9,
            "bytes": sum(stats.get("bytes_transferred", [])), "descs": sum(stats.get("num_descriptors", [])),
            "failed_transfers": len(stats.get("num_failed_transfers", [])),
            "agent": type(w.nixl_wrapper).__module__,
            "worker": type(w).__name__,
            "nixl_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("nixl", "nixl_rocm")),
        }), flush=True)
        for t in kv.values():
            if DEVICE:
                t.zero_()
            else:
                t.a[:] = 0
    w.shutdown()


def main():
    if VIA == "alias":
        assert nixl_utils.NixlWrapper is ferry.nixl.nixl_agent, nixl_utils.NixlWrapper
        assert bw.NixlWrapper is ferry.nixl.nixl_agent, bw.NixlWrapper
    if sys.argv[1] == "prefill":
        prefill()
    else:
        decode(json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
