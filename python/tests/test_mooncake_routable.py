"""A routable hostname, as SGLang and vLLM pass it (the machine's IP) and
as LMCache does (``listen_url=0.0.0.0:port``): without a token the engine
refuses to start and says so on stderr, one line at error level, whatever
Python's logging setup; the calls that need a started engine repeat why;
FERRY_AUTH=off starts with a warning; a wildcard is never advertised.

Each case runs in its own interpreter, so its stderr and logging setup are
its own."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import env_without_ferry_vars


def route_out_ip():
    """The source address of this host's route out (nothing is sent), or
    None on a host with no route but loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def run(code, **env):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=60, env=env_without_ferry_vars(**env))
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


NO_TOKEN = """
    import json, logging
    {logging_setup}
    from ferry import TransferEngine, FerryError
    te = TransferEngine()
    rc = te.initialize({host!r}, "P2PHANDSHAKE", "rdma", "")
    first = te.last_error
    port = te.get_rpc_port()
    try:
        te.get_session_id()
        raised = None
    except FerryError as e:
        raised = str(e)
    print(json.dumps(dict(rc=rc, first=first, port=port, raised=raised)))
"""

SETUPS = {
    "no logging configured": "",
    "the ferry logger silenced": "logging.getLogger('ferry').disabled = True",
    "an application's root handler": "logging.basicConfig(level=logging.ERROR)",
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("host", ["routable-ip", "ferry-node-a", "0.0.0.0:0"])
def test_no_token_one_error_line_on_stderr_and_the_reason_again(setup, host):
    if host == "routable-ip":
        host = route_out_ip()
        if host is None:
            pytest.skip("this host has no route but loopback")
    out, err = run(NO_TOKEN.format(logging_setup=SETUPS[setup], host=host))
    assert out["rc"] < 0
    lines = [x for x in err.splitlines() if x.startswith("ferry: ERROR: initialize")]
    assert len(lines) == 1, err
    assert "FERRY_AUTH_TOKEN" in lines[0] and "FERRY_AUTH=off" in lines[0]
    assert out["first"] in lines[0]
    # The ferry logger has it once more only where the application
    # configured a handler of its own (root, here): never twice on its own.
    logged = [x for x in err.splitlines() if x.startswith("ERROR:ferry:initialize")]
    assert len(logged) == (1 if "root handler" in setup else 0), err
    # get_rpc_port: an int, as Mooncake's, negative, with the reason said.
    assert isinstance(out["port"], int) and out["port"] < 0
    assert any(x.startswith("ferry: ERROR: get_rpc_port") and "FERRY_AUTH_TOKEN" in x
               for x in err.splitlines()), err
    # get_session_id: raises, with the reason.
    assert out["raised"] and "initialize failed" in out["raised"] and "FERRY_AUTH_TOKEN" in out["raised"]


ADVERTISE = """
    import json
    import numpy as np
    from ferry import TransferEngine
    target, te = TransferEngine(), TransferEngine()
    assert target.initialize({host!r}, "P2PHANDSHAKE", "tcp", "") == 0, target.last_error
    assert te.initialize({host!r}, "P2PHANDSHAKE", "tcp", "") == 0, te.last_error
    remote = np.zeros(4096, dtype=np.uint8)
    local = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    assert target.register_memory(remote.ctypes.data, 4096) == 0
    assert te.register_memory(local.ctypes.data, 4096) == 0
    name = target.get_session_id()
    rc = te.transfer_sync_write(name, local.ctypes.data, remote.ctypes.data, 4096)
    print(json.dumps(dict(name=name, port=target.get_rpc_port(), rc=rc,
                          landed=bool((remote == local).all()))))
"""


@pytest.mark.parametrize("host", ["0.0.0.0:0", "0.0.0.0", "routable-ip"])
def test_with_the_token_a_wildcard_is_never_advertised(host):
    ip = route_out_ip()
    if host == "routable-ip":
        if ip is None:
            pytest.skip("this host has no route but loopback")
        host = ip
    out, _ = run(ADVERTISE.format(host=host), FERRY_AUTH_TOKEN="a secret shared by every node")
    advertised = out["name"].rsplit(":", 1)[0]
    assert advertised not in ("0.0.0.0", "::", "[::]"), out
    assert advertised == (ip or "127.0.0.1"), out  # the route out
    assert out["name"] == f"{advertised}:{out['port']}"
    assert out["rc"] == 0 and out["landed"], out


def test_auth_off_starts_on_a_routable_address_with_a_warning():
    out, err = run(ADVERTISE.format(host="0.0.0.0:0"), FERRY_AUTH="off")
    assert out["rc"] == 0 and out["landed"], out
    warnings = [x for x in err.splitlines() if "WARN" in x and "FERRY_AUTH=off" in x]
    assert warnings, err
    assert "anyone who can reach this port can read and write registered memory" in err
