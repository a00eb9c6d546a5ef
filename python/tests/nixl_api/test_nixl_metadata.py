"""ferry.nixl's metadata blob: a blob not made with this cluster's token
is refused before anything is opened; a pushed blob (send_local_metadata
to a peer's listener) is loaded by the peer."""

import importlib.util
import subprocess
import sys

import pytest

import ferry
import ferry.nixl as nixl
from ferry import nixl_metadata


@pytest.fixture(scope="module")
def agent():
    a = nixl.nixl_agent("md-agent")
    yield a
    a.close()


def test_blob_round_trip(agent):
    other = nixl.nixl_agent("md-other")
    try:
        assert other.add_remote_agent(agent.get_agent_metadata()) == b"md-agent"
        assert other.check_remote_metadata("md-agent") and other.check_remote_metadata(b"md-agent")
        other.remove_remote_agent("md-agent")
        assert not other.check_remote_metadata("md-agent")
    finally:
        other.close()


def test_foreign_and_tampered_blobs_are_refused(agent):
    blob = agent.get_agent_metadata()
    segment = nixl_metadata.parse(blob, agent._token)[1]
    forged = nixl_metadata.build("intruder", segment, b"not the cluster token")
    with pytest.raises(nixl.nixlMismatchError, match="not made with this cluster's token"):
        agent.add_remote_agent(forged)
    tampered = blob.replace(b"md-agent", b"md-agenX")
    with pytest.raises(nixl.nixlMismatchError):
        agent.add_remote_agent(tampered)
    no_proof = nixl_metadata.build("md-agent", segment, None)
    with pytest.raises(nixl.nixlMismatchError, match="no proof"):
        agent.add_remote_agent(no_proof)
    assert not agent.check_remote_metadata("intruder")


def test_metadata_pushed_to_a_listener():
    from conftest import free_port

    port = free_port()
    listener = nixl.nixl_agent("md-listener", nixl.nixl_agent_config(enable_listen_thread=True, listen_port=port))
    sender = nixl.nixl_agent("md-sender")
    try:
        sender.send_local_metadata("127.0.0.1", port)
        assert listener.check_remote_metadata("md-sender")
        sender.fetch_remote_metadata("md-listener", "127.0.0.1", port)
        assert sender.check_remote_metadata("md-listener")
        sender.send_notif("md-listener", b"hello")
        assert listener.get_new_notifs() == {"md-sender": [b"hello"]}
    finally:
        sender.close()
        listener.close()


def test_storage_backends_are_refused_and_network_ones_mapped(caplog):
    a = nixl.nixl_agent("md-backends", nixl.nixl_agent_config(backends=["UCX", "GDS"]))
    try:
        assert list(a.backends) == ["UCX"]
        with pytest.raises(nixl.nixlNotSupportedError):
            a.create_backend("POSIX")
        with pytest.raises(nixl.nixlNotSupportedError):
            a.register_memory([(1, 2, 0, "")], "FILE")
    finally:
        a.close()


ALIAS = """
import sys, ferry.nixl
print(ferry.nixl.install())
import nixl._api, nixl_rocm._api
print(nixl._api.__name__, nixl_rocm._api.__name__)
"""


@pytest.mark.skipif(importlib.util.find_spec("nixl") is not None, reason="a real NIXL is installed in this venv")
def test_alias_resolves_nixl_api_to_ferry():
    out = subprocess.run([sys.executable, "-c", ALIAS], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "ferry.nixl", "ferry.nixl"]


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="needs a real NIXL installed (scripts/test-nixl's venv)")
def test_alias_never_shadows_a_real_nixl():
    code = "import ferry.nixl; print(ferry.nixl.install()); import nixl._api; print(nixl._api.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "nixl_cu12._api"]
    assert "left as it is" in out.stderr
    forced = "import ferry.nixl; print(ferry.nixl.install(force=True)); import nixl._api; print(nixl._api.__name__)"
    out = subprocess.run([sys.executable, "-c", forced], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "ferry.nixl"]


def test_metadata_through_etcd(etcd_url, monkeypatch):
    """With FERRY_METADATA=etcd://..., agents find each other by name:
    send_local_metadata() publishes, fetch_remote_metadata(name) loads."""
    monkeypatch.setenv("FERRY_METADATA", etcd_url)
    a = nixl.nixl_agent("etcd-a")
    b = nixl.nixl_agent("etcd-b")
    try:
        a.send_local_metadata()
        b.fetch_remote_metadata("etcd-a")
        assert b.check_remote_metadata("etcd-a")
        assert b.add_remote_agent(a.get_agent_metadata()) == b"etcd-a"
        b.send_notif("etcd-a", b"via etcd")
        assert a.get_new_notifs() == {"etcd-b": [b"via etcd"]}
        b.fetch_remote_metadata("etcd-nobody")
        assert not b.check_remote_metadata("etcd-nobody")
    finally:
        b.close()
        a.close()


def test_the_user_token_is_read_with_the_engines_checks(tmp_path, monkeypatch):
    # A token directory another user could write (XDG_RUNTIME_DIR=/tmp, the
    # race of issue 34): refused with the engine's reason, never read.
    for var in ("FERRY_AUTH_TOKEN", "FERRY_AUTH_TOKEN_FILE", "FERRY_AUTH"):
        monkeypatch.delenv(var, raising=False)
    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    with pytest.raises(ferry.FerryError) as e:
        nixl_metadata.cluster_token()
    assert "group or others may write it" in str(e.value)
    # A token given explicitly is used as it is.
    assert nixl_metadata.cluster_token("s3cret") == b"s3cret"
