#!/usr/bin/env bash
# device-check.sh — the checks that need a GPU machine (one H200 here), in one run that
# finishes within 7.5 minutes (DEVICE_CHECK_BUDGET=420 s of steps; a hung step is killed at its cap)
# and writes $OUT/results.txt (plus logs).
#
# Prepare here (no GPU needed), then run there with the prepared folder carried:
#   bash scripts/device-check.sh --prepare        # builds into .device/ (git-ignored)
#   device run: carry [".device"], command: "bash scripts/device-check.sh"
#
# What it checks:
#   1. the CUDA device layer against the real driver: contexts, streams, events, stream
#      memory operations, pointer classification, IPC across processes, and every reduction
#      kernel of kernels/reduce.ptx JIT-loaded by the real driver, bit-compared with host mode;
#      and whether mapping and freeing (cuIpcOpen/CloseMemHandle, cuMemMap/Unmap, cuMemFree,
#      cuMemFreeHost) wait for a stream held on host memory (the stream worker maps and closes
#      peers' buffers while streams wait for it);
#   2. (a) ffi-tests/cuda.c in CUDA mode (device buffers, the caller's streams, gated streams,
#      in-place, p2p, graph capture refused by default) on 1, 2 and 4 ranks sharing the GPU,
#      and the host-mode C programs on the GPU machine; (2a') how much device memory comes
#      back when every rank's ncclCommSuspend closes the peer mappings that kept the ranks'
#      freed buffers alive; (2b) CUDA graphs on their own: the
#      device layer's graph primitives, collectives recorded with NCCL_RS_GRAPH_CAPTURE=1, and
#      collectives beside another stream's global capture;
#   3. (b) PyTorch, two processes on cuda:0, backend='nccl', LD_PRELOAD of our library:
#      all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast, all_to_all_single,
#      send/recv, barrier on fp32 and bf16 with exact checks, and five DDP steps whose losses
#      must equal those of the gloo backend; then (3b) the same with expandable segments
#      (memory of the virtual memory API, shared through file descriptors), and whether the
#      collectives went direct; (3c) collectives captured by torch.cuda.graph and replayed
#      (NCCL_RS_GRAPH_CAPTURE=1, experimental), and the benchmark's -G rows;
#   4. (c) nccl-rs-perf: allreduce and allgather on 2 ranks with device buffers (--device 1;
#      allreduce also on virtual-memory buffers, --device 2), sendrecv read directly beside
#      sendrecv staged (NCCL_RS_DIRECT_P2P=0; in place, the direct one reads a device copy
#      of each send up to 64 MiB, NCCL_RS_INPLACE_SCRATCH, and sends larger ones as bytes)
#      next to the device-to-device copy bandwidth measured in the same run, and 1-rank
#      allreduce latency next to NVIDIA's NCCL (PyTorch's) in the same run, both through
#      PyTorch (and ours through nccl-rs-perf);
#   4b. allreduce on memory peers cannot map (--device 3) and PreMulSum reduce-scatter, both
#      direct from device copies, beside staged (NCCL_RS_INPLACE_SCRATCH=0); (4c) step 3's
#      PyTorch check with backend:cudaMallocAsync (pools CUDA IPC cannot share);
#   5. the polling-kernel stream gate (NCCL_RS_STREAM_GATE=kernel) against the default;
#   6. the direct path's bandwidth with its device work on the worker's stream (the design
#      before) beside the default (on the callers' streams, step 4), small sizes direct (where
#      NCCL_RS_DIRECT_MIN should be), and whether one hardware
#      queue (CUDA_DEVICE_MAX_CONNECTIONS=1) deadlocks without host-wait: direct on the callers'
#      streams, everything staged by the callers' streams, direct on the worker's stream;
#   7. PyTorch: direct all-reduces while another thread calls torch.cuda.empty_cache();
#   8. PyTorch on nonblocking communicators, also in host-wait mode;
# A step that passes its cap leaves hang-<step>.txt: every thread's stack of its processes.
set -uo pipefail
cd "$(dirname "$0")/.."
PREP=.device

