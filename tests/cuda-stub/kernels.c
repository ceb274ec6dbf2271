/*
 * The C twins of kernels/reduce.ptx, with the semantics of src/device/host/reduce.rs and
 * fp8.rs (see there for why these are NCCL's results):
 * - integers wrap; max/min compare as the type does; divide truncates, a divisor beyond the
 *   type's range is honoured (computed in 128 bits); a divisor of 0 is taken as 1;
 * - float16, bfloat16 and fp8 are widened exactly to float, computed there and rounded once
 *   to nearest-even; fp8 saturates to +-max finite (infinities included); their NaNs are the
 *   canonical 0x7FFF / 0x7FFF / 0x7F;
 * - float max/min ignore one NaN, order -0 below +0, and give the all-ones NaN for two NaNs.
 * Straightforward loops: this is a test double, not a fast path.
 */
#include <math.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "stub.h"

enum { K_REDUCE, K_PREMUL, K_PREMUL_AT, K_DIVIDE, K_WAIT, K_INDIRECT };
enum { OP_SUM, OP_PROD, OP_MAX, OP_MIN };
/* NCCL's datatype values (src/types.rs). */
enum { INT8, UINT8, INT32, UINT32, INT64, UINT64, HALF, FLOAT, DOUBLE, BFLOAT16, E4M3, E5M2, NTYPES };

static const char *const TYPE_NAMES[NTYPES] = {"int8",  "uint8",  "int32",  "uint32",   "int64",  "uint64",
                                               "half",  "float",  "double", "bfloat16", "f8e4m3", "f8e5m2"};
static const size_t TYPE_SIZES[NTYPES] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
static const char *const OP_NAMES[4] = {"sum", "prod", "max", "min"};

struct kernel {
  char name[40];
  int kind, type, op;
};

#define NKERNELS (NTYPES * 8 + 2) /* and the stream gate, nccl_rs_wait_geq, and nccl_rs_indirect_copy */
static struct kernel g_kernels[NKERNELS];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void build_table(void) {
  struct kernel *k = g_kernels;
  for (int t = 0; t < NTYPES; t++) {
    for (int op = 0; op < 4; op++, k++) {
      *k = (struct kernel){"", K_REDUCE, t, op};
      snprintf(k->name, sizeof k->name, "nccl_rs_reduce_%s_%s", TYPE_NAMES[t], OP_NAMES[op]);
    }
    *k = (struct kernel){"", K_PREMUL, t, OP_PROD};
    snprintf(k->name, sizeof k->name, "nccl_rs_premul_%s", TYPE_NAMES[t]);
    k++;
    *k = (struct kernel){"", K_PREMUL_AT, t, OP_PROD};
    snprintf(k->name, sizeof k->name, "nccl_rs_premul_at_%s", TYPE_NAMES[t]);
    k++;
    *k = (struct kernel){"", K_DIVIDE, t, 0};
    snprintf(k->name, sizeof k->name, "nccl_rs_divide_%s", TYPE_NAMES[t]);
    k++;
    *k = (struct kernel){"", K_INDIRECT, t, 0};
    snprintf(k->name, sizeof k->name, "nccl_rs_indirect_%s", TYPE_NAMES[t]);
    k++;
  }
  *k++ = (struct kernel){"nccl_rs_wait_geq", K_WAIT, UINT32, 0};
  *k = (struct kernel){"nccl_rs_indirect_copy", K_INDIRECT, -1, 0};
}

const struct kernel *kernel_find(const char *name) {
  pthread_once(&g_once, build_table);
  for (int i = 0; i < NKERNELS; i++)
    if (strcmp(g_kernels[i].name, name) == 0) return &g_kernels[i];
  return NULL;
}

int kernel_valid(const void *f) {
  const struct kernel *k = f;
  return k >= g_kernels && k < g_kernels + NKERNELS;
}

int kernel_is_gate(const struct kernel *k) { return k->kind == K_WAIT; }

int kernel_pointers(const struct kernel *k) {
  return k->kind == K_REDUCE ? 3 : k->kind == K_WAIT || k->kind == K_INDIRECT ? 1 : 2;
}

/* The bytes of pointer argument 0 a launch must be able to reach: the descriptor of an
 * indirect kernel, else its n elements. */
size_t kernel_reach(const struct kernel *k, const uint64_t params[4]) {
  return k->kind == K_INDIRECT ? 64 * (size_t)params[2] : (size_t)params[3] * TYPE_SIZES[k->type];
}


/* ---- float formats -------------------------------------------------------------------------- */

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint64_t d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
static double u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }

