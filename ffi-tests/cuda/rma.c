/*
 * cuda/rma.c - parts of the CUDA-mode test program (ffi-tests/cuda.c).
 *
 * One-sided operations in stream order: puts and signals around a ring, peer and LSA pointers,
 * bad arguments, and senders that are late, stopped, gone or failed.
 */
#include "shared.h"

/* Deregister each local rank's window (collective: grouped) and free its buffer. */
static void drop_windows(ncclWindow_t* win, void** buf) {
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommWindowDeregister(g_comms[l], win[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclMemFree(buf[l]));
}

/* One-sided operations on device memory, in stream order (NCCL 2.29+). Every rank puts from a
 * device buffer into the next rank's window (ncclMemAlloc'd, symmetric) and waits on its
 * stream for the previous rank's put, then downloads its window on that stream: sizes of one
 * element, a few KB, several of nccl-rs's 256 KiB staging units and more than all 16 of them,
 * each round at a window offset of its own (no round overwrites what a slower rank has yet to
 * read). With stream waits the stream is held while the source is uploaded on it and the calls
 * are made: they return first, and a put that read its source before its stream got there
 * sends the previous round's values. Then a put into the rank's own window and a signal
 * without data, waited for on the stream. With `pageable`, the ring's sources are host memory
 * instead (part RmaPageable), pageable in the first round of each size and pinned in the
 * second: read once the stream got to the put, and free to reuse once the stream is past it.
 * (A put from pinned memory must not make its stream copy it into pinned staging: that copy
 * would hold up the calling thread behind the held stream, CUDA's rule between host buffers.) */
static void rma_ring(int pageable) {
  test_step("rma");
  const size_t counts[] = {1, 1000, (1u << 16) + 3, (5u << 18) + 7};
  const int ncounts = g_env.quick ? 3 : 4, rounds = 2, gate = !host_wait_mode();
  const size_t extra = 4096;
  size_t total = extra, max = counts[ncounts - 1];
  for (int c = 0; c < ncounts; c++) total += (size_t)rounds * counts[c];
  void* win_buf[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  CUdeviceptr src[MAX_LOCAL];
  float *h[MAX_LOCAL], *plain[MAX_LOCAL], *pinned[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclMemAlloc(&win_buf[l], total * sizeof(float)));
    src[l] = dev_alloc(max * sizeof(float));
    h[l] = host_alloc(max * sizeof(float));
    plain[l] = pageable ? TEST_ALLOC(max * sizeof(float)) : NULL;
    pinned[l] = pageable ? host_alloc(max * sizeof(float)) : NULL;
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommWindowRegister(g_comms[l], win_buf[l], total * sizeof(float), &win[l], NCCL_WIN_COLL_SYMMETRIC));
  CHECK(ncclGroupEnd());
  size_t at = 0; /* elements into the window */
  for (int c = 0; c < ncounts; c++) {
    for (int round = 0; round < rounds; round++, at += counts[c]) {
      const size_t count = counts[c], bytes = count * sizeof(float);
      const int salt = 7 * c + round;
      CUdeviceptr flagd = 0;
      uint32_t* flag = gate ? gate_word(&flagd) : NULL;
      for (int l = 0; l < g_env.local; l++) {
        int rank = g_env.first_rank + l;
        float* fill = !pageable ? h[l] : round ? pinned[l] : plain[l];
        for (size_t j = 0; j < count; j++) fill[j] = in_value(rank, j, salt);
        if (gate) CU(cu.StreamWaitValue32(g_streams[l], flagd, 1, 0 /* GEQ */));
        if (!pageable) CU(cu.MemcpyAsync(src[l], (CUdeviceptr)(uintptr_t)h[l], bytes, g_streams[l]));
      }
      CHECK(ncclGroupStart());
      for (int l = 0; l < g_env.local; l++) {
        int rank = g_env.first_rank + l;
        const void* from = !pageable ? (const void*)(uintptr_t)src[l]
                           : round  ? (const void*)pinned[l]
                                    : (const void*)plain[l];
        CHECK(ncclPutSignal(from, count, ncclFloat32, (rank + 1) % g_env.nranks, win[l], at * sizeof(float), 0, 0, 0,
                            g_comms[l], g_streams[l]));
        ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = (rank + g_env.nranks - 1) % g_env.nranks, .sigIdx = 0, .ctx = 0};
        CHECK(ncclWaitSignal(1, &d, g_comms[l], g_streams[l]));
      }
      CHECK(ncclGroupEnd());
      for (int l = 0; l < g_env.local; l++) {
        if (gate)
          EXPECT(cu.StreamQuery(g_streams[l]) != 0, "rma %zu: the stream held before the calls has already finished",
                 count);
        CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], (CUdeviceptr)(uintptr_t)win_buf[l] + at * sizeof(float), bytes,
                          g_streams[l]));
      }
      if (gate) *(volatile uint32_t*)flag = 1;
      for (int l = 0; l < g_env.local; l++) {
        int prev = (g_env.first_rank + l + g_env.nranks - 1) % g_env.nranks;
        CU(cu.StreamSynchronize(g_streams[l]));
        size_t bad = 0;
        for (size_t j = 0; j < count; j++) bad += h[l][j] != in_value(prev, j, salt);
        EXPECT(bad == 0, "rma put of %zu floats, round %d, rank %d: %zu wrong values (first: %g, want %g)", count, round,
               g_env.first_rank + l, bad, h[l][0], in_value(prev, 0, salt));
      }
      if (flag) CU(cu.MemFreeHost(flag));
      /* Past the put on its stream: the pageable source may be reused. */
      for (int l = 0; l < g_env.local && pageable; l++) memset(round ? pinned[l] : plain[l], 0, bytes);
      expect_no_async_error("rma");
    }
  }
  /* Into its own window, and a bare signal to the next rank. */
  const size_t n = 1000;
  for (int l = 0; l < g_env.local && !pageable; l++) {
    int rank = g_env.first_rank + l;
    for (size_t j = 0; j < n; j++) h[l][j] = in_value(rank, j, 41);
    CU(cu.MemcpyAsync(src[l], (CUdeviceptr)(uintptr_t)h[l], n * sizeof(float), g_streams[l]));
    CHECK(ncclPutSignal((void*)(uintptr_t)src[l], n, ncclFloat32, rank, win[l], at * sizeof(float), 0, 0, 0, g_comms[l],
                        g_streams[l]));
    CHECK(ncclSignal((rank + 1) % g_env.nranks, 0, 0, 0, g_comms[l], g_streams[l]));
  }
  for (int l = 0; l < g_env.local && !pageable; l++) {
    int rank = g_env.first_rank + l, prev = (rank + g_env.nranks - 1) % g_env.nranks;
    /* One from the previous rank (the signal), one from itself (the put); a one-rank job's own. */
    ncclWaitSignalDesc_t d[2] = {{.opCnt = 1, .peer = prev}, {.opCnt = 1, .peer = rank}};
    CHECK(ncclWaitSignal(2, d, g_comms[l], g_streams[l]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], (CUdeviceptr)(uintptr_t)win_buf[l] + at * sizeof(float),
                      n * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < n; j++) bad += h[l][j] != in_value(rank, j, 41);
    EXPECT(bad == 0, "rma into its own window, rank %d: %zu wrong values", rank, bad);
  }
  expect_no_async_error("rma");
  drop_windows(win, win_buf);
  for (int l = 0; l < g_env.local; l++) {
    dev_free(src[l]);
    CU(cu.MemFreeHost(h[l]));
    free(plain[l]);
    if (pinned[l]) CU(cu.MemFreeHost(pinned[l]));
  }
}

