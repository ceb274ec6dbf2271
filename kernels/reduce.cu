// Reduction kernels of CUDA mode: the device twin of src/device/host/reduce.rs (and fp8.rs),
// bit for bit. Compiled to kernels/reduce.ptx by scripts/build-kernels with NVRTC 12.0; the
// PTX is committed and loaded at run time with cuModuleLoadData (ARCHITECTURE.md, decision 5).
//
// Self-contained on purpose: no #include, so NVRTC needs no CUDA headers. bf16 and fp8 are
// converted on bit patterns exactly as the host code does it; f16 with PTX's own conversions
// (cvt), which are IEEE's, as the host's `half` crate is.
//
// Kernels (84 + 13 + 1), all elementwise over n elements, all grid-stride (any grid covers any n):
//
//   nccl_rs_reduce_<type>_<op>(void* dst, const void* a, const void* b, unsigned long long n)
//       dst[i] = a[i] op b[i]; op is sum, prod, max or min.
//   nccl_rs_premul_<type>(void* dst, const void* src, unsigned long long scalar, unsigned long long n)
//       dst[i] = src[i] * s, where s is the element whose bits are the low bytes of `scalar`
//       (the 8-byte little-endian Scalar of src/types.rs, read as a 64-bit integer).
//   nccl_rs_premul_at_<type>(void* dst, const void* src, unsigned long long scalar_at, unsigned long long n)
//       the same with s the element at device address `scalar_at`, read when the kernel runs
//       (a PreMulSum scalar in device memory, ncclScalarDevice, whose value the stream writes).
//   nccl_rs_divide_<type>(void* dst, const void* src, unsigned long long divisor, unsigned long long n)
//       dst[i] = src[i] / divisor (ncclAvg); a divisor of 0 is taken as 1.
//
//   nccl_rs_indirect_<type>(const void* descs, const void*, unsigned long long count, unsigned long long n)
//       reductions or divisions of <type> (or nothing), as the `count` 64-byte descriptors at
//       `descs` say, one per blockIdx.y; `n` only sized the grid. nccl_rs_indirect_copy:
//       byte copies (or nothing). See the end of this file.
//
//   <type>: int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 f8e4m3 f8e5m2,
//           exactly DataType::name() (src/types.rs), and <op> is BuiltinOp::name(), so the
//           host side can build a kernel's name from the two.
//
// Pointers: dst may equal a and/or b (in place) but must not otherwise overlap them; a and b
// may overlap each other. Any alignment is accepted: 16-byte vector accesses where dst, a and
// b share their offset within 16 bytes, element accesses where they are element-aligned, byte
// accesses otherwise (chosen at run time, uniformly for the whole launch).
//
// Numerics (see reduce.rs's module doc for why these are NCCL's results):
// - integers wrap; max/min compare as the type does; divide truncates, and a divisor beyond
//   the type's range is honoured (quotient 0, or -1 for the signed minimum by its magnitude);
// - float16, bfloat16 and fp8 are widened exactly to f32, computed there and rounded once to
//   nearest-even; fp8 saturates to +-max finite (infinities included), every NaN of these
//   formats is stored as the canonical NaN (0x7FFF, 0x7FFF, 0x7F);
// - float32/float64 use IEEE round-to-nearest operations (the __f*_rn / __d*_rn intrinsics,
//   never contracted into FMAs, subnormals kept). A NaN they produce is the GPU's canonical
//   NaN, where the host's carries an input's payload: the one difference in bits from host
//   mode, which reduce.rs leaves unspecified;
// - float max/min ignore one NaN operand, order -0 below +0 and give the canonical NaN for
//   two NaNs, so a op b and b op a are the same bits.

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define DEV static __device__ __forceinline__

// ---------------------------------------------------------------------------------------------
// Float max/min (reduce.rs: FloatMinMax, ignore_nan). Written as selects, as the host does.

