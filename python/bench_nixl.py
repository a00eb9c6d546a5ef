#!/usr/bin/env python3
"""ferry.nixl's per-posting Python cost: make_prepped_xfer of N shuffled
indices between two prepared lists of N blocks (host memory, two agents in
this process), as vLLM's NixlConnector posts a read. Prints the median and
p99 time of make_prepped_xfer + release_xfer_handle; nothing is moved.

    python python/bench_nixl.py [--blocks 16384] [--block 16384] [--runs 30]

A benchmark, not a test: on a shared machine the numbers are noisy.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The installed wheel, not the source tree beside this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import numpy as np  # noqa: E402

from ferry.nixl import nixl_agent, nixl_agent_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--block", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    n, size = args.blocks, args.block
    a, b = nixl_agent("bench-a", nixl_agent_config()), nixl_agent("bench-b", nixl_agent_config())
    pools = [np.zeros(n * size, np.uint8) for _ in range(2)]
    for agent, pool in zip((a, b), pools):
        agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM"))

    def rows(pool):
        return [(pool.ctypes.data + i * size, size, 0) for i in range(n)]

    b.prep_xfer_dlist("NIXL_INIT_AGENT", rows(pools[1]), "DRAM")  # the peer's layout
    remote = a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(pools[0]), "DRAM")
    far = a.prep_xfer_dlist(remote, rows(pools[1]), "DRAM")
    rng = np.random.default_rng(1)
    times = []
    for _ in range(args.runs):
        li, ri = rng.permutation(n), rng.permutation(n)
        t0 = time.perf_counter_ns()
        a.release_xfer_handle(a.make_prepped_xfer("READ", local, li, far, ri))
        times.append((time.perf_counter_ns() - t0) / 1e3)
    times.sort()
    print(f"make_prepped_xfer + release, {n} x {size >> 10} KiB blocks by index arrays: "
          f"median {statistics.median(times):.0f} us, p99 {times[min(len(times) - 1, int(len(times) * 0.99))]:.0f} us "
          f"({statistics.median(times) * 1e3 / n:.0f} ns a block) over {len(times)} postings")


if __name__ == "__main__":
    main()
