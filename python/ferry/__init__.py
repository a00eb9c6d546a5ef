"""Ferry: KV-cache and tensor transfers between GPU and host memory.

Two APIs over one engine:

- ``ferry.TransferEngine``: Mooncake's Python class, method for method
  (``from ferry import TransferEngine`` instead of
  ``from mooncake.engine import TransferEngine``); see docs/python.md for
  the differences.
- ``ferry.Engine``: Ferry's own, with context managers, exceptions
  (``ferry.FerryError``) and buffers given as objects (numpy arrays, torch
  tensors on CPU or GPU, anything with ``__cuda_array_interface__`` or the
  buffer protocol).

``ferry.info()`` reports the settings in effect and the plugins this host
loaded and why any was not: the same report as ``ferry info --json`` and C's
``ferry_info_json()``. ``ferry.config()`` checks settings without starting an
engine (docs/configuration.md).
"""

from __future__ import annotations

import json as _json
import os as _os

from .lib import _ferry
from ._engine import (
    Allocation,
    Engine,
    FerryError,
    Layout,
    Registration,
    RemoteBuffer,
    Segment,
    Status,
    Transfer,
)
from .mooncake import TransferEngine, TransferNotify, TransferOpcode

__version__ = _ferry.__version__

__all__ = [
    "Allocation",
    "Engine",
    "FerryError",
    "Info",
    "Layout",
    "Registration",
    "RemoteBuffer",
    "Segment",
    "Status",
    "Transfer",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "config",
    "error_codes",
    "info",
    "plugin_dir",
]


class Info(dict):
    """``ferry info --json`` as a dict; ``str()`` is the text report."""

    def __init__(self, text: str, data: dict):
        super().__init__(data)
        self.text = text

    def __str__(self) -> str:
        return self.text


def info() -> Info:
    """Ferry's version, the settings in effect, the plugin search path, every
    plugin with its state and the reason for it, GPUs and how their memory is
    registered: ``ferry info --json`` (docs/info-json.md), from the same
    function. A bad FERRY_* value raises ``FerryError`` with the reason."""
    text, data = _ferry.info_report()
    return Info(text, _json.loads(data))


def config(settings: dict = None) -> dict:
    """The settings an engine would start with: the FERRY_* variables, then
    ``settings`` (engine keys such as ``"staging_depth"`` or
    ``"gpu_direct"``, plugin settings such as ``"tcp.connections"``) on top.
    A value a key does not accept raises ``FerryError`` (``INVALID_ARGUMENT``)
    with the reason, exactly as ``Engine(settings=...)`` would. Secrets read
    ``"(set)"``."""
    options = [(str(k), str(v)) for k, v in (settings or {}).items()]
    return dict(_ferry.effective_config(options))


def error_codes() -> dict:
    """Ferry's error codes: {code: name}, e.g. {-4: "NOT_FOUND"}."""
    return dict(_ferry.error_codes())


def plugin_dir() -> str:
    """Where this package's plugins are (found with no environment variable)."""
    return _os.path.join(_os.path.dirname(_ferry.__file__), "ferry", "plugins")
