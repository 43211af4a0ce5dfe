"""Loading the optional native module ``jax_moe._native`` and registering its FFI targets.

The package works without it (the ``xla`` backend is pure JAX), so nothing here raises when
the module is missing or fails to load; the reason is kept for ``build_info()``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import threading
from types import ModuleType

_register_lock = threading.Lock()
_registered = False


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
  try:
    return importlib.import_module("jax_moe._native"), None
  except ImportError as e:  # not built, or a shared library it needs is missing
    return None, f"{type(e).__name__}: {e}"


def load() -> ModuleType | None:
  """The ``jax_moe._native`` module, or None when it is not built or cannot be loaded."""
  return _load()[0]


def _package_version() -> str:
  try:
    return importlib.metadata.version("jax-moe")
  except importlib.metadata.PackageNotFoundError:  # running from a source tree
    return "unknown"


def build_info() -> dict:
  """What the native layer provides here.

  Keys: version, native, native_error (why it did not load, else None), cuda, cuda_version,
  cuda_archs, cutlass_version (the CUTLASS whose headers built the fp8 grouped GEMM, None when
  the build had none), libfabric, libfabric_version, libfabric_header_version, jax_version (the jax
  whose FFI headers were compiled in; None without the native module), xla_ffi_api,
  thread_names ({role: name} of the threads the native layer starts: "transfer_engine", one
  progress thread per engine; "host_proxy", one per proxied GPU; empty without the module).
  """
  module, error = _load()
  if module is None:
    return {
      "version": _package_version(),
      "native": False,
      "native_error": error,
      "cuda": False,
      "cuda_version": None,
      "cuda_archs": None,
      "cutlass_version": None,
      "libfabric": False,
      "libfabric_version": None,
      "libfabric_header_version": None,
      "jax_version": None,
      "xla_ffi_api": None,
      "thread_names": {},
    }
  return {**module.build_info(), "native_error": None}


def has_cuda() -> bool:
  """True when the native module is loaded and was built with the CUDA kernels."""
  module = load()
  return module is not None and bool(module.build_info()["cuda"])


def register_targets() -> None:
  """Registers every FFI target of the native module with jax, once per process.

  A no-op without the native module. Safe to call from several threads.
  """
  global _registered
  with _register_lock:
    if _registered:
      return
    module = load()
    if module is not None:
      import jax

      for platform, targets in module.registrations().items():
        for name, capsule in targets.items():
          jax.ffi.register_ffi_target(name, capsule, platform=platform)
    _registered = True
