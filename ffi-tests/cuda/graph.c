/*
 * cuda/graph.c - parts of the CUDA-mode test program (ffi-tests/cuda.c).
 *
 * CUDA graphs: collectives on a stream that is capturing (refused by default, recorded with
 * NCCL_RS_GRAPH_CAPTURE=1), beside another stream's capture, and graphs launched again with
 * new inputs.
 */
#include "shared.h"

/* A collective issued while its stream captures a graph is refused with a clear error, and
 * the communicator stays usable. Every rank refuses alike, so no peer waits. */
void capture(void) {
  test_step("capture");
  CUdeviceptr d = dev_alloc(64 * sizeof(float));
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamBeginCapture(g_streams[l], CU_STREAM_CAPTURE_MODE_RELAXED));
    ncclResult_t r = ncclAllReduce((const void*)(uintptr_t)d, (void*)(uintptr_t)d, 64, ncclFloat32, ncclSum, g_comms[l],
                                   g_streams[l]);
    const char* msg = ncclGetLastError(g_comms[l]);
    void* graph = NULL;
    CU(cu.StreamEndCapture(g_streams[l], &graph));
    if (graph) CU(cu.GraphDestroy(graph));
    EXPECT(r == ncclInvalidUsage, "allreduce during graph capture returned %s", result_name(r));
    EXPECT(msg && strstr(msg, "graph"), "the capture error does not say why: '%s'", msg ? msg : "(null)");
  }
  /* On the legacy stream while a blocking stream captures, which CUDA answers with "implicit
   * capture" for it: refused with a message that says so, and that capture survives. */
  CUstream blocking;
  CU(cu.StreamCreate(&blocking, 0));
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    ncclResult_t r = ncclAllReduce((const void*)(uintptr_t)d, (void*)(uintptr_t)d, 64, ncclFloat32, ncclSum, g_comms[l],
                                   NULL);
    const char* msg = ncclGetLastError(g_comms[l]);
    void* graph = NULL;
    CUresult ended = cu.StreamEndCapture(blocking, &graph);
    if (graph) CU(cu.GraphDestroy(graph));
    EXPECT(r == ncclInvalidUsage, "allreduce on the legacy stream during a capture returned %s", result_name(r));
    EXPECT(msg && strstr(msg, "legacy default stream"), "the legacy stream's refusal does not say why: '%s'",
           msg ? msg : "(null)");
    EXPECT(ended == 0, "the blocking stream's capture was invalidated (cuStreamEndCapture: CUDA error %d)", ended);
  }
  CU(cu.StreamDestroy(blocking));
  dev_free(d);
  run_coll(C_ALLREDUCE, 100, 0, 0, 9); /* still works */
}

/* While this thread captures a graph on another stream in global mode (torch.cuda.graph's
 * default), collectives outside the capture run and the capture survives: nccl-rs's calls and
 * its threads' (starting a communicator's worker, mapping peers' buffers, staging on the
 * worker's stream, ncclMemAlloc and ncclMemFree) must not be the "potentially unsafe" calls a
 * global capture forbids, which would fail and invalidate it. The communicators are split off
 * after the capture began, so that everything they set up happens during it. Only when asked
 * (--only CaptureElsewhere): its pageable output is staged by the worker on its own stream. */