void rma(void) { rma_ring(0); }
void rma_pageable(void) { rma_ring(1); }

/* Does nccl-rs reach the windows of other ranks of this host (peer access not disabled by
 * NCCL_P2P_DISABLE=1 or NCCL_P2P_LEVEL=LOC, nor by a level the GPUs are farther apart than:
 * CUDA_TEST_PEER_ACCESS=0 says so)? */
int peer_access(void) {
  const char* off = getenv("NCCL_P2P_DISABLE");
  const char* level = getenv("NCCL_P2P_LEVEL");
  const char* told = getenv("CUDA_TEST_PEER_ACCESS");
  if (told && *told) return atoi(told) != 0;
  return !(off && atoi(off) != 0) && !(level && (!strcasecmp(level, "LOC") || !strcmp(level, "0")));
}

/* Descriptors this process has open. */
static int open_fds(void) {
  DIR* d = opendir("/proc/self/fd");
  int n = 0;
  if (!d) return -1;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* nccl_device/host.h's host-side pointer queries (neither nccl.h declares them). */
ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void** outPtr);
ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void** outPtr);

/* ncclGetPeerDevicePointer and ncclGetLsaDevicePointer (NCCL 2.29+: what PyTorch's NCCL
 * symmetric memory asks for every peer once a window is registered). Ranks of one host reach
 * each other's windows: each rank copies values into the next rank's window through the
 * pointer it got, on its stream, then signals on that stream; the next rank waits on its
 * stream and reads its window. Its own pointer is its buffer; the load/store team is every
 * rank (one host); a peer out of range is refused. With peer access disabled
 * (NCCL_P2P_DISABLE=1, NCCL_P2P_LEVEL=LOC) other ranks' pointers are NULL and the team is the
 * rank alone. */
