"""What a communicator takes in memory per rank, from the native layouts themselves
(`jax_moe._native.buffer_bytes` reads ffi/protocol/nvlink_layout.h and
ffi/protocol/host_layout.h)."""

from __future__ import annotations

from jax_moe import native
from jax_moe.backends.native_backend import moe_dims
from jax_moe.config import MoEConfig


def per_rank_bytes(cfg: MoEConfig, axis_size: int, *, chunks: int = 132,
                   remote_ranks: int = 0, proxy_device_rows: str = "off") -> dict[str, int]:
  """Bytes one rank holds for a communicator of `cfg` over `axis_size` ranks.

  - "nvlink_buffer": the cuda backend's communication buffer over NVLink (both parities), for
    `chunks` token chunks (MoEConfig.num_sms, by default the device's SM count: 132 on H100
    and H200);
  - "host_buffer": the host backend's (and the cuda host proxies') buffer, plus one staging
    copy per rank on another host (`remote_ranks`; ranks of this host share buffers), of
    which only what this rank writes into that rank's buffer is memory
    (ffi/host/staging_extents.h; with JAX_MOE_PROXY_HMEM only the routes);
  - "proxy_device_rows": the device memory of a cuda proxy rank's rows: with
    JAX_MOE_PROXY_NEAR_ROWS=device or JAX_MOE_PROXY_HMEM, a device buffer in the host layout,
    and with JAX_MOE_PROXY_HMEM and ranks on other hosts also a device staging copy of each
    (its token rows and combine terms for that rank, ffi/cuda/device_staging.h); 0 with
    neither setting (`proxy_device_rows`: "off", "near" or "hmem");
  - "dispatch_output": the arrays a dispatch returns (rows, scales, weights, counts, slot
    rows), allocated by XLA for each call in flight.
  """
  if proxy_device_rows not in ("off", "near", "hmem"):
    raise ValueError("per_rank_bytes: proxy_device_rows must be 'off', 'near' or 'hmem', got "
                     f"{proxy_device_rows!r}")
  module = native.load()
  if module is None or not hasattr(module, "buffer_bytes"):
    raise ValueError(f"per_rank_bytes: needs jax_moe._native ({native.build_info()})")
  capacity = cfg.capacity(axis_size)
  dims = moe_dims(cfg, axis_size)
  layouts = module.buffer_bytes(dims, chunks)
  device_rows = 0
  if proxy_device_rows != "off":
    device_rows = int(layouts["host"])
  if proxy_device_rows == "hmem":
    device_rows += remote_ranks * sum(n for _, n in module.host_device_staging_ranges(dims))
  scales = capacity * cfg.num_scale_blocks * 4 if cfg.is_fp8 else 0
  output = (capacity * cfg.hidden * cfg.dispatch_dtype.itemsize + scales + capacity * 4
            + 2 * cfg.num_local_experts(axis_size) * 4
            + axis_size * cfg.max_tokens * cfg.experts_per_token * 4)
  return {"nvlink_buffer": int(layouts["nvlink"]),
          "host_buffer": int(layouts["host"])
          + remote_ranks * int(module.host_staging_bytes(dims, proxy_device_rows == "hmem")),
          "proxy_device_rows": device_rows,
          "dispatch_output": int(output)}