DEV float max_f32(float x, float y) {
  float r = x > y ? x : y;
  // Equal: the same bits, or +-0, where AND of the bits prefers +0.
  r = x == y ? __uint_as_float(__float_as_uint(x) & __float_as_uint(y)) : r;
  bool xn = x != x, yn = y != y;
  r = yn ? x : r;
  r = xn ? y : r;
  return xn && yn ? __uint_as_float(0x7fffffffu) : r;
}

DEV float min_f32(float x, float y) {
  float r = x < y ? x : y;
  // Equal: the same bits, or +-0, where OR of the bits prefers -0.
  r = x == y ? __uint_as_float(__float_as_uint(x) | __float_as_uint(y)) : r;
  bool xn = x != x, yn = y != y;
  r = yn ? x : r;
  r = xn ? y : r;
  return xn && yn ? __uint_as_float(0x7fffffffu) : r;
}

DEV double max_f64(double x, double y) {
  double r = x > y ? x : y;
  r = x == y ? __longlong_as_double(__double_as_longlong(x) & __double_as_longlong(y)) : r;
  bool xn = x != x, yn = y != y;
  r = yn ? x : r;
  r = xn ? y : r;
  return xn && yn ? __longlong_as_double(0x7fffffffffffffffll) : r;
}

DEV double min_f64(double x, double y) {
  double r = x < y ? x : y;
  r = x == y ? __longlong_as_double(__double_as_longlong(x) | __double_as_longlong(y)) : r;
  bool xn = x != x, yn = y != y;
  r = yn ? x : r;
  r = xn ? y : r;
  return xn && yn ? __longlong_as_double(0x7fffffffffffffffll) : r;
}

// ---------------------------------------------------------------------------------------------
// Element types. Each trait has the storage type S, the four reduction operators, `scalar` /
// `premul` (PreMulSum's factor, from the low bytes of a 64-bit Scalar) and `divisor` / `div`
// (ncclAvg's step); the factor and the divisor are prepared once per launch.

// Two's-complement integers: arithmetic in the unsigned type U, so overflow wraps (signed
// overflow would be undefined in C++).
template <class T, class U, T MIN, T MAX>
struct Int {
  typedef T S;
  typedef T Scalar;
  typedef u64 Divisor;
  DEV T sum(T x, T y) { return (T)(U)((U)x + (U)y); }
  DEV T prod(T x, T y) { return (T)(U)((U)x * (U)y); }
  DEV T max(T x, T y) { return x > y ? x : y; }
  DEV T min(T x, T y) { return x < y ? x : y; }
  DEV T scalar(u64 bits) { return (T)(U)bits; }
  DEV T premul(T x, T s) { return prod(x, s); }
  DEV u64 divisor(u64 d) { return d == 0 ? 1 : d; }
  DEV T div(T x, u64 d) {
    if (d <= (u64)MAX) return x / (T)d;
    // |x| < d, except the signed minimum divided by its own magnitude (MAX + 1).
    return MIN < 0 && x == MIN && d == (u64)MAX + 1 ? (T)-1 : (T)0;
  }
};

typedef Int<i8, u8, -128, 127> Int8;
typedef Int<u8, u8, 0, 255> Uint8;
typedef Int<i32, u32, (-2147483647 - 1), 2147483647> Int32;
typedef Int<u32, u32, 0, 4294967295u> Uint32;
typedef Int<i64, u64, (-9223372036854775807ll - 1), 9223372036854775807ll> Int64;
typedef Int<u64, u64, 0, 18446744073709551615ull> Uint64;

struct Float32 {
  typedef float S;
  typedef float Scalar;
  typedef float Divisor;
  DEV float sum(float x, float y) { return __fadd_rn(x, y); }
  DEV float prod(float x, float y) { return __fmul_rn(x, y); }
  DEV float max(float x, float y) { return max_f32(x, y); }
  DEV float min(float x, float y) { return min_f32(x, y); }
  DEV float scalar(u64 bits) { return __uint_as_float((u32)bits); }
  DEV float premul(float x, float s) { return prod(x, s); }
  // u64 -> f32 rounds to nearest-even, as Rust's `as`.
  DEV float divisor(u64 d) { return (float)(d == 0 ? 1 : d); }
  DEV float div(float x, float d) { return __fdiv_rn(x, d); }
};

