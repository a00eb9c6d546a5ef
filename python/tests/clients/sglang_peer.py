"""One side of SGLang 0.5.23's real PD-disaggregation transfer code,
unedited, with ``mooncake.engine`` resolving to Ferry (the venv's
ferry-as-mooncake .pth): the shared ``MooncakeTransferEngine``
(sglang.srt.distributed.device_communicators.mooncake_transfer_engine,
made by its ``init_mooncake_transfer_engine`` on the machine's routable IP
from SGLang's ``get_local_ip_auto``, as a server does) and
``MooncakeKVManager``'s registration and send paths
(``register_buffer_to_engine``, ``deregister_buffer_to_engine``,
``send_kvcache``, ``send_kvcache_slice``, ``send_aux``).

    python sglang_peer.py target          # prints {"session", "kv", "aux", "slice"}; then one
                                          # JSON request a line on stdin, one JSON answer each
    python sglang_peer.py initiator INFO  # a round of sends to the target INFO describes for
                                          # each line on stdin; one JSON line of results each
    python sglang_peer.py init            # initialize only: {"ok"} or {"raised"}

The manager is made without its constructor (``__new__`` plus the
attributes the send paths read): the constructor starts SGLang's bootstrap
threads and ZMQ sockets, which need a running scheduler. The methods that
move the bytes are SGLang's own. The KV pools are numpy buffers (host
memory, by address); SGLang's pools are torch tensors whose
``data_ptr()`` it passes the same way. Source addresses are numpy int64
scalars (``ptrs = base + np.arange(n) * size``), the issue's case 3.
"""

import concurrent.futures
import json
import sys

import numpy as np

import mooncake.engine
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, TransferInfo
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
    get_mooncake_transfer_engine,
    init_mooncake_transfer_engine,
)
from sglang.srt.runtime_context import _CONTEXT
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import get_local_ip_auto

LAYERS = 2  # K and V buffers per layer: kv_data_ptrs = [K0, K1, V0, V1]
PAGES = 64
HEADS, HEAD_BYTES = 2, 64
ITEM = HEADS * HEAD_BYTES  # bytes per page (page_size 1)
AUX_ITEM, AUX_SLOTS = 32, 16


def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def buffers(fill):
    kv = [pattern(i, PAGES * ITEM) if fill else np.zeros(PAGES * ITEM, np.uint8) for i in range(2 * LAYERS)]
    aux = [pattern(100, AUX_ITEM * AUX_SLOTS) if fill else np.zeros(AUX_ITEM * AUX_SLOTS, np.uint8)]
    # send_kvcache_slice's destination: a decode rank holding 1 of the 2 heads.
    sl = [np.zeros(PAGES * HEAD_BYTES, np.uint8) for _ in range(2 * LAYERS)]
    return kv, aux, sl


def numpy_ptrs(arrays):
    # Contiguous addresses as SGLang computes them from a pool (numpy int64).
    return [np.int64(a.ctypes.data) for a in arrays]


def manager(kv, aux, extra=()):
    args = KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs = numpy_ptrs(kv)
    args.kv_data_lens = [a.nbytes for a in kv]
    args.kv_item_lens = [ITEM] * len(kv)
    args.kv_layer_ids = []
    args.prefill_start_layer = 0
    args.mla_compression_ratios = None
    args.aux_data_ptrs = numpy_ptrs(aux)
    args.aux_data_lens = [a.nbytes for a in aux]
    args.aux_item_lens = [AUX_ITEM] * len(aux)
    # Extra regions (send_kvcache_slice's destination) ride as one state group.
    args.state_data_ptrs = [[int(a.ctypes.data) for a in extra]] if extra else []
    args.state_data_lens = [[a.nbytes for a in extra]] if extra else []
    args.page_size = 1
    args.kv_head_num = HEADS
    args.total_kv_head_num = HEADS
    m = MooncakeKVManager.__new__(MooncakeKVManager)
    m.kv_args = args
    m.engine = get_mooncake_transfer_engine()
    m.is_mla_backend = m.is_hybrid_mla_backend = False
    m.pp_size = m.attn_tp_size = 1
    m.enable_custom_mem_pool, m.custom_mem_pool_type = False, None
    m.max_transfer_batch_indices = 0
    m.state_strides_validated = set()
    m.enable_deferred_decode_kv_release = False
    return m