void peer_pointers(void) {
  const int direct = peer_access();
  test_step("peer pointers");
  const size_t count = 4096, off = 64;
  void* buf[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  float* h[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclMemAlloc(&buf[l], count * sizeof(float) + off));
    h[l] = host_alloc(count * sizeof(float));
  }
  /* The stand-in counts the peers' allocations this process has mapped. */
  const int mapped_before = cu.StubPeerMemory ? cu.StubPeerMemory(NULL) : 0;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommWindowRegister(g_comms[l], buf[l], count * sizeof(float) + off, &win[l], NCCL_WIN_COLL_SYMMETRIC));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l, next = (rank + 1) % g_env.nranks;
    void *mine = NULL, *theirs = NULL, *lsa = NULL;
    CHECK(ncclGetPeerDevicePointer(win[l], 0, rank, &mine));
    EXPECT(mine == buf[l], "rank %d: its own device pointer is %p, not its buffer %p", rank, mine, buf[l]);
    CHECK(ncclGetPeerDevicePointer(win[l], off, next, &theirs));
    if (next != rank)
      EXPECT((theirs != NULL) == direct, "rank %d: device pointer %p for rank %d of its host, peer access %s", rank,
             theirs, next, direct ? "allowed" : "disabled");
    CHECK(ncclGetLsaDevicePointer(win[l], off, direct ? next : 0, &lsa));
    EXPECT(lsa == (direct ? theirs : (char*)buf[l] + off), "rank %d: load/store rank %d at %p, not %p", rank,
           direct ? next : 0, lsa, direct ? theirs : (char*)buf[l] + off);
    void* none = NULL;
    EXPECT(ncclGetPeerDevicePointer(win[l], 0, g_env.nranks, &none) == ncclInvalidArgument,
           "a device pointer for rank %d of %d was not refused", g_env.nranks, g_env.nranks);
    for (size_t j = 0; j < count; j++) h[l][j] = in_value(rank, j, 60);
    if (theirs) CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)theirs, (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float),
                                  g_streams[l]));
    CHECK(ncclSignal(next, 0, 0, 0, g_comms[l], g_streams[l]));
  }
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l, prev = (rank + g_env.nranks - 1) % g_env.nranks;
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = prev, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[l], g_streams[l]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], (CUdeviceptr)(uintptr_t)buf[l] + off, count * sizeof(float),
                      g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count && (direct || prev == rank); j++) bad += h[l][j] != in_value(prev, j, 60);
    EXPECT(bad == 0, "rank %d: %zu wrong values written by rank %d through its device pointer", rank, bad, prev);
  }
  expect_no_async_error("peer pointers");
  const int mapped_during = cu.StubPeerMemory ? cu.StubPeerMemory(NULL) : 0;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommWindowDeregister(g_comms[l], win[l]));
  CHECK(ncclGroupEnd());
  if (cu.StubPeerMemory) {
    /* Another process's window was mapped (where this process has a rank whose next rank is
     * elsewhere), and deregistering closed the mapping: its owner may free the memory. */
    int remote_next = 0;
    for (int l = 0; l < g_env.local; l++) remote_next |= (g_env.first_rank + l + 1) % g_env.nranks / g_env.local !=
                                                        g_env.first_rank / g_env.local;
    const int mapped_after = cu.StubPeerMemory(NULL);
    EXPECT(!direct || !remote_next || mapped_during > mapped_before,
           "no peer window mapped (%d mappings before, %d with the window)", mapped_before, mapped_during);
    EXPECT(mapped_after == mapped_before, "%d peer mappings after the window was deregistered, %d before it",
           mapped_after, mapped_before);
  }
  /* Window after window (as PyTorch registers one per symmetric allocation), each asked for
   * the next rank's pointer: nothing accumulates, neither descriptors (the targets answer each
   * window on a connection of its own) nor mappings. */
  const int fds_before = open_fds();
  for (int k = 0; k < 48; k++) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclCommWindowRegister(g_comms[l], buf[l], count * sizeof(float), &win[l], NCCL_WIN_COLL_SYMMETRIC));
    CHECK(ncclGroupEnd());
    for (int l = 0; l < g_env.local; l++) {
      void* p = NULL;
      CHECK(ncclGetPeerDevicePointer(win[l], 0, (g_env.first_rank + l + 1) % g_env.nranks, &p));
    }
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) CHECK(ncclCommWindowDeregister(g_comms[l], win[l]));
    CHECK(ncclGroupEnd());
  }
  int fds_after = open_fds();
  for (double until = now_s() + 10; fds_after > fds_before + 8 && now_s() < until; fds_after = open_fds()) usleep(10000);
  EXPECT(fds_after <= fds_before + 8, "%d descriptors open after 48 windows asked for, %d before", fds_after, fds_before);
  if (cu.StubPeerMemory)
    EXPECT(cu.StubPeerMemory(NULL) == mapped_before, "%d peer mappings after 48 windows, %d before",
           cu.StubPeerMemory(NULL), mapped_before);
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclMemFree(buf[l]));
    CU(cu.MemFreeHost(h[l]));
  }
}

