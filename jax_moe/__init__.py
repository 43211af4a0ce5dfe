"""jax-moe: expert-parallel MoE dispatch/combine and a small-message all-reduce for JAX
(docs/architecture.md: layers and data flow; docs/semantics.md: the contract)."""

from jax_moe.all_reduce import AllReduce
from jax_moe.communicator import Communicator, available_backends
from jax_moe.types import Dispatched
from jax_moe.config import MoEConfig
from jax_moe.errors import CommError, ErrorCode, Stage
from jax_moe.native import build_info
from jax_moe.quantization import dequantize_fp8, quantize_fp8

__all__ = [
    "AllReduce", "CommError", "Communicator", "Dispatched", "ErrorCode", "MoEConfig", "Stage",
    "available_backends", "build_info", "dequantize_fp8", "quantize_fp8",
]