struct Float64 {
  typedef double S;
  typedef double Scalar;
  typedef double Divisor;
  DEV double sum(double x, double y) { return __dadd_rn(x, y); }
  DEV double prod(double x, double y) { return __dmul_rn(x, y); }
  DEV double max(double x, double y) { return max_f64(x, y); }
  DEV double min(double x, double y) { return min_f64(x, y); }
  DEV double scalar(u64 bits) { return __longlong_as_double((i64)bits); }
  DEV double premul(double x, double s) { return prod(x, s); }
  DEV double divisor(u64 d) { return (double)(d == 0 ? 1 : d); }
  DEV double div(double x, double d) { return __ddiv_rn(x, d); }
};

// A format computed through f32 (reduce.rs: Narrow): F supplies S, widen (exact) and narrow
// (nearest-even, saturated for fp8, canonical NaN).
template <class F>
struct Narrow {
  typedef typename F::S S;
  typedef float Scalar;
  typedef float Divisor;
  DEV S sum(S x, S y) { return F::narrow(__fadd_rn(F::widen(x), F::widen(y))); }
  DEV S prod(S x, S y) { return F::narrow(__fmul_rn(F::widen(x), F::widen(y))); }
  DEV S max(S x, S y) { return F::narrow(max_f32(F::widen(x), F::widen(y))); }
  DEV S min(S x, S y) { return F::narrow(min_f32(F::widen(x), F::widen(y))); }
  DEV float scalar(u64 bits) { return F::widen((S)bits); }
  DEV S premul(S x, float s) { return F::narrow(__fmul_rn(F::widen(x), s)); }
  DEV float divisor(u64 d) { return (float)(d == 0 ? 1 : d); }
  DEV S div(S x, float d) { return F::narrow(__fdiv_rn(F::widen(x), d)); }
};

// IEEE binary16 through the PTX conversions (exact widening; nearest-even narrowing that
// overflows to infinity), as the host's `half` crate / F16C do. The only inline PTX here: the
// host build of this file (tests/kernel-host, which runs these kernels on the CPU) supplies
// its own two functions instead.
#ifndef NCCL_RS_KERNEL_HOST
DEV float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
DEV u16 f32_to_f16(float v) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
#endif

struct F16Bits {
  typedef u16 S;
  DEV float widen(u16 h) { return f16_to_f32(h); }
  DEV u16 narrow(float v) {
    u16 h = f32_to_f16(v);
    return v != v ? (u16)0x7fff : h;
  }
};

// bfloat16: the top half of an f32 (reduce.rs: f32_to_bf16).
struct Bf16Bits {
  typedef u16 S;
  DEV float widen(u16 b) { return __uint_as_float((u32)b << 16); }
  DEV u16 narrow(float v) {
    u32 u = __float_as_uint(v);
    // A carry out of the mantissa is the correct next binade, or infinity.
    u16 rounded = (u16)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
    return v != v ? (u16)0x7fff : rounded;
  }
};

// 2^e as f32, for -126 <= e <= 127.
DEV float pow2(int e) { return __uint_as_float((u32)(e + 127) << 23); }

