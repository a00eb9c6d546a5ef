"""The metadata blob of ``ferry.nixl`` agents: what NIXL's
``get_agent_metadata`` returns and ``add_remote_agent`` takes.

Ferry's own, not NIXL's: the agent's name, the Ferry segment name peers
open (``host:port``, or the agent's name in etcd), and a proof: an
HMAC-SHA256 under the cluster token (the one the engine authenticates
with) over the rest. Registered memory and block layouts are not in it:
they are in the segment descriptor, which the peer reads over an
authenticated connection when it opens the segment.

The proof is a check, not the gate: ``add_remote_agent`` also opens the
segment, and that connection starts with Ferry's mutual token exchange
(docs/security.md), so a blob from a process without the token lets
nothing in either way. With the proof, a tampered or foreign blob is
refused at once with the reason instead of at the first transfer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Optional, Tuple

from .lib import _ferry

MAGIC = b"FERRY-NIXL-MD/1\n"
_CONTEXT = b"ferry-nixl-metadata-v1\0"


def cluster_token(configured: Optional[str] = None) -> Optional[bytes]:
    """The token the engine authenticates with, as bytes; None with
    FERRY_AUTH=off. The engine's own rule decides (native
    ``cluster_token``): the ``auth_token`` given, FERRY_AUTH_TOKEN,
    FERRY_AUTH_TOKEN_FILE, then this user's token file, opened without
    following a symbolic link and checked (owner, mode) as the engine checks
    it; a refusal raises FerryError with its reason."""
    options = [("auth_token", configured.strip())] if configured else []
    token = _ferry.cluster_token(options)
    return None if token is None else token.encode()


def _proof(token: bytes, payload: bytes) -> str:
    return hmac.new(token, _CONTEXT + payload, hashlib.sha256).hexdigest()


def build(agent: str, segment: str, token: Optional[bytes]) -> bytes:
    payload = json.dumps({"agent": agent, "segment": segment}, sort_keys=True).encode()
    proof = _proof(token, payload) if token is not None else ""
    return MAGIC + payload + b"\n" + proof.encode()


class MetadataError(ValueError):
    """A blob that is not Ferry's, or whose proof does not hold."""


def parse(blob: bytes, token: Optional[bytes]) -> Tuple[str, str]:
    """(agent name, segment name) of a blob, checked against ``token``
    (refused when the proof is missing or wrong; with no token, FERRY_AUTH
    is off here and the proof is not checked)."""
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise MetadataError(
            "not a ferry.nixl agent's metadata (a real NIXL agent's? both sides must run "
            "on Ferry: ferry.nixl cannot talk to NIXL's UCX)"
        )
    payload, _, proof = blob[len(MAGIC):].rpartition(b"\n")
    try:
        data = json.loads(payload)
        agent, segment = str(data["agent"]), str(data["segment"])
    except (ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"malformed ferry.nixl metadata: {e}") from None
    if token is not None:
        if not proof:
            raise MetadataError(
                f"agent {agent!r}'s metadata carries no proof (its process runs with FERRY_AUTH=off) "
                "and this one has a cluster token: refused"
            )
        if not hmac.compare_digest(proof.decode(errors="replace"), _proof(token, payload)):
            raise MetadataError(
                f"agent {agent!r}'s metadata was not made with this cluster's token "
                "(FERRY_AUTH_TOKEN differs, or the blob was altered): refused"
            )
    return agent, segment
