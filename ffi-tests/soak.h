/* A seeded random sequence of collectives and sends/receives, and a host model of what they
 * do to every rank's buffers (ffi-tests/cuda.c and collectives.c, part Soak). A seed gives
 * every process the same sequence, so every rank issues the same calls. Each rank has
 * SOAK_BUFS buffers of SOAK_BYTES; each call has a datatype (soak_type: every integer type in
 * reductions, every type in the calls that move bytes). The calls: all-reduce, reduce,
 * broadcast, all-gather, reduce-scatter, all-to-all, gather, scatter (sum, prod, max, min, avg,
 * or a PreMulSum whose scalar differs per rank), in place or not, or with one buffer for both
 * but the input where NCCL's in-place rules do not put it (soak_in_off: it overlaps the
 * output; the call reads every input before it writes); sends and
 * receives around the ring by a random shift (0: to itself), in place or not; where the
 * program asks (g_soak_rma), puts into windows around the ring likewise; some steps two
 * calls in one group, on disjoint buffers; each call on either of two communicators of the
 * same ranks (the second split from the first, nonblocking, ranks numbered alike). Counts from 1 element
 * to the buffer's size, log-uniform (and now and then 0). A reduce's non-root output and the rest of every buffer
 * must stay as they were. Static functions: each program includes it once. */
#ifndef NCCL_RS_FFI_SOAK_H
#define NCCL_RS_FFI_SOAK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SOAK_BUFS 5
#define SOAK_BYTES ((size_t)1 << 20) /* each buffer */
#define SOAK_EVERY 12
enum { S_ALLREDUCE, S_REDUCE, S_BCAST, S_ALLGATHER, S_REDUCESCATTER, S_ALLTOALL, S_SENDRECV, S_ALLTOALLV, S_GATHER, S_SCATTER,
       S_PUT, S_KINDS };
static const char* const SOAK_NAME[S_KINDS] = {"AllReduce", "Reduce",    "Broadcast", "AllGather", "ReduceScatter",
                                              "AlltoAll",  "SendRecv",  "AlltoAllv", "Gather",    "Scatter", "PutSignal"};
/* Whether the program issues one-sided calls (S_PUT: ncclPutSignal of buffer a into the
 * window over buffer b of the rank `shift` ahead, and ncclWaitSignal for the one from the
 * rank `shift` behind, in one group; every buffer a window on both communicators). Set before
 * soak_begin; programs that leave it 0 get the sequences they always got. */
static int g_soak_rma;

/* The datatypes: integers in every call (their arithmetic wraps alike in the model and the
 * library, so every value compares exactly), floating-point types in the calls that only move
 * bytes (random bytes are no numbers to reduce exactly). */
typedef struct {
  ncclDataType_t dt;
  int size, is_signed, is_float;
  const char* name;
} soak_type;
static const soak_type SOAK_TYPES[] = {
    {ncclInt8, 1, 1, 0, "int8"},           {ncclUint8, 1, 0, 0, "uint8"},         {ncclInt32, 4, 1, 0, "int32"},
    {ncclUint32, 4, 0, 0, "uint32"},       {ncclInt64, 8, 1, 0, "int64"},         {ncclUint64, 8, 0, 0, "uint64"},
    {ncclFloat16, 2, 1, 1, "float16"},     {ncclBfloat16, 2, 1, 1, "bfloat16"},   {ncclFloat32, 4, 1, 1, "float32"},
    {ncclFloat64, 8, 1, 1, "float64"},     {ncclFloat8e4m3, 1, 1, 1, "fp8e4m3"},  {ncclFloat8e5m2, 1, 1, 1, "fp8e5m2"},
};
#define SOAK_INT_TYPES 6 /* the first ones */
#define SOAK_TYPE_COUNT ((int)(sizeof SOAK_TYPES / sizeof SOAK_TYPES[0]))

