// kernels/reduce.cu built for the CPU (see cuda_host.h), as a shared library for
// tests/kernel_host.rs: every kernel is exported under its own name, and
// nccl_rs_host_launch runs one over a grid.
#define NCCL_RS_KERNEL_HOST 1
#include "cuda_host.h"

#include "../../kernels/reduce.cu"

// Every kernel takes four 64-bit parameters (pointers or integers).
typedef void (*nccl_rs_kernel)(u64, u64, u64, u64);

// Runs `kernel` over a grid of gx x gy blocks of bx threads: block after block, and in each
// block thread after thread from thread 0, as one CUDA schedule among the many allowed.
extern "C" __attribute__((visibility("default"))) void nccl_rs_host_launch(
    nccl_rs_kernel kernel, unsigned gx, unsigned gy, unsigned bx, u64 p0, u64 p1, u64 p2, u64 p3) {
  gridDim = {gx, gy, 1};
  blockDim = {bx, 1, 1};
  for (unsigned y = 0; y < gy; y++)
    for (unsigned x = 0; x < gx; x++)
      for (unsigned t = 0; t < bx; t++) {
        blockIdx = {x, y, 0};
        threadIdx = {t, 0, 0};
        kernel(p0, p1, p2, p3);
      }
}
