/*
 * cuda/faults.c - parts of the CUDA-mode test program (ffi-tests/cuda.c).
 *
 * Failures, each run as a program of its own by the harness: a killed process, mismatched
 * calls, driver calls that fail, aborts while a stream is held, late or departed peers.
 */
#include "shared.h"

/* CUDA_TEST_FAULT=shrink (3 processes, process 1 killed): the survivors shrink the failed
 * communicator (NCCL_SHRINK_ABORT) to the two of them and go on with direct all-reduces on
 * device memory, exact; then the parent is aborted and the child destroyed. */
static void shrink_survivors(ncclComm_t comm, CUdeviceptr d, size_t count, int dead) {
  test_step("shrink");
  ncclComm_t child = NULL;
  double t = now_s();
  CHECK(ncclCommShrink(comm, &dead, 1, &child, NULL, NCCL_SHRINK_ABORT));
  EXPECT(now_s() - t < 10.0, "ncclCommShrink took %.1f s", now_s() - t);
  int n = 0, me = -1;
  CHECK(ncclCommCount(child, &n));
  CHECK(ncclCommUserRank(child, &me));
  EXPECT(n == 2 && me == (g_env.first_rank < dead ? g_env.first_rank : g_env.first_rank - 1), "shrunk to rank %d of %d",
         me, n);
  float* h = host_alloc(count * sizeof(float));
  for (int round = 0; round < 3; round++) {
    for (size_t j = 0; j < count; j++) h[j] = in_value(me, j, 80 + round);
    CU(cu.MemcpyAsync(d, (CUdeviceptr)(uintptr_t)h, count * sizeof(float), g_streams[0]));
    CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, child, g_streams[0]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h, d, count * sizeof(float), g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[j] != expected(C_ALLREDUCE, count, 2, me, j, 80 + round);
    EXPECT(bad == 0, "all-reduce %d on the shrunk communicator, rank %d: %zu wrong values", round, me, bad);
  }
  tlog("SHRUNK: rank %d of %d, 3 all-reduces of %zu floats", me, n, count);
  CU(cu.MemFreeHost(h));
  CHECK(ncclCommAbort(comm));
  CHECK(ncclCommDestroy(child));
}

/* A rank that stays alive but never issues the call (CUDA_TEST_SHRINK_STUCK=FILE, 3 processes:
 * process 2 issues nothing until FILE exists, which the harness makes once the others are
 * done): ranks 0 and 1 issue an all-reduce on their streams, then shrink rank 2 away with
 * NCCL_SHRINK_ABORT, which must abort that all-reduce so their streams get past it (its result
 * is undefined); the child's all-reduces behind it on the same streams are exact. */
int shrink_stuck(void) {
  test_step("shrink-stuck");
  const char* release = getenv("CUDA_TEST_SHRINK_STUCK");
  const size_t count = 1 << 20;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  if (g_env.first_rank == 2) {
    tlog("STUCK: issuing nothing");
    EXPECT(wait_for_file(release, 60), "never released (%s)", release);
  } else {
    CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
    test_deadline(30); /* a stream left waiting for the stuck call would hang here */
    shrink_survivors(g_comms[0], d, count, 2);
    test_deadline(0);
  }
  if (g_env.first_rank == 2) CHECK(ncclCommAbort(g_comms[0]));
  dev_free(d);
  return test_finish();
}

/* A peer dies while operations run on streams: the survivor's stream must be released, the
 * communicator must report ncclRemoteError naming the lost rank within CUDA_FAULT_BOUND_S, and
 * abort must return. Rank 1 loops until it is killed. */
