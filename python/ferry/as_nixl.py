"""``import ferry.as_nixl`` makes ``nixl._api`` (and ``nixl_rocm._api``)
resolve to Ferry's NIXL-compatible agent (``ferry.nixl``) in this process,
so vLLM's NixlConnector and Dynamo run on Ferry unedited. Opt-in, and never
over a real NIXL by accident: a real one installed is left alone (with a
warning) unless FERRY_NIXL_ALIAS=force. For the worker processes a stack
spawns, a ``.pth`` line imports this only when FERRY_NIXL_ALIAS is set
(docs/python.md, "vLLM's NixlConnector on Ferry")::

    import os; os.environ.get("FERRY_NIXL_ALIAS", "0") not in ("", "0") and __import__("ferry.as_nixl")
"""

import os

from . import nixl as _nixl

_nixl.install(force=os.environ.get("FERRY_NIXL_ALIAS", "").strip().lower() == "force")