#define MINMAX(NAME, T, BITS, FROM, TO, NAN_BITS, CMP, COMBINE)                  \
  static T NAME(T x, T y) {                                                      \
    T r = x CMP y ? x : y;                                                       \
    if (x == y) r = FROM(TO(x) COMBINE TO(y)); /* +-0: AND prefers +0, OR -0 */  \
    int xn = isnan(x), yn = isnan(y);                                            \
    if (yn) r = x;                                                               \
    if (xn) r = y;                                                               \
    return xn && yn ? FROM(NAN_BITS) : r;                                        \
  }
MINMAX(max_f32, float, uint32_t, u2f, f2u, 0x7fffffffu, >, &)
MINMAX(min_f32, float, uint32_t, u2f, f2u, 0x7fffffffu, <, |)
MINMAX(max_f64, double, uint64_t, u2d, d2u, 0x7fffffffffffffffull, >, &)
MINMAX(min_f64, double, uint64_t, u2d, d2u, 0x7fffffffffffffffull, <, |)

static float pow2(int e) { return u2f((uint32_t)(e + 127) << 23); }

static float f16_widen(uint32_t h) {
  uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return u2f(sign | f2u((float)m * pow2(-24)));
  if (e == 31) return u2f(sign | 0x7f800000u | m << 13);
  return u2f(sign | (e + 112) << 23 | m << 13);
}

static uint32_t f16_narrow(float v) {
  uint32_t u = f2u(v), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;
  if (a >= 0x477ff000u) return sign | 0x7c00; /* 65520 and above round to infinity */
  if (a < 0x38800000u) /* subnormal: the FPU rounds |v| + 0.5, whose ulp is 2^-24 */
    return sign | (f2u(u2f(a) + 0.5f) - 0x3f000000u);
  uint32_t r = a + 0xfffu + ((a >> 13) & 1);
  return sign | ((r >> 13) - (112u << 10));
}

static float bf16_widen(uint32_t b) { return u2f(b << 16); }

static uint32_t bf16_narrow(float v) {
  uint32_t u = f2u(v);
  return isnan(v) ? 0x7fff : ((u + 0x7fffu + ((u >> 16) & 1)) >> 16) & 0xffff;
}

struct fp8 {
  uint32_t mant, bias;
  float max;
  uint32_t inf, first_nan;
};
static const struct fp8 FP8_E4M3 = {3, 7, 448.0f, 0x100, 0x7f};
static const struct fp8 FP8_E5M2 = {2, 15, 57344.0f, 0x7c, 0x7d};

static float fp8_widen(uint32_t code, struct fp8 f) {
  uint32_t m = code & 0x7f;
  float mag = m < (1u << f.mant) ? (float)m * pow2(1 - (int)f.bias - (int)f.mant)
                                 : u2f((m + ((127 - f.bias) << f.mant)) << (23 - f.mant));
  if (m == f.inf) mag = INFINITY;
  if (m >= f.first_nan) mag = NAN;
  return code & 0x80 ? -mag : mag;
}

static uint32_t fp8_narrow(float v, struct fp8 f) {
  if (isnan(v)) return 0x7f;
  uint32_t sign = (f2u(v) >> 24) & 0x80;
  float a = fabsf(v) > f.max ? f.max : fabsf(v);
  float magic = pow2(24 - (int)f.bias - (int)f.mant);
  uint32_t subnormal = f2u(a + magic) - f2u(magic);
  uint32_t shift = 23 - f.mant, u = f2u(a);
  uint32_t normal = ((u + ((1u << (shift - 1)) - 1) + ((u >> shift) & 1)) >> shift) - ((127 - f.bias) << f.mant);
  return sign | (a < pow2(1 - (int)f.bias) ? subnormal : normal);
}

static float widen(int t, uint32_t bits) {
  switch (t) {
    case HALF: return f16_widen(bits);
    case BFLOAT16: return bf16_widen(bits);
    case E4M3: return fp8_widen(bits, FP8_E4M3);
    default: return fp8_widen(bits, FP8_E5M2);
  }
}

static uint32_t narrow(int t, float v) {
  switch (t) {
    case HALF: return f16_narrow(v);
    case BFLOAT16: return bf16_narrow(v);
    case E4M3: return fp8_narrow(v, FP8_E4M3);
    default: return fp8_narrow(v, FP8_E5M2);
  }
}

/* ---- the loops ------------------------------------------------------------------------------ */

#define LOAD(T, p, i) ({ T v_; memcpy(&v_, (const char *)(p) + (i) * sizeof(T), sizeof(T)); v_; })
#define STORE(T, p, i, v) do { T v_ = (v); memcpy((char *)(p) + (i) * sizeof(T), &v_, sizeof(T)); } while (0)

