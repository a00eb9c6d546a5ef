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
import sys
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import ferry.nixl


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

from vllm_peer import HostTensor  # noqa: E402

# The one platform stand-in: with no accelerator vLLM resolves the
# "unspecified" platform, whose set_device raises; _nixl_handshake calls it
# for the caches' device. Here it does what vLLM's CPU platform does for
# host memory (torch.cpu.set_device: nothing). vLLM's CPU platform itself
# cannot load here: it imports its compiled CPU kernels at first use.
assert type(current_platform).__name__ == "UnspecifiedPlatform", current_platform
current_platform.set_device = lambda device: None

LAYERS = 4
BLOCKS = 64
BLOCK_SIZE = 16  # tokens per block
HEADS, HEAD_SIZE = 2, 16  # float16: 16 * 2 * 32 * 2 = 2 KiB per block per layer
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

# The blocks D pulls and where P holds them: runs, singles, out of order.
DST_BLOCKS = [40, 41, 42, 43, 7, 63, 0, 20, 21, 9]
SRC_BLOCKS = [3, 4, 5, 6, 60, 1, 33, 17, 18, 50]


class Tensor(HostTensor):
    """vllm_peer.HostTensor plus what the NIXL registration reads."""

    device = SimpleNamespace(type="cpu")

    def get_device(self):
        return -1

    def __getitem__(self, item):
        return Tensor(self.a[item], self._base)


def caches(fill):
    shape = (BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
    return {name: Tensor(np.random.default_rng(i).integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
                         if fill else np.zeros(shape, np.float16))
            for i, name in enumerate(NAMES)}


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
    w.device_type, w.kv_buffer_device, w.nixl_memory_type = "cpu", "cpu", "DRAM"
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


def prefill():
    w = worker("prefill")
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
    w = worker("decode")
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
        w.start_load_kv(meta)  # the handshake runs in vLLM's background thread
        done, failed, steps, deadline = set(), set(), 0, time.monotonic() + 60
        while req_id not in done and time.monotonic() < deadline:
            w.start_load_kv(NixlConnectorMetadata())  # a later step posts the read once the handshake is in
            r = w.get_transfer_results()
            done |= r.finished_recving
            failed |= r.failed_recving
            steps += 1
            time.sleep(0.005)
        ok = [bool(np.array_equal(kv[n].a[d].view(np.uint16), src[n].a[s].view(np.uint16)))
              for n in NAMES for d, s in zip(DST_BLOCKS, SRC_BLOCKS)]
        untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
        stats = w.xfer_stats.data
        print(json.dumps({
            "done": sorted(done), "failed": sorted(failed), "handshake": handshake_was_needed,
            "remote_agents": {e: [ferry.nixl._name(n) for n in a.values()] for e, a in w._remote_agents.items()},
            "ok": ok, "untouched_zero": all(not kv[n].a[untouched].any() for n in NAMES),
            "bytes": sum(stats.get("bytes_transferred", [])), "descs": sum(stats.get("num_descriptors", [])),
            "failed_transfers": len(stats.get("num_failed_transfers", [])),
            "agent": type(w.nixl_wrapper).__module__,
        }), flush=True)
        for t in kv.values():
            t.a[:] = 0
    w.shutdown()


def main():
    assert nixl_utils.NixlWrapper is ferry.nixl.nixl_agent, nixl_utils.NixlWrapper
    assert bw.NixlWrapper is ferry.nixl.nixl_agent, bw.NixlWrapper
    if sys.argv[1] == "prefill":
        prefill()
    else:
        decode(json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