typedef struct {
  int kind, red, in_place, a, b, root, shift, stream, comm, type;
  int overlap;       /* (in place only) the input elsewhere in the output than NCCL's layout */
  int device_scalar; /* (SOAK_PREMUL) its scalar in device memory, where the program has some */
  size_t count;      /* elements of SOAK_TYPES[type] */
} soak_op;

static uint64_t g_soak_rng;
static uint32_t soak_next(void) {
  g_soak_rng ^= g_soak_rng >> 12;
  g_soak_rng ^= g_soak_rng << 25;
  g_soak_rng ^= g_soak_rng >> 27;
  return (uint32_t)((g_soak_rng * 2685821657736338717ull) >> 32);
}

/* The rank that is late at `step` (1.2 s, in programs that make one late: NCCL_TEST_SOAK_STALL,
 * CUDA_TEST_SOAK_STALL), at one step in six, from the seed and the step; -1: none. Apart from
 * the call sequence's generator, so the calls stay what the seed gives. */
static int soak_late_rank(uint64_t seed, int step, int n) {
  const uint64_t h = (seed * 1000003u + (uint64_t)step) * 0x9E3779B97F4A7C15ull;
  return (h >> 20) % 6 == 0 ? (int)((h >> 40) % (uint64_t)n) : -1;
}

/* The reductions: ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg (integers: the wrapped sum
 * divided, truncating, by the rank count), and a PreMulSum whose scalar differs per rank
 * (soak_scalar). */
#define SOAK_PREMUL 5

/* Rank r's PreMulSum scalar: its low o's-size bytes are the value (little-endian), so a pointer
 * to it is a pointer to a scalar of the call's type. */
static uint64_t soak_scalar(int shift, int r) {
  uint64_t lo = (uint32_t)(shift + 1) * 2654435761u + (uint32_t)r * 40503u;
  return lo | (uint64_t)((uint32_t)(r + 3) * 2246822519u) << 32;
}

static size_t soak_size(const soak_op* o) { return (size_t)SOAK_TYPES[o->type].size; }

/* An element of the call's type, as the low bits of a uint64 (and back). */
static uint64_t soak_get(const uint8_t* p, size_t size) {
  uint64_t v = 0;
  memcpy(&v, p, size);
  return v;
}
static void soak_put(uint8_t* p, size_t size, uint64_t v) { memcpy(p, &v, size); }
static uint64_t soak_mask(size_t size) { return size == 8 ? ~0ull : (1ull << (8 * size)) - 1; }
static int64_t soak_signed(uint64_t v, size_t size) {
  return size == 8 ? (int64_t)v : (int64_t)(v << (64 - 8 * size)) >> (64 - 8 * size);
}

/* Rank r's contribution to a reduction: its value, or for a PreMulSum, times its scalar. */
static uint64_t soak_term(const soak_op* o, int r, uint64_t x) {
  return o->red == SOAK_PREMUL ? x * soak_scalar(o->shift, r) : x;
}

static uint64_t soak_reduce(const soak_op* o, uint64_t x, uint64_t y) {
  const size_t size = soak_size(o);
  const int sgn = SOAK_TYPES[o->type].is_signed;
  switch (o->red) {
    case ncclProd: return x * y;
    case ncclMax: return sgn ? (soak_signed(x, size) > soak_signed(y, size) ? x : y) : ((x & soak_mask(size)) > (y & soak_mask(size)) ? x : y);
    case ncclMin: return sgn ? (soak_signed(x, size) < soak_signed(y, size) ? x : y) : ((x & soak_mask(size)) < (y & soak_mask(size)) ? x : y);
    default: return x + y; /* sum, avg (divided at the end), PreMulSum */
  }
}