void capture_elsewhere(void) {
  test_step("capture elsewhere");
  const size_t small = 1000, large = 200000;
  CUdeviceptr ds[MAX_LOCAL], dp[MAX_LOCAL], dl[MAX_LOCAL];
  float *hs[MAX_LOCAL], *hl[MAX_LOCAL], *out[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) { /* the application allocates before it captures */
    ds[l] = dev_alloc(small * sizeof(float));
    dp[l] = dev_alloc(small * sizeof(float));
    dl[l] = dev_alloc(large * sizeof(float));
    hs[l] = host_alloc(small * sizeof(float));
    hl[l] = host_alloc(large * sizeof(float));
    out[l] = TEST_ALLOC((size_t)small * sizeof(float));
    for (size_t j = 0; j < small; j++) hs[l][j] = in_value(g_env.first_rank + l, j, 1);
    for (size_t j = 0; j < large; j++) hl[l][j] = in_value(g_env.first_rank + l, j, 2);
  }
  /* And a window per rank, which the previous rank puts into during the capture (with peer
   * access, the put's stream writes it; without, the target's own thread copies it in). */
  CUdeviceptr dw[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    dw[l] = dev_alloc(small * sizeof(float));
    CHECK(ncclCommWindowRegister(g_comms[l], (void*)(uintptr_t)dw[l], small * sizeof(float), &win[l],
                                 NCCL_WIN_COLL_SYMMETRIC));
  }
  CHECK(ncclGroupEnd());
  CUstream cap;
  CU(cu.StreamCreate(&cap, CU_STREAM_NON_BLOCKING));
  CU(cu.StreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_GLOBAL));
  ncclComm_t sub[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommSplit(g_comms[l], 0, g_env.first_rank + l, &sub[l], NULL));
  CHECK(ncclGroupEnd());
  void* pooled = NULL;
  CHECK(ncclMemAlloc(&pooled, 1 << 20));
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)hs[l], small * sizeof(float), g_streams[l]));
    CU(cu.MemcpyAsync(dp[l], (CUdeviceptr)(uintptr_t)hs[l], small * sizeof(float), g_streams[l]));
    CU(cu.MemcpyAsync(dl[l], (CUdeviceptr)(uintptr_t)hl[l], large * sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart()); /* a small all-reduce (staged), a large one (direct, on buffers new to
                            * the peers, which map them), and one to pageable memory (staged by
                            * the worker on its own stream) */
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclAllReduce((void*)(uintptr_t)ds[l], (void*)(uintptr_t)ds[l], small, ncclFloat32, ncclSum, sub[l], g_streams[l]));
    CHECK(ncclAllReduce((void*)(uintptr_t)dl[l], (void*)(uintptr_t)dl[l], large, ncclFloat32, ncclSum, sub[l], g_streams[l]));
    CHECK(ncclAllReduce((const void*)(uintptr_t)dp[l], out[l], small, ncclFloat32, ncclSum, sub[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    const int rank = g_env.first_rank + l, n = g_env.nranks;
    CHECK(ncclPutSignal((void*)(uintptr_t)dp[l], small, ncclFloat32, (rank + 1) % n, win[l], 0, 0, 0, 0, g_comms[l],
                        g_streams[l]));
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = (rank + n - 1) % n, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hs[l], ds[l], small * sizeof(float), g_streams[l]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hl[l], dl[l], large * sizeof(float), g_streams[l]));
  }
  /* Waiting is the application's unsafe call: this thread makes it relaxed. nccl-rs's threads
   * run while it waits, the capture still open. */
  int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  CU(cu.ThreadExchangeStreamCaptureMode(&mode));
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamSynchronize(g_streams[l]));
  CU(cu.ThreadExchangeStreamCaptureMode(&mode));
  CHECK(ncclMemFree(pooled));
  void* graph = NULL;
  CUresult ended = cu.StreamEndCapture(cap, &graph);
  EXPECT(ended == 0, "the graph captured meanwhile was invalidated (cuStreamEndCapture: CUDA error %d)", ended);
  if (graph) CU(cu.GraphDestroy(graph));
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    ncclResult_t async = ncclInProgress;
    CHECK(ncclCommGetAsyncError(sub[l], &async));
    EXPECT(async == ncclSuccess, "rank %d: collectives during another stream's capture failed: %s (%s)", rank,
           result_name(async), ncclGetLastError(sub[l]));
    size_t bad = 0;
    for (size_t j = 0; j < small; j++) bad += hs[l][j] != expected(C_ALLREDUCE, small, g_env.nranks, 0, j, 1);
    for (size_t j = 0; j < small; j++) bad += out[l][j] != expected(C_ALLREDUCE, small, g_env.nranks, 0, j, 1);
    for (size_t j = 0; j < large; j++) bad += hl[l][j] != expected(C_ALLREDUCE, large, g_env.nranks, 0, j, 2);
    EXPECT(bad == 0, "rank %d: collectives during another stream's capture: %zu wrong values", rank, bad);
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hs[l], dw[l], small * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    const int from = (rank + g_env.nranks - 1) % g_env.nranks;
    bad = 0;
    for (size_t j = 0; j < small; j++) bad += hs[l][j] != in_value(from, j, 1);
    EXPECT(bad == 0, "rank %d: %zu wrong values in its window after rank %d's put during the capture", rank, bad, from);
    ncclResult_t world = ncclInProgress;
    CHECK(ncclCommGetAsyncError(g_comms[l], &world));
    EXPECT(world == ncclSuccess, "rank %d: a put during another stream's capture failed: %s (%s)", rank,
           result_name(world), ncclGetLastError(g_comms[l]));
    dev_free(ds[l]);
    dev_free(dp[l]);
    dev_free(dl[l]);
    CU(cu.MemFreeHost(hs[l]));
    CU(cu.MemFreeHost(hl[l]));
    free(out[l]);
  }
  destroy_comms(sub);
  allreduce_sum_int(g_comms, 0); /* (every rank done with the windows) */
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclCommWindowDeregister(g_comms[l], win[l]));
    dev_free(dw[l]);
  }
  CU(cu.StreamDestroy(cap));
}

