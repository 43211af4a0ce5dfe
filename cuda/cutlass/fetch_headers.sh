#!/usr/bin/env bash
# Unpacks CUTLASS's C++ headers (include/ and tools/util/include/, ~30 MB) into .cutlass/, where
# CMakeLists.txt looks for them to build the fp8 grouped GEMM (cuda/cutlass/). They come from
# the nvidia-cutlass wheel on PyPI, which ships CUTLASS's source tree; only the headers are
# kept and nothing is installed. Without a network (the GPU machines) pass the wheel, or leave
# it in .whl/ (benchmarks/fetch_wheels.sh puts it there).
#   bash cuda/cutlass/fetch_headers.sh [path/to/nvidia_cutlass-*.whl]
set -euo pipefail
cd "$(dirname "$0")/../.."
version=4.2.0.0
wheel=${1:-$(compgen -G ".whl/nvidia_cutlass-$version-*.whl" | head -1 || true)}
if [ -z "$wheel" ]; then
  download=$(mktemp -d)
  trap 'rm -rf "$download"' EXIT
  python3 -m pip download -q --no-deps "nvidia-cutlass==$version" -d "$download"
  wheel=$(compgen -G "$download/nvidia_cutlass-*.whl" | head -1)
fi
python3 - "$wheel" .cutlass <<'PY'
import pathlib, shutil, sys, zipfile

wheel, target = sys.argv[1], pathlib.Path(sys.argv[2])
prefix = "cutlass_library/source/"
keep = (prefix + "include/", prefix + "tools/util/include/")
shutil.rmtree(target, ignore_errors=True)
count = 0
with zipfile.ZipFile(wheel) as archive:
  for member in archive.infolist():
    if member.is_dir() or not member.filename.startswith(keep):
      continue
    path = target / member.filename[len(prefix):]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(archive.read(member))
    count += 1
if not (target / "include/cutlass/version.h").exists():
  sys.exit(f"{wheel} has no {prefix}include/cutlass/version.h")
print(f"CUTLASS headers: {count} files from {wheel} in {target}/")
PY