/* A random call on buffers `a` and `b` (the same one in place). */
static soak_op soak_pick(int n, int a, int b) {
  soak_op o;
  memset(&o, 0, sizeof o);
  o.kind = (int)(soak_next() % (unsigned)(g_soak_rma ? S_KINDS : S_PUT));
  /* A put of a buffer into the same buffer of another rank races with that rank's put into
   * it (nothing orders one rank's read against another's write, in NCCL either): a send. */
  if (o.kind == S_PUT && a == b) o.kind = S_SENDRECV;
  o.red = (int)(soak_next() % 6);
  o.device_scalar = (int)(soak_next() % 2);
  o.in_place = a == b;
  o.a = a;
  o.b = b;
  o.root = (int)(soak_next() % (unsigned)n);
  o.shift = (int)(soak_next() % (unsigned)n);
  o.stream = (int)(soak_next() % 2);
  o.comm = (int)(soak_next() % 2);
  int reduces = o.kind == S_ALLREDUCE || o.kind == S_REDUCE || o.kind == S_REDUCESCATTER;
  o.type = (int)(soak_next() % (unsigned)(reduces ? SOAK_INT_TYPES : SOAK_TYPE_COUNT));
  int wide = o.kind == S_ALLGATHER || o.kind == S_REDUCESCATTER || o.kind == S_ALLTOALL || o.kind == S_ALLTOALLV ||
             o.kind == S_GATHER || o.kind == S_SCATTER;
  size_t most = SOAK_BYTES / soak_size(&o) / (wide ? (size_t)n : 1);
  size_t c = 1 + soak_next() % ((size_t)1 << (soak_next() % 19));
  o.count = soak_next() % 64 == 0 ? 0 : c < most ? c : most; /* (0: legal, does nothing) */
  /* Half the in-place collectives overlap instead (by a parity of draws the call has made
   * already, so every seed's sequence stays what it was; one rank included). */
  int collective = o.kind != S_ALLTOALL && o.kind != S_ALLTOALLV && o.kind != S_SENDRECV && o.kind != S_PUT;
  o.overlap = o.in_place && collective && (o.count + (size_t)o.stream + (size_t)o.shift) % 2 == 1;
  return o;
}

/* An all-to-all as PyTorch issues one with uneven splits (S_ALLTOALLV): in one group, rank s
 * sends soak_a2av_count(o, s, d) elements to every rank d, itself included, its blocks side by
 * side from the start of buffer a; rank d receives them side by side, by sender, from the
 * start of buffer b. Each count is at most o->count, so each side fits n * o->count. */
static size_t soak_a2av_count(const soak_op* o, int s, int d) {
  size_t half = o->count / 2;
  return half + ((size_t)s * 7 + (size_t)d * 3 + (size_t)o->shift) % (o->count - half + 1);
}

/* Where rank s's block for rank d starts in its input (`send`), or rank d's block from rank s
 * in its output. */
static size_t soak_a2av_offset(const soak_op* o, int s, int d, int send) {
  size_t at = 0;
  for (int k = 0; k < (send ? d : s); k++) at += send ? soak_a2av_count(o, s, k) : soak_a2av_count(o, k, d);
  return at;
}

/* Where rank r's input of `o` starts in its buffer a (bytes), and its output in buffer b: 0
 * unless in place (a == b). In place, NCCL's layout puts an all-gather's or gather's input at
 * the rank's block of the output, a reduce-scatter's or scatter's output at the rank's block of
 * the input, and the two at the same place otherwise; overlapping (o->overlap), the block is
 * the next rank's, and the input of an all-reduce, reduce or broadcast starts half way into
 * the output (as far as the buffer allows). */
static size_t soak_in_off(const soak_op* o, int r, int n) {
  const size_t s = soak_size(o), len = o->count * s;
  if (!o->in_place) return 0;
  switch (o->kind) {
    case S_ALLGATHER:
    case S_GATHER: return (size_t)(o->overlap ? (r + 1) % n : r) * len;
    case S_ALLREDUCE:
    case S_REDUCE:
    case S_BCAST: {
      if (!o->overlap) return 0;
      size_t half = (o->count + 1) / 2 * s, room = (SOAK_BYTES - len) / s * s;
      return half < room ? half : room;
    }
    default: return 0;
  }
}
static size_t soak_out_off(const soak_op* o, int r, int n) {
  const size_t len = o->count * soak_size(o);
  if (!o->in_place || (o->kind != S_REDUCESCATTER && o->kind != S_SCATTER)) return 0;
  return (size_t)(o->overlap ? (r + 1) % n : r) * len;
}

