"""Registers, stack frame and spills of every CUDA kernel, as ptxas reports them.

Compiles each `cuda/*.cu` of an existing build folder once more with `-Xptxas -v` (the build's
own nvcc command from its build.ninja, output to a scratch folder) and prints one line per
kernel and architecture. A stack frame in a hot loop costs a load and a store per use (session
20 found the fp8 quantization and the all-reduce keeping values there), so the default is to
show only kernels with a stack frame or spills; `--all` shows every kernel. Needs nvcc, not a
GPU. Exits 1 when `--fail-on-stack` is given and a shown kernel matches it (a regex on the
kernel's name).

  python3 benchmarks/kernel_resources.py [--build build/cp311-...] [--all] [--arch sm_90a]
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def nvcc_commands(build: Path) -> dict[str, list[str]]:
  """The nvcc command of each cuda/*.cu source in the build's ninja file."""
  text = subprocess.run(["ninja", "-C", str(build), "-t", "commands"], check=True,
                        capture_output=True, text=True).stdout
  commands = {}
  for line in text.splitlines():
    match = re.search(r"-c (\S*/cuda/\w+\.cu)\b", line)
    if "nvcc" in line and match:
      commands.setdefault(match.group(1), shlex.split(line))
  return commands


def kernel_usage(command: list[str], scratch: Path) -> list[dict]:
  """Compiles with -Xptxas -v into `scratch`; one record per (kernel, architecture)."""
  args, skip = [], False
  for arg in command:
    if skip:
      skip = False
      continue
    if arg in ("-o", "-MF", "-MT"):
      skip = True
      continue
    if arg == "-MD":
      continue
    args.append(arg)
  source = next(a for a in args if a.endswith(".cu"))
  out = scratch / (Path(source).stem + ".o")
  result = subprocess.run(args + ["-Xptxas", "-v", "-o", str(out)], capture_output=True,
                          text=True)
  if result.returncode:
    raise RuntimeError(f"nvcc failed for {source}:\n{result.stderr[-2000:]}")
  records, current = [], None
  for line in result.stderr.splitlines():
    if m := ENTRY.search(line):
      current = {"source": Path(source).name, "kernel": m.group(1), "arch": m.group(2)}
    elif current and (m := USAGE.search(line)):
      current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                     spill_loads=int(m.group(3)))
    elif current and (m := REGISTERS.search(line)):
      current["registers"] = int(m.group(1))
      records.append(current)
      current = None
  return records


def demangled(names: list[str]) -> list[str]:
  try:
    return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                          check=True).stdout.splitlines()
  except (OSError, subprocess.CalledProcessError):
    return names


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  builds = sorted(Path("build").glob("*/build.ninja"))
  p.add_argument("--build", type=Path, default=builds[0].parent if builds else None,
                 help="a CMake build folder of jax_moe with CUDA (default: the first in build/)")
  p.add_argument("--arch", default="sm_90a", help="architecture to report (default sm_90a)")
  p.add_argument("--all", action="store_true", help="every kernel, not only those with a stack")
  p.add_argument("--fail-on-stack", default=None, metavar="REGEX",
                 help="exit 1 if a kernel whose name matches has a stack frame or spills")
  args = p.parse_args()
  if args.build is None or not (args.build / "build.ninja").exists():
    p.error("--build must name a build folder with a build.ninja (pip install -e . makes one)")
  commands = nvcc_commands(args.build)
  if not commands:
    p.error(f"no nvcc command for cuda/*.cu in {args.build}/build.ninja (a build without CUDA?)")
  with tempfile.TemporaryDirectory() as scratch:
    records = [r for c in commands.values() for r in kernel_usage(c, Path(scratch))
               if r["arch"] == args.arch]
  names = demangled([r["kernel"] for r in records])
  failed = False
  for r, name in sorted(zip(records, names), key=lambda x: (x[0]["source"], x[1])):
    heavy = r["stack"] or r["spill_stores"] or r["spill_loads"]
    if not (heavy or args.all):
      continue
    short = re.sub(r"jax_moe::\(anonymous namespace\)::", "", name)[:110]
    print(f"{r['source']:20} regs {r['registers']:3d}  stack {r['stack']:4d}  spills "
          f"{r['spill_stores']:3d}/{r['spill_loads']:3d}  {short}")
    if heavy and args.fail_on_stack and re.search(args.fail_on_stack, name):
      failed = True
  print(f"{len(records)} kernels for {args.arch} in {len(commands)} sources")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