/* One-sided calls that must be refused in CUDA mode, leaving the communicator usable: a put
 * past the end of the next rank's window (windows of different sizes, not symmetric; with
 * peer access the origin knows that size and refuses the put at the call), a signal index and
 * a peer out of range, and a call on a stream that captures a CUDA graph. Then a put and its
 * wait still work. */
void rma_errors(void) {
  test_step("rma errors");
  const int direct = peer_access();
  void* buf[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  CUdeviceptr src[MAX_LOCAL];
  const size_t most = 4096 + 1024 * (size_t)g_env.nranks;
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclMemAlloc(&buf[l], most));
    src[l] = dev_alloc(most);
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommWindowRegister(g_comms[l], buf[l], 4096 + 1024 * (size_t)(g_env.first_rank + l), &win[l],
                                 NCCL_WIN_DEFAULT));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l, next = (rank + 1) % g_env.nranks;
    const size_t theirs = 4096 + 1024 * (size_t)next;
    ncclResult_t r;
    if (direct) {
      r = ncclPutSignal((void*)(uintptr_t)src[l], theirs / 4 + 1, ncclFloat32, next, win[l], 0, 0, 0, 0, g_comms[l],
                        g_streams[l]);
      const char* msg = ncclGetLastError(g_comms[l]);
      EXPECT(r == ncclInvalidArgument && msg && strstr(msg, "does not fit"),
             "rank %d: a put of %zu bytes into rank %d's window of %zu: %s (\"%s\")", rank, theirs + 4, next, theirs,
             result_name(r), msg ? msg : "");
    }
    r = ncclSignal(next, 1, 0, 0, g_comms[l], g_streams[l]);
    EXPECT(r == ncclInvalidArgument, "a signal index past config.numRmaSig: %s", result_name(r));
    ncclWaitSignalDesc_t bad = {.opCnt = 1, .peer = g_env.nranks, .sigIdx = 0, .ctx = 0};
    r = ncclWaitSignal(1, &bad, g_comms[l], g_streams[l]);
    EXPECT(r == ncclInvalidArgument, "a wait for rank %d of %d: %s", g_env.nranks, g_env.nranks, result_name(r));
    CU(cu.StreamBeginCapture(g_streams[l], CU_STREAM_CAPTURE_MODE_RELAXED));
    r = ncclSignal(next, 0, 0, 0, g_comms[l], g_streams[l]);
    const char* msg = ncclGetLastError(g_comms[l]);
    void* graph = NULL;
    CU(cu.StreamEndCapture(g_streams[l], &graph));
    if (graph) CU(cu.GraphDestroy(graph));
    EXPECT(r == ncclInvalidUsage && msg && strstr(msg, "CUDA graph"), "ncclSignal during a capture: %s (\"%s\")",
           result_name(r), msg ? msg : "");
  }
  /* Still usable: a put that fits, and its wait. */
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CHECK(ncclPutSignal((void*)(uintptr_t)src[l], 1024, ncclFloat32, (rank + 1) % g_env.nranks, win[l], 0, 0, 0, 0,
                        g_comms[l], g_streams[l]));
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = (rank + g_env.nranks - 1) % g_env.nranks, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamSynchronize(g_streams[l]));
  expect_no_async_error("rma errors");
  drop_windows(win, buf);
  for (int l = 0; l < g_env.local; l++) dev_free(src[l]);
}

