#!/usr/bin/env bash
# Fill a wheels folder for bench/gpu_check.sh on a GPU machine without network:
#   bash bench/gpu_wheels.sh DIR        (on a machine with network; then copy DIR and the checkout over)
# Downloads, for CPython 3.12 on manylinux x86-64, the project's dependencies (pyproject.toml) minus torch (the GPU
# machine brings its own CUDA build) plus what the GPU tests import (pytest; transformers for diffusers' reference
# pipeline), with their dependencies, binary wheels only. The list it used is kept as DIR/requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: bash bench/gpu_wheels.sh DIR}"
mkdir -p "$dir"
python - "$dir/requirements.txt" <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = {"pytest", "transformers"}  # tests/gpu: the runner, and the reference pipeline's imports
wanted = [d for d in project["dependencies"] if re.split(r"[\[<>=!~ ]", d)[0] != "torch"]
wanted += [d for d in project["optional-dependencies"]["test"] if re.split(r"[\[<>=!~ ]", d)[0] in extra]
open(sys.argv[1], "w").write("\n".join(wanted) + "\n")
print("\n".join(wanted))
PY
# torch is excluded by name above; a dependency that asks for it (none today) would fail here rather than pull a
# second torch in: the GPU machine's torch must stay.
python -m pip download -q --dest "$dir" --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform any -r "$dir/requirements.txt"
ls "$dir" | wc -l | xargs echo "wheels in $dir:"
