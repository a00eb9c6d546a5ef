"""``import ferry.as_mooncake`` makes ``mooncake.engine`` resolve to Ferry's
Mooncake-compatible API (``ferry.mooncake``) in this process, so SGLang,
vLLM and LMCache, which import ``from mooncake.engine import
TransferEngine``, run on Ferry unedited. A real ``mooncake`` package that
is installed is shadowed; one already imported is left alone, with its
``engine`` replaced. For worker processes the stacks spawn, put the import
in a ``.pth`` file (docs/python.md, "Running SGLang, vLLM and LMCache on
Ferry")."""

import sys
import types

from . import mooncake as engine

_package = sys.modules.get("mooncake")
if _package is None:
    _package = types.ModuleType("mooncake", "Ferry standing in for Mooncake (ferry.as_mooncake)")
    _package.__path__ = []  # a package with no submodules but engine
    sys.modules["mooncake"] = _package
_package.engine = engine
sys.modules["mooncake.engine"] = engine
