/*
 * rma.c - one-sided operations (NCCL 2.29+): ncclPutSignal, ncclSignal and ncclWaitSignal on
 * windows registered with ncclCommWindowRegister, and ncclCommQueryProperties.
 *
 *   rma [--quick] [--only Ring|AllToAll|Barrier|Order|Signals|Errors|Properties|Abort]
 *   rma --only Gone      (2+ processes: rank 1 leaves with a signal still owed)
 *   rma --only Killed    (2+ processes, rank 1 on another host: it prints READY and waits to
 *                         be SIGKILLed before it ever connected; rank 0 waits for its signal)
 *
 * NCCL: a put lands in the target's window with no call of the target; the target learns it
 * landed by waiting for its signal. Operations to the same peer arrive in program order, data
 * and signals alike. A wait consumes the signals it waited for.
 */
#include "common.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <strings.h>

static ncclComm_t g_comms[MAX_LOCAL];

static int wanted(const char* name) { return !g_env.only || !strcasecmp(g_env.only, name); }
static int me_of(int l) { return g_env.first_rank + l; }
static int next_of(int r) { return (r + 1) % g_env.nranks; }
static int prev_of(int r) { return (r + g_env.nranks - 1) % g_env.nranks; }

/* One window per local rank over a guarded buffer (registration is collective: grouped when
 * this process drives several ranks). */
typedef struct {
  gbuf_t buf;
  void* ptr;
  size_t bytes;
  ncclWindow_t win;
} window_t;

static void open_windows(ncclComm_t* comms, window_t* w, size_t bytes, int flags) {
  for (int l = 0; l < g_env.local; l++) {
    w[l].bytes = bytes;
    w[l].ptr = gbuf_alloc(&w[l].buf, bytes);
    gbuf_poison(&w[l].buf, 0x3a3au);
  }
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommWindowRegister(comms[l], w[l].ptr, bytes, &w[l].win, flags));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
}

static void close_windows(ncclComm_t* comms, window_t* w, const char* what) {
  for (int l = 0; l < g_env.local; l++) {
    check_guards(what, &w[l].buf);
    CHECK(ncclCommWindowDeregister(comms[l], w[l].win));
    gbuf_free(&w[l].buf);
  }
}

/* Each local rank waits for `n` signals (signal 0, context 0) from `peer_of(rank)`. */
static void wait_each(ncclComm_t* comms, int (*peer_of)(int), int n) {
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ncclWaitSignalDesc_t d = {.opCnt = n, .peer = peer_of(me_of(l)), .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, comms[l], TEST_STREAM));
  }
  if (g_env.local > 1) CHECK(ncclGroupEnd());
}

/* Every rank puts into the next rank's window and waits for the previous rank's put; the
 * target checks it, then acknowledges with a signal so the next round may overwrite it. */
static void ring(void) {
  if (!wanted("Ring")) return;
  test_step("Ring");
  size_t counts[] = {1, 1000, (1u << 20) + 3};
  int ncounts = g_env.quick ? 2 : 3;
  size_t max = counts[ncounts - 1];
  window_t w[MAX_LOCAL];
  open_windows(g_comms, w, max * 4, NCCL_WIN_DEFAULT);
  gbuf_t src[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) gbuf_alloc(&src[l], max * 4);
  for (int c = 0; c < ncounts; c++) {
    for (int round = 0; round < 3; round++) {
      uint32_t salt = hash3((uint32_t)c, (uint32_t)round, 0x51u);
      CHECK(ncclGroupStart());
      for (int l = 0; l < g_env.local; l++) {
        fill_bytes(gbuf_ptr(&src[l]), 4, me_of(l), 0, counts[c], salt);
        CHECK(ncclPutSignal(gbuf_ptr(&src[l]), counts[c], ncclFloat32, next_of(me_of(l)), w[l].win, 0, 0, 0, 0,
                            g_comms[l], TEST_STREAM));
      }
      CHECK(ncclGroupEnd());
      wait_each(g_comms, prev_of, 1);
      for (int l = 0; l < g_env.local; l++) {
        char what[160];
        snprintf(what, sizeof what, "Ring: rank %d's window after the put of %zu floats from rank %d (round %d)",
                 me_of(l), counts[c], prev_of(me_of(l)), round);
        check_bytes(what, w[l].ptr, 4, prev_of(me_of(l)), 0, counts[c], salt);
      }
      /* The put's source may be reused at once: the data above came from before this. */
      for (int l = 0; l < g_env.local; l++) memset(gbuf_ptr(&src[l]), 0xee, counts[c] * 4);
      CHECK(ncclGroupStart());
      for (int l = 0; l < g_env.local; l++) CHECK(ncclSignal(prev_of(me_of(l)), 0, 0, 0, g_comms[l], TEST_STREAM));
      CHECK(ncclGroupEnd());
      wait_each(g_comms, next_of, 1);
    }
  }
  for (int l = 0; l < g_env.local; l++) {
    check_guards("Ring: the put source", &src[l]);
    gbuf_free(&src[l]);
  }
  close_windows(g_comms, w, "Ring: a window");
}

