"""Two Python processes move verified data with the Mooncake-compatible API
exactly as Mooncake's documented examples do: P2PHANDSHAKE (or etcd),
register, batch write, read back."""

import pytest

from conftest import env_without_ferry_vars, free_port, run_helper


def _exchange(proc, metadata="P2PHANDSHAKE", protocol="tcp", server_host="localhost",
              client_host="localhost", env=None, client_env=None):
    server = proc("mooncake_server.py", metadata, protocol, server_host, env=env)
    info = server.json()
    client = run_helper(
        "mooncake_client.py", info["session_id"], info["ptr"], info["len"],
        metadata, protocol, client_host, env=client_env or env,
    )
    assert client.returncode == 0, client.stderr
    server.send("sha256")
    assert server.line() == client.stdout.strip(), "the server holds other bytes than were written"
    server.send("quit")
    assert server.finish() == 0
    return info, client


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_quick_start_p2p_handshake(proc, protocol):
    info, client = _exchange(proc, protocol=protocol, client_env=env_without_ferry_vars(FERRY_LOG="info"))
    host, port = info["session_id"].rsplit(":", 1)
    assert host == "localhost" and int(port) > 0
    if protocol == "tcp":
        # The protocol asked for is used when it can serve the peer...
        assert "using tcp (" in client.stderr, client.stderr
        assert "preferred: the prefer setting names it" in client.stderr, client.stderr
    else:
        # ...and is a preference, not a condition: this host runs no RDMA
        # transport, so the engine picks one that serves (Mooncake fails).
        assert 'preferred transport "rdma" does not run here' in client.stderr, client.stderr
        assert "using shm" in client.stderr, client.stderr


def test_quick_start_over_each_transport(proc):
    for only in ("tcp", "shm"):
        _exchange(proc, protocol=only, env=env_without_ferry_vars(FERRY_TRANSPORTS=only))


def test_quick_start_with_etcd(proc, etcd_url):
    server_name = f"127.0.0.1:{free_port()}"
    client_name = f"127.0.0.1:{free_port()}"
    info, _ = _exchange(proc, metadata=etcd_url, server_host=server_name, client_host=client_name)
    assert info["session_id"] == server_name


def test_quick_start_with_bare_etcd_address(proc, etcd_url):
    # Mooncake reads a metadata_server without a scheme as etcd.
    bare = etcd_url[len("etcd://"):]
    _exchange(proc, metadata=bare, server_host=f"127.0.0.1:{free_port()}",
              client_host=f"127.0.0.1:{free_port()}")