// OCP FP8, transcribed from fp8.rs (decode / encode); see there for the reasoning.
// MANT: explicit mantissa bits; BIAS: exponent bias; MAX_BITS: the f32 bits of the largest
// finite value; INF: magnitude code of infinity (above 0x7f where the format has none);
// FIRST_NAN: smallest magnitude code that is a NaN.
template <u32 MANT, u32 BIAS, u32 MAX_BITS, u32 INF, u32 FIRST_NAN>
struct Fp8Bits {
  typedef u8 S;
  DEV float widen(u8 code) {
    u32 m = code & 0x7fu;
    float normal = __uint_as_float((m + ((127 - BIAS) << MANT)) << (23 - MANT));
    float subnormal = __fmul_rn((float)m, pow2(1 - (int)BIAS - (int)MANT));
    float mag = m < (1u << MANT) ? subnormal : normal;
    mag = m == INF ? __uint_as_float(0x7f800000u) : mag;
    mag = m >= FIRST_NAN ? __uint_as_float(0x7fffffffu) : mag;
    return code & 0x80 ? -mag : mag;
  }
  DEV u8 narrow(float v) {
    u32 sign = (__float_as_uint(v) >> 24) & 0x80u;
    // Saturate first (fminf ignores a NaN v; NaN is handled last).
    float a = fminf(fabsf(v), __uint_as_float(MAX_BITS));
    // Subnormal range: the FPU's nearest-even addition does the rounding.
    float magic = pow2(24 - (int)BIAS - (int)MANT);
    u32 subnormal = __float_as_uint(__fadd_rn(a, magic)) - __float_as_uint(magic);
    // Normal range: round the mantissa to MANT bits, ties to even, then rebias.
    const u32 shift = 23 - MANT;
    u32 u = __float_as_uint(a);
    u32 rounded = u + ((1u << (shift - 1)) - 1) + ((u >> shift) & 1);
    u32 normal = (rounded >> shift) - ((127 - BIAS) << MANT);
    u32 code = a < pow2(1 - (int)BIAS) ? subnormal : normal;
    return v != v ? (u8)0x7f : (u8)(sign | code);
  }
};

typedef Narrow<F16Bits> Float16;
typedef Narrow<Bf16Bits> Bfloat16;
typedef Narrow<Fp8Bits<3, 7, 0x43e00000u /* 448 */, 0x100, 0x7f> > Float8e4m3;
typedef Narrow<Fp8Bits<2, 15, 0x47600000u /* 57344 */, 0x7c, 0x7d> > Float8e5m2;

// ---------------------------------------------------------------------------------------------
// The loop: dst[i] = f(a[i], b[i]) for i < n. Unary operations pass b == a; after inlining
// the second load is the same load, and the compiler merges them.

template <class S>
DEV S load_bytes(const char* p) {
  union { S s; u8 c[sizeof(S)]; } u;
#pragma unroll
  for (u32 k = 0; k < sizeof(S); k++) u.c[k] = p[k];
  return u.s;
}

template <class S>
DEV void store_bytes(char* p, S v) {
  union { S s; u8 c[sizeof(S)]; } u;
  u.s = v;
#pragma unroll
  for (u32 k = 0; k < sizeof(S); k++) p[k] = u.c[k];
}