/* NCCL's all-to-all by puts: each rank puts its block for rank r at offset me in r's window,
 * in one group, then waits for one signal from every rank (itself included). */
static void all_to_all(void) {
  if (!wanted("AllToAll")) return;
  test_step("AllToAll");
  const int n = g_env.nranks;
  size_t count = g_env.quick ? 257 : 65537;
  size_t block = count * 2;
  void* win_mem[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  gbuf_t src[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclMemAlloc(&win_mem[l], block * (size_t)n));
    memset(win_mem[l], 0, block * (size_t)n);
    gbuf_alloc(&src[l], block * (size_t)n);
  }
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommWindowRegister(g_comms[l], win_mem[l], block * (size_t)n, &win[l], NCCL_WIN_COLL_SYMMETRIC));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
  const uint32_t salt = 0xa2a2u;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int me = me_of(l);
    for (int r = 0; r < n; r++) {
      char* p = (char*)gbuf_ptr(&src[l]) + (size_t)r * block;
      fill_bytes(p, 2, me, (size_t)r * count, count, salt); /* data of `me` meant for `r` */
      CHECK(ncclPutSignal(p, count, ncclBfloat16, r, win[l], (size_t)me * block, 0, 0, 0, g_comms[l], TEST_STREAM));
    }
  }
  CHECK(ncclGroupEnd());
  ncclWaitSignalDesc_t* descs = TEST_ALLOC((size_t)n * sizeof *descs);
  for (int r = 0; r < n; r++) descs[r] = (ncclWaitSignalDesc_t){.opCnt = 1, .peer = r, .sigIdx = 0, .ctx = 0};
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclWaitSignal(n, descs, g_comms[l], TEST_STREAM));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int me = me_of(l);
    for (int r = 0; r < n; r++) {
      char what[160];
      snprintf(what, sizeof what, "AllToAll: block of rank %d in rank %d's window", r, me);
      check_bytes(what, (char*)win_mem[l] + (size_t)r * block, 2, r, (size_t)me * count, count, salt);
    }
  }
  free(descs);
  /* Nobody deregisters before every rank has waited for what it was sent. */
  allreduce_sum_int(g_comms, 0);
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclCommWindowDeregister(g_comms[l], win[l]));
    CHECK(ncclMemFree(win_mem[l]));
    gbuf_free(&src[l]);
  }
}

/* NCCL's barrier by signals: every rank signals every rank, then waits for all of them. */
static void barrier(void) {
  if (!wanted("Barrier")) return;
  test_step("Barrier");
  const int n = g_env.nranks;
  ncclWaitSignalDesc_t* descs = TEST_ALLOC((size_t)n * sizeof *descs);
  for (int r = 0; r < n; r++) descs[r] = (ncclWaitSignalDesc_t){.opCnt = 1, .peer = r, .sigIdx = 0, .ctx = 0};
  for (int round = 0; round < 5; round++) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      for (int r = 0; r < n; r++) CHECK(ncclSignal(r, 0, 0, 0, g_comms[l], TEST_STREAM));
    CHECK(ncclGroupEnd());
    if (g_env.local > 1) CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) CHECK(ncclWaitSignal(n, descs, g_comms[l], TEST_STREAM));
    if (g_env.local > 1) CHECK(ncclGroupEnd());
  }
  free(descs);
}

/* Puts to one peer land in program order: big puts fill a block, small ones overwrite its
 * first element; after the last signal the block holds the last big put's value and its first
 * element the last put's. */
