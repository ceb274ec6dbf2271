#!/usr/bin/env bash
# abi_layout.sh - include/nccl.h against NVIDIA's nccl.h: same ABI, same API, compiles alone.
#
# Usage:  ffi-tests/abi_layout.sh
# Env:    NCCL_REFERENCE_DIR  folder from ../shared/scripts/nccl-reference.sh (run if unset)
#         CC, CXX             compilers (default gcc, g++)
# Checks, each printed as "ok ..." or "FAIL ..." with a diff or the compiler's message:
#   1. our header alone compiles as C11 (-pedantic) and C++17 with -Wall -Wextra -Werror,
#      with the CUDA stub on the include path and without, with NCCL_OS_LINUX and without;
#   2. CUDA's cuda_runtime.h (the stub) may be included before or after ours, and NCCL_H_
#      keeps NVIDIA's header from being read after ours (and ours after NVIDIA's);
#      ncclResetDebugInit/pncclResetDebugInit warn as deprecated exactly as NVIDIA's do;
#   3. abi_layout.c prints the same lines against both headers (C11 and C++17, with
#      NCCL_OS_LINUX and without; ours with and without the stub);
#   4. prototypes.sh prints the same prototypes for both headers;
#   5. both headers define the same macro names and use the same nccl/NCCL identifiers.
# Exit status 1 if any check fails. Build outputs go to a temporary folder.
set -euo pipefail
export LC_ALL=C # ASCII quotes in compiler messages, byte order in sort

here=$(cd "$(dirname "$0")" && pwd)
ours=$(cd "$here/../include" && pwd)
ref=${NCCL_REFERENCE_DIR:-$(bash "$here/../../shared/scripts/nccl-reference.sh")}
nvidia=$ref/include
stub=$ref/cuda-stub
CC=${CC:-gcc}
CXX=${CXX:-g++}
for f in "$nvidia/nccl.h" "$stub/cuda_runtime.h" "$ours/nccl.h"; do
  [ -f "$f" ] || { echo "abi_layout.sh: missing $f" >&2; exit 2; }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

failures=0
ok() { echo "ok   $*"; }
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# compile LANG OUT SRC ARGS...: LANG is c or c++; OUT is an executable, or - for syntax only.
compile() {
  local lang=$1 out=$2 src=$3
  shift 3
  local cmd
  if [ "$lang" = c ]; then
    cmd=("$CC" -x c -std=c11)
  else
    cmd=("$CXX" -x c++ -std=c++17)
  fi
  cmd+=(-Wall -Wextra -Werror -pedantic "$@" "$src")
  if [ "$out" = - ]; then cmd+=(-fsyntax-only); else cmd+=(-o "$out"); fi
  "${cmd[@]}" >"$tmp/cc.log" 2>&1
}

# compare LABEL EXPECTED(nvidia) ACTUAL(ours)
compare() {
  if diff -u --label "nvidia: $1" --label "ours: $1" "$2" "$3" >"$tmp/diff.log"; then
    ok "$1"
  else
    fail "$1"
    cat "$tmp/diff.log"
  fi
}

# 1. The header alone.
echo '#include <nccl.h>' >"$tmp/alone.c"
for lang in c c++; do
  for cuda in none stub; do
    for os in "" -DNCCL_OS_LINUX; do
      args=(-I "$ours")
      [ "$cuda" = stub ] && args+=(-I "$stub")
      [ -n "$os" ] && args+=("$os")
      label="header alone: $lang, cuda=$cuda${os:+, $os}"
      if compile "$lang" - "$tmp/alone.c" "${args[@]}"; then ok "$label"; else fail "$label"; cat "$tmp/cc.log"; fi
    done
  done
done

# 2. Include order. The stub is named by path where our header must not find it itself.
use='int use(cudaStream_t s, cudaEvent_t e, ncclComm_t c) { return s == 0 && e == 0 && c == NCCL_COMM_NULL; }'
printf '#include <nccl.h>\n#include "%s/cuda_runtime.h"\n%s\n' "$stub" "$use" >"$tmp/cuda_after.c"
printf '#include "%s/cuda_runtime.h"\n#include <nccl.h>\n%s\n' "$stub" "$use" >"$tmp/cuda_before.c"
printf '#include <nccl.h>\n#include <cuda_runtime.h>\n%s\n' "$use" >"$tmp/cuda_after_found.c"
printf '#include <cuda_runtime.h>\n#include <nccl.h>\n%s\n' "$use" >"$tmp/cuda_before_found.c"
printf '#include <nccl.h>\n#include "%s/nccl.h"\n%s\n' "$nvidia" "$use" >"$tmp/ours_then_nvidia.c"
printf '#include "%s/nccl.h"\n#include "%s/nccl.h"\n%s\n' "$nvidia" "$ours" "$use" >"$tmp/nvidia_then_ours.c"
for lang in c c++; do
  for tu in cuda_after cuda_before cuda_after_found cuda_before_found ours_then_nvidia nvidia_then_ours; do
    args=(-I "$ours")
    case $tu in *_found | *nvidia*) args+=(-I "$stub") ;; esac
    label="include order: $tu ($lang)"
    if compile "$lang" - "$tmp/$tu.c" "${args[@]}"; then ok "$label"; else fail "$label"; cat "$tmp/cc.log"; fi
  done
