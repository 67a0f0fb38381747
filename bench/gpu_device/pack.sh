#!/usr/bin/env bash
# What a device call carries (see run.sh), built here from the package registry:
#   .whl/  the Python 3.12 wheels of our dependencies the device image lacks (fastapi, pydantic, ...)
#   .gpu/faiss90.tar.xz  the faiss-cuda wheel unpacked, its kernels cut to sm_90 (H100/H200), as xz
# Both folders are ignored by git (add `/.whl/` and `/.gpu/` to .git/info/exclude).
set -euo pipefail
plat="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64"
rm -rf .whl .gpu && mkdir -p .whl .gpu
# the versions this checkout's venv runs
pins=$(.venv/bin/pip freeze | grep -i -E '^(fastapi|starlette|pydantic|pydantic[-_]core|pydantic-settings|python-dotenv|uvicorn|httptools|python-multipart|annotated-types|annotated-doc|typing-inspection|opentelemetry-api|jsonschema|jsonschema-specifications|referencing|rpds-py)==')
python3 -m pip download -q $plat -d .whl $pins
tmp=$(mktemp -d)
python3 -m pip download -q $plat -d "$tmp" faiss-cuda==1.14.1.post4
(cd "$tmp" && unzip -q faiss_cuda-*.whl && rm faiss_cuda-*.whl)
python3 bench/gpu_device/prune_fatbin.py "$tmp"/faiss_cuda.libs/libfaiss-*.so 90
tar c -C "$tmp" . | xz -6 -T0 > .gpu/faiss90.tar.xz
rm -rf "$tmp"
du -sh .whl .gpu