template <class S, class Op>
DEV void map2(void* dst_, const void* a_, const void* b_, u64 n, Op f) {
  char* dst = (char*)dst_;
  const char *a = (const char*)a_, *b = (const char*)b_;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 pd = (u64)dst, pa = (u64)a, pb = (u64)b;

  if ((pd | pa | pb) % sizeof(S) != 0) {
    // Not element-aligned (host mode allows it; a device pointer rarely is): bytes.
    for (u64 i = tid; i < n; i += stride)
      store_bytes<S>(dst + i * sizeof(S),
                     f(load_bytes<S>(a + i * sizeof(S)), load_bytes<S>(b + i * sizeof(S))));
    return;
  }
  S* d = (S*)dst;
  const S *x = (const S*)a, *y = (const S*)b;
  // Where the three share their offset within 16 bytes: elements [0, head) up to the 16-byte
  // boundary, 16-byte vectors over [head, tail), elements [tail, n). Otherwise head = n and
  // everything goes one element at a time.
  const u32 V = 16 / sizeof(S);
  const bool phase = ((pd ^ pa) | (pd ^ pb)) % 16 == 0;
  u64 head = phase ? (16 - pd % 16) % 16 / sizeof(S) : n;
  head = head < n ? head : n;
  const u64 nvec = (n - head) / V;
  const u64 tail = head + nvec * V;

  union Vec { uint4 v; S e[16 / sizeof(S)]; };
  uint4* dv = (uint4*)(d + head);
  const uint4 *xv = (const uint4*)(x + head), *yv = (const uint4*)(y + head);
  for (u64 i = tid; i < nvec; i += stride) {
    Vec p, q, r;
    p.v = xv[i];
    q.v = yv[i];
#pragma unroll
    for (u32 k = 0; k < V; k++) r.e[k] = f(p.e[k], q.e[k]);
    dv[i] = r.v;
  }
  // The elements outside the vectors, numbered j: [0, head) then [tail, n).
  const u64 rest = head + (n - tail);
  for (u64 j = tid; j < rest; j += stride) {
    const u64 i = j < head ? j : tail + (j - head);
    d[i] = f(x[i], y[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// The kernels.

#define REDUCE_KERNEL(name, T, op)                                                            \
  extern "C" __global__ void nccl_rs_reduce_##name##_##op(void* dst, const void* a,           \
                                                          const void* b, u64 n) {             \
    map2<T::S>(dst, a, b, n, [](T::S x, T::S y) { return T::op(x, y); });                     \
  }

#define KERNELS(name, T)                                                                      \
  REDUCE_KERNEL(name, T, sum)                                                                 \
  REDUCE_KERNEL(name, T, prod)                                                                \
  REDUCE_KERNEL(name, T, max)                                                                 \
  REDUCE_KERNEL(name, T, min)                                                                 \
  extern "C" __global__ void nccl_rs_premul_##name(void* dst, const void* src, u64 scalar,    \
                                                   u64 n) {                                   \
    const T::Scalar s = T::scalar(scalar);                                                    \
    map2<T::S>(dst, src, src, n, [=](T::S x, T::S) { return T::premul(x, s); });              \
  }                                                                                           \
  extern "C" __global__ void nccl_rs_premul_at_##name(void* dst, const void* src,            \
                                                      u64 scalar_at, u64 n) {                 \
    const unsigned char* at = reinterpret_cast<const unsigned char*>(scalar_at);              \
    u64 bits = 0;                                                                             \
    for (u32 k = 0; k < sizeof(T::S); k++) bits |= (u64)at[k] << (8 * k);                    \
    const T::Scalar s = T::scalar(bits);                                                      \
    map2<T::S>(dst, src, src, n, [=](T::S x, T::S) { return T::premul(x, s); });              \
  }                                                                                           \
  extern "C" __global__ void nccl_rs_divide_##name(void* dst, const void* src, u64 divisor,   \
                                                   u64 n) {                                   \
    const T::Divisor dv = T::divisor(divisor);                                                \
    map2<T::S>(dst, src, src, n, [=](T::S x, T::S) { return T::div(x, dv); });               \
  }

KERNELS(int8, Int8)
KERNELS(uint8, Uint8)
KERNELS(int32, Int32)
KERNELS(uint32, Uint32)
KERNELS(int64, Int64)
KERNELS(uint64, Uint64)
KERNELS(half, Float16)
KERNELS(float, Float32)
KERNELS(double, Float64)
KERNELS(bfloat16, Bfloat16)
KERNELS(f8e4m3, Float8e4m3)
KERNELS(f8e5m2, Float8e5m2)

// ---------------------------------------------------------------------------------------------
// The stream gate (NCCL_RS_STREAM_GATE=kernel): holds its stream until the 32-bit word at
// `word` (mapped host memory the stream worker advances) reaches `value`, compared as the
// wrapping counter it is. Unlike a stream wait on memory (cuStreamWaitValue32), a running
// kernel does not stall a hardware queue that other streams may share. One thread polls.
extern "C" __global__ void nccl_rs_wait_geq(void* word, const void*, u64 value, u64) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const volatile unsigned* w = static_cast<const volatile unsigned*>(word);
  const unsigned v = static_cast<unsigned>(value);
  while (static_cast<int>(*w - v) < 0) __nanosleep(500);
  __threadfence_system();
}