if [ "${1:-}" = "--prepare" ]; then
  set -e
  # Built against glibc 2.28 (cargo-zigbuild, installed from PyPI into target/zigtools), so
  # that it loads on an older GPU image than this machine; with no PyPI, natively (2.34+).
  TRIPLE=x86_64-unknown-linux-gnu
  ZIG=target/zigtools
  if [ ! -x "$ZIG/bin/cargo-zigbuild" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$ZIG" cargo-zigbuild >/dev/null 2>&1 || true
  fi
  if [ -x "$ZIG/bin/cargo-zigbuild" ]; then
    PATH=$PWD/$ZIG/bin:$PATH PYTHONPATH=$PWD/$ZIG cargo zigbuild --release --target "$TRIPLE.2.28" --lib --bins \
      --test cuda_layer --test ffi --test cuda_mode 2>&1 | tail -2
    OUTDIR=target/$TRIPLE/release
  else
    echo "cargo-zigbuild unavailable: building for this machine's glibc"
    cargo build --release --lib --bins
    cargo test --release --no-run --test cuda_layer --test ffi --test cuda_mode 2>&1 | tail -3
    OUTDIR=target/release
  fi
  rm -rf "$PREP" && mkdir -p "$PREP/run/bin" "$PREP/lib"
  cp "$OUTDIR/deps/libnccl.so" "$PREP/lib/libnccl.so.2"
  ln -sfn libnccl.so.2 "$PREP/lib/libnccl.so"
  cp "$OUTDIR/nccl-rs-perf" "$PREP/run/bin/"
  for t in cuda_layer ffi cuda_mode; do
    f=$(ls -t "$OUTDIR"/deps/$t-* | grep -v '\.d$' | head -1)
    cp "$f" "$PREP/run/bin/$t"
  done
  echo "needs glibc $(objdump -T "$PREP"/lib/libnccl.so.2 "$PREP"/run/bin/* | grep -oE 'GLIBC_[0-9.]+' | sort -t. -k2,2n -u \
    | tail -1 | cut -d_ -f2)"
  # Debug info is most of the size; the carry limit is 64 MiB in all. Symbols stay.
  strip --strip-debug "$PREP"/run/bin/* "$PREP/lib/libnccl.so.2"
  du -sh "$PREP"
  exit 0
fi

OUT=${OUT:-/tmp/device-check-out}
mkdir -p "$OUT"
R=$OUT/results.txt
: > "$R"
say() { echo "$*" | tee -a "$R"; }
# The whole run must end within BUDGET seconds (the device is lent for minutes): each step
# gets its own cap, cut to what is left, and a step that runs past it is killed with all its
# processes (its own session), so one hang costs one step, not the run.
BUDGET=${DEVICE_CHECK_BUDGET:-420} # (stack dumps and probes between steps take the rest of 7.5 min)
# Where a step hangs: every thread's stack of each of its processes (gdb where installed, else
# cuda-gdb for the first two, else the kernel's view), written before the step is killed.
stacks() { # session-leader-pid name
  local p n=0
  for p in $(pgrep -s "$1"); do
    n=$((n + 1)); [ "$n" -gt 4 ] && break
    { echo "== pid $p: $(tr '\0' ' ' < /proc/"$p"/cmdline 2>/dev/null | cut -c1-200)"
      if command -v gdb >/dev/null; then
        timeout 8 gdb -p "$p" -batch -ex 'thread apply all bt 12' 2>&1 | grep -E '^(Thread|#)' | head -300
      elif command -v cuda-gdb >/dev/null && [ "$n" -le 2 ]; then # (the GPU image has only cuda-gdb)
        timeout 10 cuda-gdb -p "$p" -batch -ex 'thread apply all bt 12' 2>&1 | grep -E '^(Thread|#)' | head -300
      else
        for t in /proc/"$p"/task/*; do echo "$(cat "$t"/comm 2>/dev/null) wchan=$(cat "$t"/wchan 2>/dev/null)"; done
      fi
    } >> "$OUT/hang-$2.txt" 2>&1
  done
}
capped() { # seconds command...
  local t=$1; shift
  setsid "$@" 0<&0 & # (stdin kept: a step may read a here-document)
  local pid=$! end=$((SECONDS + t))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$end" ]; then
      stacks "$pid" "${STEP:-step}"
      kill -TERM -- -"$pid" 2>/dev/null; sleep 2; kill -KILL -- -"$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 200
    fi
    sleep 0.5
  done
  wait "$pid"
  local rc=$?
  kill -KILL -- -"$pid" 2>/dev/null # what the step left running (ranks of a failed run)
  return $rc
}
step() { # name cap-seconds command...
  local name=$1 t=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 10 ]; then say "$(printf '%-28s skipped: out of time (budget %ss)' "$name" "$BUDGET")"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$SECONDS
  STEP=$name capped "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local why; why=$([ "$rc" = 200 ] && echo "KILLED at its ${t}s cap; " )
  say "$(printf '%-28s rc=%-3s %4ss  %s%s' "$name" "$rc" "$((SECONDS - t0))" "$why" "$(grep -E 'test result|RESULT|Error|error' "$OUT/$name.log" | tail -1 | cut -c1-120)")"
}

[ -d "$PREP" ] || { say "no $PREP folder: run 'bash scripts/device-check.sh --prepare' here and carry .device"; exit 2; }
say "# nccl-rs device check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader 2>&1 | sed 's/^/# gpu: /' | tee -a "$R"
# (compute mode must be Default: Exclusive_Process refuses the second process on the GPU)
say "# env: CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset} CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}"
# The library was built elsewhere (for glibc 2.28 when prepared with cargo-zigbuild, else this
# machine's 2.34+): say so at once if it cannot load here.
say "# host: $(uname -sr), $(ldd --version 2>&1 | head -1)"
missing=$(ldd "$PREP/lib/libnccl.so.2" 2>&1 | grep -E 'not found|GLIBC' | head -3)
if [ -n "$missing" ]; then
  # Every step would fail at once: stop, and keep the device time for a build that loads.
  say "# libnccl.so.2 cannot load here: $missing"
  say "# stopped: nothing can run; prepare again with a toolchain for this glibc"
  exit 2
fi
export LD_LIBRARY_PATH=$PWD/$PREP/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The test binaries were built elsewhere: point them at this tree and the carried tool.
export NCCL_TEST_REPO=$PWD NCCL_RS_PERF=$PWD/$PREP/run/bin/nccl-rs-perf
# A CUDA-mode test job that hangs fails after 40 s with every thread's stack in its report
# (tests/common: NCCL_TEST_STACKS_AT_DEADLINE), and the step's next test still runs.
export NCCL_TEST_STACKS_AT_DEADLINE=1
# Tests that make network namespaces need root and iproute2; where they are missing, they skip.
{ [ "$(id -u)" = 0 ] && command -v ip >/dev/null; } || export NCCL_TEST_SKIP_NETNS=1

# 1. The device layer against the real driver (the test binary also builds and uses the stub
#    where cc exists; both must pass).
step cuda-layer 60 "$PREP/run/bin/cuda_layer" --test-threads=1 --skip graphs
# 1'. Whether mapping and freeing wait for a stream held on host memory: each call's answer,
#    for the record. It fails if a map waits (the stream worker maps peers' buffers while
#    streams wait for it); closes and frees run on other threads, reported only.
step held-stream-probe 30 "$PREP/run/bin/cuda_layer" --test-threads=1 --exact maps_and_frees_return_while_a_stream_waits \
  --nocapture
grep -E '^System driver: held-stream probe' "$OUT/held-stream-probe.log" | sed 's/^/# /' >> "$R"

# 2. (a) CUDA mode: ffi-tests/cuda.c against the real driver on 1, 2 and 4 ranks sharing the
#    GPU (the harness compiles it with cc; NCCL_TEST_REAL_DRIVER drops the stub from the path).
step ffi-cuda-mode 150 env NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" NCCL_TEST_REAL_DRIVER=1 "$PREP/run/bin/cuda_mode" \
  --test-threads=1 --skip graph --skip suspend
# 2a'. ncclCommSuspend(NCCL_SUSPEND_MEM) closing the peer mappings: the device's free memory
#    before and after every rank suspended (does a mapping keep freed memory alive here?).
step suspend-memory 40 env NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" NCCL_TEST_REAL_DRIVER=1 "$PREP/run/bin/cuda_mode" \
  --test-threads=1 --exact cuda_mode_suspend_releases_peer_memory --nocapture
grep -E 'device free memory' "$OUT/suspend-memory.log" | sed 's/^/# suspend: /' >> "$R"
# 2b. CUDA graphs, on their own (a hang here must not hide step 2's results): the device
#    layer's graph primitives (host nodes, memory operations and user objects in a captured
#    graph), collectives recorded into graphs (NCCL_RS_GRAPH_CAPTURE=1: launched with new
#    inputs, a peer killed during launches, a rank behind its launch named) and collectives
#    beside another stream's global capture.
step cuda-graphs 75 bash -c "\"$PREP/run/bin/cuda_layer\" --test-threads=1 graphs && \
  NCCL_FFI_LIB=\"$PWD/$PREP/lib/libnccl.so.2\" NCCL_TEST_REAL_DRIVER=1 \"$PREP/run/bin/cuda_mode\" --test-threads=1 graph"
# (The host-mode programs on a machine with a CUDA driver: their host buffers run as in host
# mode, but one-sided calls follow CUDA streams there, which these programs do not wait for,
# so the soak leaves its puts out: NCCL_TEST_SOAK_RMA=0.)
step ffi-host-mode 60 env NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" NCCL_TEST_SOAK_RMA=0 "$PREP/run/bin/ffi" \
  --test-threads=2 collectives_2_processes p2p_4_processes errors_1_process

# 3. (b) PyTorch with LD_PRELOAD, backend='nccl', device tensors: exact results, DDP = gloo.
cp scripts/torch_check.py "$OUT/torch_check.py"
if python3 -c 'import torch' 2>/dev/null; then
  step torch-nccl-rs 120 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 NCCL_DEBUG=WARN
    for r in 0 1; do RANK=\$r LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py nccl & done; wait
    export MASTER_PORT=29534
    for r in 0 1; do RANK=\$r python3 $OUT/torch_check.py gloo & done; wait
    python3 $OUT/torch_check.py compare"
  grep -E '^(rank|DDP|RESULT)' "$OUT/torch-nccl-rs.log" | sed 's/^/# torch: /' >> "$R"
  python3 -c 'import torch; print("# torch", torch.__version__, "nccl", torch.cuda.nccl.version())' 2>&1 | tee -a "$R"
else
  say "torch-nccl-rs                skipped: no torch"
fi

# 3b. The same with PyTorch's expandable segments: every tensor in cuMemCreate allocations,
#    which CUDA IPC cannot share; their descriptors pass over a Unix socket and are mapped
#    side by side.
if python3 -c 'import torch' 2>/dev/null; then
  step torch-expandable-segments 60 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29537 WORLD_SIZE=2 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=P2P
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    # (SYS: as unset for ranks of one GPU, and it makes each rank ask NVML for its NVLinks.)
    export NCCL_P2P_LEVEL=SYS
    for r in 0 1; do RANK=\$r LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py nccl & done; wait
    python3 $OUT/torch_check.py compare"
  grep -m1 -o 'CUDA device [0-9]*: PCI.*' "$OUT/torch-expandable-segments.log" | sed 's/^/# gpu place (NCCL_P2P_LEVEL): /' >> "$R"
  grep -m1 -oE 'CUDA device [0-9]*: ([0-9]+ active NVLink|no active NVLink|NVLinks unknown).*' \
    "$OUT/torch-expandable-segments.log" | sed 's/^/# nvlinks (NVML): /' >> "$R"
  say "# torch expandable segments: $(grep -c 'are read directly' "$OUT/torch-expandable-segments.log") ranks read \
directly, $(grep -c 'cannot map\|cannot receive' "$OUT/torch-expandable-segments.log") refusals; \
$(grep -m1 -o 'cannot [a-z]* rank.*' "$OUT/torch-expandable-segments.log" | cut -c1-160)"
fi

# 3c. CUDA graphs (NCCL_RS_GRAPH_CAPTURE=1, experimental): collectives captured by
#    torch.cuda.graph and replayed with new inputs, exact (ffi-cuda-mode ran the C version).
if python3 -c 'import torch' 2>/dev/null; then
  step torch-graph-capture 60 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29538 WORLD_SIZE=2 NCCL_DEBUG=WARN NCCL_RS_GRAPH_CAPTURE=1
    RANK=0 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py graph & a=\$!
    RANK=1 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py graph & b=\$!
    wait \$a && wait \$b"
  grep -E 'graph' "$OUT/torch-graph-capture.log" | sed 's/^/# torch: /' >> "$R"
fi
# The same calls through the benchmark's -G (a launch of a captured call per iteration), 2 ranks
# and the 1-rank latency, beside steps 4's rows for ordinary calls.
step perf-cuda-allreduce-2-graph 30 env NCCL_RS_GRAPH_CAPTURE=1 "$PREP/run/bin/nccl-rs-perf" allreduce -np 2 \
  --device 1 -G 5 -b 8 -e 64M -f 8 -n 5 -w 1
step perf-cuda-latency-1-graph 15 env NCCL_RS_GRAPH_CAPTURE=1 "$PREP/run/bin/nccl-rs-perf" allreduce -np 1 \
  --device 1 -G 10 -b 8 -e 8 -n 200 -w 5

# 4. (c) The benchmark with device buffers, beside the device copy bandwidth (the tool measures
#    cuMemcpyAsync device to device at each size after its sweep; latency.py at 1 GiB) and NVIDIA's NCCL.
step perf-cuda-allreduce-2 50 "$PREP/run/bin/nccl-rs-perf" allreduce -np 2 --device 1 -b 1K -e 1G -f 8 -x 1G -n 5 -w 1
# The same all-reduces on memory of the virtual memory API (PyTorch's expandable segments):
# bandwidth, and the time in the call (which describes the allocations; a peer fetches their
# descriptors at its first use of them).
step perf-cuda-allreduce-2-vmm 40 "$PREP/run/bin/nccl-rs-perf" allreduce -np 2 --device 2 -b 64K -e 256M -f 8 -n 5 -w 1
step perf-cuda-allgather-2 50 "$PREP/run/bin/nccl-rs-perf" allgather -np 2 --device 1 -b 1K -e 1G -f 8 -x 1G -n 5 -w 1
# (In place, sends past the device scratch go as bytes over TCP: the 1 GiB rows take seconds.)
step perf-cuda-sendrecv-2 45 "$PREP/run/bin/nccl-rs-perf" sendrecv -np 2 --device 1 -b 1K -e 1G -f 8 -x 1G -n 5 -w 1
step perf-cuda-sendrecv-2-staged 30 env NCCL_RS_DIRECT_P2P=0 "$PREP/run/bin/nccl-rs-perf" sendrecv -np 2 --device 1 \
  -b 64K -e 256M -f 8 -n 5 -w 1
step perf-cuda-latency-1 20 "$PREP/run/bin/nccl-rs-perf" allreduce -np 1 --device 1 -b 8 -e 8 -n 2000 -w 50
cat > "$OUT/latency.py" <<'PY'
# Device copy bandwidth, and 1-rank all-reduce latency through PyTorch of whichever libnccl
# is loaded (NVIDIA's from PyTorch's wheel, or ours with LD_PRELOAD): the same path for both.
import os, sys, time, torch, torch.distributed as dist
which = sys.argv[1]
if which == "nvidia":
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda:0"); y = torch.empty_like(x)
    for _ in range(3): y.copy_(x)
    torch.cuda.synchronize(); t = time.perf_counter(); n = 10
    for _ in range(n): y.copy_(x)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
    print(f"device-to-device copy: {x.numel() * 4 / dt / 1e9:.1f} GB/s (1 GiB)")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
t8 = torch.ones(2, device="cuda:0")
for _ in range(50): dist.all_reduce(t8)
torch.cuda.synchronize(); n = 2000; t = time.perf_counter()
for _ in range(n): dist.all_reduce(t8)
torch.cuda.synchronize()
print(f"{which} (NCCL {torch.cuda.nccl.version()}) 1-rank allreduce 8 B through PyTorch: {(time.perf_counter() - t) / n * 1e6:.2f} us per call")
dist.destroy_process_group()
PY
if python3 -c 'import torch' 2>/dev/null; then
  step copy-bw-and-nvidia-nccl 45 python3 "$OUT/latency.py" nvidia 29541
  step latency-nccl-rs-torch 45 env LD_PRELOAD="$PWD/$PREP/lib/libnccl.so.2" python3 "$OUT/latency.py" nccl-rs 29542
fi

# 4b. (After the required rows: a slow run must not lose them.) Buffers peers cannot read and
#    PreMulSum, direct from device copies.
# On memory peers cannot map (as cudaMallocAsync pools): direct from device copies, beside staged.
# (Up to 128 MiB: with the 64 MiB block the first sizes allocate, a larger one would exceed
# NCCL_RS_INPLACE_SCRATCH_MAX and be staged.)
step perf-cuda-allreduce-2-private 20 "$PREP/run/bin/nccl-rs-perf" allreduce -np 2 --device 3 -b 1M -e 128M -f 8 \
  -x 128M -n 5 -w 1
step perf-cuda-allreduce-2-private-staged 20 env NCCL_RS_INPLACE_SCRATCH=0 "$PREP/run/bin/nccl-rs-perf" allreduce \
  -np 2 --device 3 -b 1M -e 128M -f 8 -x 128M -n 5 -w 1
# PreMulSum (host scalar, as FSDP's reduce-scatters): direct from scaled copies, beside staged.
step perf-cuda-premulsum-2 20 "$PREP/run/bin/nccl-rs-perf" reducescatter -np 2 --device 1 -o premulsum -b 1M -e 128M \
  -f 8 -x 128M -n 5 -w 1
step perf-cuda-premulsum-2-staged 20 env NCCL_RS_INPLACE_SCRATCH=0 "$PREP/run/bin/nccl-rs-perf" reducescatter -np 2 \
  --device 1 -o premulsum -b 1M -e 128M -f 8 -x 128M -n 5 -w 1

# 4c. Step 3's PyTorch check with PyTorch's stream-ordered allocator: pools CUDA IPC cannot share; each
#    rank's stream copies such buffers into device memory of the communicator's, which its
#    peers read (an all-reduce's output is copied back after).
if python3 -c 'import torch' 2>/dev/null; then
  step torch-cuda-malloc-async 45 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29539 WORLD_SIZE=2 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=P2P
    export PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
    for r in 0 1; do RANK=\$r LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py nccl & done; wait
    python3 $OUT/torch_check.py compare"
  say "# torch cudaMallocAsync: $(grep -c 'are read directly' "$OUT/torch-cuda-malloc-async.log") ranks read \
directly, $(grep -c 'are copied on the caller' "$OUT/torch-cuda-malloc-async.log") copy, \
$(grep -c 'is staged through host memory, as are later' "$OUT/torch-cuda-malloc-async.log") staged"
fi

# 5. The other stream gate (NCCL_RS_STREAM_GATE=kernel: a polling kernel instead of
#    cuStreamWaitValue32), to choose the default: CUDA mode tests, PyTorch, 2-rank latency.
step ffi-cuda-gate-kernel 60 env NCCL_RS_STREAM_GATE=kernel NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" \
  NCCL_TEST_REAL_DRIVER=1 "$PREP/run/bin/cuda_mode" --test-threads=1 cuda_mode_2_processes cuda_mode_2_ranks_in_one_process
step perf-cuda-allreduce-2-gate-kernel 40 env NCCL_RS_STREAM_GATE=kernel "$PREP/run/bin/nccl-rs-perf" allreduce -np 2 \
  --device 1 -b 1K -e 64M -f 8 -n 5 -w 1
if python3 -c 'import torch' 2>/dev/null; then
  step torch-nccl-rs-gate-kernel 60 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29535 WORLD_SIZE=2 NCCL_RS_STREAM_GATE=kernel NCCL_DEBUG=WARN
    for r in 0 1; do RANK=\$r LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py nccl & done; wait
    python3 $OUT/torch_check.py compare"
fi
# 6. One hardware queue (Megatron-LM's CUDA_DEVICE_MAX_CONNECTIONS=1), host-wait forced off:
#    what the stand-in's queue model predicts, on the GPU. The direct path with its kernels
#    queued on the callers' streams (the default) and everything staged by the callers'
#    streams (NCCL_P2P_DISABLE=1): the worker issues no device work while a stream waits, and
#    the model says both pass. The direct path on the worker's stream (NCCL_RS_DIRECT_ON_STREAM=0,
#    the design before): the model says it hangs (killed at the cap; hang-*.txt shows where).
step perf-cuda-allreduce-2-worker-direct 40 env NCCL_RS_DIRECT_ON_STREAM=0 "$PREP/run/bin/nccl-rs-perf" allreduce \
  -np 2 --device 1 -b 64K -e 256M -f 8 -n 5 -w 1
# Where direct should start (NCCL_RS_DIRECT_MIN, 64 KiB): below it, small sizes direct, to set
# beside the staged rows of perf-cuda-allreduce-2.
step perf-cuda-allreduce-2-direct-small 30 env NCCL_RS_DIRECT_MIN=1 "$PREP/run/bin/nccl-rs-perf" allreduce \
  -np 2 --device 1 -b 1K -e 64K -f 4 -n 20 -w 5
# (Staged one-sided puts are left out: their landing copy may queue behind the target's wait
# for them, README "CUDA mode"; puts written directly stay in.)
step one-queue-direct 40 env CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_RS_HOST_WAIT=0 CUDA_TEST_SKIP=RmaPageable \
  NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" NCCL_TEST_REAL_DRIVER=1 "$PREP/run/bin/cuda_mode" --test-threads=1 \
  --exact cuda_mode_2_processes cuda_mode_2_ranks_in_one_process
step one-queue-staged 40 env CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_RS_HOST_WAIT=0 NCCL_P2P_DISABLE=1 \
  CUDA_TEST_SKIP=Rma,RmaPageable NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" NCCL_TEST_REAL_DRIVER=1 "$PREP/run/bin/cuda_mode" --test-threads=1 \
  --exact cuda_mode_2_processes cuda_mode_2_ranks_in_one_process
# 7. Direct all-reduces while another thread of the process calls torch.cuda.empty_cache()
#    (cudaFree waits for the device; a stream worker that needed the driver then would hang).
if python3 -c 'import torch' 2>/dev/null; then
  step torch-empty-cache 45 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29536 WORLD_SIZE=2 NCCL_DEBUG=WARN
    RANK=0 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py stress & a=\$!
    RANK=1 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py stress & b=\$!
    wait \$a && wait \$b"
  grep -E 'stress' "$OUT/torch-empty-cache.log" | sed 's/^/# torch: /' >> "$R"
fi
# 8. PyTorch on nonblocking communicators (TORCH_NCCL_USE_COMM_NONBLOCKING=1: every init and
#    call may answer ncclInProgress, which PyTorch polls with ncclCommGetAsyncError), in
#    host-wait mode too (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron-LM sets it), where calls on
#    nonblocking communicators answer ncclInProgress until their operation is done.
if python3 -c 'import torch' 2>/dev/null; then
  step torch-nonblocking 60 bash -c "
    set -e
    export MASTER_ADDR=127.0.0.1 WORLD_SIZE=2 NCCL_DEBUG=WARN TORCH_NCCL_USE_COMM_NONBLOCKING=1
    for port in 29543 29544; do
      [ \$port = 29544 ] && export CUDA_DEVICE_MAX_CONNECTIONS=1
      export MASTER_PORT=\$port
      rm -f $OUT/ddp-nccl.json
      RANK=0 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py nccl & a=\$!
      RANK=1 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2 python3 $OUT/torch_check.py nccl & b=\$!
      wait \$a; wait \$b
      python3 $OUT/torch_check.py compare
    done"
  grep -E '^(DDP|RESULT)|RESULT' "$OUT/torch-nonblocking.log" | sed 's/^/# torch nonblocking: /' >> "$R"
fi
step one-queue-worker-direct 25 env CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_RS_HOST_WAIT=0 NCCL_RS_DIRECT_ON_STREAM=0 \
  NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" NCCL_TEST_REAL_DRIVER=1 "$PREP/run/bin/cuda_mode" --test-threads=1 \
  --exact cuda_mode_2_processes

for f in perf-cuda-allreduce-2 perf-cuda-allreduce-2-vmm perf-cuda-allgather-2 perf-cuda-sendrecv-2 \
         perf-cuda-sendrecv-2-staged perf-cuda-latency-1 copy-bw-and-nvidia-nccl latency-nccl-rs-torch \
         perf-cuda-allreduce-2-private perf-cuda-allreduce-2-private-staged perf-cuda-premulsum-2 \
         perf-cuda-premulsum-2-staged \
         perf-cuda-allreduce-2-gate-kernel torch-nccl-rs-gate-kernel perf-cuda-allreduce-2-worker-direct \
         perf-cuda-allreduce-2-direct-small; do
  grep -E '^ +[0-9]|Avg bus|GB/s|us per call|RESULT' "$OUT/$f.log" 2>/dev/null | sed "s/^/# $f: /" >> "$R"
done
say "# done in ${SECONDS}s"
