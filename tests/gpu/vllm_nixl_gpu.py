#!/usr/bin/env python3
"""vLLM 0.34's NixlConnector worker path with cuda:0 KV caches in two
processes (python/tests/clients/vllm_nixl_peer.py with
FERRY_NIXL_DEVICE=cuda:0): P registers its caches and serves vLLM's
handshake; D registers its caches and pulls 1,024 shuffled blocks of 8
layers (64 KiB a block a layer, 512 MiB a request) by vLLM's
start_load_kv -> make_prepped_xfer("READ") -> transfer -> get_finished,
verified on the GPU, with the request's notification seen by P.

    python tests/gpu/vllm_nixl_gpu.py --via connector|alias|nixl [--requests 6]

--via: FerryNixlConnector (vLLM's factory, kv_connector_module_path), the
nixl._api alias, or vLLM on the real NIXL (no Ferry). The first request
pays the handshake; the median of the others is the throughput (request
posted to finished_recving as D's step loop sees it). The environment
carries FERRY_APPEND_PATH (vLLM's .py tree) and FERRY_HEAVY_STUBS_REAL
(tests/gpu/nixl.sh sets both). Exits 0 only if every request's blocks
arrived intact, none failed and P saw every request as sent.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from nixl_gpu import json_reply

PEER = Path(__file__).resolve().parents[2] / "python" / "tests" / "clients" / "vllm_nixl_peer.py"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--via", choices=["connector", "alias", "nixl"], required=True)
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args()
    env = dict(os.environ, FERRY_NIXL_VIA=args.via, FERRY_NIXL_DEVICE=os.environ.get("FERRY_NIXL_DEVICE", "cuda:0"))

    def spawn(*argv):
        return subprocess.Popen([sys.executable, str(PEER), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=str(PEER.parent))

    label = f"vLLM NixlConnector worker, {env['FERRY_NIXL_DEVICE'] or 'host memory'}, via {args.via}"
    prefill = spawn("prefill")
    decode = None
    ok = True
    try:
        line = json_reply(prefill.stdout)
        if not line:
            print(f"FAIL {label}: prefill did not start\n{prefill.communicate(timeout=60)[1][-6000:]}")
            return 1
        info = json.loads(line)
        decode = spawn("decode", json.dumps(info))
        rates = []
        for i in range(args.requests):
            req = f"req-{i + 1}"
            for p in (prefill, decode):
                p.stdin.write(json.dumps({"req": req}) + "\n")
                p.stdin.flush()
            line = json_reply(decode.stdout)
            if not line:
                print(f"FAIL {label}: decode stopped at {req}\n{decode.communicate(timeout=60)[1][-6000:]}")
                return 1
            d = json.loads(line)
            sent = json.loads(json_reply(prefill.stdout) or "{}")
            good = (d["done"] == [req] and not d["failed"] and d["failed_transfers"] == 0 and all(d["ok"])
                    and d["untouched_zero"] and sent.get("sent") == [req])
            ok &= good
            print(f"{label}: {req} {'verified' if good else 'WRONG'} in {d['seconds'] * 1e3:.2f} ms "
                  f"({d['gbps']:.2f} GB/s){' with the handshake' if d['handshake'] else ''}; agent {d['agent']}, "
                  f"worker {d['worker']}, nixl modules {d['nixl_modules']}; P: {sent}", flush=True)
            if not good:
                print(f"  {d}")
            if not d["handshake"]:
                rates.append(d["gbps"])
        if rates:
            print(f"{label}: median {statistics.median(rates):.2f} GB/s over {len(rates)} requests after the handshake "
                  f"(on cuda:0 512 MiB each: 1,024 blocks x 8 layers x 64 KiB)", flush=True)
        return 0 if ok else 1
    finally:
        for p in (decode, prefill):
            if p is not None:
                try:
                    p.stdin.close()
                    p.wait(timeout=60)
                except Exception:  # noqa: BLE001 (cleanup)
                    p.kill()
                err = p.stderr.read() if p.stderr and not p.stderr.closed else ""
                if p.returncode not in (0, None) or not ok:
                    sys.stderr.write(err[-4000:])


if __name__ == "__main__":
    sys.exit(main())