int fault(void) {
  test_step("fault");
  const size_t count = 1 << 20;
  const double bound = getenv("CUDA_FAULT_BOUND_S") ? atof(getenv("CUDA_FAULT_BOUND_S")) : 30.0;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  ncclComm_t comm = g_comms[0];
  CUstream st = g_streams[0];
  /* CUDA_TEST_FAULT=graph: the all-reduce captured into a graph once, the graph launched. */
  void *graph = NULL, *exec = NULL;
  if (!strcmp(getenv("CUDA_TEST_FAULT"), "graph")) {
    CU(cu.StreamBeginCapture(st, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, comm, st));
    CU(cu.StreamEndCapture(st, &graph));
    CU(cu.GraphInstantiate(&exec, graph, 0));
  }
  const int p2p = !strcmp(getenv("CUDA_TEST_FAULT"), "p2p");
  double start = now_s(), failed_at = 0;
  ncclResult_t seen = ncclSuccess;
  const char* why = "";
  for (long i = 0; now_s() - start < bound + 5; i++) {
    ncclResult_t r;
    if (exec) {
      r = cu.GraphLaunch(exec, st) == 0 ? ncclSuccess : ncclUnhandledCudaError;
    } else if (p2p) {
      /* CUDA_TEST_FAULT=p2p: the two ranks exchange halves of d (sends and receives read
       * directly), grouped. */
      const size_t half = count / 2, mine = (size_t)g_env.first_rank % 2 * half;
      const int partner = g_env.first_rank ^ 1;
      r = ncclGroupStart();
      if (r == ncclSuccess) r = ncclSend((void*)(uintptr_t)(d + mine * sizeof(float)), half, ncclFloat32, partner, comm, st);
      if (r == ncclSuccess) r = ncclRecv((void*)(uintptr_t)(d + (half - mine) * sizeof(float)), half, ncclFloat32, partner, comm, st);
      ncclResult_t ended = ncclGroupEnd();
      if (r == ncclSuccess) r = ended;
    } else {
      r = ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, comm, st);
    }
    if (r == ncclSuccess) {
      CU(cu.StreamSynchronize(st)); /* must return: a failed operation still releases it */
      CHECK(ncclCommGetAsyncError(comm, &r));
    }
    if (r != ncclSuccess) {
      seen = r;
      why = ncclGetLastError(comm);
      failed_at = now_s();
      break;
    }
    if (i == 5) tlog("LOOPING: %ld allreduces on device memory done", i);
  }
  if (g_env.first_rank == 0) {
    EXPECT(seen == ncclRemoteError, "after the peer died: %s (%s), expected ncclRemoteError", result_name(seen), why);
    EXPECT(why && strstr(why, "rank 1"), "the error does not name the lost rank: '%s'", why ? why : "(null)");
    EXPECT(failed_at > 0 && failed_at - start <= bound + 5, "no error within %.0f s of the loop's start", bound + 5);
    tlog("TIMING error_after_start=%.3f", failed_at - start);
  }
  if (!strcmp(getenv("CUDA_TEST_FAULT"), "shrink")) {
    shrink_survivors(comm, d, count, 1);
    dev_free(d);
    return test_finish();
  }
  double t = now_s();
  CHECK(ncclCommAbort(comm));
  EXPECT(now_s() - t < 5.0, "ncclCommAbort took %.1f s", now_s() - t);
  if (exec) {
    CU(cu.GraphLaunch(exec, st)); /* after the abort: released at once */
    CU(cu.StreamSynchronize(st));
    CU(cu.GraphExecDestroy(exec));
    CU(cu.GraphDestroy(graph));
  }
  dev_free(d);
  return test_finish();
}

/* Ranks 0 and 1 group a large all-reduce with a send/receive between them; the others issue
 * the all-reduce alone. Every rank must still take the same path for the all-reduce. */
/* Two ranks issue all-reduces of different counts on device memory (large enough for the
 * direct path): neither may read the other's buffer as if it were the same call; both must
 * end with ncclInvalidUsage naming the calls, and their streams must be released. */
