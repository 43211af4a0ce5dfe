"""`jax-moe info`: jax version, processes, devices, the global mesh, backends, build."""

from __future__ import annotations

from jax_moe.cli import common


def add_parser(commands) -> None:
  info = commands.add_parser("info", help="jax version, processes, devices, global mesh, "
                                         "available backends, build info")
  common.add_distributed_arguments(info)
  info.set_defaults(run=run)


def run(args) -> int:
  code = common.join(args, "info")
  if code is not None:
    return code
  import jax
  import jax_moe as jm
  from jax_moe import distributed

  if not distributed.is_primary():
    return 0
  print(f"jax {jax.__version__}, default platform {jax.default_backend()}")
  print(distributed.processes_summary())
  for device in jax.devices():
    print(f"  {device.id}: {device.device_kind} ({device.platform}, process "
          f"{device.process_index})")
  mesh = distributed.global_mesh()
  print(f"global mesh: {dict(mesh.shape)} over {mesh.devices.size} device(s) of "
        f"{jax.process_count()} process(es)")
  print(f"backends available: {', '.join(jm.available_backends())}")
  print("build:")
  for key, value in jm.build_info().items():
    print(f"  {key}: {value}")
  return 0