/* CUDA_TEST_RMA_RELEASE=FILE cuda --only RmaStreams (3 processes, one rank each): rank 0
 * signals rank 1 on a stream it holds (a wait on host memory) and rank 2 on another stream.
 * Rank 2 gets its signal while the first stream is still held (it says ARRIVED, and the
 * harness then writes FILE): one peer's operations wait only for their own streams. Rank 0
 * releases the held stream once FILE exists, and rank 1 gets its signal too. */
void rma_streams(void) {
  test_step("rma streams");
  const char* file = getenv("CUDA_TEST_RMA_RELEASE");
  if (!file || g_env.local != 1 || g_env.nranks != 3) return;
  const int rank = g_env.first_rank;
  if (rank == 0) {
    CUstream other;
    CU(cu.StreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CUdeviceptr flagd = 0;
    uint32_t* flag = gate_word(&flagd);
    CU(cu.StreamWaitValue32(g_streams[0], flagd, 1, 0 /* GEQ */));
    CHECK(ncclSignal(1, 0, 0, 0, g_comms[0], g_streams[0]));
    CHECK(ncclSignal(2, 0, 0, 0, g_comms[0], other));
    EXPECT(wait_for_file(file, 30), "rank 2 never got the signal of the stream that was not held");
    *(volatile uint32_t*)flag = 1;
    CU(cu.StreamSynchronize(g_streams[0]));
    CU(cu.StreamSynchronize(other));
    CU(cu.StreamDestroy(other));
    CU(cu.MemFreeHost(flag));
  } else {
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = 0, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[0], g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    tlog("ARRIVED: rank %d has rank 0's signal", rank);
  }
  expect_no_async_error("rma streams");
}

/* CUDA_TEST_RMA_LATE=FILE cuda --only RmaLate (2 processes, one rank each): rank 0's stream
 * waits for a signal from rank 1, which sends it only once FILE exists (the harness writes it
 * once rank 0 has said, after 10 s, which signal its stream waits for). Rank 0's stream then
 * goes on, with no error. */
void rma_late(void) {
  test_step("rma late");
  const char* file = getenv("CUDA_TEST_RMA_LATE");
  if (!file || g_env.local != 1) return;
  if (g_env.first_rank == 0) {
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = 1, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[0], g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    expect_no_async_error("rma late");
  } else if (g_env.first_rank == 1) {
    EXPECT(wait_for_file(file, 60), "the release file %s never came", file);
    CHECK(ncclSignal(0, 0, 0, 0, g_comms[0], g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
  }
}

/* cuda --only RmaStopped (2 processes, one rank each, one host): once both have registered a
 * window, rank 1 stops itself (SIGSTOP).
 * Rank 0's first put into its window asks rank 1 where the window is, and must say at WARN,
 * about a second in, that rank 1's process is stopped (the harness then sends SIGCONT; before,
 * the wait said nothing for up to NCCL_PEER_TIMEOUT_S). The put then lands: rank 1's wait for
 * its signal reads the values rank 0 put, exact. */
void rma_stopped(void) {
  test_step("rma stopped");
  if (g_env.local != 1 || g_env.nranks != 2) return;
  const size_t count = 1000, bytes = count * sizeof(float);
  void* win_buf[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  float* h = host_alloc(bytes);
  CHECK(ncclMemAlloc(&win_buf[0], bytes));
  CHECK(ncclCommWindowRegister(g_comms[0], win_buf[0], bytes, &win[0], NCCL_WIN_COLL_SYMMETRIC));
  if (g_env.first_rank == 1) {
    tlog("STOPPING");
    raise(SIGSTOP);
    tlog("resumed");
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = 0, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[0], g_streams[0]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h, (CUdeviceptr)(uintptr_t)win_buf[0], bytes, g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[j] != in_value(0, j, 5);
    EXPECT(bad == 0, "rank 1: %zu of the values rank 0 put are wrong", bad);
  } else {
    CUdeviceptr src = dev_alloc(bytes);
    for (size_t j = 0; j < count; j++) h[j] = in_value(0, j, 5);
    CU(cu.MemcpyAsync(src, (CUdeviceptr)(uintptr_t)h, bytes, g_streams[0]));
    CHECK(ncclPutSignal((void*)(uintptr_t)src, count, ncclFloat32, 1, win[0], 0, 0, 0, 0, g_comms[0], g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    dev_free(src);
  }
  expect_no_async_error("rma stopped");
  drop_windows(win, win_buf);
  CU(cu.MemFreeHost(h));
}

/* cuda --only HeldBySignal (3 processes, one rank each, one host): rank 2 stops itself
 * (SIGSTOP) before it signals rank 1. Rank 1's stream waits for that signal (ncclWaitSignal),
 * then sends to rank 0, which receives. Rank 0 waits on rank 1, whose call waits for its stream;
 * it must name rank 2, whose stopped process holds that stream (before, it said only that rank 1
 * waits for its stream), and rank 1 must say that its stream waits for a stopped process. The
 * harness then sends SIGCONT: the signal comes, and rank 0 receives rank 1's values, exact. */
void held_by_signal(void) {
  test_step("held by signal");
  if (g_env.local != 1 || g_env.nranks != 3) return;
  const size_t count = 1000, bytes = count * sizeof(float);
  float* h = host_alloc(bytes);
  CUdeviceptr buf = dev_alloc(bytes);
  if (g_env.first_rank == 2) {
    tlog("STOPPING");
    raise(SIGSTOP);
    tlog("resumed");
    CHECK(ncclSignal(1, 0, 0, 0, g_comms[0], g_streams[0]));
  } else if (g_env.first_rank == 1) {
    for (size_t j = 0; j < count; j++) h[j] = in_value(1, j, 9);
    CU(cu.MemcpyAsync(buf, (CUdeviceptr)(uintptr_t)h, bytes, g_streams[0]));
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = 2, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, g_comms[0], g_streams[0]));
    CHECK(ncclSend((void*)(uintptr_t)buf, count, ncclFloat32, 0, g_comms[0], g_streams[0]));
  } else {
    CHECK(ncclRecv((void*)(uintptr_t)buf, count, ncclFloat32, 1, g_comms[0], g_streams[0]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h, buf, bytes, g_streams[0]));
  }
  CU(cu.StreamSynchronize(g_streams[0]));
  if (g_env.first_rank == 0) {
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[j] != in_value(1, j, 9);
    EXPECT(bad == 0, "rank 0: %zu of the values rank 1 sent are wrong", bad);
  }
  expect_no_async_error("held by signal");
  dev_free(buf);
  CU(cu.MemFreeHost(h));
}

/* --only RmaGone (2+ processes, one rank each): rank 0's stream waits for a signal from rank 1,
 * which destroys its communicator and exits without sending it. No host thread waits for it,
 * yet the stream is let go, and rank 0's ncclCommGetAsyncError turns to ncclRemoteError naming
 * rank 1 (NCCL would wait forever). */
void rma_gone(void) {
  test_step("rma gone");
  if (g_env.local != 1 || g_env.first_rank != 0) return; /* rank 1 leaves: main destroys its communicator */
  ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = 1, .sigIdx = 0, .ctx = 0};
  CHECK(ncclWaitSignal(1, &d, g_comms[0], g_streams[0]));
  CU(cu.StreamSynchronize(g_streams[0]));
  ncclResult_t async = ncclSuccess;
  for (int i = 0; i < 2000 && async == ncclSuccess; i++) {
    CHECK(ncclCommGetAsyncError(g_comms[0], &async));
    if (async == ncclSuccess) usleep(10000);
  }
  const char* msg = ncclGetLastError(g_comms[0]);
  EXPECT(async == ncclRemoteError && msg && strstr(msg, "rank 1"),
         "a stream waiting for signals of a rank that left: async error %s (\"%s\"), not ncclRemoteError naming rank 1",
         result_name(async), msg ? msg : "");
}

/* --only RmaNoSender (the stand-in with NCCL_RS_STUB_HOST_ALLOC_FAILS=<local>:4194304): the
 * sender of one-sided operations cannot be started (its 4 MiB of pinned staging cannot be
 * allocated). The first ncclPutSignal of each rank fails with ncclUnhandledCudaError naming the
 * allocation, and its communicator stays usable; the next calls start the sender and are
 * ordered with their streams as ever: part Rma, whose calls must return while their streams
 * are held. Before, the calls fell back to running on the calling thread, which waited for the
 * held stream, and the program waited for ever. */
void rma_no_sender(void) {
  test_step("rma no sender");
  if (host_wait_mode()) return;
  const size_t count = 256;
  void* buf[MAX_LOCAL];
  ncclWindow_t win[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) CHECK(ncclMemAlloc(&buf[l], count * sizeof(float)));
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommWindowRegister(g_comms[l], buf[l], count * sizeof(float), &win[l], NCCL_WIN_COLL_SYMMETRIC));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    const int rank = g_env.first_rank + l;
    ncclResult_t r = ncclPutSignal(buf[l], count, ncclFloat32, (rank + 1) % g_env.nranks, win[l], 0, 0, 0, 0, g_comms[l],
                                   g_streams[l]);
    const char* msg = ncclGetLastError(g_comms[l]);
    EXPECT(r == ncclUnhandledCudaError && msg && strstr(msg, "cuMemHostAlloc") && strstr(msg, "one-sided"),
           "rank %d: a put whose sender cannot be started returned %s (\"%s\"), not ncclUnhandledCudaError naming it",
           rank, result_name(r), msg ? msg : "");
  }
  expect_no_async_error("a put refused at once");
  drop_windows(win, buf);
  rma();
}

/* --only RmaFailed (2 processes, one rank each): rank 0's communicator fails in a one-sided
 * operation queued on a stream: it has used every file descriptor it may (the hard limit set to
 * the soft one, so the library cannot raise it) when its signal to rank 1 needs a connection.
 * Its stream that waits for a signal from rank 1 (another stream makes the signal), and rank 1's
 * stream, which waits for
 * rank 0's signal, are both let go: nothing can be assumed of a failed communicator's
 * operations (NCCL), and a stream must not wait for ever on what the failure cut off. Rank 0's
 * asynchronous error names the limit; rank 1's names rank 0's failure, which rank 0 publishes
 * (and rank 1 asks for once rank 0 has descriptors again). Before, both streams waited for
 * ever. */
void rma_failed(void) {
  test_step("rma failed");
  if (g_env.local != 1 || g_env.nranks != 2) return;
  ncclComm_t comm = g_comms[0];
  CUstream st = g_streams[0];
  const int me = g_env.first_rank, other = 1 - me;
  const char* id_file = getenv("NCCL_TEST_ID_FILE");
  char done[4096];
  snprintf(done, sizeof done, "%s.rma-failed-done", id_file ? id_file : "/tmp/nccl-rs-rma-failed");
  /* The one-sided machinery of both ranks starts now (a signal to itself), with descriptors. */
  ncclWaitSignalDesc_t self = {.opCnt = 1, .peer = me, .sigIdx = 0, .ctx = 0};
  CHECK(ncclSignal(me, 0, 0, 0, comm, st));
  CHECK(ncclWaitSignal(1, &self, comm, st));
  CU(cu.StreamSynchronize(st));
  CHECK(allreduce_sum_int(g_comms, 1) == 2 ? ncclSuccess : ncclInternalError);
  ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = other, .sigIdx = 0, .ctx = 0};
  ncclResult_t async = ncclSuccess;
  const char* msg = "";
  if (me == 0) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur > 65536) {
      fprintf(stderr, "rma failed: the open-file limit is too high for this test\n");
      exit(2);
    }
    rl.rlim_max = rl.rlim_cur;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      perror("setrlimit");
      exit(2);
    }
    static int held[65536];
    int nheld = 0, fd;
    while (nheld < 65536 && (fd = dup(2)) >= 0) held[nheld++] = fd;
    /* The wait first (the signal fails on its own stream, which may be before the wait's call). */
    CUstream st2;
    CU(cu.StreamCreate(&st2, CU_STREAM_NON_BLOCKING));
    CHECK(ncclWaitSignal(1, &d, comm, st));
    CHECK(ncclSignal(other, 0, 0, 0, comm, st2));
    for (int i = 0; i < 2000 && async == ncclSuccess; i++) {
      CHECK(ncclCommGetAsyncError(comm, &async));
      if (async == ncclSuccess) usleep(10000);
    }
    msg = ncclGetLastError(comm);
    while (nheld > 0) close(held[--nheld]);
    tlog("rank 0's communicator: %s (%s)", result_name(async), msg ? msg : "");
    EXPECT(async == ncclSystemError && msg && strstr(msg, "open-file limit"),
           "a one-sided operation out of file descriptors: async error %s (\"%s\"), not ncclSystemError naming the limit",
           result_name(async), msg ? msg : "");
    double t0 = now_s();
    CU(cu.StreamSynchronize(st));
    EXPECT(now_s() - t0 < 5.0, "rank 0's stream was let go only after %.1f s", now_s() - t0);
    CU(cu.StreamSynchronize(st2));
    CU(cu.StreamDestroy(st2));
    /* (Its process stays until rank 1 has asked it why: a process that exited is named so.) */
    EXPECT(wait_for_file(done, 60), "rank 1 never said it was done (%s)", done);
  } else {
    CHECK(ncclWaitSignal(1, &d, comm, st));
    CU(cu.StreamSynchronize(st));
    CHECK(ncclCommGetAsyncError(comm, &async));
    msg = ncclGetLastError(comm);
    tlog("rank 1's communicator: %s (%s)", result_name(async), msg ? msg : "");
    EXPECT(async == ncclRemoteError && msg && strstr(msg, "rank 0") && strstr(msg, "failed"),
           "a stream waiting for signals of a rank whose communicator failed: async error %s (\"%s\"), not "
           "ncclRemoteError naming rank 0's failure", result_name(async), msg ? msg : "");
    FILE* f = fopen(done, "w");
    if (f) fclose(f);
  }
}