int mismatch(void) {
  test_step("mismatch");
  /* CUDA_TEST_MISMATCH=small: rank 1's call is below the direct path's size, so the ranks do
   * not even take the same path. */
  const int small = !strcmp(getenv("CUDA_TEST_MISMATCH"), "small");
  /* CUDA_TEST_MISMATCH=p2p: rank 0 sends 100000 floats to rank 1, which receives 200000 (both
   * read directly): the receiver must not copy a buffer of the wrong size, and the two get the
   * error, naming the send and the receive. */
  const int p2p = !strcmp(getenv("CUDA_TEST_MISMATCH"), "p2p");
  /* CUDA_TEST_MISMATCH=both_send: each rank sends 16 MiB to the other and waits for
   * its stream before it would receive: neither send can finish. The streams get past the
   * send with the error; the rank that sees it first says each sends to the other (checked by
   * the harness: the other may only see it leave). (Without the wait, the worker may take the
   * send and the receive in one batch, as one group, and both succeed.) */
  /* CUDA_TEST_MISMATCH=cycle_send (3 processes or more): the same round all the ranks, each
   * sending to the next: the one that sees it first names the cycle. */
  const int cycle = !strcmp(getenv("CUDA_TEST_MISMATCH"), "cycle_send");
  const int both = cycle || !strcmp(getenv("CUDA_TEST_MISMATCH"), "both_send");
  const size_t count = both ? 4 << 20 : g_env.first_rank == 0 ? 100000 : small ? 1000 : 200000;
  const char* named = both ? "" : p2p ? (g_env.first_rank == 0 ? "Send" : "Recv") : "AllReduce";
  CUdeviceptr d = dev_alloc((both ? 2 * count : 200000) * sizeof(float));
  ncclComm_t comm = g_comms[0];
  if (both) {
    const int other = cycle ? (g_env.first_rank + 1) % g_env.nprocs : 1 - g_env.first_rank;
    CHECK(ncclSend((const void*)(uintptr_t)d, count, ncclFloat32, other, comm, g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    ncclResult_t rr = ncclRecv((void*)(uintptr_t)(d + count * sizeof(float)), count, ncclFloat32, other, comm,
                               g_streams[0]);
    tlog("the receive after the failed send: %s", result_name(rr));
  } else if (p2p && g_env.first_rank == 0) {
    CHECK(ncclSend((const void*)(uintptr_t)d, count, ncclFloat32, 1, comm, g_streams[0]));
  } else if (p2p) {
    CHECK(ncclRecv((void*)(uintptr_t)d, count, ncclFloat32, 0, comm, g_streams[0]));
  } else {
    CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, comm, g_streams[0]));
  }
  CU(cu.StreamSynchronize(g_streams[0]));
  ncclResult_t r = ncclSuccess;
  CHECK(ncclCommGetAsyncError(comm, &r));
  const char* why = ncclGetLastError(comm);
  EXPECT(r == ncclInvalidUsage || r == ncclRemoteError, "mismatched calls gave %s (%s)", result_name(r), why);
  EXPECT(why && strstr(why, named), "the error does not name the %s: '%s'", named, why ? why : "(null)");
  /* The direct path's internal exchanges are named by the call they serve, not by themselves. */
  EXPECT(why && !strstr(why, "AllGather") && !strstr(why, "int8"), "the error names internal operations: '%s'", why ? why : "(null)");
  tlog("mismatch: %s: %s", result_name(r), why);
  CHECK(ncclCommAbort(comm));
  dev_free(d);
  return test_finish();
}

/* CUDA_TEST_POINTER_FAILS (1 rank, the stand-in only): while the driver refuses pointer
 * queries (as after a sticky error), a call on device buffers fails with
 * ncclUnhandledCudaError saying why, instead of reading the buffers on the host as if they
 * were host memory; once queries work again, so does the call. */
int pointer_fails(void) {
  test_step("pointer-fails");
  const size_t count = 1000;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  if (!EXPECT(cu.StubPointerQueriesFail != NULL, "not the stand-in driver")) return test_finish();
  cu.StubPointerQueriesFail(1);
  ncclResult_t r = ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, g_comms[0],
                                 g_streams[0]);
  const char* why = ncclGetLastError(g_comms[0]);
  cu.StubPointerQueriesFail(0);
  EXPECT(r == ncclUnhandledCudaError && why && strstr(why, "classifying the buffer"),
         "an all-reduce whose buffer the driver cannot classify -> %s (%s)", result_name(r), why ? why : "(null)");
  tlog("pointer-fails: %s: %s", result_name(r), why ? why : "(null)");
  CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
  CU(cu.StreamSynchronize(g_streams[0]));
  dev_free(d);
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamDestroy(g_streams[l]));
  destroy_comms(g_comms);
  return test_finish();
}