/* A driver that cannot record what a captured call needs (the harness sets the stand-in's
 * NCCL_RS_STUB_CAPTURE_REFUSES; CUDA_TEST_EXPECT_CALL names the driver call that fails): the
 * call fails with ncclUnhandledCudaError naming it, alike on every rank; whatever graph the
 * capture still gives launches without a hang and leaves the user's buffer as it was; the
 * communicators stay usable. (NCCL_RS_GRAPH_CAPTURE=1, --only GraphRefused.) */
void graph_refused(void) {
  test_step("graph: the driver refuses");
  const char* call = getenv("CUDA_TEST_EXPECT_CALL");
  const size_t count = 5000;
  CUdeviceptr x[MAX_LOCAL];
  float* h[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    x[l] = dev_alloc(count * sizeof(float));
    h[l] = host_alloc(count * sizeof(float));
    for (size_t j = 0; j < count; j++) h[l][j] = in_value(g_env.first_rank + l, j, 4);
    CU(cu.MemcpyAsync(x[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
  }
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CU(cu.StreamBeginCapture(g_streams[l], CU_STREAM_CAPTURE_MODE_GLOBAL));
    ncclResult_t r = ncclAllReduce((void*)(uintptr_t)x[l], (void*)(uintptr_t)x[l], count, ncclFloat32, ncclSum,
                                   g_comms[l], g_streams[l]);
    const char* why = ncclGetLastError(g_comms[l]);
    EXPECT(r == ncclUnhandledCudaError && call && strstr(why, call), "rank %d: captured all-reduce: %s (%s), expected %s",
           rank, result_name(r), why, call ? call : "(CUDA_TEST_EXPECT_CALL unset)");
    void* graph = NULL;
    CUresult ended = cu.StreamEndCapture(g_streams[l], &graph);
    tlog("rank %d: cuStreamEndCapture returned %d", rank, ended);
    if (graph) {
      void* exec = NULL;
      CU(cu.GraphInstantiate(&exec, graph, 0));
      CU(cu.GraphLaunch(exec, g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l])); /* never a hang */
      CU(cu.GraphExecDestroy(exec));
      CU(cu.GraphDestroy(graph));
    }
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], x[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t changed = 0;
    for (size_t j = 0; j < count; j++) changed += h[l][j] != in_value(rank, j, 4);
    EXPECT(changed == 0, "rank %d: the refused capture changed %zu values of the user's buffer", rank, changed);
  }
  for (int l = 0; l < g_env.local; l++) {
    dev_free(x[l]);
    CU(cu.MemFreeHost(h[l]));
  }
  run_coll(C_ALLREDUCE, 100, 0, 0, 9); /* still works */
}

/* ---- Graph: collectives captured into CUDA graphs (NCCL_RS_GRAPH_CAPTURE=1) ----------------
 * Captured as PyTorch captures them: in global mode (torch.cuda.graph's) on a stream of the
 * process's own, which each rank's stream (PyTorch's NCCL stream) joins through an event, and
 * which waits for them through events before the capture ends: one graph for the process's
 * ranks. Per rank, one group: an in-place all-reduce, a large out-of-place one, an all-gather,
 * a PreMulSum all-reduce with its scalar in device memory, an in-place all-gather and an
 * in-place reduce-scatter (staged once: one buffer holds the other), and a send to the next
 * rank with a receive from the previous. The graph is destroyed once instantiated (the executable copy
 * keeps what it needs) and launched three times, each time with new inputs and scalars
 * uploaded before, while the launch's stream is held on a host word and an ordinary all-reduce
 * (large: direct between ranks of a host) is issued on each rank's stream behind the launch
 * (an event): the launch must run first, and every result be exact. Then a graph captured on
 * each rank's stream alone, of a communicator destroyed before its launch: the stream must go
 * on (a warning says why). */
enum { G_SMALL = 1000, G_LARGE = 100000, G_GATHER = 3000 };

static void graph_inputs(int l, float* h, CUdeviceptr* d, int salt) {
  int rank = g_env.first_rank + l;
  const size_t n = (size_t)g_env.nranks;
  /* Buffers 0-4, then this rank's part of the in-place all-gather's buffer (10) and the whole
   * of the in-place reduce-scatter's (11). */
  const size_t counts[7] = {G_SMALL, G_LARGE, G_GATHER, G_SMALL, G_SMALL, G_GATHER, G_GATHER * n};
  const CUdeviceptr to[7] = {d[0], d[1], d[2], d[3], d[4], d[10] + rank * G_GATHER * sizeof(float), d[11]};
  for (int b = 0; b < 7; b++) {
    for (size_t j = 0; j < counts[b]; j++) h[j] = in_value(rank, j, salt + b);
    CU(cu.MemcpyAsync(to[b], (CUdeviceptr)(uintptr_t)h, counts[b] * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l])); /* h is reused for the next buffer */
  }
}