static void order(void) {
  if (!wanted("Order")) return;
  test_step("Order");
  const size_t big = 16384;
  const int K = 50;
  window_t w[MAX_LOCAL];
  open_windows(g_comms, w, big * 4, NCCL_WIN_COLL_SYMMETRIC);
  uint32_t* vals[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) vals[l] = TEST_ALLOC((size_t)K * big * 4);
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    for (int k = 0; k < K; k++) {
      uint32_t* v = vals[l] + (size_t)k * big;
      size_t count = k % 10 == 0 ? big : 1;
      for (size_t j = 0; j < count; j++) v[j] = (uint32_t)(1000 * me_of(l) + k);
      CHECK(ncclPutSignal(v, count, ncclUint32, next_of(me_of(l)), w[l].win, 0, 0, 0, 0, g_comms[l], TEST_STREAM));
    }
  }
  CHECK(ncclGroupEnd());
  wait_each(g_comms, prev_of, K);
  for (int l = 0; l < g_env.local; l++) {
    const uint32_t* got = w[l].ptr;
    uint32_t from = (uint32_t)prev_of(me_of(l)) * 1000;
    EXPECT(got[0] == from + (uint32_t)K - 1, "Order: rank %d's first element is %u, not the last put's %u", me_of(l),
           got[0], from + (uint32_t)K - 1);
    size_t bad = 0;
    for (size_t j = 1; j < big; j++) bad += got[j] != from + 40;
    EXPECT(bad == 0, "Order: %zu of %zu elements of rank %d's window are not the last big put's %u", bad, big - 1,
           me_of(l), from + 40);
    free(vals[l]);
  }
  allreduce_sum_int(g_comms, 0);
  close_windows(g_comms, w, "Order: a window");
}

/* Windows of two communicators made from the same unique id (NCCL_COMM_ID gives every
 * communicator the same; this part runs only with it set, one rank per process, 3 ranks or
 * more): the world, and a pair of its first two ranks. Ranks 0 and 1 register a window on the
 * pair first, then one on the world; the others only the world's. The last rank puts into
 * rank 0's world window: it must land there, and the pair's window stay as it was. Windows
 * used to be numbered per (hash, rank), which both communicators of rank 0 share, so rank 0's
 * world window was its second where the last rank's was its first: the put landed in the
 * pair's. */
static void same_id(void) {
  if (!wanted("SameId") || !getenv("NCCL_COMM_ID") || g_env.local != 1 || g_env.nranks < 3) return;
  test_step("SameId");
  const int me = g_env.first_rank, last = g_env.nranks - 1;
  const size_t count = 1024;
  ncclComm_t pair = NULL;
  window_t p, w;
  if (me < 2) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id));
    CHECK(ncclCommInitRank(&pair, 2, id, me));
    open_windows(&pair, &p, count * 4, NCCL_WIN_COLL_SYMMETRIC);
  }
  open_windows(g_comms, &w, count * 4, NCCL_WIN_COLL_SYMMETRIC);
  uint32_t* v = TEST_ALLOC(count * 4);
  for (size_t j = 0; j < count; j++) v[j] = 7000u + (uint32_t)j;
  if (me == last) CHECK(ncclPutSignal(v, count, ncclUint32, 0, w.win, 0, 0, 0, 0, g_comms[0], TEST_STREAM));
  if (me == 0) {
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = last, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[0], TEST_STREAM));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += ((const uint32_t*)w.ptr)[j] != 7000u + (uint32_t)j;
    EXPECT(bad == 0, "SameId: %zu of %zu elements of rank 0's world window are not rank %d's put", bad, count, last);
    EXPECT(gbuf_poison_intact(&p.buf, 0x3a3au, 0, count * 4),
           "SameId: rank %d's put into rank 0's world window changed its window on the pair", last);
  }
  free(v);
  allreduce_sum_int(g_comms, 0);
  close_windows(g_comms, &w, "SameId: a world window");
  if (pair) {
    close_windows(&pair, &p, "SameId: a window on the pair");
    CHECK(ncclCommDestroy(pair));
  }
}

/* Nonblocking communicators (host mode): one-sided calls take their place among the
 * communicator's operations. Every rank but the last all-reduces its buffer in place (the
 * call returns ncclInProgress: the last rank has yet to join) and puts that buffer into the
 * next rank's window; only then does the last rank join, after a barrier on the blocking
 * communicator that the others reach once their calls returned. A put that ran at its call
 * would send the buffer before the all-reduce wrote it; one that waited for the all-reduce
 * in the call would never return. */
