/*
 * cuda/soak.c - parts of the CUDA-mode test program (ffi-tests/cuda.c).
 *
 * A seeded random sequence of calls (soak.h), checked against a host model.
 */
#include "shared.h"
#include "../soak.h"

/* ---- Soak: a seeded random sequence of calls (soak.h), issued back to back ------------------
 * CUDA_TEST_SEED (1 unless set) seeds it. Each rank's buffers are device memory
 * (CUDA_TEST_VMM: of the virtual memory API) but the last, in pinned host memory; each call
 * goes on either of two streams per rank. Nothing is synchronised between calls: a stream
 * that switches waits for the other one with an event, as an application does. This process
 * compares its ranks' buffers with the model, every value, after every SOAK_EVERY calls.
 * Every buffer is a window on both communicators, and puts into them are among the calls
 * (CUDA_TEST_SOAK_RMA=0: none).
 * Counts are log-uniform, so that small calls are staged and large ones go direct or through
 * the device scratch. */
typedef struct {
  ncclComm_t split[MAX_LOCAL]; /* the second communicator (soak.h) */
  /* PreMulSums: the operator of each call of the step, and scalars in device memory (a slot
   * per call, uploaded in stream order from pinned memory). */
  ncclRedOp_t premul[2][MAX_LOCAL];
  CUdeviceptr scalars[MAX_LOCAL];
  uint64_t* scalars_up[MAX_LOCAL];
  CUdeviceptr buf[MAX_LOCAL][SOAK_BUFS];
  CUstream st[MAX_LOCAL][2];
  void* ev[MAX_LOCAL][2];
  int used[MAX_LOCAL][2]; /* work queued on the stream since the other one last waited for it */
  ncclWindow_t win[MAX_LOCAL][2][SOAK_BUFS]; /* every buffer a window, on either communicator */
} soak_state;

/* Stream `s` of local rank `l`, after whatever the other stream of the rank holds. */
static CUstream soak_stream(soak_state* S, int l, int s) {
  int t = 1 - s;
  if (S->used[l][t]) {
    CU(cu.EventRecord(S->ev[l][t], S->st[l][t]));
    CU(cu.StreamWaitEvent(S->st[l][s], S->ev[l][t], 0));
    S->used[l][t] = 0;
  }
  S->used[l][s] = 1;
  return S->st[l][s];
}

#define SOAK_SCALAR_SLOTS 64

static void soak_issue(soak_state* S, const soak_op* o, int k, int l) {
  const int n = g_env.nranks, r = g_env.first_rank + l;
  const size_t c = o->count, s = soak_size(o);
  const ncclDataType_t dt = SOAK_TYPES[o->type].dt;
  CUdeviceptr A = S->buf[l][o->a], B = S->buf[l][o->b];
  CUstream st = S->st[l][o->stream]; /* (ordered after the other stream: `soak`) */
  ncclComm_t comm = o->comm ? S->split[l] : g_comms[l];
  void* a = (void*)(uintptr_t)A;
  void* b = (void*)(uintptr_t)B;
  void* in = (void*)(uintptr_t)(A + soak_in_off(o, r, n));
  void* out = (void*)(uintptr_t)(B + soak_out_off(o, r, n));
  ncclRedOp_t red = o->red == SOAK_PREMUL ? S->premul[k][l] : (ncclRedOp_t)o->red;
  switch (o->kind) {
    case S_ALLREDUCE: CHECK(ncclAllReduce(in, out, c, dt, red, comm, st)); break;
    case S_REDUCE: CHECK(ncclReduce(in, out, c, dt, red, o->root, comm, st)); break;
    case S_BCAST: CHECK(ncclBroadcast(in, out, c, dt, o->root, comm, st)); break;
    case S_ALLGATHER: CHECK(ncclAllGather(in, out, c, dt, comm, st)); break;
    case S_REDUCESCATTER: CHECK(ncclReduceScatter(in, out, c, dt, red, comm, st)); break;
    case S_ALLTOALL: CHECK(ncclAlltoAll(in, out, c, dt, comm, st)); break;
    case S_GATHER: CHECK(ncclGather(in, out, c, dt, o->root, comm, st)); break;
    case S_SCATTER: CHECK(ncclScatter(in, out, c, dt, o->root, comm, st)); break;
    case S_SENDRECV:
      CHECK(ncclGroupStart());
      CHECK(ncclSend(a, c, dt, (r + o->shift) % n, comm, st));
      CHECK(ncclRecv(b, c, dt, (r + n - o->shift) % n, comm, st));
      CHECK(ncclGroupEnd());
      break;
    case S_ALLTOALLV:
      CHECK(ncclGroupStart());
      for (int p = 0; p < n; p++) {
        CHECK(ncclSend((void*)(uintptr_t)(A + soak_a2av_offset(o, r, p, 1) * s), soak_a2av_count(o, r, p), dt, p,
                       comm, st));
        CHECK(ncclRecv((void*)(uintptr_t)(B + soak_a2av_offset(o, p, r, 0) * s), soak_a2av_count(o, p, r), dt, p,
                       comm, st));
      }
      CHECK(ncclGroupEnd());
      break;
    case S_PUT: {
      CHECK(ncclPutSignal(a, c, dt, (r + o->shift) % n, S->win[l][o->comm][o->b], 0, 0, 0, 0, comm, st));
      ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = (r + n - o->shift) % n, .sigIdx = 0, .ctx = 0};
      CHECK(ncclWaitSignal(1, &d, comm, st));
      break;
    }
  }
}

