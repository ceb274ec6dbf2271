#!/usr/bin/env bash
# prototypes.sh - normalised, sorted list of the function prototypes declared by an nccl.h.
#
# Usage:  prototypes.sh HEADER [INCLUDE_DIR...]
#         (HEADER's own folder is searched first; give e.g. the cuda-stub folder for
#         NVIDIA's header.) Output format: see the docstring of prototypes.py.
# The header is preprocessed as C with NCCL_OS_LINUX defined, so the declarations that
# exist only on Linux (ncclResetDebugInit) are listed too.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 HEADER [INCLUDE_DIR...]" >&2
  exit 2
fi
header=$1
shift
args=(-I "$(dirname "$header")")
for dir in "$@"; do args+=(-I "$dir"); done
here=$(dirname "$0")
# Pipe with pipefail: a preprocessor error fails the script.
gcc -E -P -x c -std=c11 -DNCCL_OS_LINUX "${args[@]}" "$header" | python3 "$here/prototypes.py"