/* Process 1's reduction kernels fail to launch (the stand-in's NCCL_RS_STUB_LAUNCH_FAILS) in
 * a direct all-reduce: both must end with an error (rank 0's names rank 1's failure) instead
 * of waiting for each other, and the streams get past the call. Where the kernels are queued
 * at call time (the caller's stream, the default) rank 1's call itself fails; on the worker's
 * stream (NCCL_RS_DIRECT_ON_STREAM=0) it fails after the ranks agreed on the path, and the
 * error is asynchronous. */
int launch_fail(void) {
  test_step("launch-fail");
  const size_t count = 100000;
  const double bound = 20.0;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  ncclComm_t comm = g_comms[0];
  double start = now_s();
  ncclResult_t r = ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, comm,
                                 g_streams[0]);
  /* Host-wait mode: the call returns once its operation is done, so it returns the failure
   * itself, on every rank (before: ncclSuccess, with only the asynchronous error set, and the
   * result not there). Otherwise, as NCCL: the asynchronous error. */
  if (host_wait_mode())
    EXPECT(r != ncclSuccess, "host-wait mode: rank %d's call returned ncclSuccess though its operation failed",
           g_env.first_rank);
  else
    EXPECT(r == ncclSuccess || g_env.first_rank == 1, "rank 0's call failed: %s", result_name(r));
  CU(cu.StreamSynchronize(g_streams[0]));
  if (r == ncclSuccess) CHECK(ncclCommGetAsyncError(comm, &r));
  const char* why = ncclGetLastError(comm);
  EXPECT(r != ncclSuccess, "rank %d: a failed kernel launch went unreported", g_env.first_rank);
  EXPECT(now_s() - start < bound, "rank %d: the error took %.1f s", g_env.first_rank, now_s() - start);
  if (g_env.first_rank == 0)
    EXPECT(why && strstr(why, "rank 1") && strstr(why, "cuLaunchKernel"), "rank 0: %s (%s), expected rank 1's failure",
           result_name(r), why ? why : "(null)");
  tlog("launch-fail: %s: %s", result_name(r), why ? why : "");
  /* Process 1 stays alive, its communicator open, until process 0 has its error: rank 0 must
   * learn of the failure from rank 1's connections, not from its exit. */
  char marker[4096];
  const char* idf = getenv("NCCL_TEST_ID_FILE");
  snprintf(marker, sizeof marker, "%s.launch-fail-done", idf ? idf : "/tmp/nccl-rs-cuda-test");
  if (g_env.first_rank == 0) {
    FILE* f = fopen(marker, "w");
    if (f) fclose(f);
  } else {
    double until = now_s() + bound;
    FILE* f = NULL;
    while (now_s() < until && !(f = fopen(marker, "r"))) sleep_ms(10); /* polling, with a deadline */
    EXPECT(f != NULL, "rank 0 did not finish within %.0f s", bound);
    if (f) fclose(f);
  }
  CHECK(ncclCommAbort(comm));
  dev_free(d);
  return test_finish();
}

/* The call's stream is held (waiting on host memory) before the call, so the operation can
 * never start; ncclCommAbort must still return promptly, and the stream, once let go, must
 * get past the aborted operation (staged, or direct with its kernels queued on the stream). */
int abort_held(void) {
  test_step("abort-held");
  long count = atol(getenv("CUDA_TEST_ABORT_HELD"));
  if (count <= 1) count = 1024;
  CUdeviceptr d = dev_alloc((size_t)count * sizeof(float));
  CUdeviceptr dflag = 0;
  uint32_t* flag = gate_word(&dflag);
  CU(cu.StreamWaitValue32(g_streams[0], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
  if (getenv("CUDA_TEST_ABORT_HELD_ALLTOALL")) {
    /* In place: its input is copied (on the held stream, so not yet) into memory of the
     * communicator's, which the abort must not free under that copy. */
    const size_t block = (size_t)count / (size_t)g_env.nranks;
    CHECK(ncclAlltoAll((void*)(uintptr_t)d, (void*)(uintptr_t)d, block, ncclFloat32, g_comms[0], g_streams[0]));
  } else {
    CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, (size_t)count, ncclFloat32, ncclSum, g_comms[0],
                        g_streams[0]));
  }
  double t = now_s();
  CHECK(ncclCommAbort(g_comms[0]));
  EXPECT(now_s() - t < 5.0, "ncclCommAbort took %.1f s with the stream held", now_s() - t);
  __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  CU(cu.StreamSynchronize(g_streams[0]));
  dev_free(d);
  CU(cu.MemFreeHost(flag));
  return test_finish();
}

