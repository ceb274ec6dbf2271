/*
 * cuda/torch.c - parts of the CUDA-mode test program (ffi-tests/cuda.c).
 *
 * Communicators driven the way PyTorch's ProcessGroupNCCL drives them.
 */
#include "shared.h"

/* ---- Torch: communicators driven the way PyTorch's ProcessGroupNCCL drives them ----------
 * A nonblocking communicator (ncclCommInitRankConfig, blocking = 0) split into a sub-group
 * (with three or more ranks the last stays out with NCCL_SPLIT_NOCOLOR; keys reverse the
 * ranks); a watchdog thread polling ncclCommGetAsyncError on every communicator throughout;
 * collectives issued on a separate "NCCL stream" ordered after the compute stream by an event,
 * their results consumed on the compute stream after an event recorded behind them (the only
 * synchronisation is of the compute stream); DDP-style coalesced all-reduces of mixed sizes in
 * one group, ncclAlltoAll, an uneven all-to-all of grouped sends and receives including to
 * self, a one-element barrier on the parent, and Finalize + Destroy of both. */

#define TORCH_COMMS (2 * MAX_LOCAL)

typedef struct {
  ncclComm_t comms[TORCH_COMMS]; /* published with atomic stores: the watchdog reads them */
  int stop;
  int errors;
  ncclResult_t first;
  const char* first_why;
  long polls;
} watchdog_t;

static void* watchdog_main(void* arg) {
  watchdog_t* w = arg;
  while (!__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) {
    for (int i = 0; i < TORCH_COMMS; i++) {
      ncclComm_t c = __atomic_load_n(&w->comms[i], __ATOMIC_ACQUIRE);
      if (!c) continue;
      ncclResult_t state = ncclInternalError;
      ncclResult_t r = ncclCommGetAsyncError(c, &state);
      if (r == ncclSuccess) r = state;
      if (r != ncclSuccess && r != ncclInProgress && w->errors++ == 0) {
        w->first = r;
        w->first_why = ncclGetLastError(c);
      }
    }
    __atomic_add_fetch(&w->polls, 1, __ATOMIC_RELEASE);
    sleep_ms(1); /* the watchdog's polling period, as PyTorch's has one */
  }
  return NULL;
}

/* A call on a nonblocking communicator may answer ncclInProgress. */
#define ISSUED(call)                                                                        \
  do {                                                                                      \
    ncclResult_t issued_r_ = (call);                                                        \
    EXPECT(issued_r_ == ncclSuccess || issued_r_ == ncclInProgress, "%s: %s", #call,       \
           result_name(issued_r_));                                                         \
  } while (0)

/* Elements rank s (of the sub-group) sends to rank d in the uneven all-to-all: large and
 * small messages mixed. */
static size_t uneven_count(int s, int d) { return (s + d) % 2 ? 300 + 7 * s + d : 20000 + 997 * s + 13 * d; }

