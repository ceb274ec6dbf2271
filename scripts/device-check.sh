#!/usr/bin/env bash
# device-check.sh — the checks that need a GPU machine (one H200 here), in one run that
# finishes well under 8 minutes and writes $OUT/results.txt (plus logs).
#
# Prepare here (no GPU needed), then run there with the prepared folder carried:
#   bash scripts/device-check.sh --prepare        # builds into .device/ (git-ignored via .git/info/exclude)
#   device run: carry [".device"], command: "bash scripts/device-check.sh"
#
# What it checks today (CUDA mode is not wired into the collectives yet):
#   1. the CUDA device layer against the real driver: contexts, streams, events, stream
#      memory operations, pointer classification, IPC across processes, and every reduction
#      kernel of kernels/reduce.ptx JIT-loaded by the real driver, bit-compared with host mode;
#   2. the C test programs in host mode on the GPU machine (the driver is present, buffers are
#      host memory): collectives and p2p on 2 and 4 processes;
#   3. PyTorch under LD_PRELOAD with backend='nccl' on cuda:0: device tensors must get a clean
#      NCCL error (ncclInvalidUsage, "device memory"), never a crash or a hang;
#   4. nccl-rs-perf in host mode (allreduce, allgather; 2 and 8 ranks) next to the machine's
#      memcpy bandwidth, and NVIDIA's NCCL version if PyTorch brings one.
# When CUDA mode lands, steps 2-4 switch to device buffers and PyTorch's exact checks.
set -uo pipefail
cd "$(dirname "$0")/.."
PREP=.device

if [ "${1:-}" = "--prepare" ]; then
  set -e
  grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
  cargo build --release --lib --bins
  cargo test --release --no-run --test cuda_layer --test ffi 2>&1 | tail -3
  rm -rf "$PREP" && mkdir -p "$PREP/bin" "$PREP/lib"
  cp target/release/deps/libnccl.so "$PREP/lib/libnccl.so.2"
  ln -sfn libnccl.so.2 "$PREP/lib/libnccl.so"
  cp target/release/nccl-rs-perf "$PREP/bin/"
  for t in cuda_layer ffi; do
    f=$(ls -t target/release/deps/$t-* | grep -v '\.d$' | head -1)
    cp "$f" "$PREP/bin/$t"
  done
  du -sh "$PREP"
  exit 0
fi

OUT=${OUT:-/tmp/device-check-out}
mkdir -p "$OUT"
R=$OUT/results.txt
: > "$R"
say() { echo "$*" | tee -a "$R"; }
step() { # name timeout command...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  say "$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E 'test result|RESULT|Error|error' "$OUT/$name.log" | tail -1 | cut -c1-120)")"
}

[ -d "$PREP" ] || { say "no $PREP folder: run 'bash scripts/device-check.sh --prepare' here and carry .device"; exit 2; }
say "# nccl-rs device check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/# gpu: /' | tee -a "$R"
export LD_LIBRARY_PATH=$PWD/$PREP/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# 1. The device layer against the real driver (the test binary also builds and uses the stub
#    where cc exists; both must pass).
step cuda-layer 240 "$PREP/bin/cuda_layer" --test-threads=1

# 2. Host-mode C programs on the GPU machine (the harness compiles them with cc).
step ffi-collectives 240 env NCCL_FFI_LIB="$PWD/$PREP/lib/libnccl.so.2" "$PREP/bin/ffi" \
  --test-threads=2 collectives_2_processes collectives_4_processes p2p_4_processes errors_1_process

# 3. PyTorch: device tensors must be refused cleanly.
cat > "$OUT/torch_check.py" <<'PY'
import os, sys, torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda:0"))
t = torch.ones(1024, device="cuda:0")
try:
    dist.all_reduce(t); torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce on device memory returned (unexpected before CUDA mode): {t[0].item()}")
except Exception as e:
    print(f"rank {rank}: refused as expected: {type(e).__name__}: {str(e)[:200]}")
dist.destroy_process_group()
PY
if python3 -c 'import torch' 2>/dev/null; then
  step torch-refuses-device 120 bash -c "
    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LD_PRELOAD=$PWD/$PREP/lib/libnccl.so.2
    RANK=0 python3 $OUT/torch_check.py & RANK=1 python3 $OUT/torch_check.py; wait"
  python3 -c 'import torch; print("# torch", torch.__version__, "nccl", torch.cuda.nccl.version())' 2>&1 | tee -a "$R"
else
  say "torch-refuses-device         skipped: no torch"
fi

# 4. Host-mode benchmark numbers on this machine.
step perf-allreduce-2 120 "$PREP/bin/nccl-rs-perf" allreduce -np 2 -b 8 -e 256M -f 8 -n 10 -w 2
step perf-allreduce-8 120 "$PREP/bin/nccl-rs-perf" allreduce -np 8 -b 8 -e 64M -f 8 -n 5 -w 1
step perf-allgather-2 120 "$PREP/bin/nccl-rs-perf" allgather -np 2 -b 1K -e 256M -f 16 -n 10 -w 2
for f in perf-allreduce-2 perf-allreduce-8 perf-allgather-2; do
  grep -E '^ +[0-9]|Avg bus' "$OUT/$f.log" | sed "s/^/# $f: /" >> "$R"
done
say "# done in ${SECONDS}s"
