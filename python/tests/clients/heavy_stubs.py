"""Stand-ins for the heavy native modules that SGLang, vLLM and LMCache
import at module level but whose code the transfer paths under test never
run. Installed by a meta-path finder for the top-level names in STUBS only
(the test venv's ``ferry-clients-stubs.pth`` imports this module); every
other import is the real package's. Each stub module answers any
attribute with a placeholder class, so ``torch.Tensor`` in an annotation,
``torch.float16`` in a table or ``@triton.jit`` on a kernel definition
import without running anything. A placeholder that is *called* for real
work fails loudly (``StubUsed``), so a test can never pass on stub output.

SGLang and vLLM run some torch at import (sglang.srt.utils, the model
configs, vLLM's custom-op and IR-op registration, its reload tracer):
ANSWERS gives those calls answers that do no work, each with its reason:
custom-op registration (``torch.library.Library``), dtype objects and
``finfo``, ``torch.device``, ``no_grad`` as a decorator, vLLM's
``infer_schema`` (a schema string from the signature; vLLM's IR parses
it), ``register_fake`` and ``triton_op`` (decorators that register),
``torch.Tensor.__int__`` and friends as values, ``nn.Module``
subclasses constructed at import (running one raises), tensor
constants (``torch.tensor``/``zeros``/...) that raise on any use, and
``torch.tensor([], dtype=d).element_size()`` (vLLM's dtype-size helper). ABSENT
names real torch lacks (``hasattr(torch, "npu")`` probes).
"""

import abc
import importlib.abc
import importlib.machinery
import os
import sys
import types

#: top-level name -> why it is a stub (python/tests/test_real_clients.py lists these too).
STUBS = {
    "torch": "PyPI's torch is the CUDA build (~900 MB with its nvidia-* wheels, which it needs to "
             "import); the CPU build is not on PyPI. The transfer paths move host memory by address "
             "(numpy buffers here); torch is imported for annotations, dtype tables and GPU helpers",
    "torchvision": "torch's image extension (native, over libtorch); SGLang's model configs "
                   "import it for multimodal preprocessing",
    "tvm_ffi": "apache-tvm-ffi (native), the FFI of SGLang's JIT CUDA kernels (all-reduce)",
    "compressed_tensors": "weight-quantization schemes (SGLang's quantization configs); its import "
                          "builds transformers' torch modeling classes, which need real torch",
    "triton": "GPU kernel compiler (vLLM, SGLang kernels); needs a GPU driver",
    "sgl_kernel": "SGLang's CUDA kernels (native, GPU only)",
    "flashinfer": "CUDA attention kernels",
    "xgrammar": "structured-output grammar compiler (native, over tvm_ffi and torch); vLLM's "
                "request module builds its grammar class at import",
    "vllm._C": "vLLM's compiled CUDA ops (loading needs libtorch and libcudart)",
    "vllm._custom_ops": "wrappers over vllm._C",
    "vllm._C_stable_libtorch": "vLLM's compiled ops on libtorch's stable ABI (its CUDA platform "
                               "imports them; the GPU run of vllm_nixl_peer.py has no vLLM build)",
    "lmcache.lmcache_native": "LMCache's C++ ops, linked against libtorch (libc10.so); the "
                              "transfer channel moves bytes through the engine, not these",
    "numba": "a JIT compiler over llvmlite (native LLVM, ~50 MB) for LMCache's cachegen "
             "compression kernels, which the transfer channel does not run",
    "lmcache.cuda_ops": "LMCache's CUDA kernels (libtorch, libcudart)",
}


# On a machine that has some of these for real (the GPU run of
# vllm_nixl_peer.py: torch and triton), FERRY_HEAVY_STUBS_REAL names them.
for _real in os.environ.get("FERRY_HEAVY_STUBS_REAL", "").split(","):
    STUBS.pop(_real.strip(), None)


class StubUsed(RuntimeError):
    pass


