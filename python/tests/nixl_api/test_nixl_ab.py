"""The same two-process NIXL script (ab_script.py) on ferry.nixl and, where
NIXL itself is installed (scripts/test-nixl's venv), on real NIXL: every
call's result, the transfer states, the notifications and the digests of
the bytes that landed must match."""

import importlib.util
import os

import pytest

import ab_runner

#: Where ferry.nixl differs from NIXL on purpose (docs/python.md lists why): none in this script.
KNOWN_DIFFERENCES = {}


def _real_nixl_reason():
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed in this venv (scripts/test-nixl installs nixl 1.5.1 and runs this)"
    return None


@pytest.fixture(scope="module")
def ferry_logs():
    return ab_runner.run("ferry")


def test_ferry_run_moves_the_bytes(ferry_logs):
    target, initiator = ferry_logs
    for state in ("write.state", "write2.state", "read.state", "initialize_xfer.state"):
        assert initiator[state] == "DONE", state
    assert initiator["read bytes"] and initiator["read untouched"]
    assert target["get_new_notifs"] == [b"init", b"standalone", b"written", b"written"]
    assert initiator["get_new_notifs"] == [b"ack"]
    assert initiator["add_remote_agent"] == b"target" and target["add_remote_agent"] == b"initiator"


@pytest.mark.skipif(_real_nixl_reason() is not None, reason=str(_real_nixl_reason()))
def test_same_results_as_real_nixl(ferry_logs):
    if os.environ.get("FERRY_REAL_NIXL") != "1":
        pytest.skip("FERRY_REAL_NIXL=1 runs real NIXL's side (scripts/test-nixl)")
    real = ab_runner.run("real")
    for side, ours, theirs in zip(("target", "initiator"), ferry_logs, real):
        assert ours.keys() == theirs.keys()
        for call in theirs:
            if (side, call) in KNOWN_DIFFERENCES:
                continue
            assert ours[call] == theirs[call], f"{side} {call}: ferry.nixl {ours[call]!r}, NIXL {theirs[call]!r}"
