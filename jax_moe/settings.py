"""Every JAX_MOE_* environment variable, read in one place (README.md lists them).

Each is read when it is needed (a Communicator, AllReduce or TransferEngine being built), so a
test or program may set it just before; a bad value raises ValueError naming the variable and
what it takes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

# Kernels wait in nanoseconds held in 64 bits; a day keeps every conversion far from overflow.
MAX_TIMEOUT_S = 86_400.0
DEFAULT_HOST_PROVIDER = "shm"


def timeout_s() -> float:
  """JAX_MOE_TIMEOUT_S: every wait's timeout in seconds, default 10."""
  text = os.environ.get("JAX_MOE_TIMEOUT_S", "10")
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan and inf
    raise ValueError(f"JAX_MOE_TIMEOUT_S must be a number of seconds in (0, {MAX_TIMEOUT_S}], "
                     f"got {text!r}")
  return value


def stage_clocks() -> bool:
  """JAX_MOE_STAGE_CLOCKS: "1" makes cuda communicators record per-block stage timestamps of
  their NVLink kernels (Communicator.stage_clocks(); default "0")."""
  text = os.environ.get("JAX_MOE_STAGE_CLOCKS", "0")
  if text not in ("0", "1"):
    raise ValueError(f"JAX_MOE_STAGE_CLOCKS must be 0 or 1, got {text!r}")
  return text == "1"


def force_remote() -> bool:
  """JAX_MOE_FORCE_REMOTE: "1" makes every peer of a cuda communicator remote (default "0")."""
  text = os.environ.get("JAX_MOE_FORCE_REMOTE", "0")
  if text not in ("0", "1"):
    raise ValueError(f"JAX_MOE_FORCE_REMOTE must be 0 or 1, got {text!r}")
  return text == "1"


def proxy_wait() -> str:
  """JAX_MOE_PROXY_WAIT: how a cuda stream rings and waits for its host proxy: "stream"
  (default, stream memory operations on the doorbell: no kernel is launched or holds the GPU
  meanwhile) or "kernel" (a one-thread kernel rings and spins, timeout-bounded on the GPU)."""
  text = os.environ.get("JAX_MOE_PROXY_WAIT", "stream")
  if text not in ("stream", "kernel"):
    raise ValueError(f"JAX_MOE_PROXY_WAIT must be 'stream' or 'kernel', got {text!r}")
  return text


def proxy_near_rows() -> str:
  """JAX_MOE_PROXY_NEAR_ROWS: where a cuda communicator through host proxies moves the rows
  between ranks of one host: "host" (default, through their shared host buffers, over PCIe)
  or "device" (each rank's device buffer, which the others of its host map: NVLink or the
  same GPU; routes and flags still go through host memory)."""
  text = os.environ.get("JAX_MOE_PROXY_NEAR_ROWS", "host")
  if text not in ("host", "device"):
    raise ValueError(f"JAX_MOE_PROXY_NEAR_ROWS must be 'host' or 'device', got {text!r}")
  return text


PROXY_HMEM_CHOICES = ("off", "on", "auto")
# Providers whose NICs write device memory themselves (GPUDirect RDMA); JAX_MOE_PROXY_HMEM
# uses only these, where this libfabric registers CUDA memory (it needs a build with CUDA).
# shm and tcp are refused: they move device memory with blocking CUDA copies on the progress
# thread. With a CUDA-built libfabric 1.17.1 on an H100 (session 20), such a copy of shm never
# returned while the streams waited for those rows, and its lock stopped both processes'
# proxies (a hang).
HMEM_PROVIDERS = ("efa", "verbs")


def proxy_hmem() -> str:
  """JAX_MOE_PROXY_HMEM: whether a cuda communicator through host proxies receives the rows
  of ranks on other hosts straight into device memory (libfabric FI_HMEM: the TransferEngine
  writes into a device buffer in the host layout; routes and flags stay in host memory): "off"
  (default, until this path has run on a GPU cluster: rows land in the host buffer), "on"
  (required: a provider of HMEM_PROVIDERS, and creating the communicator fails where it does
  not grant FI_HMEM or libfabric cannot register CUDA memory) or "auto" (on with the providers
  of HMEM_PROVIDERS where libfabric registers CUDA memory, off otherwise)."""
  text = os.environ.get("JAX_MOE_PROXY_HMEM", "off")
  if text not in PROXY_HMEM_CHOICES:
    raise ValueError(f"JAX_MOE_PROXY_HMEM must be one of {PROXY_HMEM_CHOICES}, got {text!r}")
  return text