static void nonblocking(void) {
  if (!wanted("Nonblocking")) return;
  test_step("Nonblocking");
  const int n = g_env.nranks, last = n - 1;
  const size_t count = 4096;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t nb[MAX_LOCAL];
  CHECK(make_comms_config("rma-nonblocking", nb, &cfg));
  window_t w[MAX_LOCAL];
  int32_t* buf[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    w[l].bytes = count * 4;
    w[l].ptr = gbuf_alloc(&w[l].buf, count * 4);
    gbuf_poison(&w[l].buf, 0x3a3au);
    buf[l] = TEST_ALLOC(count * 4);
    for (size_t j = 0; j < count; j++) buf[l][j] = me_of(l) + 1 + (int32_t)(j % 5);
  }
  if (g_env.local > 1) CHECK(ncclGroupStart());
  ncclResult_t r = ncclSuccess;
  for (int l = 0; l < g_env.local; l++) {
    r = ncclCommWindowRegister(nb[l], w[l].ptr, count * 4, &w[l].win, NCCL_WIN_COLL_SYMMETRIC);
    EXPECT(r == ncclSuccess || r == ncclInProgress, "window registration returned %s", result_name(r));
  }
  if (g_env.local > 1) r = ncclGroupEnd();
  CHECK(finish_async(r, nb, g_env.local));
  for (int late = 0; late < 2; late++) {
    int issued = 0;
    if (g_env.local > 1) CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      if ((me_of(l) == last) == late) {
        r = ncclAllReduce(buf[l], buf[l], count, ncclInt32, ncclSum, nb[l], TEST_STREAM);
        EXPECT(r == ncclSuccess || r == ncclInProgress, "the all-reduce returned %s", result_name(r));
        issued++;
      }
    if (g_env.local > 1) r = ncclGroupEnd();
    EXPECT(!issued || late || r == ncclInProgress, "an all-reduce a peer has yet to join returned %s", result_name(r));
    for (int l = 0; l < g_env.local; l++)
      if ((me_of(l) == last) == late) {
        r = ncclPutSignal(buf[l], count, ncclInt32, next_of(me_of(l)), w[l].win, 0, 0, 0, 0, nb[l], TEST_STREAM);
        EXPECT(late || r == ncclInProgress, "rank %d: a put behind an all-reduce in progress returned %s", me_of(l),
               result_name(r));
      }
    if (!late) expect_in_progress_then_barrier(nb, g_comms);
  }
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = prev_of(me_of(l)), .sigIdx = 0, .ctx = 0};
    r = ncclWaitSignal(1, &d, nb[l], TEST_STREAM);
    EXPECT(r == ncclSuccess || r == ncclInProgress, "the wait returned %s", result_name(r));
  }
  if (g_env.local > 1) r = ncclGroupEnd();
  EXPECT(r == ncclSuccess || r == ncclInProgress, "the waits returned %s", result_name(r));
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t state = wait_comm(nb[l]);
    EXPECT(state == ncclSuccess, "rank %d: the nonblocking calls ended in %s: %s", me_of(l), result_name(state),
           ncclGetLastError(nb[l]) ? ncclGetLastError(nb[l]) : "");
    size_t bad = 0;
    const int32_t* got = w[l].ptr;
    for (size_t j = 0; j < count; j++) bad += got[j] != n * (n + 1) / 2 + n * (int32_t)(j % 5);
    EXPECT(bad == 0, "rank %d: %zu of %zu elements of its window are not rank %d's all-reduced buffer (first: %d)",
           me_of(l), bad, count, prev_of(me_of(l)), got[0]);
  }
  for (int l = 0; l < g_env.local; l++) {
    check_guards("Nonblocking: a window", &w[l].buf);
    r = ncclCommWindowDeregister(nb[l], w[l].win);
    CHECK(finish_async(r, &nb[l], 1));
    gbuf_free(&w[l].buf);
    free(buf[l]);
    CHECK(ncclCommDestroy(nb[l]));
  }
  tlog("Nonblocking: puts in order behind all-reduces in progress");
}

/* Signals are counted per (context, signal index, sender), with numRmaCtx and numRmaSig from
 * the config, and a wait consumes what it waited for. */