def engine():
    # The configuration a server publishes at start (defaults: no unified
    # memory pool, transfer backend mooncake).
    _CONTEXT.set_server_args(ServerArgs(model_path="none"))
    return init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=0, ib_device=None)


def target():
    te = engine()
    kv, aux, sl = buffers(fill=False)
    m = manager(kv, aux, sl)
    m.register_buffer_to_engine()
    named = {"kv": kv, "aux": aux, "slice": sl}
    print(json.dumps({"session": te.get_session_id(), **{k: [int(a.ctypes.data) for a in v]
                                                          for k, v in named.items()}}), flush=True)
    src = dict(zip(("kv", "aux", "slice"), buffers(fill=True)))
    for line in sys.stdin:
        req = json.loads(line)
        if "check" in req:
            # [dst_kind, dst_i, dst_off, src_kind, src_i, src_off, len]
            ok = [bool(np.array_equal(named[dk][di][do:do + n], src[sk][si][so:so + n]))
                  for dk, di, do, sk, si, so, n in req["check"]]
            print(json.dumps({"ok": ok}), flush=True)
        elif "reregister" in req:
            # vLLM's sleep / wake-up, in SGLang's terms (a P<->D role switch
            # re-registers the same pools): the same addresses again.
            for _ in range(req["reregister"]):
                m.deregister_buffer_to_engine()
                m.register_buffer_to_engine()
            for arrays in named.values():
                for a in arrays:
                    a[:] = 0
            print(json.dumps({"ok": True}), flush=True)


def initiator(info):
    te = engine()
    kv, aux, _ = buffers(fill=True)
    m = manager(kv, aux)
    m.register_buffer_to_engine()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    # One round of sends for each line on stdin, from the same engine, so
    # a round after the target re-registered reuses what this engine knew.
    for _ in sys.stdin:
        send_round(te, m, info, pool)


def send_round(te, m, info, pool):
    session = info["session"]
    # Pages 3..9 and 20, 21 to the decode side's 40..46, 10, 11 (two runs plus one).
    src_pages = np.array([3, 4, 5, 6, 7, 8, 9, 20, 21], dtype=np.int32)
    dst_pages = np.array([40, 41, 42, 43, 44, 45, 46, 10, 11], dtype=np.int32)
    results = {"kv": m.send_kvcache(session, src_pages, info["kv"], dst_pages, pool)}
    checks = [["kv", b, int(d) * ITEM, "kv", b, int(s) * ITEM, ITEM]
              for b in range(2 * LAYERS) for s, d in zip(src_pages, dst_pages)]
    req = TransferInfo(room=1, endpoint="", dst_port=0, mooncake_session_id=session,
                       dst_kv_indices=dst_pages, dst_aux_index=5, dst_state_indices=[],
                       required_dst_info_num=1, is_dummy=False)
    results["aux"] = m.send_aux(req, 2, info["aux"])
    checks.append(["aux", 0, 5 * AUX_ITEM, "aux", 0, 2 * AUX_ITEM, AUX_ITEM])
    # Prefill TP 1 -> decode TP 2, decode rank 0: head 0 of every token slot.
    results["slice"] = m.send_kvcache_slice(session, src_pages, info["slice"], dst_pages,
                                            dst_tp_rank=0, dst_attn_tp_size=2,
                                            dst_kv_item_len=HEAD_BYTES, executor=pool)
    checks += [["slice", b, int(d) * HEAD_BYTES, "kv", b, int(s) * ITEM, HEAD_BYTES]
               for b in range(2 * LAYERS) for s, d in zip(src_pages, dst_pages)]
    # An address outside the target's pools: SGLang's failure path (a
    # negative status from batch_transfer_sync), not an exception.
    results["out_of_range"] = m.send_kvcache(session, src_pages[:1], [p + (1 << 40) for p in info["kv"]],
                                             dst_pages[:1], pool)
    print(json.dumps({"results": results, "checks": checks, "session": te.get_session_id()}), flush=True)


def main():
    assert mooncake.engine.__name__ == "ferry.mooncake", mooncake.engine
    role = sys.argv[1]
    if role == "init":
        try:
            engine()
            print(json.dumps({"ok": True}), flush=True)
        except Exception as e:  # noqa: BLE001 - what SGLang raises is the result
            print(json.dumps({"raised": f"{type(e).__name__}: {e}"}), flush=True)
    elif role == "target":
        target()
    else:
        initiator(json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