// ---------------------------------------------------------------------------------------------
// The direct path on the caller's stream (src/transport/ipc.rs): the caller queues these at
// call time, before it knows where the peers' buffers are mapped; the stream worker writes
// what each one does into its descriptor (mapped host memory) before the stream's gate for
// that step opens. A launch runs `count` consecutive descriptors, one per blockIdx.y (the
// caller launches copies of a phase together, reductions one by one: each reads the last's
// result). A descriptor is eight little-endian 64-bit words:
//   [0] code | datatype << 32   code: 0 nothing, 1 copy n bytes from a, 2-5 reduce a and b
//                               (sum, prod, max, min), 6 divide a by arg (ncclAvg)
//   [1] dst  [2] a  [3] b  [4] n (elements; bytes for a copy)  [5] arg  [6, 7] unused
enum { D_SKIP = 0, D_COPY = 1, D_SUM = 2, D_PROD = 3, D_MAX = 4, D_MIN = 5, D_DIVIDE = 6 };

struct Desc {
  u64 head, dst, a, b, n, arg;
};

template <class T>
DEV void run_desc(const Desc& d) {
  typedef typename T::S S;
  void* dst = (void*)d.dst;
  const void *a = (const void*)d.a, *b = (const void*)d.b;
  switch ((u32)d.head) {
    case D_SUM: map2<S>(dst, a, b, d.n, [](S x, S y) { return T::sum(x, y); }); break;
    case D_PROD: map2<S>(dst, a, b, d.n, [](S x, S y) { return T::prod(x, y); }); break;
    case D_MAX: map2<S>(dst, a, b, d.n, [](S x, S y) { return T::max(x, y); }); break;
    case D_MIN: map2<S>(dst, a, b, d.n, [](S x, S y) { return T::min(x, y); }); break;
    case D_DIVIDE: {
      const typename T::Divisor dv = T::divisor(d.arg);
      map2<S>(dst, a, a, d.n, [=](S x, S) { return T::div(x, dv); });
      break;
    }
    default: break;
  }
}

// One kernel per datatype (its reductions and division) and one for copies: one kernel
// covering them all would need the registers of the most demanding type, and fewer threads
// would fit on a multiprocessor for every one. The caller knows which one a descriptor needs
// (the datatype, and whether it is a copy) when it queues the kernel; the worker only fills
// in addresses and sizes, or turns the kernel into a no-op.
DEV void load_desc(Desc& d, const void* descs, u64 count) {
  if (threadIdx.x == 0) {
    // Written by the host after this launch was queued: read through, never from a cache.
    const volatile u64* w = static_cast<const volatile u64*>(descs) + (u64)blockIdx.y * 8;
    const bool mine = blockIdx.y < count;
    d.head = mine ? w[0] : 0;
    d.dst = mine ? w[1] : 0;
    d.a = mine ? w[2] : 0;
    d.b = mine ? w[3] : 0;
    d.n = mine ? w[4] : 0;
    d.arg = mine ? w[5] : 0;
  }
  __syncthreads();
}

// Copies are independent of each other within a phase (they write disjoint outputs): one
// launch runs `count` consecutive descriptors side by side, one per blockIdx.y.
extern "C" __global__ void nccl_rs_indirect_copy(void* descs, const void*, u64 count, u64) {
  __shared__ Desc d;
  load_desc(d, descs, count);
  if ((u32)d.head == D_COPY)
    map2<u8>((void*)d.dst, (const void*)d.a, (const void*)d.a, d.n, [](u8 x, u8) { return x; });
}

#define INDIRECT_KERNEL(name, T)                                                              \
  extern "C" __global__ void nccl_rs_indirect_##name(void* descs, const void*, u64 count, u64) { \
    __shared__ Desc d;                                                                        \
    load_desc(d, descs, count);                                                               \
    run_desc<T>(d);                                                                           \
  }

INDIRECT_KERNEL(int8, Int8)
INDIRECT_KERNEL(uint8, Uint8)
INDIRECT_KERNEL(int32, Int32)
INDIRECT_KERNEL(uint32, Uint32)
INDIRECT_KERNEL(int64, Int64)
INDIRECT_KERNEL(uint64, Uint64)
INDIRECT_KERNEL(half, Float16)
INDIRECT_KERNEL(float, Float32)
INDIRECT_KERNEL(double, Float64)
INDIRECT_KERNEL(bfloat16, Bfloat16)
INDIRECT_KERNEL(f8e4m3, Float8e4m3)
INDIRECT_KERNEL(f8e5m2, Float8e5m2)
