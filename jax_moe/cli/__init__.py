"""The `jax-moe` command: `info`, `demo` and `generate`, one module each in this package.

`info` says what runs here, `demo` runs one MoE layer and checks it against a dense one, and
`generate` runs expert-parallel text generation with a Qwen3-MoE or DeepSeek-V3 model.
"""

from __future__ import annotations

import argparse
import os

from jax_moe.cli import demo, generate, info

_CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def _simulate_cpu_devices(count: int = 8) -> None:
  """Gives the CPU platform `count` devices unless XLA_FLAGS already sets a count.

  XLA reads XLA_FLAGS when it creates its first client, so this must run before any jax
  call that touches devices. The flag only affects the CPU platform.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if _CPU_DEVICES_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_CPU_DEVICES_FLAG}={count}".strip()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jax-moe", description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  for command in (info, demo, generate):
    command.add_parser(commands)
  return parser


def main(argv: list[str] | None = None) -> int:
  _simulate_cpu_devices()
  args = _parser().parse_args(argv)
  return args.run(args)