/* Rank l's call `r` in a capture was refused with ncclInvalidUsage and a message saying `want`;
 * the capture of its stream ends (the graph, if any, destroyed). */
static void end_refused_capture(int l, ncclResult_t r, const char* want, const char* what) {
  const char* why = ncclGetLastError(g_comms[l]);
  EXPECT(r == ncclInvalidUsage && strstr(why, want), "%s: %s (%s)", what, result_name(r), why);
  void* g = NULL;
  CU(cu.StreamEndCapture(g_streams[l], &g));
  if (g) CU(cu.GraphDestroy(g));
}

void graph(void) {
  test_step("graph: capture");
  const int n = g_env.nranks;
  /* Per rank: inputs [0] small in place, [1] large, [2] gather, [3] premul in place, [4] send;
   * outputs [5] large, [6] gather (n x), [7] receive; [8] the scalar; [9] an eager all-reduce;
   * in place, [10] an all-gather (n x) and [11] a reduce-scatter (n x). And an all-reduce of [4]
   * into pinned host memory, which the worker writes where it is. */
  CUdeviceptr d[MAX_LOCAL][12];
  float *h[MAX_LOCAL], *pinned_out[MAX_LOCAL];
  ncclRedOp_t pre[MAX_LOCAL];
  void *graphs[MAX_LOCAL], *execs[MAX_LOCAL];
  const size_t bytes[12] = {G_SMALL, G_LARGE, G_GATHER, G_SMALL, G_SMALL, G_LARGE, (size_t)G_GATHER * n, G_SMALL, 1,
                            G_LARGE, (size_t)G_GATHER * n, (size_t)G_GATHER * n};
  for (int l = 0; l < g_env.local; l++) {
    for (int b = 0; b < 12; b++) d[l][b] = dev_alloc(bytes[b] * sizeof(float));
    h[l] = host_alloc((size_t)G_LARGE * (n > 8 ? n : 8) * sizeof(float));
    pinned_out[l] = host_alloc(G_SMALL * sizeof(float));
    CHECK(ncclRedOpCreatePreMulSum(&pre[l], (void*)(uintptr_t)d[l][8], ncclFloat32, ncclScalarDevice, g_comms[l]));
  }
  CUstream cap;
  void *fork, *joined[MAX_LOCAL], *after;
  CU(cu.StreamCreate(&cap, CU_STREAM_NON_BLOCKING));
  CU(cu.EventCreate(&fork, CU_EVENT_DISABLE_TIMING));
  CU(cu.EventCreate(&after, CU_EVENT_DISABLE_TIMING));
  for (int l = 0; l < g_env.local; l++) CU(cu.EventCreate(&joined[l], CU_EVENT_DISABLE_TIMING));
  CU(cu.StreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CU(cu.EventRecord(fork, cap));
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamWaitEvent(g_streams[l], fork, 0));
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    ncclComm_t c = g_comms[l];
    CUstream st = g_streams[l];
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l][0], (void*)(uintptr_t)d[l][0], G_SMALL, ncclFloat32, ncclSum, c, st));
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l][1], (void*)(uintptr_t)d[l][5], G_LARGE, ncclFloat32, ncclSum, c, st));
    CHECK(ncclAllGather((void*)(uintptr_t)d[l][2], (void*)(uintptr_t)d[l][6], G_GATHER, ncclFloat32, c, st));
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l][3], (void*)(uintptr_t)d[l][3], G_SMALL, ncclFloat32, pre[l], c, st));
    CHECK(ncclAllGather((void*)(uintptr_t)(d[l][10] + (size_t)rank * G_GATHER * sizeof(float)), (void*)(uintptr_t)d[l][10],
                        G_GATHER, ncclFloat32, c, st));
    CHECK(ncclReduceScatter((void*)(uintptr_t)d[l][11], (void*)(uintptr_t)(d[l][11] + (size_t)rank * G_GATHER * sizeof(float)),
                            G_GATHER, ncclFloat32, ncclSum, c, st));
    CHECK(ncclSend((void*)(uintptr_t)d[l][4], G_SMALL, ncclFloat32, (rank + 1) % n, c, st));
    CHECK(ncclRecv((void*)(uintptr_t)d[l][7], G_SMALL, ncclFloat32, (rank + n - 1) % n, c, st));
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l][4], pinned_out[l], G_SMALL, ncclFloat32, ncclSum, c, st));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.EventRecord(joined[l], g_streams[l]));
    CU(cu.StreamWaitEvent(cap, joined[l], 0));
  }
  void *graph_all = NULL, *exec_all = NULL;
  CU(cu.StreamEndCapture(cap, &graph_all));
  EXPECT(graph_all != NULL, "the capture gave no graph");
  CU(cu.GraphInstantiate(&exec_all, graph_all, 0));
  CU(cu.GraphDestroy(graph_all));
  for (int launch = 0; launch < 3; launch++) {
    test_step("graph: launch");
    int salt = 10 * (launch + 1);
    CUdeviceptr dflag = 0;
    uint32_t* flag = gate_word(&dflag);
    for (int l = 0; l < g_env.local; l++) {
      int rank = g_env.first_rank + l;
      graph_inputs(l, h[l], d[l], salt);
      h[l][0] = (float)(rank + 1 + launch);
      CU(cu.MemcpyAsync(d[l][8], (CUdeviceptr)(uintptr_t)h[l], sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      for (size_t j = 0; j < G_LARGE; j++) h[l][j] = in_value(rank, j, salt + 7);
      CU(cu.MemcpyAsync(d[l][9], (CUdeviceptr)(uintptr_t)h[l], G_LARGE * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      memset(pinned_out[l], 0xff, G_SMALL * sizeof(float)); /* NaN: the launch must write it */
    }
    CU(cu.StreamWaitValue32(cap, dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
    CU(cu.GraphLaunch(exec_all, cap));
    CU(cu.EventRecord(after, cap));
    for (int l = 0; l < g_env.local; l++) CU(cu.StreamWaitEvent(g_streams[l], after, 0));
    /* In host-wait mode a call returns once done: the launch is released first. */
    if (host_wait_mode()) __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
    CHECK(ncclGroupStart()); /* behind the launch, issued while it is held */
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclAllReduce((void*)(uintptr_t)d[l][9], (void*)(uintptr_t)d[l][9], G_LARGE, ncclFloat32, ncclSum,
                          g_comms[l], g_streams[l]));
    CHECK(ncclGroupEnd());
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
    for (int l = 0; l < g_env.local; l++) {
      int rank = g_env.first_rank + l, prev = (rank + n - 1) % n;
      CU(cu.StreamSynchronize(g_streams[l]));
      float* out = h[l];
      size_t bad[8] = {0};
      const CUdeviceptr what[8] = {d[l][0], d[l][5], d[l][6], d[l][3], d[l][7], d[l][9], d[l][10],
                                   d[l][11] + (size_t)rank * G_GATHER * sizeof(float)};
      const size_t counts[8] = {G_SMALL, G_LARGE, (size_t)G_GATHER * n, G_SMALL, G_SMALL, G_LARGE, (size_t)G_GATHER * n,
                                G_GATHER};
      for (int k = 0; k < 8; k++) {
        CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)out, what[k], counts[k] * sizeof(float), g_streams[l]));
        CU(cu.StreamSynchronize(g_streams[l]));
        for (size_t j = 0; j < counts[k]; j++) {
          float want;
          switch (k) {
            case 0: want = expected(C_ALLREDUCE, G_SMALL, n, rank, j, salt); break;
            case 1: want = expected(C_ALLREDUCE, G_LARGE, n, rank, j, salt + 1); break;
            case 2: want = expected(C_ALLGATHER, G_GATHER, n, rank, j, salt + 2); break;
            case 3:
              want = 0;
              for (int r = 0; r < n; r++) want += (float)(r + 1 + launch) * in_value(r, j, salt + 3);
              break;
            case 4: want = in_value(prev, j, salt + 4); break;
            case 5: want = expected(C_ALLREDUCE, G_LARGE, n, rank, j, salt + 7); break;
            case 6: want = expected(C_ALLGATHER, G_GATHER, n, rank, j, salt + 5); break;
            default: want = expected(C_REDUCESCATTER, G_GATHER, n, rank, j, salt + 6); break;
          }
          bad[k] += out[j] != want;
        }
      }
      size_t bad_pinned = 0;
      for (size_t j = 0; j < G_SMALL; j++) bad_pinned += pinned_out[l][j] != expected(C_ALLREDUCE, G_SMALL, n, rank, j, salt + 4);
      EXPECT(bad_pinned == 0, "graph launch %d, rank %d: all-reduce into pinned memory: %zu wrong values", launch + 1, rank,
             bad_pinned);
      EXPECT(bad[0] + bad[1] + bad[2] + bad[3] + bad[4] + bad[5] + bad[6] + bad[7] == 0,
             "graph launch %d, rank %d: wrong values: all-reduce in place %zu, large %zu, all-gather %zu, "
             "PreMulSum %zu, receive %zu, the all-reduce behind the launch %zu, all-gather in place %zu, "
             "reduce-scatter in place %zu",
             launch + 1, rank, bad[0], bad[1], bad[2], bad[3], bad[4], bad[5], bad[6], bad[7]);
      ncclResult_t async = ncclInProgress;
      CHECK(ncclCommGetAsyncError(g_comms[l], &async));
      EXPECT(async == ncclSuccess, "rank %d after graph launch %d: %s (%s)", rank, launch + 1, result_name(async),
             ncclGetLastError(g_comms[l]));
    }
    CU(cu.MemFreeHost(flag));
  }
  CU(cu.GraphExecDestroy(exec_all));
  CU(cu.StreamDestroy(cap));
  CU(cu.EventDestroy(fork));
  CU(cu.EventDestroy(after));
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.EventDestroy(joined[l]));
    CHECK(ncclRedOpDestroy(pre[l], g_comms[l]));
    for (int b = 0; b < 12; b++) dev_free(d[l][b]);
    CU(cu.MemFreeHost(h[l]));
    CU(cu.MemFreeHost(pinned_out[l]));
  }

  /* What a graph cannot hold is refused alike on every rank, with a message, and the
   * communicators stay usable: pageable host memory (a graph cannot copy it), a group whose
   * operations on one communicator are on two capturing streams. */
  test_step("graph: refused");
  {
    CUstream other;
    CU(cu.StreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CUdeviceptr x[MAX_LOCAL];
    float* pageable[MAX_LOCAL];
    for (int l = 0; l < g_env.local; l++) {
      x[l] = dev_alloc(G_SMALL * sizeof(float));
      pageable[l] = TEST_ALLOC((size_t)G_SMALL * sizeof(float));
    }
    for (int l = 0; l < g_env.local; l++) {
      CU(cu.StreamBeginCapture(g_streams[l], CU_STREAM_CAPTURE_MODE_GLOBAL));
      ncclResult_t r = ncclAllReduce((void*)(uintptr_t)x[l], pageable[l], G_SMALL, ncclFloat32, ncclSum, g_comms[l],
                                     g_streams[l]);
      end_refused_capture(l, r, "pageable", "a captured all-reduce into pageable memory");
    }
    for (int l = 0; l < g_env.local; l++) {
      CU(cu.StreamBeginCapture(g_streams[l], CU_STREAM_CAPTURE_MODE_GLOBAL));
      CHECK(ncclGroupStart());
      CHECK(ncclAllReduce((void*)(uintptr_t)x[l], (void*)(uintptr_t)x[l], G_SMALL, ncclFloat32, ncclSum, g_comms[l],
                          g_streams[l]));
      CHECK(ncclAllReduce((void*)(uintptr_t)x[l], (void*)(uintptr_t)x[l], G_SMALL, ncclFloat32, ncclSum, g_comms[l],
                          other));
      end_refused_capture(l, ncclGroupEnd(), "one stream", "a captured group on two streams");
    }
    for (int l = 0; l < g_env.local; l++) {
      dev_free(x[l]);
      free(pageable[l]);
    }
    CU(cu.StreamDestroy(other));
  }
  run_coll(C_ALLREDUCE, 100, 0, 0, 9); /* still works */

  test_step("graph: launched after its communicator is gone");
  ncclComm_t sub[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommSplit(g_comms[l], 0, g_env.first_rank + l, &sub[l], NULL));
  CHECK(ncclGroupEnd());
  CUdeviceptr x[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) x[l] = dev_alloc(G_SMALL * sizeof(float));
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamBeginCapture(g_streams[l], CU_STREAM_CAPTURE_MODE_GLOBAL));
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce((void*)(uintptr_t)x[l], (void*)(uintptr_t)x[l], G_SMALL, ncclFloat32, ncclSum, sub[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamEndCapture(g_streams[l], &graphs[l]));
    CU(cu.GraphInstantiate(&execs[l], graphs[l], 0));
  }
  destroy_comms(sub);
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.GraphLaunch(execs[l], g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l])); /* released at once: never a hang */
    CU(cu.GraphExecDestroy(execs[l]));
    CU(cu.GraphDestroy(graphs[l]));
    dev_free(x[l]);
  }
}