static void signals(void) {
  if (!wanted("Signals")) return;
  test_step("Signals");
  ncclComm_t comms[MAX_LOCAL];
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.numRmaCtx = 2;
  config.numRmaSig = 3;
  CHECK(make_comms_config("signals", comms, &config));
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    for (int ctx = 0; ctx < 2; ctx++)
      for (int sig = 0; sig < 3; sig++)
        for (int k = 0; k < (sig + 1) * (ctx + 1); k++)
          CHECK(ncclSignal(next_of(me_of(l)), sig, ctx, 0, comms[l], TEST_STREAM));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    /* Each count asked in two parts: a signal named twice in one wait wants both. */
    ncclWaitSignalDesc_t d[12];
    for (int i = 0; i < 12; i++) {
      int ctx = i / 6, sig = i % 3, total = (sig + 1) * (ctx + 1);
      d[i] = (ncclWaitSignalDesc_t){.opCnt = i % 6 < 3 ? total - 1 : 1, .peer = prev_of(me_of(l)), .sigIdx = sig, .ctx = ctx};
    }
    CHECK(ncclWaitSignal(12, d, comms[l], TEST_STREAM));
    ncclResult_t r = ncclSignal(0, 3, 0, 0, comms[l], TEST_STREAM);
    EXPECT(r == ncclInvalidArgument, "Signals: signal index 3 with numRmaSig = 3: %s", result_name(r));
    r = ncclSignal(0, 0, 2, 0, comms[l], TEST_STREAM);
    EXPECT(r == ncclInvalidArgument, "Signals: context 2 with numRmaCtx = 2: %s", result_name(r));
  }
  /* Twice one signal, waited for one at a time: the second wait needs the second signal. */
  for (int round = 0; round < 2; round++) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) CHECK(ncclSignal(next_of(me_of(l)), 2, 1, 0, comms[l], TEST_STREAM));
    CHECK(ncclGroupEnd());
  }
  for (int k = 0; k < 2; k++)
    for (int l = 0; l < g_env.local; l++) {
      ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = prev_of(me_of(l)), .sigIdx = 2, .ctx = 1};
      CHECK(ncclWaitSignal(1, &d, comms[l], TEST_STREAM));
    }
  destroy_comms(comms);
}

static void expect_error(const char* what, ncclResult_t got, ncclResult_t want, ncclComm_t comm, const char* says) {
  const char* msg = ncclGetLastError(comm);
  EXPECT(got == want && (!says || (msg && strstr(msg, says))), "Errors: %s: %s (\"%s\"), not %s saying \"%s\"", what,
         result_name(got), msg ? msg : "", result_name(want), says ? says : "");
}