static void soak_describe(const soak_op* o, char* out, size_t len) {
  snprintf(out, len, "%s%s %zu %s, buffers %d->%d, op %d, root %d, shift %d, stream %d, communicator %d",
           SOAK_NAME[o->kind], o->overlap ? " overlapping" : o->in_place ? " in place" : "", o->count, SOAK_TYPES[o->type].name, o->a, o->b, o->red,
           o->root, o->shift, o->stream, o->comm);
}

/* The model: every rank's buffers, flat. */
static uint8_t* g_soak_model;
/* Byte `at` of buffer b of rank r in the model. */
static size_t soak_at(int r, int b, size_t at) { return ((size_t)r * SOAK_BUFS + (size_t)b) * SOAK_BYTES + at; }

/* The reduction over every rank of the element at byte `at` of its input, as the library
 * computes it in the call's type. */
static uint64_t soak_reduce_at(const soak_op* o, int n, size_t at) {
  const size_t size = soak_size(o);
  uint64_t v = soak_term(o, 0, soak_get(&g_soak_model[soak_at(0, o->a, soak_in_off(o, 0, n) + at)], size));
  for (int r = 1; r < n; r++)
    v = soak_reduce(o, v, soak_term(o, r, soak_get(&g_soak_model[soak_at(r, o->a, soak_in_off(o, r, n) + at)], size)));
  v &= soak_mask(size);
  if (o->red == ncclAvg) v = SOAK_TYPES[o->type].is_signed ? (uint64_t)(soak_signed(v, size) / n) : v / (uint64_t)n;
  return v & soak_mask(size);
}

/* What `o` does to every rank's buffers, in the model (`tmp`: n * SOAK_BYTES scratch). */
static void soak_apply(const soak_op* o, int n, uint8_t* tmp) {
  uint8_t* m = g_soak_model;
  const size_t s = soak_size(o), c = o->count, len = c * s;
  switch (o->kind) {
    case S_ALLREDUCE:
    case S_REDUCE:
      for (size_t j = 0; j < c; j++) soak_put(&tmp[j * s], s, soak_reduce_at(o, n, j * s));
      for (int r = 0; r < n; r++)
        if (o->kind == S_ALLREDUCE || r == o->root) memcpy(&m[soak_at(r, o->b, 0)], tmp, len);
      break;
    case S_BCAST:
      memcpy(tmp, &m[soak_at(o->root, o->a, soak_in_off(o, o->root, n))], len);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, 0)], tmp, len);
      break;
    case S_ALLGATHER: /* every input read before the outputs are written (soak_in_off) */
      for (int k = 0; k < n; k++) memcpy(&tmp[(size_t)k * len], &m[soak_at(k, o->a, soak_in_off(o, k, n))], len);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, 0)], tmp, (size_t)n * len);
      break;
    case S_REDUCESCATTER:
      for (size_t j = 0; j < (size_t)n * c; j++) soak_put(&tmp[j * s], s, soak_reduce_at(o, n, j * s));
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, soak_out_off(o, r, n))], &tmp[(size_t)r * len], len);
      break;
    case S_ALLTOALL: {
      /* Block k of rank r's output is block r of rank k's input; one rank's output at a time
       * (in place, the inputs are read from a copy). */
      uint8_t* in = TEST_ALLOC((size_t)n * n * len);
      for (int k = 0; k < n; k++) memcpy(&in[(size_t)k * n * len], &m[soak_at(k, o->a, 0)], (size_t)n * len);
      for (int r = 0; r < n; r++)
        for (int k = 0; k < n; k++)
          memcpy(&m[soak_at(r, o->b, (size_t)k * len)], &in[(size_t)k * n * len + (size_t)r * len], len);
      free(in);
      break;
    }
    case S_ALLTOALLV: {
      uint8_t* in = TEST_ALLOC((size_t)n * SOAK_BYTES);
      for (int k = 0; k < n; k++) memcpy(&in[(size_t)k * SOAK_BYTES], &m[soak_at(k, o->a, 0)], SOAK_BYTES);
      for (int d = 0; d < n; d++)
        for (int k = 0; k < n; k++)
          memcpy(&m[soak_at(d, o->b, soak_a2av_offset(o, k, d, 0) * s)],
                 &in[(size_t)k * SOAK_BYTES + soak_a2av_offset(o, k, d, 1) * s], soak_a2av_count(o, k, d) * s);
      free(in);
      break;
    }
    case S_SENDRECV: /* and a put: rank r's buffer a into the window over buffer b of rank r + shift */
    case S_PUT:
      for (int r = 0; r < n; r++) memcpy(&tmp[(size_t)r * len], &m[soak_at((r + n - o->shift) % n, o->a, 0)], len);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, 0)], &tmp[(size_t)r * len], len);
      break;
    case S_GATHER: /* only the root's b changes */
      for (int k = 0; k < n; k++) memcpy(&tmp[(size_t)k * len], &m[soak_at(k, o->a, soak_in_off(o, k, n))], len);
      memcpy(&m[soak_at(o->root, o->b, 0)], tmp, (size_t)n * len);
      break;
    case S_SCATTER:
      memcpy(tmp, &m[soak_at(o->root, o->a, 0)], (size_t)n * len);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, soak_out_off(o, r, n))], &tmp[(size_t)r * len], len);
      break;
  }
}