/* Integers: arithmetic in the unsigned type U, so overflow wraps. */
#define INT_LOOP(T, U)                                                                         \
  for (uint64_t i = 0; i < n; i++) {                                                           \
    T x = LOAD(T, a, i), r;                                                                    \
    if (k->kind == K_DIVIDE) {                                                                 \
      r = (T)((__int128)x / (__int128)(p2 ? p2 : 1));                                          \
    } else {                                                                                   \
      T y = k->kind == K_PREMUL ? (T)(U)p2 : LOAD(T, b, i);                                    \
      switch (k->op) {                                                                         \
        case OP_SUM: r = (T)(U)((U)x + (U)y); break;                                           \
        case OP_PROD: r = (T)(U)((U)x * (U)y); break;                                          \
        case OP_MAX: r = x > y ? x : y; break;                                                 \
        default: r = x < y ? x : y;                                                            \
      }                                                                                        \
    }                                                                                          \
    STORE(T, dst, i, r);                                                                       \
  }

/* float and double: IEEE operations, one rounding each. */
#define FLOAT_LOOP(T, FROM_BITS, MAX, MIN)                                                     \
  for (uint64_t i = 0; i < n; i++) {                                                           \
    T x = LOAD(T, a, i), r;                                                                    \
    if (k->kind == K_DIVIDE) {                                                                 \
      r = x / (T)(p2 ? p2 : 1);                                                                \
    } else {                                                                                   \
      T y = k->kind == K_PREMUL ? FROM_BITS : LOAD(T, b, i);                                   \
      switch (k->op) {                                                                         \
        case OP_SUM: r = x + y; break;                                                         \
        case OP_PROD: r = x * y; break;                                                        \
        case OP_MAX: r = MAX(x, y); break;                                                     \
        default: r = MIN(x, y);                                                                \
      }                                                                                        \
    }                                                                                          \
    STORE(T, dst, i, r);                                                                       \
  }

/* The formats computed through float; S is the storage type. */
#define NARROW_LOOP(S)                                                                         \
  for (uint64_t i = 0; i < n; i++) {                                                           \
    float x = widen(t, LOAD(S, a, i)), r;                                                      \
    if (k->kind == K_DIVIDE) {                                                                 \
      r = x / (float)(p2 ? p2 : 1);                                                            \
    } else {                                                                                   \
      float y = k->kind == K_PREMUL ? widen(t, (S)p2) : widen(t, LOAD(S, b, i));               \
      switch (k->op) {                                                                         \
        case OP_SUM: r = x + y; break;                                                         \
        case OP_PROD: r = x * y; break;                                                        \
        case OP_MAX: r = max_f32(x, y); break;                                                 \
        default: r = min_f32(x, y);                                                            \
      }                                                                                        \
    }                                                                                          \
    STORE(S, dst, i, (S)narrow(t, r));                                                         \
  }

/* nccl_rs_indirect_<type> and _copy (kernels/reduce.cu): what the descriptor says, read when
 * the kernel runs (the host fills it in after the launch was queued). Type -1 is the copy
 * kernel. A descriptor of another kernel, or a pointer the device cannot reach, is a fault:
 * the real GPU would do something wrong or lose the context; the stand-in stops the process. */
static void run_one_indirect(int kernel_type, const uint64_t *desc) {
  uint64_t w[6];
  for (int i = 0; i < 6; i++) w[i] = __atomic_load_n(&desc[i], __ATOMIC_ACQUIRE);
  const uint32_t code = (uint32_t)w[0], type = (uint32_t)(w[0] >> 32);
  const uint64_t n = w[4];
  if (code == 0 || n == 0) return;
  if (code > 6 || (code > 1 && type >= NTYPES) || (code == 1) != (kernel_type < 0) ||
      (code > 1 && (int)type != kernel_type)) {
    fprintf(stderr, "cuda-stub: nccl_rs_indirect: descriptor (code %u, type %u) for the kernel of type %d\n", code,
            type, kernel_type);
    abort();
  }
  const size_t bytes = code == 1 ? (size_t)n : (size_t)n * TYPE_SIZES[type];
  const int pointers = code == 1 || code == 6 ? 2 : 3;
  for (int i = 1; i <= pointers; i++) {
    if (mem_lookup(w[i], bytes) == MEM_PAGEABLE) {
      fprintf(stderr, "cuda-stub: nccl_rs_indirect: illegal address %#llx (+%zu)\n", (unsigned long long)w[i], bytes);
      abort();
    }
    if (!device_reaches(t_kernel_dev, w[i])) {
      fprintf(stderr, "cuda-stub: nccl_rs_indirect: %#llx is another device's memory, and device %d has no peer access "
              "to it\n", (unsigned long long)w[i], t_kernel_dev);
      abort();
    }
  }
  if (code == 1) {
    /* A slow device, for tests: each copy waits this long before it runs. */
    const int delay_ms = env_int("NCCL_RS_STUB_COPY_DELAY_MS", 0);
    if (delay_ms > 0) {
      struct timespec slow = {delay_ms / 1000, (long)(delay_ms % 1000) * 1000000L};
      nanosleep(&slow, NULL);
    }
    if (w[1] < w[2] + bytes && w[2] < w[1] + bytes) {
      /* The GPU's threads copy side by side: overlapping buffers give whatever they race to. */
      fprintf(stderr, "cuda-stub: nccl_rs_indirect_copy: source %#llx and destination %#llx of %zu bytes overlap\n",
              (unsigned long long)w[2], (unsigned long long)w[1], bytes);
      abort();
    }
    memcpy(dev_view(w[1]), dev_view(w[2]), bytes);
    return;
  }
  struct kernel inner = {"", code == 6 ? K_DIVIDE : K_REDUCE, (int)type, code == 6 ? 0 : (int)code - 2};
  const uint64_t params[4] = {w[1], w[2], code == 6 ? w[5] : w[3], n};
  kernel_run(&inner, params, 1);
}