class _OpRegistry:
    """``torch.library.Library(ns, kind)``: SGLang and vLLM register their
    custom ops at import time (``define``/``impl``/``_register_fake``).
    Registering is bookkeeping; *running* an op goes through ``torch.ops``,
    which stays a raising stub, so accepting the registration runs no work."""

    def __init__(self, ns=None, *args, **kwargs):
        self.m = None
        self.ns = ns  # vLLM looks its ops up again by namespace (torch.ops.<ns>)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _Module:
    """``torch.nn.Module``: SGLang builds a few module objects at import time
    (``register_fused_op(SiluAndMulOp(), ...)``); constructing one stores
    Python attributes only. Running one (``module(x)``) is real work: it
    raises, as does every tensor op its ``forward`` would call."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise StubUsed(f"{type(self).__qualname__}: running a torch module is a test stub "
                       "(python/tests/clients/heavy_stubs.py)")


class _Device:
    """``torch.device("cpu")``: a name, used as a default argument value."""

    def __init__(self, type="cpu", index=None):
        self.type, self.index = (str(type).split(":") + [index])[:2] if ":" in str(type) else (type, index)

    def __repr__(self):
        return f"device(type={self.type!r}" + (f", index={self.index})" if self.index is not None else ")")


class _GradMode:
    """``@torch.no_grad()`` / ``@torch.inference_mode()`` on a method: the
    method itself (a decorator factory; whatever the method does runs)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, f):
        return f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DType:
    """``torch.float16`` and the rest: names in tables and pydantic fields
    (``isinstance(x, torch.dtype)``); no arithmetic."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"

    @property
    def itemsize(self):
        bits = "".join(c for c in self.name.split("_")[0] if c.isdigit())
        return int(bits) // 8 if bits else 1

    is_floating_point = property(lambda self: self.name.startswith(("float", "bfloat", "half")))


DTYPES = {n: _DType(n) for n in (
    "float16 float32 float64 bfloat16 half float double int8 int16 int32 int64 uint8 uint16 uint32 "
    "uint64 bool long int short float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2 complex64 complex128 bits8 qint8 quint8 qint32").split()}


#: torch.finfo(dtype).max for the narrow float types (module-level
#: constants such as SGLang's FP8_E4M3_MAX); the others come from numpy.
_FMAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0,
         "float8_e5m2fnuz": 57344.0, "bfloat16": 3.3895313892515355e38, "float4_e2m1fn_x2": 6.0}


def _info(dtype):
    import numpy as np

    name = getattr(dtype, "name", str(dtype))
    if name in _FMAX:
        return types.SimpleNamespace(max=_FMAX[name], min=-_FMAX[name], eps=2.0 ** -3,
                                     tiny=2.0 ** -6, bits=dtype.itemsize * 8, dtype=name)
    aliases = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32"}
    t = np.dtype(aliases.get(name, name))
    return np.finfo(t) if t.kind == "f" else np.iinfo(t)


class _Inert:
    """What ``torch.tensor([...])`` / ``torch.zeros(...)`` return at import
    time (class-level constants of quantization helpers): holds nothing, and
    every use (an attribute, an operator, indexing) raises StubUsed."""

    def __init__(self, maker):
        object.__setattr__(self, "_maker", maker)

    def _used(self, *args, **kwargs):
        raise StubUsed(f"a tensor from {self._maker} is a test stub (python/tests/clients/heavy_stubs.py)")

    def __getattr__(self, name):
        self._used()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __getitem__ = _used
    __setitem__ = __iter__ = __len__ = __bool__ = __int__ = __float__ = __index__ = __setattr__ = _used
    __lt__ = __le__ = __gt__ = __ge__ = __matmul__ = __neg__ = __array__ = _used


def _schema(f):
    """``torch.library.infer_schema(f)``: the op schema string of ``f``'s
    signature, read from its annotations as torch does (one ``Tensor`` per
    tensor the function returns; vLLM's IR ops parse it). Bookkeeping."""
    import inspect

    sig = inspect.signature(f)
    ret = sig.return_annotation
    n = (ret if isinstance(ret, str) else repr(ret)).count("Tensor")
    if ret is inspect.Signature.empty or ret is None:
        n = 0
    returns = "()" if n == 0 else "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return "(" + ", ".join(f"Tensor {p}" for p in sig.parameters) + ") -> " + returns


class _EmptyOf:
    """``torch.tensor([], dtype=d)``: vLLM's ``get_dtype_size`` asks an
    empty tensor its ``element_size()``, a fact of the dtype; nothing else."""

    def __init__(self, dtype):
        self.dtype = dtype

    def element_size(self):
        return self.dtype.itemsize


def _maker(name):
    def make(*args, **kwargs):
        if name == "tensor" and args and args[0] == [] and isinstance(kwargs.get("dtype"), _DType):
            return _EmptyOf(kwargs["dtype"])
        return _Inert(f"torch.{name}")
    return make


#: The few stub calls that must answer, each the truthful answer on a
#: machine with no GPU (import-time probes of the stacks).
ANSWERS = {
    "torch.cuda.is_available": lambda *a, **k: False,
    "torch.cuda.device_count": lambda *a, **k: 0,
    "torch.version.cuda": None,
    "torch.version.hip": None,
    "torch.__version__": "2.9.0+ferry.stub",
    "torch.library.Library": _OpRegistry,
    # vLLM's direct_register_custom_op: the schema string for the
    # registration above (bookkeeping; the op itself runs through torch.ops).
    "torch.library.infer_schema": lambda f, *a, **k: _schema(f),
    # @register_fake("_C::op") (vLLM's CPU ops): a decorator that records a
    # shape function for tracing; the decorated function is returned as is.
    "torch.library.register_fake": lambda *a, **k: (lambda f: f),
    # @triton_op("vllm::name", mutates_args=...): registration, as above.
    "torch.library.triton_op": lambda *a, **k: (lambda f: f),
    "torch.nn.Module": _Module,
    # A kernel's compile-time constant wrapper: the value itself.
    "triton.language.constexpr": lambda value=None, *a, **k: value,
    "torch.device": _Device,
    **{f"torch.{n}": _maker(n) for n in "tensor zeros ones empty full arange".split()},
    "torch.finfo": _info,
    "torch.iinfo": _info,
    "torch.dtype": _DType,
    **{f"torch.{n}": d for n, d in DTYPES.items()},
    # torch's own CPU set_device does nothing (vLLM's CPU platform calls it
    # before a NIXL handshake).
    "torch.cpu.set_device": lambda *a, **k: None,
    "torch.no_grad": _GradMode,
    "torch.inference_mode": _GradMode,
    "torch.enable_grad": _GradMode,
    "torch.distributed.ReduceOp.SUM": 0,  # its value in torch (int(ReduceOp.SUM) at import)
}


#: Names real torch does not have: out-of-tree accelerator backends, which
#: the stacks probe with ``hasattr(torch, "npu")``.
ABSENT = {"torch.npu", "torch.hpu", "torch.musa", "torch.mlu", "torch.sail", "torch.sdaa"}


def _attribute(qualname):
    if qualname in ABSENT:
        raise AttributeError(qualname)
    if qualname in ANSWERS:
        return ANSWERS[qualname]
    # Every accelerator probe (torch.npu, torch.xpu, torch.mps, ...): none here.
    if qualname.startswith("torch.") and qualname.rsplit(".", 1)[-1] in ("is_available", "device_count"):
        return ANSWERS["torch.cuda." + qualname.rsplit(".", 1)[-1]]
    return _placeholder(qualname)


_METHOD_DUNDERS = {"__int__", "__float__", "__index__", "__complex__"}


class _Placeholder(abc.ABCMeta):
    # ABCMeta, not type: stacks derive from a stub and ABC at once
    # (SGLang's ``class BaseFusedOp(nn.Module, ABC)``).
    def __getattr__(cls, name):
        # Tensor methods named as values (vLLM's reload tracer keeps a set
        # of torch.Tensor.__int__ and friends): placeholders too.
        if name.startswith("__") and name.endswith("__") and name not in _METHOD_DUNDERS:
            raise AttributeError(name)
        return _attribute(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        # Decorators (@triton.jit, @torch.compile(...)) hand back what they wrap.
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        if not args and kwargs:
            return lambda f: f
        raise StubUsed(f"{cls.__qualname__} is a test stub (python/tests/clients/heavy_stubs.py): "
                       "the code under test called into a heavy module it should not need")

    def __or__(cls, other):
        return cls

    # Module-level constants computed from torch (-finfo.max, sizes).
    __ror__ = __add__ = __radd__ = __sub__ = __rsub__ = __or__
    __mul__ = __rmul__ = __truediv__ = __floordiv__ = __pow__ = __or__

    def __neg__(cls):
        return cls

    __pos__ = __neg__

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


def _placeholder(qualname):
    return _Placeholder(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "stub"})


class _StubModule(types.ModuleType):
    __ferry_stub__ = True

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _attribute(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+ferry.stub"
        return m

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBS):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