def proxy_rows_device_from_remote(registers_cuda_memory: Callable[[str, str], bool]) -> bool:
  """Whether remote ranks' rows land in device memory: proxy_hmem(), and for "auto" the
  provider and `registers_cuda_memory(provider, node)` (transport.registers_cuda_memory: a
  registration probe, asked only then)."""
  choice = proxy_hmem()
  if choice == "off":
    return False
  provider = host_provider()
  rdma = provider.split(";")[0] in HMEM_PROVIDERS
  if choice == "on" and not rdma:
    raise ValueError(
        f"JAX_MOE_PROXY_HMEM=on needs JAX_MOE_HOST_PROVIDER to be one of {HMEM_PROVIDERS} "
        f"(GPUDirect RDMA), got {provider!r}: other providers copy device memory with "
        "blocking CUDA copies on their progress thread, which hang behind the streams that "
        "wait for those rows; use JAX_MOE_PROXY_HMEM=off")
  return choice == "on" or (rdma and registers_cuda_memory(provider, host_node()))


MLA_DECODE_CHOICES = ("auto", "pallas", "xla")  # jax_moe.models.mla_decode's implementations


def mla_decode() -> str:
  """JAX_MOE_MLA_DECODE: how a DeepSeek-V3 decode step attends over its cache
  (jax_moe.models.mla_decode): "auto" (default: the Pallas kernel on CUDA GPUs for bf16 and
  f16 caches of up to mla_decode.AUTO_MAX_KEYS rows, the einsums elsewhere), "pallas" or "xla"
  (the einsums)."""
  text = os.environ.get("JAX_MOE_MLA_DECODE", "auto")
  if text not in MLA_DECODE_CHOICES:
    raise ValueError(f"JAX_MOE_MLA_DECODE must be 'auto', 'pallas' or 'xla', got {text!r}")
  return text


def host_provider() -> str:
  """JAX_MOE_HOST_PROVIDER: the libfabric provider of the host backend across processes."""
  return os.environ.get("JAX_MOE_HOST_PROVIDER", DEFAULT_HOST_PROVIDER)


def host_node() -> str:
  """JAX_MOE_HOST_NODE: the address the host backend's endpoints bind ('' lets libfabric pick)."""
  return os.environ.get("JAX_MOE_HOST_NODE", "")


def host_domains(device: int = 0) -> list[str]:
  """JAX_MOE_HOST_DOMAINS: the libfabric domain names (NICs) whose endpoints the TransferEngine
  of the host backend's rank or cuda proxy on local device `device` uses, one rail each, its
  peers sharded across them: comma-separated ("rdmap79s0,rdmap80s0"), or one such group per
  local device separated by ";" (group device % groups: each GPU its nearest NICs, when one
  process drives several). Unset or empty: one rail on the provider's first domain."""
  text = os.environ.get("JAX_MOE_HOST_DOMAINS", "")
  if not text.strip():
    return []
  groups = [[d.strip() for d in group.split(",")] for group in text.split(";")]
  if not all(all(group) for group in groups):
    raise ValueError("JAX_MOE_HOST_DOMAINS must be comma-separated domain names, or groups of "
                     f"them separated by ';', got {text!r}")
  return groups[device % len(groups)]


def host_group() -> str:
  """JAX_MOE_HOST_GROUP: the host this process counts as (default: its host name). Processes of
  one host share memory: their host-backend ranks and cuda proxies map each other's buffers
  instead of writing through the TransferEngine, and a cuda mesh within one host needs no
  proxies. Tests give processes of one machine different groups to stand for several hosts."""
  return os.environ.get("JAX_MOE_HOST_GROUP", "").strip() or socket.gethostname()


def host_shuffle_seed() -> int:
  """JAX_MOE_HOST_SHUFFLE_SEED: non-zero applies completions late and in random order (tests)."""
  text = os.environ.get("JAX_MOE_HOST_SHUFFLE_SEED", "0")
  if not text.isdigit():
    raise ValueError(f"JAX_MOE_HOST_SHUFFLE_SEED must be a non-negative integer, got {text!r}")
  return int(text)


def _threads(variable: str, default: int) -> int:
  text = os.environ.get(variable, str(default))
  if not text.isdigit() or not 1 <= int(text) <= 64:
    raise ValueError(f"{variable} must be a number of threads in [1, 64], got {text!r}")
  return int(text)


def host_threads() -> int:
  """JAX_MOE_HOST_THREADS: row-loop threads of each host-backend rank (default 1: XLA runs
  each CPU device's program on its own thread already)."""
  return _threads("JAX_MOE_HOST_THREADS", 1)