void torch_like(void) {
  test_step("torch");
  const int n = g_env.nranks;
  int L = g_env.local;
  const int m = n >= 3 ? n - 1 : n; /* members of the sub-group: world ranks 0..m-1 */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t world[MAX_LOCAL], sub[MAX_LOCAL];
  ncclResult_t r = make_comms_config("torch", world, &cfg);
  EXPECT(r == ncclSuccess, "nonblocking ncclCommInitRankConfig in CUDA mode: %s", result_name(r));
  if (r != ncclSuccess) return;

  watchdog_t w;
  memset(&w, 0, sizeof w);
  for (int l = 0; l < L; l++) __atomic_store_n(&w.comms[l], world[l], __ATOMIC_RELEASE);
  pthread_t watchdog;
  if (pthread_create(&watchdog, NULL, watchdog_main, &w) != 0) {
    EXPECT(0, "cannot start the watchdog thread");
    return;
  }

  test_step("torch: split");
  ncclResult_t first_err = ncclSuccess;
  /* As PyTorch splits one rank per process: outside a group, polling the parent until it is
   * done, by when the handle is set; the ranks of one process in a group. */
  const int grouped = L > 1;
  if (grouped) CHECK(ncclGroupStart());
  for (int l = 0; l < L; l++) {
    int rank = g_env.first_rank + l;
    sub[l] = NULL;
    ncclResult_t rl = ncclCommSplit(world[l], rank < m ? 0 : NCCL_SPLIT_NOCOLOR, m - 1 - rank, &sub[l], &cfg);
    if (rl != ncclSuccess && rl != ncclInProgress && first_err == ncclSuccess) first_err = rl;
  }
  if (grouped) {
    r = ncclGroupEnd();
    r = finish_async(first_err != ncclSuccess ? first_err : r, sub, L);
  } else {
    r = finish_async(first_err != ncclSuccess ? first_err : ncclInProgress, world, L);
    if (r == ncclSuccess && sub[0]) r = wait_comm(sub[0]);
  }
  EXPECT(r == ncclSuccess, "nonblocking ncclCommSplit in CUDA mode: %s", result_name(r));
  for (int l = 0; l < L; l++) {
    int rank = g_env.first_rank + l;
    EXPECT((sub[l] != NULL) == (rank < m), "rank %d: ncclCommSplit gave %p (member: %d)", rank, (void*)sub[l], rank < m);
    if (sub[l]) {
      int sr = -1, sn = -1;
      CHECK(ncclCommUserRank(sub[l], &sr));
      CHECK(ncclCommCount(sub[l], &sn));
      EXPECT(sr == m - 1 - rank && sn == m, "rank %d: sub-group rank %d of %d, expected %d of %d", rank, sr, sn, m - 1 - rank, m);
    }
    __atomic_store_n(&w.comms[MAX_LOCAL + l], sub[l], __ATOMIC_RELEASE);
  }
  if (r != ncclSuccess) L = 0; /* nothing more to run; still stop the watchdog below */

  /* Buffers: three all-reduce buckets, the ncclAlltoAll and uneven all-to-all buffers. */
  enum { BUCKETS = 3 };
  const size_t bucket[BUCKETS] = {60000, 999, 30000};
  const size_t a2a = 20000; /* per peer */
  size_t ua_send[MAX_LOCAL], ua_recv[MAX_LOCAL];
  CUdeviceptr db[MAX_LOCAL][BUCKETS], da_in[MAX_LOCAL], da_out[MAX_LOCAL], du_in[MAX_LOCAL], du_out[MAX_LOCAL];
  float *hb[MAX_LOCAL][BUCKETS], *ha_in[MAX_LOCAL], *ha_out[MAX_LOCAL], *hu_in[MAX_LOCAL], *hu_out[MAX_LOCAL];
  CUstream nccl_stream[MAX_LOCAL];
  void *ev_in[MAX_LOCAL], *ev_out[MAX_LOCAL];
  int members = 0;
  for (int l = 0; l < L; l++) members += sub[l] != NULL;

  test_step("torch: collectives");
  for (int l = 0; l < L; l++) {
    int rank = g_env.first_rank + l, me = m - 1 - rank;
    CUstream cs = g_streams[l];
    CU(cu.StreamCreate(&nccl_stream[l], CU_STREAM_NON_BLOCKING));
    CU(cu.EventCreate(&ev_in[l], CU_EVENT_DISABLE_TIMING));
    CU(cu.EventCreate(&ev_out[l], CU_EVENT_DISABLE_TIMING));
    if (!sub[l]) continue;
    for (int b = 0; b < BUCKETS; b++) {
      db[l][b] = dev_alloc(bucket[b] * sizeof(float));
      hb[l][b] = host_alloc(bucket[b] * sizeof(float));
      for (size_t j = 0; j < bucket[b]; j++) hb[l][b][j] = in_value(rank, j, 30 + b);
      CU(cu.MemcpyAsync(db[l][b], (CUdeviceptr)(uintptr_t)hb[l][b], bucket[b] * sizeof(float), cs));
    }
    da_in[l] = dev_alloc(a2a * m * sizeof(float));
    da_out[l] = dev_alloc(a2a * m * sizeof(float));
    ha_in[l] = host_alloc(a2a * m * sizeof(float));
    ha_out[l] = host_alloc(a2a * m * sizeof(float));
    for (int k = 0; k < m; k++)
      for (size_t j = 0; j < a2a; j++) ha_in[l][k * a2a + j] = in_value(rank, j, 40 + k);
    CU(cu.MemcpyAsync(da_in[l], (CUdeviceptr)(uintptr_t)ha_in[l], a2a * m * sizeof(float), cs));
    ua_send[l] = ua_recv[l] = 0;
    for (int k = 0; k < m; k++) {
      ua_send[l] += uneven_count(me, k);
      ua_recv[l] += uneven_count(k, me);
    }
    du_in[l] = dev_alloc(ua_send[l] * sizeof(float));
    du_out[l] = dev_alloc(ua_recv[l] * sizeof(float));
    hu_in[l] = host_alloc(ua_send[l] * sizeof(float));
    hu_out[l] = host_alloc(ua_recv[l] * sizeof(float));
    size_t at = 0;
    for (int d = 0; d < m; d++)
      for (size_t j = 0; j < uneven_count(me, d); j++) hu_in[l][at++] = in_value(rank, j, 50 + d);
    CU(cu.MemcpyAsync(du_in[l], (CUdeviceptr)(uintptr_t)hu_in[l], ua_send[l] * sizeof(float), cs));
    /* The NCCL stream starts after the compute stream's uploads. */
    CU(cu.EventRecord(ev_in[l], cs));
    CU(cu.StreamWaitEvent(nccl_stream[l], ev_in[l], 0));
  }
  if (members) {
    CHECK(ncclGroupStart()); /* DDP's coalesced buckets */
    for (int l = 0; l < L; l++)
      for (int b = 0; sub[l] && b < BUCKETS; b++)
        ISSUED(ncclAllReduce((void*)(uintptr_t)db[l][b], (void*)(uintptr_t)db[l][b], bucket[b], ncclFloat32, ncclSum, sub[l], nccl_stream[l]));
    r = ncclGroupEnd();
    EXPECT(finish_async(r, sub, L) == ncclSuccess, "coalesced all-reduces: %s", result_name(r));
    CHECK(ncclGroupStart());
    for (int l = 0; l < L; l++)
      if (sub[l]) ISSUED(ncclAlltoAll((void*)(uintptr_t)da_in[l], (void*)(uintptr_t)da_out[l], a2a, ncclFloat32, sub[l], nccl_stream[l]));
    r = ncclGroupEnd();
    EXPECT(finish_async(r, sub, L) == ncclSuccess, "ncclAlltoAll: %s", result_name(r));
    CHECK(ncclGroupStart()); /* all_to_all_single with uneven splits */
    for (int l = 0; l < L; l++) {
      if (!sub[l]) continue;
      int me = m - 1 - (g_env.first_rank + l);
      size_t so = 0, ro = 0;
      for (int k = 0; k < m; k++) {
        ISSUED(ncclSend((void*)(uintptr_t)(du_in[l] + so * sizeof(float)), uneven_count(me, k), ncclFloat32, k, sub[l], nccl_stream[l]));
        ISSUED(ncclRecv((void*)(uintptr_t)(du_out[l] + ro * sizeof(float)), uneven_count(k, me), ncclFloat32, k, sub[l], nccl_stream[l]));
        so += uneven_count(me, k);
        ro += uneven_count(k, me);
      }
    }
    r = ncclGroupEnd();
    EXPECT(finish_async(r, sub, L) == ncclSuccess, "uneven all-to-all: %s", result_name(r));
  }
  for (int l = 0; l < L; l++) {
    if (!sub[l]) continue;
    CUstream cs = g_streams[l];
    /* The compute stream consumes the results after an event behind the collectives. */
    CU(cu.EventRecord(ev_out[l], nccl_stream[l]));
    CU(cu.StreamWaitEvent(cs, ev_out[l], 0));
    for (int b = 0; b < BUCKETS; b++)
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hb[l][b], db[l][b], bucket[b] * sizeof(float), cs));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)ha_out[l], da_out[l], a2a * m * sizeof(float), cs));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hu_out[l], du_out[l], ua_recv[l] * sizeof(float), cs));
  }
  for (int l = 0; l < L; l++) {
    if (!sub[l]) continue;
    int rank = g_env.first_rank + l, me = m - 1 - rank;
    CU(cu.StreamSynchronize(g_streams[l]));
    for (int b = 0; b < BUCKETS; b++) {
      size_t bad = 0;
      for (size_t j = 0; j < bucket[b]; j++) {
        float want = 0;
        for (int q = 0; q < m; q++) want += in_value(q, j, 30 + b);
        bad += hb[l][b][j] != want;
      }
      EXPECT(bad == 0, "coalesced all-reduce bucket %d (%zu) on the sub-group, rank %d: %zu wrong values", b, bucket[b], rank, bad);
    }
    size_t bad = 0;
    for (int p = 0; p < m; p++)
      for (size_t j = 0; j < a2a; j++) bad += ha_out[l][p * a2a + j] != in_value(m - 1 - p, j, 40 + me);
    EXPECT(bad == 0, "ncclAlltoAll on the sub-group, rank %d: %zu wrong values", rank, bad);
    bad = 0;
    size_t at = 0;
    for (int s = 0; s < m; s++)
      for (size_t j = 0; j < uneven_count(s, me); j++) bad += hu_out[l][at++] != in_value(m - 1 - s, j, 50 + me);
    EXPECT(bad == 0, "uneven all-to-all of sends and receives, rank %d: %zu wrong values", rank, bad);
  }

  test_step("torch: barrier");
  float* one[MAX_LOCAL];
  CUdeviceptr done[MAX_LOCAL];
  for (int l = 0; l < L; l++) {
    one[l] = host_alloc(sizeof(float));
    done[l] = dev_alloc(sizeof(float));
    *one[l] = (float)(g_env.first_rank + l + 1);
    CU(cu.MemcpyAsync(done[l], (CUdeviceptr)(uintptr_t)one[l], sizeof(float), nccl_stream[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < L; l++)
    ISSUED(ncclAllReduce((void*)(uintptr_t)done[l], (void*)(uintptr_t)done[l], 1, ncclFloat32, ncclSum, world[l], nccl_stream[l]));
  r = ncclGroupEnd();
  EXPECT(finish_async(r, world, L) == ncclSuccess, "barrier: %s", result_name(r));
  for (int l = 0; l < L; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)one[l], done[l], sizeof(float), nccl_stream[l]));
    CU(cu.StreamSynchronize(nccl_stream[l]));
    EXPECT(*one[l] == (float)(n * (n + 1) / 2), "barrier's all-reduce gave %g, expected %d", *one[l], n * (n + 1) / 2);
  }

  __atomic_store_n(&w.stop, 1, __ATOMIC_RELEASE);
  pthread_join(watchdog, NULL);
  EXPECT(w.polls > 0, "the watchdog never polled");
  EXPECT(w.errors == 0, "the watchdog saw %d errors, the first %s: %s", w.errors, result_name(w.first), w.first_why ? w.first_why : "");

  test_step("torch: finalize");
  ncclComm_t* sets[2] = {sub, world};
  for (int k = 0; k < 2; k++) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      if (sets[k][l]) ISSUED(ncclCommFinalize(sets[k][l]));
    r = ncclGroupEnd();
    r = finish_async(r == ncclSuccess ? ncclInProgress : r, sets[k], g_env.local);
    EXPECT(r == ncclSuccess, "ncclCommFinalize of the %s: %s", k ? "parent" : "sub-group", result_name(r));
    for (int l = 0; l < g_env.local; l++)
      if (sets[k][l]) CHECK(ncclCommDestroy(sets[k][l]));
  }
  for (int l = 0; l < L; l++) {
    CU(cu.StreamDestroy(nccl_stream[l]));
    CU(cu.EventDestroy(ev_in[l]));
    CU(cu.EventDestroy(ev_out[l]));
    dev_free(done[l]);
    CU(cu.MemFreeHost(one[l]));
    if (!sub[l]) continue;
    for (int b = 0; b < BUCKETS; b++) {
      dev_free(db[l][b]);
      CU(cu.MemFreeHost(hb[l][b]));
    }
    dev_free(da_in[l]);
    dev_free(da_out[l]);
    dev_free(du_in[l]);
    dev_free(du_out[l]);
    CU(cu.MemFreeHost(ha_in[l]));
    CU(cu.MemFreeHost(ha_out[l]));
    CU(cu.MemFreeHost(hu_in[l]));
    CU(cu.MemFreeHost(hu_out[l]));
  }
}
