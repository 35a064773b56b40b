#!/usr/bin/env bash
# The Triton kernels on a CUDA machine with torch and triton (no paddle needed): docs/gpu.md.
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