/* Compares every buffer of this process's ranks with the model; 0 if any differs. */
static int soak_compare(soak_state* S, uint8_t* host, int first, int last, char (*said)[160]) {
  int ok = 1;
  for (int l = 0; l < g_env.local; l++) {
    int r = g_env.first_rank + l;
    CUstream st = soak_stream(S, l, 0);
    for (int b = 0; b < SOAK_BUFS && ok; b++) {
      const uint8_t* got = (const uint8_t*)(uintptr_t)S->buf[l][b];
      if (b < SOAK_BUFS - 1) {
        CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)host, S->buf[l][b], SOAK_BYTES, st));
        got = host;
      }
      CU(cu.StreamSynchronize(st));
      size_t at = 0, bad = soak_mismatches(got, r, b, &at);
      if (bad) {
        EXPECT(0, "soak (CUDA_TEST_SEED=%s), calls %d-%d: rank %d buffer %d: %zu wrong bytes, first at %zu: %u, expected %u",
               getenv("CUDA_TEST_SEED") ? getenv("CUDA_TEST_SEED") : "1", first, last, r, b, bad, at, got[at],
               g_soak_model[soak_at(r, b, at)]);
        for (int k = first; k <= last; k++) tlog("soak call %d: %s", k, said[k - first]);
        ok = 0;
      }
    }
  }
  return ok;
}