/* Process 1's stream is held (a wait on host memory queued before the call, as a kernel that
 * does not finish would hold it) while both processes all-reduce (after a first all-reduce
 * that connects them); it is released once the file CUDA_TEST_STREAM_HELD names exists (the
 * harness makes it when the ranks have said what they wait for), within 60 s. */
int stream_held(void) {
  test_step("stream-held");
  const char* release = getenv("CUDA_TEST_STREAM_HELD");
  const size_t count = 1024;
  int rank = g_env.first_rank, held = rank == 1;
  CUdeviceptr d = dev_alloc(count * sizeof(float)), dflag = 0;
  float* h = host_alloc(count * sizeof(float));
  for (size_t j = 0; j < count; j++) h[j] = in_value(rank, j, 3);
  CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
  CU(cu.MemcpyAsync(d, (CUdeviceptr)(uintptr_t)h, count * sizeof(float), g_streams[0]));
  uint32_t* flag = gate_word(&dflag);
  if (held) CU(cu.StreamWaitValue32(g_streams[0], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
  CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
  if (held) {
    tlog("HELD");
    EXPECT(wait_for_file(release, 60), "the stream was never released (%s)", release);
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  }
  CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h, d, count * sizeof(float), g_streams[0]));
  CU(cu.StreamSynchronize(g_streams[0]));
  size_t bad = 0;
  for (size_t j = 0; j < count; j++) bad += h[j] != expected(C_ALLREDUCE, count, g_env.nranks, rank, j, 3);
  EXPECT(bad == 0, "all-reduce behind a held stream, rank %d: %zu wrong values", rank, bad);
  dev_free(d);
  CU(cu.MemFreeHost(h));
  CU(cu.MemFreeHost(flag));
  destroy_comms(g_comms);
  return test_finish();
}

/* A rank whose direct send waits for a receive its peer has not issued names that peer
 * (CUDA_TEST_P2P_LATE=FILE, 2 processes): process 0 sends 70000 floats of device memory to
 * process 1, which issues the receive only once FILE exists (the harness makes it once process
 * 0 has said why it waits). The bytes arrive exact. */
int p2p_late(void) {
  test_step("p2p-late");
  const char* release = getenv("CUDA_TEST_P2P_LATE");
  const size_t count = 70000;
  int rank = g_env.first_rank;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  float* h = host_alloc(count * sizeof(float));
  if (rank == 0) {
    for (size_t j = 0; j < count; j++) h[j] = in_value(0, j, 5);
    CU(cu.MemcpyAsync(d, (CUdeviceptr)(uintptr_t)h, count * sizeof(float), g_streams[0]));
    CHECK(ncclSend((const void*)(uintptr_t)d, count, ncclFloat32, 1, g_comms[0], g_streams[0]));
  } else {
    EXPECT(wait_for_file(release, 60), "the receive was never released (%s)", release);
    CHECK(ncclRecv((void*)(uintptr_t)d, count, ncclFloat32, 0, g_comms[0], g_streams[0]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h, d, count * sizeof(float), g_streams[0]));
  }
  CU(cu.StreamSynchronize(g_streams[0]));
  size_t bad = 0;
  for (size_t j = 0; rank == 1 && j < count; j++) bad += h[j] != in_value(0, j, 5);
  EXPECT(bad == 0, "a late receive: %zu wrong values", bad);
  dev_free(d);
  CU(cu.MemFreeHost(h));
  destroy_comms(g_comms);
  return test_finish();
}

