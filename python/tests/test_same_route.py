"""One request routes the same way through Rust, C and Python: a peer in
another process of this host, a request from host memory, with no
preference and with each transport preferred. Rust is
target/debug/ferry-host-model, C is libferry.so driven by ctypes in its
own process (helpers/c_route.py), Python is ferry.Engine and Mooncake's
TransferEngine (whose ``protocol`` is the same ``prefer`` setting)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import HELPERS, Proc, env_without_ferry_vars
from ferry import Engine, TransferEngine

BUILT = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parents[2] / "target")) / "debug"
LEN = 64 * 1024


def built(name):
    path = BUILT / name
    if not path.exists():
        # A wheel installed without the workspace built beside it (the GPU
        # machine): scripts/test builds it first, so this runs there.
        pytest.skip(f"no {path} (cargo build --workspace; scripts/test does)")
    return path


@pytest.fixture(scope="module")
def peer():
    p = Proc("mooncake_server.py", "P2PHANDSHAKE", "tcp", "127.0.0.1")
    info = p.json()
    yield info
    p.send("quit")
    p.finish()


def decision(transport, reason):
    """The route with its figures masked: each engine measures shm's copy
    speed as it starts, so the estimates differ run to run while the
    decision and the words that explain it must not."""
    return transport, re.sub(r"\d+(\.\d+)?", "#", reason)


def rust_route(prefer, session, addr):
    env = env_without_ferry_vars(**({"FERRY_PREFER": prefer} if prefer else {}))
    out = subprocess.run([str(built("ferry-host-model")), "route", session, str(addr), str(LEN)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def c_route(prefer, session, addr):
    out = subprocess.run([sys.executable, str(HELPERS / "c_route.py"), str(built("libferry.so")), prefer or "-",
                          session, str(addr), str(LEN)],
                         capture_output=True, text=True, env=env_without_ferry_vars(), timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def python_route(prefer, session, addr):
    local = np.zeros(LEN, dtype=np.uint8)
    with Engine(prefer=prefer) as e:
        e.register(local)
        return e.open(session).route(local, addr, LEN)


def mooncake_route(prefer, session, addr):
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", prefer or "", "") == 0, te.last_error
    try:
        local = np.zeros(LEN, dtype=np.uint8)
        assert te.register_memory(local.ctypes.data, LEN) == 0, te.last_error
        return te._engine.open(session).route(local, addr, LEN)
    finally:
        te._engine.close()


@pytest.mark.parametrize("prefer", [None, "tcp", "shm"])
def test_one_request_one_route_through_rust_c_and_python(peer, prefer):
    session, addr = peer["session_id"], peer["ptr"]
    rust = rust_route(prefer, session, addr)
    c = c_route(prefer, session, addr)
    routes = {
        "rust": decision(rust["transport"], rust["reason"]),
        "c": decision(c["transport"], c["reason"]),
        "python": decision(*python_route(prefer, session, addr)),
        "mooncake": decision(*mooncake_route(prefer, session, addr)),
    }
    assert len(set(routes.values())) == 1, routes
    transport = routes["rust"][0]
    if prefer:
        assert transport == prefer, routes
