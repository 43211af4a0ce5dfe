"""What a communicator takes in memory per rank, from the native layouts themselves
(`jax_moe._native.buffer_bytes` reads ffi/protocol/nvlink_layout.h and
ffi/protocol/host_layout.h)."""

from __future__ import annotations

from jax_moe import native
from jax_moe.backends.native_backend import moe_dims
from jax_moe.config import MoEConfig


def per_rank_bytes(cfg: MoEConfig, axis_size: int, *, chunks: int = 132,
                   remote_ranks: int = 0) -> dict[str, int]:
  """Bytes one rank holds for a communicator of `cfg` over `axis_size` ranks.

  - "nvlink_buffer": the cuda backend's communication buffer over NVLink (both parities), for
    `chunks` token chunks (MoEConfig.num_sms, by default the device's SM count: 132 on H100
    and H200);
  - "host_buffer": the host backend's (and the cuda host proxies') buffer, plus one staging
    copy per rank on another host (`remote_ranks`; ranks of this host share buffers), of
    which only what this rank writes into that rank's buffer is memory
    (ffi/host/staging_extents.h); a cuda proxy rank with JAX_MOE_PROXY_NEAR_ROWS=device or
    JAX_MOE_PROXY_HMEM holds the buffer once more in device memory, and with the latter a
    device staging copy per remote rank (host_device_staging_ranges);
  - "dispatch_output": the arrays a dispatch returns (rows, scales, weights, counts, slot
    rows), allocated by XLA for each call in flight.
  """
  module = native.load()
  if module is None or not hasattr(module, "buffer_bytes"):
    raise ValueError(f"per_rank_bytes: needs jax_moe._native ({native.build_info()})")
  capacity = cfg.capacity(axis_size)
  layouts = module.buffer_bytes(moe_dims(cfg, axis_size), chunks)
  scales = capacity * cfg.num_scale_blocks * 4 if cfg.is_fp8 else 0
  output = (capacity * cfg.hidden * cfg.dispatch_dtype.itemsize + scales + capacity * 4
            + 2 * cfg.num_local_experts(axis_size) * 4
            + axis_size * cfg.max_tokens * cfg.experts_per_token * 4)
  return {"nvlink_buffer": int(layouts["nvlink"]),
          "host_buffer": int(layouts["host"])
          + remote_ranks * int(module.host_staging_bytes(moe_dims(cfg, axis_size))),
          "dispatch_output": int(output)}