/* How many bytes of buffer b of rank r (`got`, SOAK_BYTES) differ from the model; the first at
 * `*at`. */
static size_t soak_mismatches(const uint8_t* got, int r, int b, size_t* at) {
  size_t bad = 0;
  for (size_t j = 0; j < SOAK_BYTES; j++)
    if (got[j] != g_soak_model[soak_at(r, b, j)] && bad++ == 0) *at = j;
  return bad;
}

/* Seeds the sequence and fills the model of `n` ranks with the initial values. */
static void soak_begin(int n, uint64_t seed) {
  g_soak_rng = 0x9E3779B97F4A7C15ull ^ seed;
  g_soak_model = TEST_ALLOC((size_t)n * SOAK_BUFS * SOAK_BYTES);
  for (int r = 0; r < n; r++)
    for (int b = 0; b < SOAK_BUFS; b++)
      for (size_t j = 0; j < SOAK_BYTES / 4; j++) {
        uint32_t v = (uint32_t)(r * 2654435761u) ^ (uint32_t)(b * 40503u) ^ (uint32_t)(j * 2246822519u);
        v = v ^ (v >> 15) ^ (uint32_t)g_soak_rng;
        memcpy(&g_soak_model[soak_at(r, b, j * 4)], &v, 4);
      }
}

/* The next step: one call, or two in a group on disjoint buffers (a shuffle of the buffers).
 * Returns how many. */
static int soak_step(int n, soak_op ops[2]) {
  int perm[SOAK_BUFS];
  for (int k = 0; k < SOAK_BUFS; k++) perm[k] = k;
  for (int k = SOAK_BUFS - 1; k > 0; k--) {
    int j = (int)(soak_next() % (unsigned)(k + 1)), t = perm[k];
    perm[k] = perm[j];
    perm[j] = t;
  }
  int pair = soak_next() % 4 == 0;
  ops[0] = soak_pick(n, perm[0], soak_next() % 3 == 0 ? perm[0] : perm[1]);
  if (pair) ops[1] = soak_pick(n, perm[2], soak_next() % 3 == 0 ? perm[2] : perm[3]);
  return 1 + pair;
}

#endif