void kernel_run(const struct kernel *k, const uint64_t params[4], unsigned grid_y) {
  if (k->kind == K_INDIRECT) {
    /* params[2] descriptors, one per row of blocks (the rows run side by side on a GPU); a row
     * past them does nothing, and a descriptor past the rows is not run. */
    for (uint64_t row = 0; row < params[2] && row < grid_y; row++)
      run_one_indirect(k->type, (const uint64_t *)dev_view(params[0]) + 8 * row);
    return;
  }
  if (k->kind == K_PREMUL_AT) {
    /* The scalar's element, read now (when the kernel runs, as on the GPU), as K_PREMUL's. */
    const size_t es = TYPE_SIZES[k->type];
    if (mem_lookup(params[2], es) == MEM_PAGEABLE) {
      fprintf(stderr, "cuda-stub: nccl_rs_premul_at: illegal scalar address %#llx\n", (unsigned long long)params[2]);
      abort();
    }
    uint64_t bits = 0;
    memcpy(&bits, dev_view(params[2]), es);
    struct kernel inner = {"", K_PREMUL, k->type, OP_PROD};
    const uint64_t at[4] = {params[0], params[1], bits, params[3]};
    kernel_run(&inner, at, grid_y);
    return;
  }
  if (k->kind == K_WAIT) {
    /* The stream gate: poll the word (written by the host, maybe another process) until it
     * reaches the value, as a wrapping counter, like the GPU's one polling thread. */
    const uint32_t *word = dev_view(params[0]);
    const uint32_t value = (uint32_t)params[2];
    struct timespec pause = {0, 20000};
    while ((int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - value) < 0) nanosleep(&pause, NULL);
    return;
  }
  /* reduce.cu's contract: dst may be a (or b) exactly, but must not otherwise overlap them
   * (the GPU's threads read and write side by side). */
  const uint64_t span = params[3] * TYPE_SIZES[k->type];
  for (int i = 1; i < kernel_pointers(k); i++) {
    const uint64_t d = params[0], x = params[i];
    if (d != x && d < x + span && x < d + span) {
      fprintf(stderr, "cuda-stub: %s: output %#llx overlaps input %#llx (%llu bytes) other than exactly\n", k->name,
              (unsigned long long)d, (unsigned long long)x, (unsigned long long)span);
      abort();
    }
  }
  /* (b is a scalar, not a pointer, for PreMulSum and the division.) */
  void *dst = dev_view(params[0]);
  const void *a = dev_view(params[1]), *b = kernel_pointers(k) == 3 ? dev_view(params[2]) : (const void *)(uintptr_t)params[2];
  uint64_t p2 = params[2], n = params[3];
  int t = k->type;
  switch (t) {
    case INT8: INT_LOOP(int8_t, uint8_t) break;
    case UINT8: INT_LOOP(uint8_t, uint8_t) break;
    case INT32: INT_LOOP(int32_t, uint32_t) break;
    case UINT32: INT_LOOP(uint32_t, uint32_t) break;
    case INT64: INT_LOOP(int64_t, uint64_t) break;
    case UINT64: INT_LOOP(uint64_t, uint64_t) break;
    case FLOAT: FLOAT_LOOP(float, u2f((uint32_t)p2), max_f32, min_f32) break;
    case DOUBLE: FLOAT_LOOP(double, u2d(p2), max_f64, min_f64) break;
    case HALF: case BFLOAT16: NARROW_LOOP(uint16_t) break;
    default: NARROW_LOOP(uint8_t) break;
  }
}
