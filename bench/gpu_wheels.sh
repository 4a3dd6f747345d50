#!/usr/bin/env bash
# Fill a wheels folder for bench/gpu_check.sh on a GPU machine without network:
#   bash bench/gpu_wheels.sh DIR                   (here, with a package registry; then carry DIR with the checkout)
#   PYVER=3.11 bash bench/gpu_wheels.sh DIR        (wheels for another CPython, e.g. to rehearse on this machine)
# The GPU machine brings its own Python (3.12 on the workplace's CUDA image), CUDA torch and a large scientific
# stack; what it lacks is diffusers and the service's web packages. This folder holds the project's dependencies
# (pyproject.toml, torch excluded) with the whole closure of what they need, binary wheels for CPython $PYVER on
# manylinux x86-64, minus the large packages that such an image already has (LARGE_AND_PRESENT below: numpy,
# pillow, tokenizers...): the device tool carries at most 64 MiB with the checkout, and those alone are ~40 MB.
# Small pure-Python ones stay even where the image has them, so that pip can satisfy a pin the image's copy misses.
# The list gpu_check.sh installs is kept as DIR/requirements.txt: the project's pins, except transformers and
# pytest (only the GPU tests import them; the image's own are used) and torch (the machine's CUDA build stays).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: bash bench/gpu_wheels.sh DIR}"
pyver="${PYVER:-3.12}"
# Present on the CUDA image (device tool's package list, 2026-11-17) and too big to carry: never downloaded into DIR.
LARGE_AND_PRESENT="torch triton numpy pillow regex hf-xet tokenizers safetensors transformers uvloop sympy networkx"
mkdir -p "$dir"
rm -f "$dir"/*.whl
python3 - "$dir/requirements.txt" <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
name = lambda requirement: re.split(r"[\[<>=!~ ;]", requirement)[0].lower()
wanted = [d for d in project["dependencies"] if name(d) != "torch"]
# The GPU tests' runner and diffusers' reference pipeline: any version the machine has (unpinned).
wanted += ["pytest", "transformers"]
open(sys.argv[1], "w").write("\n".join(wanted) + "\n")
print("\n".join(wanted))
PY
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
# The closure, resolved for the target Python. Nothing in it asks for torch today; were something to, its torch
# wheel would be left out below with the other large ones, so no second torch can reach the GPU machine.
grep -v -E '^(pytest|transformers)$' "$dir/requirements.txt" > "$stage/download.txt"
python3 -m pip download -q --dest "$stage" --only-binary=:all: --implementation cp --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform any -r "$stage/download.txt"
for wheel in "$stage"/*.whl; do
  project="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')"
  if [[ " $LARGE_AND_PRESENT " == *" $project "* ]]; then
    echo "left out (on the image): $(basename "$wheel")"
  else
    cp "$wheel" "$dir/"
  fi
done
echo "wheels in $dir: $(ls "$dir"/*.whl | wc -l), $(du -cb "$dir"/*.whl | tail -1 | cut -f1) bytes"