void soak(void) {
  test_step("soak");
  const int n = g_env.nranks;
  const char* seed = getenv("CUDA_TEST_SEED");
  const char* steps_env = getenv("CUDA_TEST_SOAK_STEPS");
  const int steps = steps_env && *steps_env ? atoi(steps_env) : 48;
  const char* every_env = getenv("CUDA_TEST_SOAK_EVERY"); /* (to find the call that went wrong) */
  const int every = every_env && atoi(every_env) > 0 && atoi(every_env) <= SOAK_EVERY ? atoi(every_env) : SOAK_EVERY;
  const char* rma = getenv("CUDA_TEST_SOAK_RMA"); /* 0: no puts */
  g_soak_rma = !(rma && *rma && atoi(rma) == 0);
  const char* graphs_env = getenv("CUDA_TEST_SOAK_GRAPH");
  const int graphs = graphs_env && atoi(graphs_env) != 0;
  const char* stall_env = getenv("CUDA_TEST_SOAK_STALL");
  const int stall = stall_env && atoi(stall_env) == 1;
  soak_begin(n, (uint64_t)(seed && *seed ? atoll(seed) : 1));
  uint8_t* tmp = TEST_ALLOC((size_t)n * SOAK_BYTES);
  uint8_t* host = host_alloc(SOAK_BYTES);
  soak_state S;
  memset(&S, 0, sizeof S);
  /* The second communicator is nonblocking: a call on it may answer ncclInProgress, and a
   * step waits for it (ncclCommGetAsyncError) before the next, as NCCL asks. */
  ncclConfig_t nonblocking = NCCL_CONFIG_INITIALIZER;
  nonblocking.blocking = 0;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommSplit(g_comms[l], 0, g_env.first_rank + l, &S.split[l], &nonblocking));
  CHECK(finish_async(ncclGroupEnd(), S.split, g_env.local));
  for (int l = 0; l < g_env.local; l++) {
    int r = g_env.first_rank + l;
    for (int s = 0; s < 2; s++) {
      CU(cu.EventCreate(&S.ev[l][s], CU_EVENT_DISABLE_TIMING));
      if (s == 0) S.st[l][s] = g_streams[l];
      else CU(cu.StreamCreate(&S.st[l][s], CU_STREAM_NON_BLOCKING));
    }
    S.scalars[l] = dev_alloc(SOAK_SCALAR_SLOTS * 8);
    S.scalars_up[l] = host_alloc(SOAK_SCALAR_SLOTS * 8);
    for (int b = 0; b < SOAK_BUFS; b++) {
      S.buf[l][b] = b < SOAK_BUFS - 1 ? dev_alloc(SOAK_BYTES) : (CUdeviceptr)(uintptr_t)host_alloc(SOAK_BYTES);
      if (b < SOAK_BUFS - 1) {
        memcpy(host, &g_soak_model[soak_at(r, b, 0)], SOAK_BYTES);
        CU(cu.MemcpyAsync(S.buf[l][b], (CUdeviceptr)(uintptr_t)host, SOAK_BYTES, S.st[l][0]));
        CU(cu.StreamSynchronize(S.st[l][0]));
      } else {
        memcpy((void*)(uintptr_t)S.buf[l][b], &g_soak_model[soak_at(r, b, 0)], SOAK_BYTES);
      }
    }
    S.used[l][0] = 1;
  }
  for (int k = 0; k < 2 && g_soak_rma; k++) {
    ncclComm_t* comms = k ? S.split : g_comms;
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      for (int b = 0; b < SOAK_BUFS; b++)
        CHECK(ncclCommWindowRegister(comms[l], (void*)(uintptr_t)S.buf[l][b], SOAK_BYTES, &S.win[l][k][b],
                                     NCCL_WIN_COLL_SYMMETRIC));
    CHECK(finish_async(ncclGroupEnd(), comms, g_env.local));
  }
  char said[SOAK_EVERY * 2][160];
  int first = 0, call = 0, ok = 1;
  for (int step = 0; step < steps && ok; step++) {
    soak_op ops[2];
    const int pair = soak_step(n, ops) - 1;
    /* CUDA_TEST_SOAK_STALL=1: now and then a rank 1.2 s late for its calls (as in
     * collectives.c): what the ranks waiting on it find may never fail a valid call. */
    const int slow = stall ? soak_late_rank((uint64_t)(seed && *seed ? atoll(seed) : 1), step, n) : -1;
    if (slow >= g_env.first_rank && slow < g_env.first_rank + g_env.local) {
      tlog("soak step %d: rank %d is late by 1.2 s", step, slow);
      sleep_ms(1200); /* (a slow rank, not a wait for anything) */
    }
    /* A put lands in its target's buffer whenever its sender gets to it, ordered with nothing
     * on the target's streams: as a program must, every rank finishes what its streams hold
     * and meets the others before a step with puts. */
    if (ops[0].kind == S_PUT || (pair && ops[1].kind == S_PUT)) {
      for (int l = 0; l < g_env.local; l++)
        for (int t = 0; t < 2; t++) CU(cu.StreamSynchronize(S.st[l][t]));
      allreduce_sum_int(g_comms, 0);
    }
    /* Each stream a call uses waits for the other's work first (an event recorded inside the
     * group would not cover the group's calls), and the other waits for it before its next. */
    for (int l = 0; l < g_env.local; l++)
      for (int k = 0; k <= pair; k++) soak_stream(&S, l, ops[k].stream);
    /* A PreMulSum's scalar as a host value, or in device memory the call's stream wrote. */
    for (int k = 0; k <= pair; k++)
      for (int l = 0; l < g_env.local && ops[k].red == SOAK_PREMUL; l++) {
        const int slot = (call + k) % SOAK_SCALAR_SLOTS;
        uint64_t* up = &S.scalars_up[l][slot]; /* (its low bytes: little-endian) */
        *up = soak_scalar(ops[k].shift, g_env.first_rank + l);
        const ncclDataType_t dt = SOAK_TYPES[ops[k].type].dt;
        ncclComm_t comm = ops[k].comm ? S.split[l] : g_comms[l];
        if (ops[k].device_scalar) {
          CUdeviceptr at = S.scalars[l] + (CUdeviceptr)slot * 8;
          CU(cu.MemcpyAsync(at, (CUdeviceptr)(uintptr_t)up, soak_size(&ops[k]), S.st[l][ops[k].stream]));
          CHECK(finish_async(ncclRedOpCreatePreMulSum(&S.premul[k][l], (void*)(uintptr_t)at, dt, ncclScalarDevice, comm),
                             &comm, 1));
        } else {
          CHECK(finish_async(ncclRedOpCreatePreMulSum(&S.premul[k][l], up, dt, ncclScalarHostImmediate, comm), &comm, 1));
        }
      }
    /* CUDA_TEST_SOAK_GRAPH=1 (with NCCL_RS_GRAPH_CAPTURE=1): a step whose calls are on one
     * stream and put nothing is captured, each rank's stream its own capture, and its graph
     * launched once or twice (odd steps twice: the model applies the calls again). */
    const int on_one_stream = !pair || ops[0].stream == ops[1].stream;
    const int puts = ops[0].kind == S_PUT || (pair && ops[1].kind == S_PUT);
    const int captured = graphs && on_one_stream && !puts;
    const int launches = captured ? 1 + step % 2 : 1;
    if (captured)
      for (int l = 0; l < g_env.local; l++) CU(cu.StreamBeginCapture(S.st[l][ops[0].stream], CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(ncclGroupStart());
    for (int k = 0; k <= pair; k++)
      for (int l = 0; l < g_env.local; l++) soak_issue(&S, &ops[k], k, l);
    CHECK(finish_async(ncclGroupEnd(), S.split, g_env.local));
    if (captured) {
      void *graph[MAX_LOCAL], *exec[MAX_LOCAL];
      for (int l = 0; l < g_env.local; l++) {
        CU(cu.StreamEndCapture(S.st[l][ops[0].stream], &graph[l]));
        CU(cu.GraphInstantiate(&exec[l], graph[l], 0));
      }
      for (int t = 0; t < launches; t++)
        for (int l = 0; l < g_env.local; l++) CU(cu.GraphLaunch(exec[l], S.st[l][ops[0].stream]));
      for (int l = 0; l < g_env.local; l++) {
        CU(cu.StreamSynchronize(S.st[l][ops[0].stream]));
        CU(cu.GraphExecDestroy(exec[l]));
        CU(cu.GraphDestroy(graph[l]));
      }
    }
    for (int k = 0; k <= pair; k++)
      for (int l = 0; l < g_env.local && ops[k].red == SOAK_PREMUL; l++) {
        ncclComm_t comm = ops[k].comm ? S.split[l] : g_comms[l];
        CHECK(finish_async(ncclRedOpDestroy(S.premul[k][l], comm), &comm, 1));
      }
    for (int l = 0; l < g_env.local; l++)
      for (int k = 0; k <= pair; k++) S.used[l][ops[k].stream] = 1;
    for (int k = 0; k <= pair; k++) {
      for (int t = 0; t < launches; t++) soak_apply(&ops[k], n, tmp);
      soak_describe(&ops[k], said[call - first], sizeof said[0]);
      if (captured) {
        char times[48];
        snprintf(times, sizeof times, " (captured, launched %dx)", launches);
        strncat(said[call - first], times, sizeof said[0] - strlen(said[call - first]) - 1);
      }
      if (getenv("CUDA_TEST_SOAK_TRACE")) tlog("soak call %d issued: %s", call, said[call - first]);
      if (k == 1) strncat(said[call - first], " (grouped with the call before)", sizeof said[0] - strlen(said[call - first]) - 1);
      call++;
    }
    if (call - first >= every || step == steps - 1) {
      ok = soak_compare(&S, host, first, call - 1, said);
      first = call;
    }
  }
  expect_no_async_error("soak");
  if (ok) tlog("Soak: %d calls checked against the model", call);
  for (int l = 0; l < g_env.local; l++)
    for (int s = 0; s < 2; s++) CU(cu.StreamSynchronize(S.st[l][s]));
  for (int k = 0; k < 2 && g_soak_rma; k++) {
    ncclComm_t* comms = k ? S.split : g_comms;
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      for (int b = 0; b < SOAK_BUFS; b++) CHECK(ncclCommWindowDeregister(comms[l], S.win[l][k][b]));
    CHECK(finish_async(ncclGroupEnd(), comms, g_env.local));
  }
  for (int l = 0; l < g_env.local; l++) {
    for (int b = 0; b < SOAK_BUFS; b++) {
      if (b < SOAK_BUFS - 1) dev_free(S.buf[l][b]);
      else CU(cu.MemFreeHost((void*)(uintptr_t)S.buf[l][b]));
    }
    CU(cu.StreamDestroy(S.st[l][1]));
    CHECK(ncclCommDestroy(S.split[l]));
    dev_free(S.scalars[l]);
    CU(cu.MemFreeHost(S.scalars_up[l]));
    for (int s = 0; s < 2; s++) CU(cu.EventDestroy(S.ev[l][s]));
  }
  CU(cu.MemFreeHost(host));
  free(tmp);
  free(g_soak_model);
}