done

# Deprecation warnings (attributes are not in the prototype list): the same in both.
printf 'void use(void) { ncclResetDebugInit(); pncclResetDebugInit(); }\n' >"$tmp/deprecated.c"
for variant in nvidia ours; do
  dir=$ours
  [ "$variant" = nvidia ] && dir=$nvidia
  { "$CC" -std=c11 -DNCCL_OS_LINUX -include nccl.h -I "$dir" -I "$stub" -fsyntax-only \
      "$tmp/deprecated.c" 2>&1 || true; } | grep -oE "'p?ncclResetDebugInit' is deprecated" >"$tmp/deprecated-$variant.txt" || true
done
if [ -s "$tmp/deprecated-nvidia.txt" ]; then
  compare "deprecation warnings" "$tmp/deprecated-nvidia.txt" "$tmp/deprecated-ours.txt"
else
  fail "deprecation warnings: none seen from NVIDIA's header (has the check gone stale?)"
fi

# 3. ABI facts printed by abi_layout.c.
for lang in c c++; do
  for os in "" -DNCCL_OS_LINUX; do
    tag=$lang${os:+-linux}
    built=1
    for variant in nvidia ours-stub ours-nocuda; do
      case $variant in
        nvidia) args=(-I "$nvidia" -I "$stub") ;;
        ours-stub) args=(-I "$ours" -I "$stub") ;;
        ours-nocuda) args=(-I "$ours") ;;
      esac
      [ -n "$os" ] && args+=("$os")
      exe=$tmp/abi-$variant-$tag
      if compile "$lang" "$exe" "$here/abi_layout.c" "${args[@]}" && "$exe" >"$exe.txt"; then
        :
      else
        fail "abi_layout.c against $variant ($tag) does not build or run"
        cat "$tmp/cc.log"
        built=0
      fi
    done
    if [ "$built" = 1 ]; then
      n=$(wc -l <"$tmp/abi-nvidia-$tag.txt")
      compare "abi layout ($tag, CUDA stub, $n lines)" "$tmp/abi-nvidia-$tag.txt" "$tmp/abi-ours-stub-$tag.txt"
      compare "abi layout ($tag, no CUDA, $n lines)" "$tmp/abi-nvidia-$tag.txt" "$tmp/abi-ours-nocuda-$tag.txt"
    fi
  done
done

# 4. Prototypes.
if "$here/prototypes.sh" "$nvidia/nccl.h" "$stub" >"$tmp/proto-nvidia.txt" \
  && "$here/prototypes.sh" "$ours/nccl.h" "$stub" >"$tmp/proto-ours-stub.txt" \
  && "$here/prototypes.sh" "$ours/nccl.h" >"$tmp/proto-ours-nocuda.txt"; then
  n=$(wc -l <"$tmp/proto-nvidia.txt")
  compare "prototypes (CUDA stub, $n functions)" "$tmp/proto-nvidia.txt" "$tmp/proto-ours-stub.txt"
  compare "prototypes (no CUDA, $n functions)" "$tmp/proto-nvidia.txt" "$tmp/proto-ours-nocuda.txt"
else
  fail "prototypes.sh failed"
fi

# 5. Names: every macro (both with the stub, so the same system headers are read), and
#    every identifier starting with nccl, pnccl or NCCL after preprocessing.
# names LANG OUT ARGS...
names() {
  local lang=$1 out=$2
  shift 2
  local x=c std=-std=c11
  [ "$lang" = c++ ] && x=c++ std=-std=c++17
  "$CC" -x "$x" "$std" -E -dM "$@" "$tmp/alone.c" | awk '$1 == "#define" { sub(/\(.*/, "", $2); print "macro", $2 }' | sort -u >"$out"
  "$CC" -x "$x" "$std" -E -P "$@" "$tmp/alone.c" | grep -oE '\b(p?nccl|NCCL)[A-Za-z0-9_]*' | sort -u | sed 's/^/identifier /' >>"$out"
}
for lang in c c++; do
  for os in "" -DNCCL_OS_LINUX; do
    tag=$lang${os:+-linux}
    extra=()
    [ -n "$os" ] && extra+=("$os")
    names "$lang" "$tmp/names-nvidia" -I "$nvidia" -I "$stub" ${extra[@]+"${extra[@]}"}
    names "$lang" "$tmp/names-ours" -I "$ours" -I "$stub" ${extra[@]+"${extra[@]}"}
    compare "macro names and identifiers ($tag)" "$tmp/names-nvidia" "$tmp/names-ours"
  done
done

if [ "$failures" -ne 0 ]; then
  echo "abi_layout.sh: $failures check(s) failed"
  exit 1
fi
echo "abi_layout.sh: all checks passed"
