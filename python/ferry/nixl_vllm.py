"""vLLM's NixlConnector on Ferry, chosen by vLLM's configuration alone:

    --kv-transfer-config '{"kv_connector": "FerryNixlConnector",
                           "kv_connector_module_path": "ferry.nixl_vllm",
                           "kv_role": "kv_producer"}'

``FerryNixlConnector`` is vLLM's ``NixlConnector`` (the pull connector:
the decode side READs), its code unedited, whose worker's agent is
``ferry.nixl.nixl_agent`` instead of NIXL's. Nothing else in the process
changes: ``nixl._api`` is not aliased (``ferry.nixl.install()`` is not
called), so a real NIXL installed beside it, and any other NixlConnector
in the process, keep NIXL. The agent is swapped only while the worker is
constructed (vLLM's ``NixlBaseConnectorWorker.__init__`` is the one place
that reads ``NixlWrapper`` and ``nixl_agent_config``, module globals of
``vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker``), under
a lock, and put back at once, whatever the constructor does.

Needs vLLM (a version whose worker takes its agent from those two names:
0.34 does; an import of this module on one that does not fails with a
message saying so, never later in a transfer). docs/python.md ("vLLM's
NixlConnector on Ferry") lists what maps to what.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

from . import nixl as _ferry_nixl

logger = logging.getLogger("ferry.nixl")

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
except ImportError as e:  # vLLM absent, or laid out otherwise than this module knows
    raise ImportError(
        f"ferry.nixl_vllm: vLLM's NixlConnector could not be imported ({e}); this module runs "
        "vLLM's own connector code (vLLM 0.34's layout), so vLLM must be installed"
    ) from e

#: The names vLLM's worker takes its agent from, and Ferry's counterparts.
_AGENT_NAMES = {"NixlWrapper": _ferry_nixl.nixl_agent, "nixl_agent_config": _ferry_nixl.nixl_agent_config}

_missing = [n for n in _AGENT_NAMES if n not in vars(_base_worker)]
if _missing:
    raise ImportError(
        f"ferry.nixl_vllm: this vLLM's NixlConnector worker does not take its agent from "
        f"{', '.join(_missing)} (vLLM 0.34 does); FerryNixlConnector cannot run it on Ferry"
    )

_swap_lock = threading.RLock()


@contextmanager
def _ferry_agent():
    """vLLM's worker module sees Ferry's agent for the duration, only."""
    with _swap_lock:
        saved = {n: vars(_base_worker)[n] for n in _AGENT_NAMES}
        vars(_base_worker).update(_AGENT_NAMES)
        try:
            yield
        finally:
            vars(_base_worker).update(saved)


class FerryNixlConnectorWorker(NixlPullConnectorWorker):
    """vLLM's pull worker whose ``nixl_wrapper`` is a ``ferry.nixl`` agent."""

    def __init__(self, *args, **kwargs):
        with _ferry_agent():
            super().__init__(*args, **kwargs)
        if not isinstance(self.nixl_wrapper, _ferry_nixl.nixl_agent):  # a vLLM that made it otherwise
            raise RuntimeError(
                f"ferry.nixl_vllm: vLLM's worker made a {type(self.nixl_wrapper).__module__} agent, "
                "not Ferry's: this vLLM is not one FerryNixlConnector knows"
            )
        logger.info(
            "FerryNixlConnector: vLLM's NixlConnector worker (engine %s) moves its KV cache "
            "through Ferry (transports %s); nixl._api is left as it is",
            getattr(self, "engine_id", "?"), self.nixl_wrapper.get_engine().transports,
        )


class FerryNixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull) with its worker on Ferry's agent:
    use it through ``kv_connector_module_path="ferry.nixl_vllm"``."""

    def __init__(self, vllm_config, role, kv_cache_config):
        # The parent makes vLLM's worker; the swap makes that worker's
        # agent Ferry's (its scheduler side has no agent).
        with _ferry_agent():
            super().__init__(vllm_config, role, kv_cache_config)
        worker = getattr(self, "connector_worker", None)
        if worker is not None and not isinstance(worker.nixl_wrapper, _ferry_nixl.nixl_agent):
            raise RuntimeError(
                "ferry.nixl_vllm: vLLM's connector made its worker's agent with another class than "
                "Ferry's: this vLLM is not one FerryNixlConnector knows"
            )
        if worker is not None:
            logger.info(
                "FerryNixlConnector: vLLM's NixlConnector worker (engine %s) moves its KV cache "
                "through Ferry (transports %s); nixl._api is left as it is",
                self.engine_id, worker.nixl_wrapper.get_engine().transports,
            )


__all__ = ["FerryNixlConnector", "FerryNixlConnectorWorker"]
