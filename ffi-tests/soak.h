/* A seeded random sequence of collectives and sends/receives, and a host model of what they
 * do to every rank's buffers (ffi-tests/cuda.c and collectives.c, part Soak). A seed gives
 * every process the same sequence, so every rank issues the same calls. Each rank has
 * SOAK_BUFS uint32 buffers of SOAK_CAP elements; uint32 arithmetic wraps alike in the model
 * and in the library, so results compare exactly. The calls: all-reduce, reduce, broadcast,
 * all-gather, reduce-scatter, all-to-all (sum, prod, max, min, or a PreMulSum whose scalar
 * differs per rank), in place or not; sends and
 * receives around the ring by a random shift (0: to itself), in place or not; some steps two
 * calls in one group, on disjoint buffers; each call on either of two communicators of the
 * same ranks (the second split from the first, ranks numbered alike). Counts from 1 element
 * to the buffer's size, log-uniform. A reduce's non-root output and the rest of every buffer
 * must stay as they were. Static functions: each program includes it once. */
#ifndef NCCL_RS_FFI_SOAK_H
#define NCCL_RS_FFI_SOAK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SOAK_BUFS 5
#define SOAK_CAP ((size_t)1 << 18)
#define SOAK_EVERY 12
enum { S_ALLREDUCE, S_REDUCE, S_BCAST, S_ALLGATHER, S_REDUCESCATTER, S_ALLTOALL, S_SENDRECV, S_ALLTOALLV, S_KINDS };
static const char* const SOAK_NAME[S_KINDS] = {"AllReduce", "Reduce",   "Broadcast", "AllGather", "ReduceScatter",
                                              "AlltoAll",  "SendRecv", "AlltoAllv"};
typedef struct {
  int kind, red, in_place, a, b, root, shift, stream, comm;
  int device_scalar; /* (SOAK_PREMUL) its scalar in device memory, where the program has some */
  size_t count;
} soak_op;

static uint64_t g_soak_rng;
static uint32_t soak_next(void) {
  g_soak_rng ^= g_soak_rng >> 12;
  g_soak_rng ^= g_soak_rng << 25;
  g_soak_rng ^= g_soak_rng >> 27;
  return (uint32_t)((g_soak_rng * 2685821657736338717ull) >> 32);
}

/* The reductions: ncclSum, ncclProd, ncclMax, ncclMin, and a PreMulSum whose scalar differs
 * per rank (soak_scalar). */
#define SOAK_PREMUL 4

static uint32_t soak_scalar(int shift, int r) { return (uint32_t)(shift + 1) * 2654435761u + (uint32_t)r * 40503u; }

/* Rank r's contribution to a reduction: its value, or for a PreMulSum, times its scalar. */
static uint32_t soak_term(const soak_op* o, int r, uint32_t x) {
  return o->red == SOAK_PREMUL ? x * soak_scalar(o->shift, r) : x;
}

static uint32_t soak_reduce(int red, uint32_t x, uint32_t y) {
  switch (red) {
    case ncclSum:
    case SOAK_PREMUL: return x + y;
    case ncclProd: return x * y;
    case ncclMax: return x > y ? x : y;
    default: return x < y ? x : y;
  }
}

