// What kernels/reduce.cu needs of CUDA, for a host C++ compiler: the test
// tests/kernel_host.rs compiles reduce.cu with this in front (launch.cpp) and runs every
// kernel on the CPU, one simulated thread after another, against host mode's reductions.
// This runs the kernels' own source; the stand-in driver (tests/cuda-stub/kernels.c) runs C
// twins of them instead. Only the two f16 conversions, inline PTX in reduce.cu, are
// replaced here, by IEEE's definitions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define __device__
#define __global__
#define __forceinline__ inline
// One block runs at a time on a thread of the test; its thread 0 runs first (launch.cpp).
#define __shared__ static thread_local

struct nccl_rs_dim3 {
  unsigned x, y, z;
};
static thread_local nccl_rs_dim3 threadIdx, blockIdx, blockDim, gridDim;

// Threads run one after another, each to its end, thread 0 first: a barrier has nothing to
// wait for. (reduce.cu's only barrier follows thread 0's read of a descriptor.)
static inline void __syncthreads() {}
static inline void __threadfence_system() {}
static inline void __nanosleep(unsigned) {}

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

static inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline double __longlong_as_double(long long u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
static inline long long __double_as_longlong(double d) {
  long long u;
  std::memcpy(&u, &d, 8);
  return u;
}

// IEEE round-to-nearest operations: the host's own, compiled with -ffp-contract=off (no FMA)
// and without -ffast-math (subnormals kept).
static inline float __fadd_rn(float x, float y) { return x + y; }
static inline float __fmul_rn(float x, float y) { return x * y; }
static inline float __fdiv_rn(float x, float y) { return x / y; }
static inline double __dadd_rn(double x, double y) { return x + y; }
static inline double __dmul_rn(double x, double y) { return x * y; }
static inline double __ddiv_rn(double x, double y) { return x / y; }

// PTX cvt.f32.f16: exact.
static inline float f16_to_f32(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  const unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in f32
    const float mag = (float)m * 0x1p-24f;
    return __uint_as_float(sign | __float_as_uint(mag));
  }
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
  return __uint_as_float(sign | ((e + 127 - 15) << 23) | (m << 13));
}

// PTX cvt.rn.f16.f32: nearest-even, overflowing to infinity.
static inline unsigned short f32_to_f16(float v) {
  const unsigned x = __float_as_uint(v);
  const unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520: infinity
  if (ax < 0x38800000u) {
    // Below 2^-14: a subnormal m * 2^-24 (m = 1024 is the smallest normal, 0x400).
    const double m = std::nearbyint((double)__uint_as_float(ax) * 0x1p24);
    return (unsigned short)(sign | (unsigned)m);
  }
  const unsigned r = (ax + 0xfffu + ((ax >> 13) & 1u)) >> 13;
  return (unsigned short)(sign | (r - ((127u - 15u) << 10)));
}