static void errors(void) {
  if (!wanted("Errors")) return;
  test_step("Errors");
  const int n = g_env.nranks;
  window_t w[MAX_LOCAL];
  open_windows(g_comms, w, 64, NCCL_WIN_COLL_SYMMETRIC);
  float src[32] = {0};
  for (int l = 0; l < g_env.local; l++) {
    ncclComm_t c = g_comms[l];
    int me = me_of(l);
    ncclWindow_t win = w[l].win;
    expect_error("peer -1", ncclPutSignal(src, 1, ncclFloat32, -1, win, 0, 0, 0, 0, c, TEST_STREAM), ncclInvalidArgument, c,
                 "out of range");
    expect_error("peer nranks", ncclSignal(n, 0, 0, 0, c, TEST_STREAM), ncclInvalidArgument, c, "out of range");
    expect_error("NULL window", ncclPutSignal(src, 1, ncclFloat32, me, NULL, 0, 0, 0, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "peerWin");
    expect_error("a put past a symmetric window's end", ncclPutSignal(src, 17, ncclFloat32, me, win, 0, 0, 0, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "does not fit");
    expect_error("a put at the window's end", ncclPutSignal(src, 1, ncclFloat32, me, win, 64, 0, 0, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "does not fit");
    expect_error("an offset that overflows", ncclPutSignal(src, 1, ncclFloat32, me, win, SIZE_MAX, 0, 0, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "does not fit");
    expect_error("context 1 of 1", ncclPutSignal(src, 1, ncclFloat32, me, win, 0, 0, 1, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "numRmaCtx");
    expect_error("signal index 1 of 1", ncclSignal(me, 1, 0, 0, c, TEST_STREAM), ncclInvalidArgument, c, "numRmaSig");
    expect_error("flags 1", ncclSignal(me, 0, 0, 1, c, TEST_STREAM), ncclInvalidArgument, c, "flags");
    expect_error("NULL localbuff", ncclPutSignal(NULL, 1, ncclFloat32, me, win, 0, 0, 0, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "localbuff");
    expect_error("datatype 99", ncclPutSignal(src, 1, (ncclDataType_t)99, me, win, 0, 0, 0, 0, c, TEST_STREAM),
                 ncclInvalidArgument, c, "datatype");
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = me, .sigIdx = 0, .ctx = 0};
    expect_error("nDesc -1", ncclWaitSignal(-1, &d, c, TEST_STREAM), ncclInvalidArgument, c, "nDesc");
    expect_error("NULL signalDescs", ncclWaitSignal(1, NULL, c, TEST_STREAM), ncclInvalidArgument, c, "signalDescs");
    ncclWaitSignalDesc_t bad = {.opCnt = -1, .peer = me, .sigIdx = 0, .ctx = 0};
    expect_error("opCnt -1", ncclWaitSignal(1, &bad, c, TEST_STREAM), ncclInvalidArgument, c, "opCnt");
    bad = (ncclWaitSignalDesc_t){.opCnt = 1, .peer = n, .sigIdx = 0, .ctx = 0};
    expect_error("a wait on rank nranks", ncclWaitSignal(1, &bad, c, TEST_STREAM), ncclInvalidArgument, c, "out of range");
    CHECK(ncclWaitSignal(0, NULL, c, TEST_STREAM));
    /* A put of nothing to itself still signals. */
    CHECK(ncclPutSignal(NULL, 0, ncclFloat32, me, win, 0, 0, 0, 0, c, TEST_STREAM));
    CHECK(ncclWaitSignal(1, &d, c, TEST_STREAM));
    /* A bad call in a group fails the group's end, as NCCL's groups do. */
    CHECK(ncclGroupStart());
    ncclResult_t in_group = ncclSignal(-1, 0, 0, 0, c, TEST_STREAM);
    ncclResult_t end = ncclGroupEnd();
    EXPECT(in_group == ncclInvalidArgument && end == ncclInvalidArgument,
           "Errors: a bad signal in a group: %s at the call, %s at ncclGroupEnd (both should be ncclInvalidArgument)",
           result_name(in_group), result_name(end));
  }
  /* A put past the end of a target's window that is not symmetric is found by the target:
   * nothing is written, and its wait (and every later one-sided call) names the put. */
  window_t small[MAX_LOCAL];
  open_windows(g_comms, small, 64, NCCL_WIN_DEFAULT);
  float big[32] = {0};
  if (n == 1) {
    expect_error("a put past the end of its own window", ncclPutSignal(big, 32, ncclFloat32, 0, small[0].win, 0, 0, 0, 0,
                                                                       g_comms[0], TEST_STREAM),
                 ncclInvalidArgument, g_comms[0], "does not fit");
  } else {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclPutSignal(big, 32, ncclFloat32, next_of(me_of(l)), small[l].win, 0, 0, 0, 0, g_comms[l], TEST_STREAM));
    CHECK(ncclGroupEnd());
    for (int l = 0; l < g_env.local; l++) {
      ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = prev_of(me_of(l)), .sigIdx = 0, .ctx = 0};
      expect_error("a wait for a put past the end of the window", ncclWaitSignal(1, &d, g_comms[l], TEST_STREAM),
                   ncclRemoteError, g_comms[l], "must stay inside the target's window");
      EXPECT(gbuf_poison_intact(&small[l].buf, 0x3a3au, 0, 64), "Errors: a put that did not fit wrote into the window");
    }
  }
  allreduce_sum_int(g_comms, 0);
  close_windows(g_comms, small, "Errors: a small window");
  /* Windows stay each rank's own: a deregistered one is refused. */
  ncclWindow_t old[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) old[l] = w[l].win;
  close_windows(g_comms, w, "Errors: a window");
  for (int l = 0; l < g_env.local; l++)
    expect_error("a deregistered window", ncclPutSignal(src, 1, ncclFloat32, me_of(l), old[l], 0, 0, 0, 0, g_comms[l], TEST_STREAM),
                 ncclInvalidArgument, g_comms[l], "not a window");
}

/* ncclCommProperties_t of NCCL 2.32.3 (nccl_device/host.h, which neither nccl.h declares). */
typedef struct {
  size_t size;
  unsigned int magic, version;
  int rank, nRanks, cudaDev, nvmlDev;
  bool deviceApiSupport, multimemSupport;
  int ginType, nLsaTeams;
  bool hostRmaSupport;
  int railedGinType;
  uint64_t commHash;
  int ginMinStride, ginConnectionType;
  bool ginSupport[64];
  size_t devCommRuntimeVersionSize;
  bool cftSupport, cftMulticastSupport, cftCountedSupport;
} props_v23203_t;
ncclResult_t ncclCommQueryProperties(ncclComm_t comm, void* props);
/* nccl_device/host.h's host-side pointer queries (neither nccl.h declares them). */
ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void** outPtr);
ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void** outPtr);

static void properties(void) {
  if (!wanted("Properties")) return;
  test_step("Properties");
  for (int l = 0; l < g_env.local; l++) {
    props_v23203_t p;
    memset(&p, 0x5c, sizeof p);
    p.size = sizeof p;
    p.magic = 0xcafebeef;
    p.version = NCCL_VERSION_CODE;
    CHECK(ncclCommQueryProperties(g_comms[l], &p));
    EXPECT(sizeof p == 152, "props: %zu bytes, NVIDIA's are 152", sizeof p);
    EXPECT(p.rank == me_of(l) && p.nRanks == g_env.nranks, "props: rank %d of %d, not %d of %d", p.rank, p.nRanks,
           me_of(l), g_env.nranks);
    EXPECT(!p.deviceApiSupport && !p.multimemSupport && p.ginType == 0 && !p.cftSupport,
           "props: device API %d, multimem %d, GIN type %d, CFT %d: nccl-rs has none", p.deviceApiSupport,
           p.multimemSupport, p.ginType, p.cftSupport);
    EXPECT(p.hostRmaSupport, "props: host RMA not supported, but host mode runs it");
    EXPECT(p.nLsaTeams == g_env.nranks, "props: %d load/store teams, not one per rank", p.nLsaTeams);
    int ginAny = 0;
    for (int i = 0; i < 64; i++) ginAny |= p.ginSupport[i];
    EXPECT(!ginAny && p.devCommRuntimeVersionSize == 0, "props: GIN types or a device communicator size reported");
    /* Every rank names the same communicator. */
    int low = (int)(p.commHash & 0x7fff);
    int sum = allreduce_sum_int(g_comms, low);
    EXPECT(sum == low * g_env.nranks, "props: commHash differs between ranks (sum of low bits %d)", sum);
    /* An older header's smaller struct: only its prefix is written. */
    props_v23203_t small;
    memset(&small, 0x5c, sizeof small);
    small.size = 24; /* header, rank, nRanks */
    small.magic = 0xcafebeef;
    small.version = NCCL_VERSION(2, 29, 0);
    CHECK(ncclCommQueryProperties(g_comms[l], &small));
    unsigned char poison[sizeof small];
    memset(poison, 0x5c, sizeof poison);
    EXPECT(small.rank == me_of(l) && small.size == 24 && !memcmp((char*)&small + 24, poison + 24, sizeof small - 24),
           "props: a 24-byte struct got rank %d and bytes past its end written", small.rank);
    props_v23203_t bad;
    memset(&bad, 0, sizeof bad);
    bad.size = sizeof bad;
    expect_error("props without its magic", ncclCommQueryProperties(g_comms[l], &bad), ncclInvalidArgument, g_comms[l],
                 "magic");
    expect_error("NULL props", ncclCommQueryProperties(g_comms[l], NULL), ncclInvalidArgument, g_comms[l], "props");
  }
  /* Device pointers of a window (host mode: one rank per load/store team): a rank's own part
   * is its buffer, other ranks' are NULL; a peer out of range or a deregistered window is
   * refused. */
  window_t w[MAX_LOCAL];
  open_windows(g_comms, w, 4096, NCCL_WIN_COLL_SYMMETRIC);
  for (int l = 0; l < g_env.local; l++) {
    void* p = NULL;
    CHECK(ncclGetPeerDevicePointer(w[l].win, 128, me_of(l), &p));
    EXPECT(p == (char*)w[l].ptr + 128, "own device pointer %p, not the buffer + 128 (%p)", p, (char*)w[l].ptr + 128);
    CHECK(ncclGetLsaDevicePointer(w[l].win, 0, 0, &p));
    EXPECT(p == w[l].ptr, "load/store rank 0 (itself) at %p, not its buffer %p", p, w[l].ptr);
    if (g_env.nranks > 1) {
      p = (void*)1;
      CHECK(ncclGetPeerDevicePointer(w[l].win, 0, next_of(me_of(l)), &p));
      EXPECT(p == NULL, "host mode: rank %d's device pointer for rank %d is %p, not NULL", me_of(l), next_of(me_of(l)), p);
    }
    expect_error("a device pointer of rank nranks", ncclGetPeerDevicePointer(w[l].win, 0, g_env.nranks, &p),
                 ncclInvalidArgument, g_comms[l], "out of range");
    expect_error("load/store rank 1 of a team of one", ncclGetLsaDevicePointer(w[l].win, 0, 1, &p), ncclInvalidArgument,
                 g_comms[l], "lsaRank");
  }
  ncclWindow_t gone[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) gone[l] = w[l].win;
  close_windows(g_comms, w, "device pointers");
  for (int l = 0; l < g_env.local; l++) {
    void* p = NULL;
    expect_error("a device pointer of a deregistered window", ncclGetPeerDevicePointer(gone[l], 0, 0, &p),
                 ncclInvalidArgument, g_comms[l], "not a window");
  }
}

/* Rank 0 waits for `count` signals from rank 1, which will not send them: the wait must end
 * with ncclRemoteError naming rank 1 and saying `says`. */
static void expect_wait_fails(const char* part, int count, const char* says) {
  test_deadline(60);
  ncclWaitSignalDesc_t d = {.opCnt = count, .peer = 1, .sigIdx = 0, .ctx = 0};
  double t0 = now_s();
  ncclResult_t r = ncclWaitSignal(1, &d, g_comms[0], TEST_STREAM);
  const char* msg = ncclGetLastError(g_comms[0]);
  tlog("%s: ncclWaitSignal returned %s after %.1f s: %s", part, result_name(r), now_s() - t0, msg ? msg : "");
  EXPECT(r == ncclRemoteError && msg && strstr(msg, "rank 1") && strstr(msg, says),
         "%s: a wait for rank 1's signals: %s (\"%s\"), not ncclRemoteError naming rank 1 and saying \"%s\"", part,
         result_name(r), msg ? msg : "", says);
  test_deadline(0);
}

/* Rank 1 signals once and leaves; rank 0 waits for two: it is told, not left waiting. */
static void gone(void) {
  if (!g_env.only || strcasecmp(g_env.only, "Gone")) return;
  test_step("Gone");
  EXPECT(g_env.nranks >= 2 && g_env.local == 1, "Gone needs 2+ processes of one rank");
  int me = g_env.first_rank;
  if (me == 1) {
    CHECK(ncclSignal(0, 0, 0, 0, g_comms[0], TEST_STREAM));
    CHECK(ncclCommDestroy(g_comms[0]));
    g_comms[0] = NULL;
    return;
  }
  if (me == 0) expect_wait_fails("Gone", 2, "1 of 2");
}

static int g_revoke; /* Abort part: revoke instead of abort */

static void* abort_later(void* comm) {
  sleep_ms(300); /* let the wait start; either order must end it */
  ncclResult_t r = g_revoke ? ncclCommRevoke((ncclComm_t)comm, NCCL_REVOKE_DEFAULT) : ncclCommAbort((ncclComm_t)comm);
  return (void*)(intptr_t)r;
}

/* ncclCommAbort (or ncclCommRevoke) from another thread ends a wait for a signal that never
 * comes. */
static void abort_wait_once(int revoke) {
  g_revoke = revoke;
  ncclComm_t comms[MAX_LOCAL];
  make_comms(revoke ? "revoke" : "abort", comms);
  test_deadline(30);
  pthread_t th[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) TEST_THREAD(&th[l], abort_later, comms[l]);
  for (int l = 0; l < g_env.local; l++) {
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = me_of(l), .sigIdx = 0, .ctx = 0}; /* nobody signals */
    ncclResult_t r = ncclWaitSignal(1, &d, comms[l], TEST_STREAM);
    EXPECT(r != ncclSuccess && r != ncclInProgress, "Abort: a wait on an aborted communicator returned %s", result_name(r));
  }
  for (int l = 0; l < g_env.local; l++) {
    void* ret = NULL;
    pthread_join(th[l], &ret);
    EXPECT((intptr_t)ret == ncclSuccess, "Abort: %s returned %s", revoke ? "ncclCommRevoke" : "ncclCommAbort",
           result_name((ncclResult_t)(intptr_t)ret));
  }
  test_deadline(0);
  if (revoke) destroy_comms(comms); /* a revoked communicator is still destroyed */
}

static void abort_wait(void) {
  if (!wanted("Abort")) return;
  test_step("Abort");
  abort_wait_once(0);
  abort_wait_once(1);
}

/* Rank 1, of another host, is killed before it ever sent anything: rank 0's wait finds its
 * bootstrap service gone (after NCCL_PEER_TIMEOUT_S) and says so, instead of waiting forever. */
static void killed(void) {
  if (!g_env.only || strcasecmp(g_env.only, "Killed")) return;
  test_step("Killed");
  int me = g_env.first_rank;
  if (me == 1) {
    test_deadline(40); /* the job kills it long before */
    tlog("READY: rank 1 waits to be killed");
    for (;;) sleep_ms(1000);
  }
  if (me == 0) expect_wait_fails("Killed", 1, "gone");
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  make_comms("", g_comms);
  ring();
  all_to_all();
  barrier();
  order();
  same_id();
  nonblocking();
  signals();
  errors();
  properties();
  abort_wait();
  gone();
  killed();
  if (g_comms[0]) destroy_comms(g_comms);
  return test_finish();
}
