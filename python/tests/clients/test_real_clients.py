"""The real packages' transfer code on Ferry, not copies of it: LMCache
0.5.6's ``mooncake_te`` transfer channel, SGLang 0.5.23's
``MooncakeTransferEngine`` and ``MooncakeKVManager`` send paths
(sglang_peer.py) and vLLM 0.34.0's ``MooncakeConnectorWorker`` and
encoder-cache ``MooncakeTransfer`` (vllm_peer.py), and its
``NixlConnectorWorker`` on ``ferry.nixl`` (vllm_nixl_peer.py; vLLM and
SGLang installed by FERRY_REAL_CLIENTS=full), installed from PyPI with
--no-deps into its own venv (target/clients-venv, made by
scripts/test-clients) with ``mooncake.engine`` resolving to
``ferry.TransferEngine`` (a ``ferry-as-mooncake.pth`` line), in two
processes, on a routable address with the cluster token.

Stubs (python/tests/clients/heavy_stubs.py, a meta-path finder for these
names only; a stub that is called for real work raises StubUsed, so no
test passes on stub output):

- torch: PyPI serves only the CUDA build (~900 MB with the nvidia-* wheels
  it needs to import); the CPU build is not on PyPI. The channel moves host
  memory by address; torch is imported for annotations, dtype tables and
  device probes (which answer: no GPU).
- numba: a JIT over llvmlite (native LLVM) for LMCache's cachegen kernels.
- lmcache.lmcache_native, lmcache.cuda_ops: LMCache's C++/CUDA ops, linked
  against libtorch (libc10.so).
- triton, sgl_kernel, flashinfer, tvm_ffi, vllm._C, vllm._custom_ops: GPU
  kernels of SGLang and vLLM.
- xgrammar: vLLM's structured-output grammar compiler (native, over
  tvm_ffi and torch), imported by vLLM's request module.
- torchvision, compressed_tensors: imported by SGLang's model configs;
  they need real torch.
- The torch stub answers what SGLang and vLLM run at import (custom-op
  registration, including vLLM's infer_schema / register_fake /
  triton_op, dtypes, finfo, torch.device, nn.Module subclasses made at
  import, tensor constants that raise when used): heavy_stubs.py lists each.
- vLLM's KV caches are numpy arrays behind a tensor-like wrapper
  (vllm_peer.HostTensor: data_ptr, untyped_storage, shape, stride,
  element_size, nbytes, indexing), since the torch stub has no tensors.

Skipped unless FERRY_REAL_CLIENTS=1 (scripts/test-clients sets it), since
the venv takes minutes and ~1.3 GB to make.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TOKEN = "a secret shared by every node"

pytestmark = pytest.mark.skipif(
    os.environ.get("FERRY_REAL_CLIENTS") != "1",
    reason="the real SGLang/vLLM/LMCache clients run with FERRY_REAL_CLIENTS=1 (scripts/test-clients)",
)


def free_port():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "MC_"))}
    e.update(extra)
    return e


def peer(*args, **extra):
    return subprocess.Popen([sys.executable, str(HERE / "lmcache_peer.py"), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(**extra), cwd=str(HERE))


def test_lmcache_mooncake_te_channel_reads_across_processes_on_a_routable_address():
    server = peer("server", "0.0.0.0", free_port(), FERRY_AUTH_TOKEN=TOKEN)
    try:
        line = server.stdout.readline()
        assert line, f"server did not start:\n{server.communicate(timeout=30)[1][-4000:]}"
        info = json.loads(line)
        # listen_url 0.0.0.0: the session name is the route out's address.
        assert not info["session"].startswith(("0.0.0.0", "[::]", "::")), info
        client = subprocess.run(
            [sys.executable, str(HERE / "lmcache_peer.py"), "client", "0.0.0.0", str(free_port()), info["url"]],
            capture_output=True, text=True, timeout=300, env=env(FERRY_AUTH_TOKEN=TOKEN), cwd=str(HERE))
        assert client.returncode == 0, client.stderr[-4000:]
        out = json.loads(client.stdout.strip().splitlines()[-1])
        assert out["mask"] == [True] * 4 and out["landed"], out
        # The case 4: a failed read is LMCache's failed result.
        assert out["out_of_range"] == {"mask": [False]}, out
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()


def test_lmcache_without_the_token_stops_with_the_reason_on_stderr():
    p = subprocess.run([sys.executable, str(HERE / "lmcache_peer.py"), "init", "0.0.0.0", str(free_port())],
                       capture_output=True, text=True, timeout=120, env=env(), cwd=str(HERE))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "Failed to initialize mooncake_te engine" in out.get("raised", ""), out
    errors = [x for x in p.stderr.splitlines() if x.startswith("ferry: ERROR: initialize")]
    assert len(errors) == 1 and "FERRY_AUTH_TOKEN" in errors[0], p.stderr[-4000:]


def test_lmcache_with_auth_off_on_a_trusted_network():
    p = subprocess.run([sys.executable, str(HERE / "lmcache_peer.py"), "init", "0.0.0.0", str(free_port())],
                       capture_output=True, text=True, timeout=120, env=env(FERRY_AUTH="off"), cwd=str(HERE))
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"ok": True}, (out, p.stderr[-4000:])
    assert "FERRY_AUTH=off" in p.stderr


# --- SGLang 0.5.23 (sglang_peer.py) ---------------------------------------

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is installed into the clients venv by FERRY_REAL_CLIENTS=full scripts/test-clients",
)


def sglang(*args, **extra):
    return subprocess.Popen([sys.executable, str(HERE / "sglang_peer.py"), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(**extra), cwd=str(HERE))


def ask(proc, request):
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"peer stopped:\n{proc.stderr.read()[-4000:]}"
    return json.loads(line)


def close(*procs):
    for p in procs:
        try:
            p.stdin.close()
            p.wait(timeout=60)
        except Exception:  # noqa: BLE001 - cleanup
            pass
        finally:
            if p.poll() is None:
                p.kill()


@needs_sglang
def test_sglang_kv_manager_sends_kv_aux_and_slices_and_survives_reregistration():
    """MooncakeKVManager.send_kvcache / send_aux / send_kvcache_slice on
    SGLang's MooncakeTransferEngine (the machine's IP, the token), with
    numpy int64 source addresses (case 3); then the target deregisters and
    registers the same pools again, three times (case 2: SGLang's role
    switch, vLLM's sleep / wake-up), and the same initiator engine's next
    round must land too."""
    target = sglang("target", FERRY_AUTH_TOKEN=TOKEN)
    initiator = None
    try:
        line = target.stdout.readline()
        assert line, f"target did not start:\n{target.communicate(timeout=30)[1][-4000:]}"
        info = json.loads(line)
        assert not info["session"].startswith(("0.0.0.0", "127.", "[::]")), info
        initiator = sglang("initiator", json.dumps(info), FERRY_AUTH_TOKEN=TOKEN)
        for rnd in range(2):
            initiator.stdin.write("send\n")
            initiator.stdin.flush()
            line = initiator.stdout.readline()
            assert line, f"initiator stopped (round {rnd}):\n{initiator.stderr.read()[-4000:]}"
            out = json.loads(line)
            # out_of_range: SGLang's failure path, a negative status.
            r = out["results"]
            assert (r["kv"], r["aux"], r["slice"]) == (0, 0, 0) and r["out_of_range"] < 0, (rnd, r)
            landed = ask(target, {"check": out["checks"]})["ok"]
            assert len(landed) == len(out["checks"]) and all(landed), (rnd, landed)
            if rnd == 0:
                assert ask(target, {"reregister": 3}) == {"ok": True}
    finally:
        close(*(p for p in (initiator, target) if p is not None))


@needs_sglang
def test_sglang_on_the_routable_ip_without_the_token_says_why_on_stderr():
    """Case 1: SGLang passes get_local_ip_auto(); without the token its
    initialize fails as on Mooncake, and the reason is one ferry: ERROR
    line on stderr naming the variable. With the token it starts."""
    p = subprocess.run([sys.executable, str(HERE / "sglang_peer.py"), "init"],
                       capture_output=True, text=True, timeout=300, env=env(), cwd=str(HERE))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"raised": "RuntimeError: Mooncake Transfer Engine initialization failed."}, out
    errors = [x for x in p.stderr.splitlines() if x.startswith("ferry: ERROR: initialize")]
    assert len(errors) == 1 and "FERRY_AUTH_TOKEN" in errors[0], p.stderr[-4000:]
    p = subprocess.run([sys.executable, str(HERE / "sglang_peer.py"), "init"],
                       capture_output=True, text=True, timeout=300, env=env(FERRY_AUTH_TOKEN=TOKEN),
                       cwd=str(HERE))
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"ok": True}, p.stderr[-4000:]


# --- vLLM 0.34.0 (vllm_peer.py) -------------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is installed into the clients venv by FERRY_REAL_CLIENTS=full scripts/test-clients",
)


def vllm(*args, **extra):
    return subprocess.Popen([sys.executable, str(HERE / "vllm_peer.py"), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(**extra), cwd=str(HERE))


@needs_vllm
def test_vllm_mooncake_connector_sends_blocks_and_survives_sleep_and_wake_up():
    """vLLM's MooncakeConnectorWorker on both sides (made with __new__,
    vllm_peer.py says which attributes and why): register_kv_caches over
    host-memory tensors, the decode worker's pull metadata, the prefill
    worker's block-id-to-address plan and _send_blocks; the encoder-cache
    MooncakeTransfer's write. Then the decode worker sleeps and wakes up
    (unregister_kv_caches / restore_kv_caches, three times: the same
    memory registered again) and the same prefill engines' next round must
    land too (issue 31's case 2)."""
    target = vllm("target", FERRY_AUTH_TOKEN=TOKEN)
    initiator = None
    try:
        line = target.stdout.readline()
        assert line, f"target did not start:\n{target.communicate(timeout=30)[1][-4000:]}"
        info = json.loads(line)
        assert not info["session"].startswith(("0.0.0.0", "127.", "[::]")), info
        initiator = vllm("initiator", json.dumps(info), FERRY_AUTH_TOKEN=TOKEN)
        for rnd in range(2):
            initiator.stdin.write("send\n")
            initiator.stdin.flush()
            line = initiator.stdout.readline()
            assert line, f"initiator stopped (round {rnd}):\n{initiator.stderr.read()[-4000:]}"
            out = json.loads(line)
            # Two runs and a single per layer: vLLM coalesced them.
            assert out["send"] == 0 and out["descriptors"] == 2 * 3, (rnd, out["send"], out["descriptors"])
            assert out["out_of_range"] < 0 and out["ec_released"], (rnd, out)
            landed = ask(target, {"check": out["check"], "ec": out["ec"]})
            assert all(landed["ok"]) and landed["ec"], (rnd, landed)
            if rnd == 0:
                assert ask(target, {"sleep": 3}) == {"ok": True, "unregistered": False}
    finally:
        close(*(p for p in (initiator, target) if p is not None))


# --- vLLM 0.34.0's NixlConnector on ferry.nixl (vllm_nixl_peer.py) ----------


def vllm_nixl(*args, **extra):
    return subprocess.Popen([sys.executable, str(HERE / "vllm_nixl_peer.py"), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(**extra), cwd=str(HERE))


@needs_vllm
@pytest.mark.parametrize("via", ["alias", "connector"])
def test_vllm_nixl_connector_worker_pulls_blocks_by_id_with_notifications(via):
    """vLLM's NixlConnectorWorker (pull) on both sides, unedited, on
    ferry.nixl through ``ferry.nixl.install()`` (made with __new__,
    vllm_nixl_peer.py says which attributes and the one platform stand-in):
    register_kv_caches over host-memory tensors; D's start_load_kv runs
    vLLM's ZMQ handshake against P's own side-channel listener
    (compatibility hash, NixlAgentMetadata, add_remote_agent), then reads
    ten blocks of four layers by id (make_prepped_xfer READ with the
    request's notification); get_finished reports the request received on
    D with the bytes in place and sent on P (the notification). A second
    request reuses the handshake.

    ``via="connector"``: no alias; vLLM's KVConnectorFactory finds
    ``FerryNixlConnector`` by ``kv_connector_module_path="ferry.nixl_vllm"``
    and its constructor (vLLM's, run whole, stand-ins listed in
    vllm_nixl_peer.connector_worker) makes the workers: their agents are
    Ferry's, and no ``nixl`` module is ever imported."""
    prefill = vllm_nixl("prefill", FERRY_AUTH_TOKEN=TOKEN, FERRY_NIXL_VIA=via)
    decode = None
    try:
        line = prefill.stdout.readline()
        assert line, f"prefill did not start:\n{prefill.communicate(timeout=30)[1][-4000:]}"
        info = json.loads(line)
        decode = vllm_nixl("decode", json.dumps(info), FERRY_AUTH_TOKEN=TOKEN, FERRY_NIXL_VIA=via)
        for rnd, req in enumerate(("req-1", "req-2")):
            for p in (prefill, decode):
                p.stdin.write(json.dumps({"req": req}) + "\n")
                p.stdin.flush()
            line = decode.stdout.readline()
            assert line, f"decode stopped ({req}):\n{decode.stderr.read()[-4000:]}"
            d = json.loads(line)
            assert d["agent"] == "ferry.nixl" and d["handshake"] == (rnd == 0), d
            if via == "connector":
                assert d["worker"] == "NixlPullConnectorWorker" and d["nixl_modules"] == [], d
            else:
                assert d["nixl_modules"] == ["nixl", "nixl._api"], d
            assert d["done"] == [req] and d["failed"] == [] and d["failed_transfers"] == 0, d
            assert len(d["ok"]) == 40 and all(d["ok"]) and d["untouched_zero"], d
            # vLLM's stats come from get_xfer_telemetry: 40 descriptors of 2 KiB a request.
            assert (d["descs"], d["bytes"]) == (40 * (rnd + 1), 40 * 2048 * (rnd + 1)), d
            line = prefill.stdout.readline()
            assert line, f"prefill stopped ({req}):\n{prefill.stderr.read()[-4000:]}"
            assert json.loads(line) == {"sent": [req], "pending": []}
    finally:
        close(*(p for p in (decode, prefill) if p is not None))
