"""ferry.nixl_vllm (FerryNixlConnector) without vLLM installed: the import
fails at once with a message that says what is missing, never later in a
transfer, and it changes nothing about ``nixl._api``. With vLLM the
connector runs in python/tests/clients (vllm_nixl_peer.py,
FERRY_NIXL_VIA=connector)."""

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (python/tests/clients runs the connector)")
def test_without_vllm_the_import_says_what_is_missing():
    code = """
import sys
try:
    import ferry.nixl_vllm
except ImportError as e:
    print(e)
print(sorted(m for m in sys.modules if m.split('.')[0] in ('nixl', 'nixl_rocm')))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "vLLM's NixlConnector could not be imported" in lines[0] and "vLLM must be installed" in lines[0], lines
    assert lines[-1] == "[]", lines
