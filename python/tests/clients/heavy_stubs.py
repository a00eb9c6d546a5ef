"""Stand-ins for the heavy native modules that SGLang, vLLM and LMCache
import at module level but whose code the transfer paths under test never
run. Installed by a meta-path finder for the top-level names in STUBS only
(the test venv's ``ferry-clients-stubs.pth`` imports this module); every
other import is the real package's. Each stub module answers any
attribute with a placeholder class, so ``torch.Tensor`` in an annotation,
``torch.float16`` in a table or ``@triton.jit`` on a kernel definition
import without running anything. A placeholder that is *called* for real
work fails loudly (``StubUsed``), so a test can never pass on stub output.
"""

import importlib.abc
import importlib.machinery
import sys
import types

#: top-level name -> why it is a stub (python/tests/test_real_clients.py lists these too).
STUBS = {
    "torch": "PyPI's torch is the CUDA build (~900 MB with its nvidia-* wheels, which it needs to "
             "import); the CPU build is not on PyPI. The transfer paths move host memory by address "
             "(numpy buffers here); torch is imported for annotations, dtype tables and GPU helpers",
    "triton": "GPU kernel compiler (vLLM, SGLang kernels); needs a GPU driver",
    "sgl_kernel": "SGLang's CUDA kernels (native, GPU only)",
    "flashinfer": "CUDA attention kernels",
    "vllm._C": "vLLM's compiled CUDA ops (loading needs libtorch and libcudart)",
    "vllm._custom_ops": "wrappers over vllm._C",
    "lmcache.lmcache_native": "LMCache's C++ ops, linked against libtorch (libc10.so); the "
                              "transfer channel moves bytes through the engine, not these",
    "numba": "a JIT compiler over llvmlite (native LLVM, ~50 MB) for LMCache's cachegen "
             "compression kernels, which the transfer channel does not run",
    "lmcache.cuda_ops": "LMCache's CUDA kernels (libtorch, libcudart)",
}


#: The few stub calls that must answer, each the truthful answer on a
#: machine with no GPU (import-time probes of the stacks).
ANSWERS = {
    "torch.cuda.is_available": lambda *a, **k: False,
    "torch.cuda.device_count": lambda *a, **k: 0,
    "torch.version.cuda": None,
    "torch.version.hip": None,
    "torch.__version__": "2.9.0+ferry.stub",
}


class StubUsed(RuntimeError):
    pass


def _attribute(qualname):
    if qualname in ANSWERS:
        return ANSWERS[qualname]
    # Every accelerator probe (torch.npu, torch.xpu, torch.mps, ...): none here.
    if qualname.startswith("torch.") and qualname.rsplit(".", 1)[-1] in ("is_available", "device_count"):
        return ANSWERS["torch.cuda." + qualname.rsplit(".", 1)[-1]]
    return _placeholder(qualname)


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
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