/* CUDA_TEST_CLOSED_EARLY=1 (2 processes of 1 rank): process 1 destroys its communicator right
 * after init and its process goes on; process 0's receive from it (device memory, direct) must
 * end with ncclRemoteError saying so, and its stream go on, not wait for ever: the process is
 * alive, so checking whether it exited does not see it. */
int closed_early(void) {
  test_step("closed-early");
  const char* id = getenv("NCCL_TEST_ID_FILE");
  if (!id || g_env.nprocs != 2 || g_env.local != 1) {
    fprintf(stderr, "CUDA_TEST_CLOSED_EARLY: run as 2 processes of 1 rank\n");
    exit(2);
  }
  char done[4200];
  snprintf(done, sizeof done, "%s.closed-early-done", id);
  if (g_env.first_rank == 1) {
    destroy_comms(g_comms);
    EXPECT(wait_for_file(done, 40), "rank 0 did not finish within 40 s");
    return test_finish();
  }
  const size_t count = 1 << 18;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  CHECK(ncclRecv((void*)(uintptr_t)d, count, ncclFloat32, 1, g_comms[0], g_streams[0]));
  ncclResult_t async = ncclSuccess;
  int stream_done = 0;
  double t0 = now_s();
  while (now_s() - t0 < 20 && !(async != ncclSuccess && async != ncclInProgress && stream_done)) {
    CHECK(ncclCommGetAsyncError(g_comms[0], &async));
    stream_done = cu.StreamQuery(g_streams[0]) == 0;
    usleep(10000);
  }
  const char* msg = ncclGetLastError(g_comms[0]);
  tlog("after %.1f s: async error %s, stream %s: %s", now_s() - t0, result_name(async), stream_done ? "done" : "held",
       msg ? msg : "");
  EXPECT(async == ncclRemoteError && msg && strstr(msg, "rank 1") && strstr(msg, "destroyed or aborted its communicator"),
         "a receive from a rank that destroyed its communicator: async error %s (\"%s\"), not ncclRemoteError saying so",
         result_name(async), msg ? msg : "");
  EXPECT(stream_done, "the stream of that receive is still held");
  CHECK(ncclCommAbort(g_comms[0]));
  dev_free(d);
  FILE* f = fopen(done, "w");
  if (f) fclose(f);
  return test_finish();
}

/* A rank that has not launched its graph yet is named as such by the rank whose launch waits
 * for it (CUDA_TEST_GRAPH_HELD=FILE, NCCL_RS_GRAPH_CAPTURE=1, 2 processes): both capture an
 * all-reduce and launch it once; for the second launch process 1 waits until FILE exists (the
 * harness makes it once process 0 has said why it waits). Both results exact. */
int graph_held(void) {
  test_step("graph-held");
  const char* release = getenv("CUDA_TEST_GRAPH_HELD");
  const size_t count = 1024;
  int rank = g_env.first_rank;
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  float* h = host_alloc(count * sizeof(float));
  void *graph = NULL, *exec = NULL;
  CU(cu.StreamBeginCapture(g_streams[0], CU_STREAM_CAPTURE_MODE_GLOBAL));
  CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
  CU(cu.StreamEndCapture(g_streams[0], &graph));
  CU(cu.GraphInstantiate(&exec, graph, 0));
  for (int launch = 0; launch < 2; launch++) {
    for (size_t j = 0; j < count; j++) h[j] = in_value(rank, j, launch);
    CU(cu.MemcpyAsync(d, (CUdeviceptr)(uintptr_t)h, count * sizeof(float), g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    if (launch == 1 && rank == 1) {
      tlog("HOLDING the launch");
      EXPECT(wait_for_file(release, 60), "never released (%s)", release);
    }
    CU(cu.GraphLaunch(exec, g_streams[0]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h, d, count * sizeof(float), g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[j] != expected(C_ALLREDUCE, count, g_env.nranks, rank, j, launch);
    EXPECT(bad == 0, "graph launch %d, rank %d: %zu wrong values", launch + 1, rank, bad);
  }
  CU(cu.GraphExecDestroy(exec));
  CU(cu.GraphDestroy(graph));
  dev_free(d);
  CU(cu.MemFreeHost(h));
  destroy_comms(g_comms);
  return test_finish();
}