/* A random call on buffers `a` and `b` (the same one in place). */
static soak_op soak_pick(int n, int a, int b) {
  soak_op o;
  memset(&o, 0, sizeof o);
  o.kind = (int)(soak_next() % S_KINDS);
  o.red = (int)(soak_next() % 5);
  o.device_scalar = (int)(soak_next() % 2);
  o.in_place = a == b;
  o.a = a;
  o.b = b;
  o.root = (int)(soak_next() % (unsigned)n);
  o.shift = (int)(soak_next() % (unsigned)n);
  o.stream = (int)(soak_next() % 2);
  o.comm = (int)(soak_next() % 2);
  int wide = o.kind == S_ALLGATHER || o.kind == S_REDUCESCATTER || o.kind == S_ALLTOALL || o.kind == S_ALLTOALLV;
  size_t most = wide ? SOAK_CAP / (size_t)n : SOAK_CAP;
  size_t c = 1 + soak_next() % ((size_t)1 << (soak_next() % 19));
  o.count = c < most ? c : most;
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

static void soak_describe(const soak_op* o, char* out, size_t len) {
  snprintf(out, len, "%s%s count %zu, buffers %d->%d, op %d, root %d, shift %d, stream %d, communicator %d",
           SOAK_NAME[o->kind], o->in_place ? " in place" : "", o->count, o->a, o->b, o->red, o->root, o->shift,
           o->stream, o->comm);
}

/* The model: every rank's buffers, flat. */
static uint32_t* g_soak_model;
static size_t soak_at(int r, int b, size_t j) { return ((size_t)r * SOAK_BUFS + (size_t)b) * SOAK_CAP + j; }

/* What `o` does to every rank's buffers, in the model (`tmp`: n * SOAK_CAP scratch). */
static void soak_apply(const soak_op* o, int n, uint32_t* tmp) {
  uint32_t* m = g_soak_model;
  const size_t c = o->count;
  switch (o->kind) {
    case S_ALLREDUCE:
    case S_REDUCE:
      for (size_t j = 0; j < c; j++) {
        uint32_t v = soak_term(o, 0, m[soak_at(0, o->a, j)]);
        for (int r = 1; r < n; r++) v = soak_reduce(o->red, v, soak_term(o, r, m[soak_at(r, o->a, j)]));
        tmp[j] = v;
      }
      for (int r = 0; r < n; r++)
        if (o->kind == S_ALLREDUCE || r == o->root) memcpy(&m[soak_at(r, o->b, 0)], tmp, c * 4);
      break;
    case S_BCAST:
      memcpy(tmp, &m[soak_at(o->root, o->a, 0)], c * 4);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, 0)], tmp, c * 4);
      break;
    case S_ALLGATHER: /* in place: each rank's input is its block of the output */
      for (int k = 0; k < n; k++)
        memcpy(&tmp[(size_t)k * c], &m[o->in_place ? soak_at(k, o->b, (size_t)k * c) : soak_at(k, o->a, 0)], c * 4);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, 0)], tmp, (size_t)n * c * 4);
      break;
    case S_REDUCESCATTER: /* in place: each rank's output is its block of the input */
      for (int r = 0; r < n; r++)
        for (size_t j = 0; j < c; j++) {
          uint32_t v = soak_term(o, 0, m[soak_at(0, o->a, (size_t)r * c + j)]);
          for (int k = 1; k < n; k++)
            v = soak_reduce(o->red, v, soak_term(o, k, m[soak_at(k, o->a, (size_t)r * c + j)]));
          tmp[(size_t)r * c + j] = v;
        }
      for (int r = 0; r < n; r++)
        memcpy(&m[soak_at(r, o->b, o->in_place ? (size_t)r * c : 0)], &tmp[(size_t)r * c], c * 4);
      break;
    case S_ALLTOALL: {
      /* Block k of rank r's output is block r of rank k's input; one rank's output at a time
       * (in place, the inputs are read from a copy). */
      uint32_t* in = malloc((size_t)n * n * c * 4);
      if (!in) exit(1);
      for (int k = 0; k < n; k++) memcpy(&in[(size_t)k * n * c], &m[soak_at(k, o->a, 0)], (size_t)n * c * 4);
      for (int r = 0; r < n; r++)
        for (int k = 0; k < n; k++)
          memcpy(&m[soak_at(r, o->b, (size_t)k * c)], &in[(size_t)k * n * c + (size_t)r * c], c * 4);
      free(in);
      break;
    }
    case S_ALLTOALLV: {
      uint32_t* in = malloc((size_t)n * SOAK_CAP * 4);
      if (!in) exit(1);
      for (int k = 0; k < n; k++) memcpy(&in[(size_t)k * SOAK_CAP], &m[soak_at(k, o->a, 0)], SOAK_CAP * 4);
      for (int d = 0; d < n; d++)
        for (int k = 0; k < n; k++)
          memcpy(&m[soak_at(d, o->b, soak_a2av_offset(o, k, d, 0))],
                 &in[(size_t)k * SOAK_CAP + soak_a2av_offset(o, k, d, 1)], soak_a2av_count(o, k, d) * 4);
      free(in);
      break;
    }
    case S_SENDRECV:
      for (int r = 0; r < n; r++) memcpy(&tmp[(size_t)r * c], &m[soak_at((r + n - o->shift) % n, o->a, 0)], c * 4);
      for (int r = 0; r < n; r++) memcpy(&m[soak_at(r, o->b, 0)], &tmp[(size_t)r * c], c * 4);
      break;
  }
}

/* How many of buffer b of rank r (`got`, SOAK_CAP elements) differ from the model; the first at
 * `*at`. */
static size_t soak_mismatches(const uint32_t* got, int r, int b, size_t* at) {
  size_t bad = 0;
  for (size_t j = 0; j < SOAK_CAP; j++)
    if (got[j] != g_soak_model[soak_at(r, b, j)] && bad++ == 0) *at = j;
  return bad;
}

/* Seeds the sequence and fills the model of `n` ranks with the initial values. */
static void soak_begin(int n, uint64_t seed) {
  g_soak_rng = 0x9E3779B97F4A7C15ull ^ seed;
  g_soak_model = malloc((size_t)n * SOAK_BUFS * SOAK_CAP * 4);
  if (!g_soak_model) exit(1);
  for (int r = 0; r < n; r++)
    for (int b = 0; b < SOAK_BUFS; b++)
      for (size_t j = 0; j < SOAK_CAP; j++) {
        uint32_t v = (uint32_t)(r * 2654435761u) ^ (uint32_t)(b * 40503u) ^ (uint32_t)(j * 2246822519u);
        g_soak_model[soak_at(r, b, j)] = v ^ (v >> 15) ^ (uint32_t)g_soak_rng;
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
