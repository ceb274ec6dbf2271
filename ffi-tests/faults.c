/*
 * faults.c - what a rank sees when something goes wrong: a peer killed, a link cut, an abort
 * from another thread, mismatched calls, a hostile bootstrap port. Driven by tests/faults.rs,
 * which kills processes, cuts links and attacks the root while this runs; one part per run:
 *
 *   faults --only loop        allreduce in a loop until a call fails, then judge the failure
 *   faults --only abort       ncclCommAbort from a second thread while the main thread is
 *                             blocked in an allreduce that rank 1 never joins; then a new
 *                             communicator must work
 *   faults --only abort-init  (1 process) ncclCommAbort of a nonblocking communicator whose
 *                             init waits for a rank that never comes; then a new one works
 *   faults --only mismatch    rank 0 and rank 1 make different calls (FAULTS_CASE)
 *   faults --only hello       init, one allreduce, destroy (while tests/faults.rs attacks
 *                             the bootstrap root)
 *   faults --only gone-early  rank 1 exits after init; rank 0's first allreduce must fail
 *                             naming it
 *   faults --only closed-early  rank 1 destroys its communicator after init and its process
 *                             stays; rank 0's first receive from it must fail naming it
 *   faults --only stopped     rank 1's process stops itself (SIGSTOP); rank 0 must say so while
 *                             it waits (tests/faults.rs then sends SIGCONT)
 *   faults --only stopped-remote  (3 processes, 0 on one host and 1, 2 on another by
 *                             NCCL_HOSTID) rank 2 stops itself; rank 0, receiving from it,
 *                             must say so as rank 1 sees it (tests/faults.rs sends SIGCONT)
 *   faults --only culprit     (3 processes) rank 1 exits, rank 0 fails and exits, then the
 *                             stopped rank 2 fails: it must name rank 1 first, rank 0 as gone
 *                             after failing itself (tests/faults.rs sends SIGCONT); with
 *                             FAULTS_CASE=p2p a send and a receive in place of the all-reduce
 *   faults --only held-up     (2 or more processes) the last rank makes its all-reduce only
 *                             once every other rank has said at WARN that it has not issued
 *                             the call (tests/faults.rs sets the flag "go"); then the sum is
 *                             exact
 *   faults --only pipeline-late  (2 or more processes) a pipeline's forward pass: rank k
 *                             receives from rank k-1 and sends to rank k+1; rank 0 sends only
 *                             once every other rank has named it at WARN (the flag "go")
 *   faults --only held-elsewhere  (3 processes) rank 0 receives from rank 1, which is in an
 *                             all-reduce with rank 2 on another communicator first: rank 0
 *                             must name rank 2 as what holds rank 1 up there
 *   faults --only signal-wait (3 processes) rank 1 waits for a signal from rank 2, which has
 *                             stopped itself, while rank 0 sends to rank 1: rank 0 must say
 *                             rank 1 is in ncclWaitSignal, rank 1 that rank 2 is stopped
 *   faults --only crossed     two ranks call two communicators in different orders; each must
 *                             name the call the other is in (then both abort)
 *   faults --only fd-starved  (3 processes) the process that made a job's id has no file
 *                             descriptor left, and cannot get more, when the job's two ranks
 *                             (the other processes) join: their init must fail within seconds
 *   faults --only no-threads  (3 processes) rank 2 cannot start a thread when the ranks split
 *                             or shrink (FAULTS_CASE): the others must fail within seconds
 *
 * Environment (besides common.h's):
 *   FAULTS_COUNT       floats per allreduce in `loop` and `abort` (default 1048576)
 *   FAULTS_NONBLOCKING 1: `loop` uses a nonblocking communicator and polls
 *                      ncclCommGetAsyncError after every call
 *   FAULTS_LOST_RANK   `loop`: the rank the error must name ("rank K"); -1: do not check
 *   FAULTS_BOUND_S     `loop`: the failing call must end within this many seconds after the
 *                      last completed allreduce (default 30)
 *   FAULTS_MAX_S       `loop`: give up (fail) when no call failed after this long (default 45)
 *   FAULTS_SHRINK      `loop`: after the failure, ncclCommShrink the lost rank out ("default"
 *                      or "abort": the flag) and check an allreduce on the result
 *   FAULTS_ABORT_AFTER_MS  `abort`: when the second thread aborts (default 1000)
 *   FAULTS_CASE        `mismatch`: coll | count | dtype | op | root | reduce_root | gather_root | p2p_size | both_send | both_recv
 *                      | cycle_send | cycle_recv (3 or more ranks);
 *                      `closed-early`: recv (default) | signal; `stopped`: cold (default) | warm;
 *                      `no-threads`: split (default) | shrink
 *
 * Lines the harness watches: "LOOPING" (the loop runs: kill or cut now).
 * Timings are printed as "TIMING name=seconds" for the report.
 */
#include "common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static int env_int_or(const char* name, int dflt) {
  const char* s = getenv(name);
  if (!s || !*s) return dflt;
  return atoi(s);
}

/* Does `text` name rank k ("rank K" not followed by another digit)? */
static int names_rank(const char* text, int k) {
  char want[32];
  snprintf(want, sizeof want, "rank %d", k);
  size_t n = strlen(want);
  for (const char* p = text ? strstr(text, want) : NULL; p; p = strstr(p + 1, want)) {
    char next = p[n];
    if (next < '0' || next > '9') return 1;
  }
  return 0;
}

static const char* last_error(ncclComm_t comm) {
  const char* s = ncclGetLastError(comm);
  return s ? s : "(null)";
}

/* ---- flags between the processes of one job: files beside the unique id ---------------- */

static void flag_path(const char* name, char* out, size_t n) {
  const char* id = getenv("NCCL_TEST_ID_FILE");
  if (!id) {
    fprintf(stderr, "[proc %d] NCCL_TEST_ID_FILE must be set\n", g_env.proc);
    exit(2);
  }
  snprintf(out, n, "%s.flag-%s", id, name);
}

static void flag_set(const char* name) {
  char path[4200];
  flag_path(name, path, sizeof path);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd >= 0) close(fd);
}

/* Waits up to `seconds` for the flag; returns whether it came. */
static int flag_wait(const char* name, double seconds) {
  char path[4200];
  flag_path(name, path, sizeof path);
  double deadline = now_s() + seconds;
  struct stat st;
  while (stat(path, &st) != 0) {
    if (now_s() > deadline) return 0;
    sleep_ms(5);
  }
  return 1;
}

/* Writes this process's pid into the flag `name`, for tests/faults.rs to signal it. */
static void flag_pid(const char* name) {
  char path[4200];
  flag_path(name, path, sizeof path);
  FILE* f = fopen(path, "w");
  if (!f) exit(2);
  fprintf(f, "%d\n", (int)getpid());
  fclose(f);
}

/* ---- loop: allreduce until a call fails ------------------------------------------------ */

/* Nonblocking communicators: poll until the state is not ncclInProgress, or `seconds` pass. */
static ncclResult_t poll_async(ncclComm_t comm, double seconds) {
  double deadline = now_s() + seconds;
  for (;;) {
    ncclResult_t state = ncclInternalError;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) {
      tlog("ncclCommGetAsyncError itself returned %s", result_name(r));
      return r;
    }
    if (state != ncclInProgress) return state;
    if (now_s() > deadline) return ncclInProgress;
    sleep_ms(1);
  }
}

static ncclComm_t make_one_comm(const char* tag, int nonblocking) {
  ncclComm_t comm = NULL;
  if (!nonblocking) {
    make_comms(tag, &comm);
    return comm;
  }
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = make_comms_config(tag, &comm, &cfg);
  if (r != ncclSuccess) {
    fprintf(stderr, "[proc %d] nonblocking init -> %s: %s\n", g_env.proc, result_name(r),
            last_error(comm));
    exit(1);
  }
  return comm;
}

static void part_loop(void) {
  const int count = env_int_or("FAULTS_COUNT", 1 << 20);
  const int nonblocking = env_int_or("FAULTS_NONBLOCKING", 0);
  const int lost = env_int_or("FAULTS_LOST_RANK", -1);
  const double bound = env_int_or("FAULTS_BOUND_S", 30);
  const double max_s = env_int_or("FAULTS_MAX_S", 45);
  const int rank = g_env.first_rank, n = g_env.nranks;
  test_deadline((unsigned)max_s + 10);

  test_step("init");
  ncclComm_t comm = make_one_comm("", nonblocking);
  float* send = TEST_ALLOC((size_t)count * sizeof(float));
  float* recv = TEST_ALLOC((size_t)count * sizeof(float));
  for (int i = 0; i < count; i++) send[i] = (float)(rank + 1);
  const float want = (float)(n * (n + 1) / 2);

  test_step("allreduce loop");
  double start = now_s(), last_ok = start;
  long iters = 0;
  ncclResult_t returned = ncclSuccess, r = ncclSuccess;
  for (;;) {
    returned = ncclAllReduce(send, recv, (size_t)count, ncclFloat32, ncclSum, comm, TEST_STREAM);
    r = returned;
    if (nonblocking && (r == ncclSuccess || r == ncclInProgress)) r = poll_async(comm, max_s);
    if (r != ncclSuccess) break;
    if (recv[0] != want || recv[count - 1] != want) {
      EXPECT(0, "iteration %ld: got %g and %g, expected %g", iters, recv[0], recv[count - 1], want);
      break;
    }
    iters++;
    last_ok = now_s();
    if (iters == 5) tlog("LOOPING: %ld allreduces of %d floats done, %.3f s each", iters, count,
                         (last_ok - start) / (double)iters);
    if (last_ok - start > max_s) break;
  }
  double t_err = now_s();
  const char* text = last_error(comm);
  ncclResult_t async_state = ncclInternalError;
  ncclResult_t ra = ncclCommGetAsyncError(comm, &async_state);
  tlog("ERROR after %ld allreduces: the call returned %s%s%s, %.3f s after the last completed one",
       iters, result_name(returned), nonblocking ? ", ncclCommGetAsyncError reported " : "",
       nonblocking ? result_name(r) : "", t_err - last_ok);
  tlog("TIMING detect=%.3f", t_err - last_ok);
  tlog("ncclCommGetAsyncError -> %s, state %s", result_name(ra), result_name(async_state));
  tlog("ncclGetLastError: %s", text);

  EXPECT(r != ncclSuccess, "no call failed within %.0f s (%ld allreduces)", max_s, iters);
  EXPECT(r == ncclRemoteError, "the failure is %s, expected ncclRemoteError", result_name(r));
  EXPECT(t_err - last_ok <= bound, "the failing call ended %.3f s after the last completed one (bound %.0f s)",
         t_err - last_ok, bound);
  if (lost >= 0)
    EXPECT(names_rank(text, lost), "ncclGetLastError does not name the lost rank %d: %s", lost, text);

  const char* shrink = getenv("FAULTS_SHRINK");
  if (shrink && lost >= 0) {
    /* The survivors leave the lost rank out and go on (NCCL's fault-tolerance recipe). */
    test_step("ncclCommShrink after the failure");
    int flags = !strcmp(shrink, "abort") ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT;
    int excluded[1] = {lost};
    ncclComm_t child = NULL;
    ncclResult_t rs = ncclCommShrink(comm, excluded, 1, &child, NULL, flags);
    tlog("ncclCommShrink(%s) -> %s", shrink, result_name(rs));
    if (nonblocking) {
      /* The child inherits the parent's nonblocking config: in progress, then polled ready. */
      EXPECT(rs == ncclInProgress, "a nonblocking ncclCommShrink returned %s, not ncclInProgress", result_name(rs));
      if (rs == ncclInProgress && child) rs = poll_async(child, max_s);
      tlog("the nonblocking shrink's communicator -> %s", result_name(rs));
    }
    if (EXPECT(rs == ncclSuccess && child, "ncclCommShrink(%s) of the failed communicator -> %s: %s", shrink,
               result_name(rs), last_error(child ? child : comm))) {
      int cn = -1, cr = -1;
      CHECK(ncclCommCount(child, &cn));
      CHECK(ncclCommUserRank(child, &cr));
      EXPECT(cn == n - 1 && cr == (rank < lost ? rank : rank - 1), "shrunk communicator: rank %d of %d, expected %d of %d",
             cr, cn, rank < lost ? rank : rank - 1, n - 1);
      for (int i = 0; i < count; i++) recv[i] = -1;
      ncclResult_t ra2 = ncclAllReduce(send, recv, (size_t)count, ncclFloat32, ncclSum, child, TEST_STREAM);
      if (nonblocking && (ra2 == ncclSuccess || ra2 == ncclInProgress)) ra2 = poll_async(child, max_s);
      const float survivors = (float)(n * (n + 1) / 2 - (lost + 1));
      EXPECT(ra2 == ncclSuccess && recv[0] == survivors && recv[count - 1] == survivors,
             "allreduce on the shrunk communicator -> %s, got %g and %g, expected %g: %s", result_name(ra2), recv[0],
             recv[count - 1], survivors, last_error(child));
      CHECK(ncclCommDestroy(child));
    }
  }

  test_step("ncclCommAbort after the failure");
  double t0 = now_s();
  ncclResult_t rab = ncclCommAbort(comm);
  tlog("ncclCommAbort -> %s in %.3f s", result_name(rab), now_s() - t0);
  tlog("TIMING abort=%.3f", now_s() - t0);
  EXPECT(rab == ncclSuccess, "ncclCommAbort -> %s: %s", result_name(rab), last_error(NULL));
  EXPECT(now_s() - t0 < 5.0, "ncclCommAbort took %.3f s", now_s() - t0);
  free(send);
  free(recv);
}

/* ---- abort: from a second thread, while the main thread is blocked ---------------------- */

typedef struct {
  ncclComm_t comm;
  int after_ms;
  double t_abort, t_abort_done;
  ncclResult_t r;
} aborter_t;

static void* aborter(void* arg) {
  aborter_t* a = (aborter_t*)arg;
  sleep_ms(a->after_ms);
  tlog("ABORTING from a second thread");
  a->t_abort = now_s();
  a->r = ncclCommAbort(a->comm);
  a->t_abort_done = now_s();
  return NULL;
}

static void second_communicator(const char* why) {
  test_step("a new communicator after the abort");
  ncclComm_t comm2 = NULL;
  double t0 = now_s();
  make_comms("second", &comm2);
  int v = allreduce_sum_int(&comm2, g_env.proc + 1);
  int want = g_env.nranks * (g_env.nranks + 1) / 2;
  tlog("new communicator after %s: allreduce -> %d (expected %d) in %.3f s", why, v, want, now_s() - t0);
  EXPECT(v == want, "allreduce on the new communicator gave %d, expected %d", v, want);
  CHECK(ncclCommDestroy(comm2));
}

static void part_abort(void) {
  const int count = env_int_or("FAULTS_COUNT", 1 << 20);
  test_deadline(40);
  if (g_env.nprocs != 2 || g_env.local != 1) {
    fprintf(stderr, "abort: run as 2 processes of 1 rank\n");
    exit(2);
  }
  test_step("init");
  ncclComm_t comm = NULL;
  make_comms("", &comm);
  /* Connections are up: what blocks below is the collective itself. */
  int v = allreduce_sum_int(&comm, 1);
  EXPECT(v == 2, "warm-up allreduce gave %d", v);

  if (g_env.proc == 1) {
    test_step("rank 1: waiting (never joins the allreduce)");
    int came = flag_wait("aborted", 30);
    EXPECT(came, "rank 0 never said it was done");
    test_step("rank 1: ncclCommAbort");
    ncclResult_t r = ncclCommAbort(comm);
    EXPECT(r == ncclSuccess, "rank 1: ncclCommAbort -> %s: %s", result_name(r), last_error(NULL));
    second_communicator("the abort of rank 0");
    return;
  }

  float* send = TEST_ALLOC((size_t)count * sizeof(float));
  float* recv = TEST_ALLOC((size_t)count * sizeof(float));
  aborter_t a = {comm, env_int_or("FAULTS_ABORT_AFTER_MS", 1000), 0, 0, ncclInternalError};
  pthread_t th;
  TEST_THREAD(&th, aborter, &a);
  test_step("rank 0: blocked in ncclAllReduce, waiting for the abort");
  tlog("BLOCKING in ncclAllReduce of %d floats; rank 1 never joins", count);
  double t_call = now_s();
  ncclResult_t r = ncclAllReduce(send, recv, (size_t)count, ncclFloat32, ncclSum, comm, TEST_STREAM);
  double t_ret = now_s();
  const char* text = last_error(NULL);
  test_step("rank 0: joining the aborting thread");
  pthread_join(th, NULL);
  tlog("ncclAllReduce returned %s after %.3f s; the abort started %.3f s into the call and took %.3f s",
       result_name(r), t_ret - t_call, a.t_abort - t_call, a.t_abort_done - a.t_abort);
  tlog("TIMING return_after_abort=%.3f", t_ret - a.t_abort);
  tlog("ncclGetLastError: %s", text);
  EXPECT(r != ncclSuccess, "the allreduce nobody joined returned ncclSuccess");
  EXPECT(t_ret >= a.t_abort, "the allreduce returned %.3f s before the abort (%s: %s)",
         a.t_abort - t_ret, result_name(r), text);
  EXPECT(t_ret - a.t_abort <= 1.0, "the allreduce returned %.3f s after ncclCommAbort (limit 1 s)",
         t_ret - a.t_abort);
  EXPECT(a.r == ncclSuccess, "ncclCommAbort -> %s", result_name(a.r));
  flag_set("aborted");
  free(send);
  free(recv);
  second_communicator("the abort");
}

/* ---- abort-init: abort a nonblocking communicator still initialising -------------------- */

static void part_abort_init(void) {
  test_deadline(30);
  if (g_env.nprocs != 1 || g_env.local != 1) {
    fprintf(stderr, "abort-init: run as 1 process of 1 rank\n");
    exit(2);
  }
  test_step("nonblocking init of rank 0 of 2 (rank 1 never comes)");
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, 0, &cfg);
  tlog("ncclCommInitRankConfig(nranks 2, rank 0, nonblocking) -> %s", result_name(r));
  EXPECT(r == ncclInProgress || r == ncclSuccess, "nonblocking init -> %s: %s", result_name(r),
         last_error(NULL));
  if (!comm) {
    EXPECT(0, "no communicator handle to abort");
    return;
  }
  sleep_ms(500);
  ncclResult_t state = ncclInternalError;
  ncclCommGetAsyncError(comm, &state);
  tlog("after 500 ms: ncclCommGetAsyncError state %s", result_name(state));
  EXPECT(state == ncclInProgress, "init state %s while rank 1 is missing (expected ncclInProgress)",
         result_name(state));
  /* NCCL: using a communicator before it reports ncclSuccess is ncclInvalidArgument. */
  int32_t one = 1, out = 0;
  ncclResult_t rc = ncclAllReduce(&one, &out, 1, ncclInt32, ncclSum, comm, TEST_STREAM);
  EXPECT(rc == ncclInvalidArgument, "an allreduce on a communicator still initialising -> %s (%s)", result_name(rc),
         last_error(comm));
  test_step("ncclCommAbort during init");
  double t0 = now_s();
  ncclResult_t ra = ncclCommAbort(comm);
  double took = now_s() - t0;
  tlog("ncclCommAbort during init -> %s in %.3f s", result_name(ra), took);
  tlog("TIMING abort_init=%.3f", took);
  EXPECT(ra == ncclSuccess, "ncclCommAbort during init -> %s: %s", result_name(ra), last_error(NULL));
  EXPECT(took <= 1.0, "ncclCommAbort during init took %.3f s (limit 1 s)", took);

  test_step("a new communicator after the abort");
  ncclUniqueId id2;
  CHECK(ncclGetUniqueId(&id2));
  ncclComm_t c2 = NULL;
  CHECK(ncclCommInitRank(&c2, 1, id2, 0));
  int v = allreduce_sum_int(&c2, 7);
  EXPECT(v == 7, "allreduce on the new communicator gave %d", v);
  CHECK(ncclCommDestroy(c2));
}

/* ---- gone-early: a rank exits after init, before any collective connected it ------------ */

/* Rank 1 exits (without destroying its communicator) once init is done; rank 0's first
 * all-reduce waits for rank 1's first connection, which never comes: it must fail with
 * ncclRemoteError naming rank 1, soon (the wait for a first connection has no limit of its
 * own unless NCCL_INIT_TIMEOUT_S is set). */
static void part_gone_early(void) {
  test_deadline(30);
  if (g_env.nprocs != 2 || g_env.local != 1) {
    fprintf(stderr, "gone-early: run as 2 processes of 1 rank\n");
    exit(2);
  }
  ncclComm_t comm = NULL;
  test_step("init");
  make_comms("", &comm);
  if (g_env.proc == 1) {
    tlog("exiting without a collective");
    exit(test_finish());
  }
  test_step("the first all-reduce, rank 1 gone");
  const size_t count = 1 << 20;
  float* buf = TEST_ALLOC((size_t)count * sizeof(float));
  double t0 = now_s();
  ncclResult_t r = ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm, TEST_STREAM);
  double took = now_s() - t0;
  const char* text = last_error(comm);
  tlog("ncclAllReduce -> %s after %.3f s: %s", result_name(r), took, text);
  EXPECT(r == ncclRemoteError, "the all-reduce with rank 1 gone -> %s, expected ncclRemoteError", result_name(r));
  EXPECT(names_rank(text, 1), "the error does not name rank 1: %s", text);
  EXPECT(took < 15.0, "the all-reduce noticed rank 1 was gone only after %.3f s", took);
  CHECK(ncclCommAbort(comm));
  free(buf);
}

/* ---- closed-early: a rank destroys its communicator after init and its process goes on --- */

/* Rank 1 destroys its communicator once init is done, before any call connected it, and its
 * process stays; rank 0's first receive from it waits for a first connection that will never
 * come (a wait with no limit of its own). It must fail soon with ncclRemoteError naming rank 1
 * and saying what it did, not hang: its process is alive, so the check of gone-early (has the
 * process exited?) does not see it. 2 processes of 1 rank (shared memory or sockets), or 1
 * process of 2 ranks (the ring between ranks of one process). FAULTS_CASE=signal: rank 0 waits
 * for a signal (ncclWaitSignal) instead. */
static void part_closed_early(void) {
  test_deadline(30);
  if (g_env.nranks != 2) {
    fprintf(stderr, "closed-early: run as 2 processes of 1 rank or 1 process of 2 ranks\n");
    exit(2);
  }
  ncclComm_t comms[2] = {NULL, NULL};
  test_step("init");
  make_comms("", comms);
  if (g_env.nprocs == 2 && g_env.proc == 1) {
    CHECK(ncclCommDestroy(comms[0]));
    tlog("destroyed; staying until rank 0 is done");
    EXPECT(flag_wait("closed-early-done", 25), "rank 0 did not finish within 25 s");
    return;
  }
  if (g_env.local == 2) CHECK(ncclCommDestroy(comms[1]));
  const char* which = getenv("FAULTS_CASE");
  const int signal = which && !strcmp(which, "signal");
  test_step(signal ? "a wait for a signal from rank 1, whose communicator is destroyed"
                   : "a receive from rank 1, whose communicator is destroyed");
  const size_t count = 1024;
  float* buf = TEST_ALLOC((size_t)count * sizeof(float));
  double t0 = now_s();
  ncclWaitSignalDesc_t want = {.opCnt = 1, .peer = 1, .sigIdx = 0, .ctx = 0};
  ncclResult_t r = signal ? ncclWaitSignal(1, &want, comms[0], TEST_STREAM)
                          : ncclRecv(buf, count, ncclFloat32, 1, comms[0], TEST_STREAM);
  double took = now_s() - t0;
  const char* text = last_error(comms[0]);
  tlog("%s -> %s after %.3f s: %s", signal ? "ncclWaitSignal" : "ncclRecv", result_name(r), took, text);
  EXPECT(r == ncclRemoteError, "the wait for a destroyed rank 1 -> %s, expected ncclRemoteError", result_name(r));
  EXPECT(names_rank(text, 1), "the error does not name rank 1: %s", text);
  EXPECT(strstr(text, "destroyed or aborted its communicator") != NULL, "the error does not say what rank 1 did: %s", text);
  EXPECT(took < 15.0, "the wait noticed rank 1 had destroyed its communicator only after %.3f s", took);
  CHECK(ncclCommAbort(comms[0]));
  if (g_env.nprocs == 2) flag_set("closed-early-done");
  free(buf);
}

/* ---- stopped: a rank's process is stopped (SIGSTOP) while its peer waits on it ------------- */

/* Process 1 writes its pid beside the unique id (flag "pid"), prints STOPPING and stops itself
 * with SIGSTOP before its all-reduce (FAULTS_CASE=warm: after a first one, so the two ranks are
 * connected). Rank 0's all-reduce waits on it; within seconds of SILENT_AFTER (10 s) rank 0 must
 * say at WARN that rank 1 does not answer and that its process is stopped (the harness watches
 * for that line, then sends SIGCONT). Both all-reduces then complete, exact. */
static void part_stopped(void) {
  test_deadline(60);
  if (g_env.nprocs != 2 || g_env.local != 1) {
    fprintf(stderr, "stopped: run as 2 processes of 1 rank\n");
    exit(2);
  }
  const char* which = getenv("FAULTS_CASE");
  const int warm = which && !strcmp(which, "warm");
  ncclComm_t comm = NULL;
  test_step("init");
  make_comms("", &comm);
  if (warm) {
    int v = allreduce_sum_int(&comm, g_env.proc + 1);
    EXPECT(v == 3, "the first all-reduce gave %d, expected 3", v);
  }
  if (g_env.proc == 1) {
    flag_pid("pid");
    tlog("STOPPING");
    raise(SIGSTOP);
    tlog("resumed");
  }
  test_step("an all-reduce with rank 1 stopped");
  double t0 = now_s();
  int v = allreduce_sum_int(&comm, 10 * (g_env.proc + 1));
  tlog("all-reduce -> %d after %.1f s", v, now_s() - t0);
  EXPECT(v == 30, "the all-reduce across the stop gave %d, expected 30", v);
  CHECK(ncclCommDestroy(comm));
}

/* ---- culprit: a survivor that failed and exited before another survivor looks ----------
 * Three processes. After a first all-reduce, process 2 writes its pid and stops itself
 * (SIGSTOP); process 1 then exits, as if killed; process 0 fails its second all-reduce naming
 * rank 1, writes its pid and ends. tests/faults.rs waits for process 0 to be gone and sends
 * process 2 SIGCONT: its second all-reduce fails and finds ranks 0 and 1 both gone. The
 * culprit is rank 1, named first; rank 0, which told the others of its failure before it
 * went, is named as gone after failing itself. */
static void part_culprit(void) {
  ncclComm_t comm = NULL;
  test_step("init");
  make_comms("", &comm);
  int v = allreduce_sum_int(&comm, g_env.proc + 1);
  EXPECT(v == 6, "the first all-reduce gave %d, expected 6", v);
  if (g_env.proc == 1) {
    EXPECT(flag_wait("pid-2", 30), "process 2 did not say it stops");
    tlog("EXITING");
    fflush(stdout);
    _exit(test_finish());
  }
  if (g_env.proc == 2) {
    flag_pid("pid-2");
    tlog("STOPPING");
    raise(SIGSTOP);
    tlog("resumed");
  }
  /* FAULTS_CASE=p2p: instead of the all-reduce, each rank sends 64 KiB to the next and
   * receives from the one before, in a group: rank 0's send to rank 1 is all written before
   * it waits on stopped rank 2, and over sockets only the reset it draws says rank 1 is gone. */
  const char* c = getenv("FAULTS_CASE");
  const int p2p = c && !strcmp(c, "p2p");
  test_step(p2p ? "a send and a receive with rank 1 gone" : "an all-reduce with rank 1 gone");
  enum { P2P_COUNT = 16384 };
  static int out[P2P_COUNT], in[P2P_COUNT];
  int x = 1, y = 0;
  ncclResult_t r;
  if (p2p) {
    const int n = g_env.nranks, me = g_env.first_rank;
    r = ncclGroupStart();
    if (r == ncclSuccess) r = ncclSend(out, P2P_COUNT, ncclInt32, (me + 1) % n, comm, TEST_STREAM);
    if (r == ncclSuccess) r = ncclRecv(in, P2P_COUNT, ncclInt32, (me + n - 1) % n, comm, TEST_STREAM);
    ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
  } else {
    r = ncclAllReduce(&x, &y, 1, ncclInt32, ncclSum, comm, TEST_STREAM);
  }
  const char* text = last_error(comm);
  tlog("the operation -> %s: %s", result_name(r), text);
  EXPECT(r == ncclRemoteError, "the operation -> %s, expected ncclRemoteError", result_name(r));
  EXPECT(names_rank(text, 1), "the error does not name rank 1: %s", text);
  if (g_env.proc == 2) {
    /* The list of lost ranks, before what this rank itself saw. */
    char lost[4096];
    const char* from = strstr(text, "lost rank ");
    snprintf(lost, sizeof lost, "%s", from ? from : "");
    char* end = strstr(lost, "; this rank saw");
    if (end) *end = 0;
    const char* zero = strstr(lost, "rank 0 (");
    const char* zero_end = zero ? strstr(zero, "), rank") : NULL;
    const char* after = zero ? strstr(zero, "after failing itself") : NULL;
    /* (In the p2p case rank 2 fails connecting to rank 1, its first connection to it: it
     * names that rank alone.) */
    EXPECT(strncmp(lost, "lost rank 1 (", 13) == 0 && (zero || p2p) && (!zero || (after && (!zero_end || after < zero_end))),
           "rank 1 is not named first, or rank 0 not as gone after failing itself: %s", text);
  }
  if (g_env.proc == 0) {
    flag_pid("pid-0");
    tlog("ENDING");
  }
  CHECK(ncclCommAbort(comm));
}

/* ---- crossed: two ranks call two communicators in different orders ---------------------- */

typedef struct {
  ncclComm_t comms[2];
  int aborted;
} crossed_t;

static void* crossed_releaser(void* arg) {
  crossed_t* x = arg;
  if (!flag_wait("release-0", 40) || !flag_wait("release-1", 5)) return NULL;
  for (int k = 0; k < 2; k++) EXPECT(ncclCommAbort(x->comms[k]) == ncclSuccess, "ncclCommAbort of communicator %d", k);
  x->aborted = 1;
  return NULL;
}

/* Rank 0 all-reduces on communicator A then B, rank 1 on B then A: each waits in its first call
 * for the other, for ever (host memory: the calls block). Each must say at WARN that the other
 * has not issued the call and what it is in instead: the other communicator's all-reduce. The
 * harness sets flag "release-P" once process P has said so, and with both set a second thread
 * of each process aborts both communicators, which ends the blocked calls. */
static void part_crossed(void) {
  test_deadline(50);
  if (g_env.nprocs != 2 || g_env.local != 1) {
    fprintf(stderr, "crossed: run as 2 processes of 1 rank\n");
    exit(2);
  }
  crossed_t x = {{NULL, NULL}, 0};
  test_step("init");
  make_comms("", &x.comms[0]);
  make_comms("b", &x.comms[1]);
  pthread_t th;
  TEST_THREAD(&th, crossed_releaser, &x);
  const int first = g_env.proc;
  test_step("the first all-reduce, which the other rank calls second");
  int32_t send = 1, recv = 0;
  tlog("all-reduce on communicator %c first", 'A' + first);
  ncclResult_t r = ncclAllReduce(&send, &recv, 1, ncclInt32, ncclSum, x.comms[first], TEST_STREAM);
  tlog("the first all-reduce -> %s: %s", result_name(r), last_error(NULL));
  EXPECT(r != ncclSuccess, "the first all-reduce completed, though the other rank was in another call");
  pthread_join(th, NULL);
  EXPECT(x.aborted, "the communicators were never released");
}

/* ---- mismatch: rank 0 and rank 1 make different calls ----------------------------------- */

static void part_mismatch(void) {
  const char* which = getenv("FAULTS_CASE");
  test_deadline(25);
  if (g_env.nprocs < 2 || g_env.local != 1 || !which) {
    fprintf(stderr, "mismatch: run as 2 or more processes of 1 rank with FAULTS_CASE set\n");
    exit(2);
  }
  ncclComm_t comm = NULL;
  test_step("init");
  make_comms("", &comm);
  int v = allreduce_sum_int(&comm, 1);
  EXPECT(v == g_env.nprocs, "warm-up allreduce gave %d", v);

  /* Rank 1 makes the other call; every other rank makes rank 0's (with 3 ranks or more, rank
   * 2 matches rank 0 and must fail all the same). `me` is 0 or 1: which call this rank makes. */
  const int rank = g_env.proc, me = rank == 1;
  float* send = TEST_ALLOC((size_t)4096 * sizeof(float));
  float* recv = TEST_ALLOC((size_t)8192 * sizeof(float));
  const char *mine = "", *a = "", *b = "";
  ncclResult_t r;
  int sender_may_succeed = 0;
  test_step("the mismatched call");
  if (!strcmp(which, "coll")) {
    a = "AllReduce", b = "AllGather";
    if (me == 0) {
      mine = "AllReduce(count 1024, float, sum)";
      r = ncclAllReduce(send, recv, 1024, ncclFloat32, ncclSum, comm, TEST_STREAM);
    } else {
      mine = "AllGather(sendcount 2048, float)";
      r = ncclAllGather(send, recv, 2048, ncclFloat32, comm, TEST_STREAM);
    }
  } else if (!strcmp(which, "count")) {
    a = "1024", b = "2048";
    mine = me == 0 ? "AllReduce(count 1024, float, sum)" : "AllReduce(count 2048, float, sum)";
    r = ncclAllReduce(send, recv, me == 0 ? 1024 : 2048, ncclFloat32, ncclSum, comm, TEST_STREAM);
  } else if (!strcmp(which, "dtype")) {
    a = "float", b = "int32";
    mine = me == 0 ? "AllReduce(count 1024, float, sum)" : "AllReduce(count 1024, int32, sum)";
    r = ncclAllReduce(send, recv, 1024, me == 0 ? ncclFloat32 : ncclInt32, ncclSum, comm, TEST_STREAM);
  } else if (!strcmp(which, "op")) {
    a = "sum", b = "max";
    mine = me == 0 ? "AllReduce(count 1024, float, sum)" : "AllReduce(count 1024, float, max)";
    r = ncclAllReduce(send, recv, 1024, ncclFloat32, me == 0 ? ncclSum : ncclMax, comm, TEST_STREAM);
  } else if (!strcmp(which, "root")) {
    a = "root 0", b = "root 1";
    mine = me == 0 ? "Broadcast(count 1024, float, root 0)" : "Broadcast(count 1024, float, root 1)";
    r = ncclBroadcast(send, recv, 1024, ncclFloat32, me, comm, TEST_STREAM);
  } else if (!strcmp(which, "reduce_root")) {
    /* Both ranks believe they are the root: each waits to receive, nobody sends. */
    a = "root 0", b = "root 1";
    mine = me == 0 ? "Reduce(count 1024, float, sum, root 0)" : "Reduce(count 1024, float, sum, root 1)";
    r = ncclReduce(send, recv, 1024, ncclFloat32, ncclSum, me, comm, TEST_STREAM);
  } else if (!strcmp(which, "gather_root")) {
    a = "root 0", b = "root 1";
    mine = me == 0 ? "Gather(count 1024, float, root 0)" : "Gather(count 1024, float, root 1)";
    r = ncclGather(send, recv, 1024, ncclFloat32, me, comm, TEST_STREAM);
  } else if (!strcmp(which, "both_send") || !strcmp(which, "both_recv")) {
    /* Each rank sends 16 MiB to the other (or receives from it) outside a group, and nothing
     * else: neither call can finish. Both get ncclInvalidUsage saying so, instead of a hang. */
    const int sends = !strcmp(which, "both_send");
    a = sends ? "each sends to the other" : "each receives from the other", b = "ncclGroupStart";
    mine = sends ? "Send(count 1048576, float, to the other)" : "Recv(count 1048576, float, from the other)";
    float* big = TEST_ALLOC(((size_t)1 << 20) * sizeof(float));
    r = sends ? ncclSend(big, 1 << 20, ncclFloat32, 1 - me, comm, TEST_STREAM)
              : ncclRecv(big, 1 << 20, ncclFloat32, 1 - me, comm, TEST_STREAM);
    free(big);
  } else if (!strcmp(which, "cycle_send") || !strcmp(which, "cycle_recv")) {
    /* Round all the ranks (3 or more), each sends 16 MiB to the next (or receives from it)
     * outside a group, and nothing else: each waits on the next, none can finish. Every rank
     * gets ncclInvalidUsage naming the cycle, instead of a hang (NCCL hangs). */
    const int sends = !strcmp(which, "cycle_send");
    a = "wait on each other in a cycle", b = "ncclGroupStart";
    mine = sends ? "Send(count 4194304, float, to the next rank)" : "Recv(count 4194304, float, from the next rank)";
    float* big = TEST_ALLOC(((size_t)1 << 22) * sizeof(float));
    const int next = (rank + 1) % g_env.nprocs;
    r = sends ? ncclSend(big, 1 << 22, ncclFloat32, next, comm, TEST_STREAM)
              : ncclRecv(big, 1 << 22, ncclFloat32, next, comm, TEST_STREAM);
    free(big);
  } else if (!strcmp(which, "p2p_size")) {
    /* A receive smaller than its send: the receiver names both sizes, in bytes. (The send may
     * complete: its bytes were on their way.) */
    a = "sent 4096 bytes", b = "takes 2048";
    mine = me == 0 ? "Send(count 1024, float, to 1)" : "Recv(count 512, float, from 0)";
    r = me == 0 ? ncclSend(send, 1024, ncclFloat32, 1, comm, TEST_STREAM)
                : ncclRecv(recv, 512, ncclFloat32, 0, comm, TEST_STREAM);
    sender_may_succeed = me == 0;
  } else {
    fprintf(stderr, "unknown FAULTS_CASE %s\n", which);
    exit(2);
  }
  const char* text = last_error(comm);
  tlog("%s -> %s", mine, result_name(r));
  tlog("ncclGetLastError: %s", r == ncclSuccess ? "(call succeeded)" : text);
  EXPECT(r != ncclSuccess || sender_may_succeed, "%s returned ncclSuccess although rank %d made a different call",
         mine, me ? 0 : 1);
  if (r == ncclSuccess && sender_may_succeed) {
    tlog("the send completed: its bytes were on their way");
  } else if (r != ncclSuccess) {
    EXPECT(r == ncclInvalidUsage, "%s -> %s, expected ncclInvalidUsage", mine, result_name(r));
    EXPECT(strstr(text, a) && strstr(text, b), "the message does not name both calls (\"%s\" and \"%s\"): %s",
           a, b, text);
  } else {
    /* Undetected: say what the next, matching, call sees (for the report only). */
    test_step("a matching allreduce after an undetected mismatch");
    int32_t one = 1, sum = -1;
    ncclResult_t r2 = ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, TEST_STREAM);
    tlog("the next (matching) AllReduce -> %s, sum %d (expected 2)%s%s", result_name(r2), sum,
         r2 == ncclSuccess ? "" : ": ", r2 == ncclSuccess ? "" : last_error(comm));
  }
  /* Every rank has returned before any aborts, so none sees another leave. */
  char flag[32];
  snprintf(flag, sizeof flag, "returned-%d", rank);
  flag_set(flag);
  test_step("waiting for the other ranks to return");
  for (int other = 0; other < g_env.nprocs; other++) {
    if (other == rank) continue;
    snprintf(flag, sizeof flag, "returned-%d", other);
    EXPECT(flag_wait(flag, 15), "rank %d never returned from its call", other);
  }
  test_step("ncclCommAbort");
  ncclResult_t ra = ncclCommAbort(comm);
  EXPECT(ra == ncclSuccess, "ncclCommAbort -> %s", result_name(ra));
  free(send);
  free(recv);
}

/* ---- sent-early: a small send completes before its receiver connects; the sender leaves -- */

/* Rank 0's first call is a send of 10 ints to rank 1 (small: it completes at once, before rank
 * 1 has connected), then it destroys its communicator. FAULTS_CASE=receive: rank 1 receives
 * only then, and gets the ints (before: the sender's destroy removed the shared-memory ring
 * they were in, and the receive failed with "shm: open ...: No such file"). FAULTS_CASE=never:
 * rank 1 destroys its communicator without receiving, and no ring file of rank 0's for it is
 * left in /dev/shm. 2 processes of 1 rank, or 1 process of 2 ranks. */
static void part_sent_early(void) {
  test_deadline(30);
  if (g_env.nranks != 2) {
    fprintf(stderr, "sent-early: run as 2 processes of 1 rank or 1 process of 2 ranks\n");
    exit(2);
  }
  const char* which = getenv("FAULTS_CASE");
  const int never = which && !strcmp(which, "never");
  ncclComm_t comms[2] = {NULL, NULL};
  test_step("init");
  make_comms("", comms);
  int32_t data[10];
  const int sender = g_env.proc == 0, receiver = g_env.nprocs == 1 || g_env.proc == 1;
  if (sender) {
    test_step("the send, then ncclCommDestroy");
    for (int i = 0; i < 10; i++) data[i] = 1000 + i;
    CHECK(ncclSend(data, 10, ncclInt32, 1, comms[0], TEST_STREAM));
    CHECK(ncclCommDestroy(comms[0]));
    char pid[32];
    snprintf(pid, sizeof pid, "sent-early-%d", (int)getpid());
    flag_set(pid);
    flag_set("sent-early");
  }
  if (!receiver) return;
  ncclComm_t mine = comms[g_env.nprocs == 1 ? 1 : 0];
  EXPECT(flag_wait("sent-early", 20), "rank 0 did not send and destroy within 20 s");
  if (never) {
    test_step("ncclCommDestroy without the receive");
    CHECK(ncclCommDestroy(mine));
    if (g_env.nprocs == 1) return; /* (in one process the ring is not a file) */
    /* Rank 0's pid, from the flag it left: its ring files are named "...-0-1-<pid>-<port>". */
    char dir[4200], *slash;
    flag_path("", dir, sizeof dir);
    slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    int pid0 = -1;
    DIR* d = opendir(dir);
    for (struct dirent* e; d && (e = readdir(d));) {
      const char* at = strstr(e->d_name, ".flag-sent-early-");
      if (at) pid0 = atoi(at + strlen(".flag-sent-early-"));
    }
    if (d) closedir(d);
    EXPECT(pid0 > 0, "rank 0's pid flag is missing");
    char mark[64];
    snprintf(mark, sizeof mark, "-0-1-%d-", pid0);
    int left = 0;
    d = opendir("/dev/shm");
    for (struct dirent* e; d && (e = readdir(d));)
      if (!strncmp(e->d_name, "nccl-rs-", 8) && strstr(e->d_name, mark)) left++, tlog("left: /dev/shm/%s", e->d_name);
    if (d) closedir(d);
    EXPECT(left == 0, "%d ring file(s) of rank 0 for rank 1 left in /dev/shm", left);
    return;
  }
  test_step("the receive, after the sender destroyed its communicator");
  for (int i = 0; i < 10; i++) data[i] = -1;
  ncclResult_t r = ncclRecv(data, 10, ncclInt32, 0, mine, TEST_STREAM);
  EXPECT(r == ncclSuccess, "the receive -> %s: %s", result_name(r), last_error(mine));
  for (int i = 0; i < 10 && r == ncclSuccess; i++)
    EXPECT(data[i] == 1000 + i, "element %d is %d, expected %d", i, data[i], 1000 + i);
  CHECK(ncclCommDestroy(mine));
}

/* ---- helpers of the parts below that run one rank per process ------------------------- */

/* Start part `name`, which must run as `procs` processes of one rank each (0: 2 or more),
 * with a deadline of `deadline` s: its communicator, made. */
static ncclComm_t one_rank_part_within(const char* name, int procs, int deadline) {
  test_deadline(deadline);
  if ((procs ? g_env.nprocs != procs : g_env.nprocs < 2) || g_env.local != 1) {
    if (procs) fprintf(stderr, "%s: run as %d processes of 1 rank\n", name, procs);
    else fprintf(stderr, "%s: run as 2 or more processes of 1 rank\n", name);
    exit(2);
  }
  ncclComm_t comm = NULL;
  test_step("init");
  make_comms("", &comm);
  return comm;
}

/* The same with a deadline of 40 s. */
static ncclComm_t one_rank_part(const char* name, int procs) { return one_rank_part_within(name, procs, 40); }

/* ---- p2p-order: a rank in a receive from a late third rank is not a mismatch ------------- */

/* Sends and receives of different pairs are not ordered: rank 1 receives from rank 2 first,
 * then from rank 0, while rank 0's send to rank 1 waits for it. Rank 2 sends only once rank
 * 0 has said, at WARN, that rank 1 is in a receive from rank 2 (the harness sets the flag
 * "go"). All three calls succeed, the data exact (before: rank 0's wait asked rank 1 what it
 * ran, saw another send or receive, and failed with a mismatch error). 3 processes. */
static void part_p2p_order(void) {
  ncclComm_t comm = one_rank_part("p2p-order", 3);
  const size_t big = 1 << 22; /* (16 MiB: a send that waits for its receive) */
  int32_t* buf = TEST_ALLOC((size_t)big * sizeof(int32_t));
  ncclResult_t r = ncclSuccess;
  if (g_env.proc == 0) {
    test_step("the send to rank 1");
    for (size_t i = 0; i < big; i++) buf[i] = (int32_t)(i * 7 + 1);
    r = ncclSend(buf, big, ncclInt32, 1, comm, TEST_STREAM);
  } else if (g_env.proc == 1) {
    test_step("the receive from rank 2, then from rank 0");
    r = ncclRecv(buf, 10, ncclInt32, 2, comm, TEST_STREAM);
    for (int i = 0; i < 10 && r == ncclSuccess; i++) EXPECT(buf[i] == 500 + i, "from rank 2: element %d is %d", i, buf[i]);
    if (r == ncclSuccess) r = ncclRecv(buf, big, ncclInt32, 0, comm, TEST_STREAM);
    size_t wrong = 0;
    for (size_t i = 0; i < big && r == ncclSuccess; i++) wrong += buf[i] != (int32_t)(i * 7 + 1);
    EXPECT(wrong == 0, "from rank 0: %zu elements wrong", wrong);
  } else {
    test_step("waiting for the go, then the send to rank 1");
    EXPECT(flag_wait("go", 30), "no go within 30 s (rank 0 did not say that rank 1 waits on rank 2)");
    for (int i = 0; i < 10; i++) buf[i] = 500 + i;
    r = ncclSend(buf, 10, ncclInt32, 1, comm, TEST_STREAM);
  }
  EXPECT(r == ncclSuccess, "rank %d's call -> %s: %s", g_env.proc, result_name(r), last_error(comm));
  CHECK(ncclCommDestroy(comm));
  free(buf);
}

/* ---- p2p-done: a finished receive in a group that waits on a late rank is not crossed ---- */

/* Rank 1's group receives 16 MiB from rank 2 and sends 16 MiB to a late rank 0; then rank 1
 * sends 4 bytes to rank 2. Rank 2 sends its 16 MiB (done once rank 1 has them), then receives
 * the 4 bytes, and waits: rank 1's group waits on rank 0. Rank 2 asks rank 1 what it runs:
 * before, rank 1 still showed its finished receive from rank 2, so the two looked as if each
 * only received from the other, and rank 2's valid receive failed ("neither call can finish").
 * Now rank 1 shows only its send to rank 0; rank 2 says so at WARN, and on that line the
 * harness lets rank 0 go (flag "go"). Every call succeeds, the data exact. 3 processes. */
static void part_p2p_done(void) {
  ncclComm_t comm = one_rank_part("p2p-done", 3);
  const size_t big = 1 << 22; /* (16 MiB: a send that waits for its receive) */
  const int rank = g_env.proc;
  int32_t* out = TEST_ALLOC((size_t)big * sizeof(int32_t));
  int32_t* in = TEST_ALLOC((size_t)big * sizeof(int32_t));
  for (size_t i = 0; i < big; i++) out[i] = (int32_t)(rank * 1000003 + i);
  ncclResult_t r = ncclSuccess;
  size_t wrong = 0;
  if (rank == 0) {
    test_step("waiting for the go, then the receive from rank 1");
    EXPECT(flag_wait("go", 30), "no go within 30 s (rank 2 did not say that rank 1 waits on rank 0)");
    r = ncclRecv(in, big, ncclInt32, 1, comm, TEST_STREAM);
    for (size_t i = 0; i < big && r == ncclSuccess; i++) wrong += in[i] != (int32_t)(1 * 1000003 + i);
  } else if (rank == 1) {
    test_step("the group: receive from rank 2, send to rank 0; then the send to rank 2");
    CHECK(ncclGroupStart());
    CHECK(ncclRecv(in, big, ncclInt32, 2, comm, TEST_STREAM));
    CHECK(ncclSend(out, big, ncclInt32, 0, comm, TEST_STREAM));
    r = ncclGroupEnd();
    for (size_t i = 0; i < big && r == ncclSuccess; i++) wrong += in[i] != (int32_t)(2 * 1000003 + i);
    if (r == ncclSuccess) r = ncclSend(out, 1, ncclInt32, 2, comm, TEST_STREAM);
  } else {
    test_step("the send to rank 1, then the receive from it");
    r = ncclSend(out, big, ncclInt32, 1, comm, TEST_STREAM);
    if (r == ncclSuccess) r = ncclRecv(in, 1, ncclInt32, 1, comm, TEST_STREAM);
    wrong += r == ncclSuccess && in[0] != 1 * 1000003;
  }
  EXPECT(r == ncclSuccess, "rank %d's calls -> %s: %s", rank, result_name(r), last_error(comm));
  EXPECT(wrong == 0, "rank %d: %zu elements wrong", rank, wrong);
  CHECK(ncclCommDestroy(comm));
  free(out);
  free(in);
}

/* ---- coll-done: a collective done in a group that waits on a late rank is not a mismatch -- */

/* Rank 0's group holds an all-reduce (done at once) and a send of 16 MiB to a late rank 2;
 * then rank 0 sends 16 MiB to rank 1, which made the all-reduce and waits in its receive.
 * Rank 1 asks rank 0 what it runs: before, rank 0 still showed the finished all-reduce, and
 * rank 1's valid receive failed ("rank 0 issued AllReduce #0 ... where rank 1 issued a
 * receive"). Now rank 0 shows only its send to rank 2; rank 1 says so at WARN, and on that
 * line the harness lets rank 2 go (flag "go"). Every call succeeds, exact. 3 processes. */
static void part_coll_done(void) {
  ncclComm_t comm = one_rank_part("coll-done", 3);
  const size_t big = 1 << 22; /* (16 MiB: a send that waits for its receive) */
  const int rank = g_env.proc;
  int32_t* data = TEST_ALLOC((size_t)big * sizeof(int32_t));
  int32_t sum = rank + 1;
  ncclResult_t r;
  if (rank == 0) {
    test_step("the group: all-reduce and the send to rank 2; then the send to rank 1");
    for (size_t i = 0; i < big; i++) data[i] = (int32_t)(i * 3 + 7);
    CHECK(ncclGroupStart());
    CHECK(ncclAllReduce(&sum, &sum, 1, ncclInt32, ncclSum, comm, TEST_STREAM));
    CHECK(ncclSend(data, big, ncclInt32, 2, comm, TEST_STREAM));
    r = ncclGroupEnd();
    if (r == ncclSuccess) r = ncclSend(data, big, ncclInt32, 1, comm, TEST_STREAM);
  } else {
    test_step("the all-reduce, then the receive from rank 0");
    r = ncclAllReduce(&sum, &sum, 1, ncclInt32, ncclSum, comm, TEST_STREAM);
    if (rank == 2 && r == ncclSuccess) {
      test_step("waiting for the go, then the receive from rank 0");
      EXPECT(flag_wait("go", 30), "no go within 30 s (rank 1 did not say that rank 0 waits on rank 2)");
    }
    if (r == ncclSuccess) r = ncclRecv(data, big, ncclInt32, 0, comm, TEST_STREAM);
    size_t wrong = 0;
    for (size_t i = 0; i < big && r == ncclSuccess; i++) wrong += data[i] != (int32_t)(i * 3 + 7);
    EXPECT(wrong == 0, "rank %d: %zu elements wrong", rank, wrong);
  }
  EXPECT(r == ncclSuccess, "rank %d's calls -> %s: %s", rank, result_name(r), last_error(comm));
  EXPECT(r != ncclSuccess || sum == 6, "rank %d: the all-reduce gave %d, expected 6", rank, sum);
  CHECK(ncclCommDestroy(comm));
  free(data);
}

/* ---- group-late: sends and receives grouped with a collective a late rank holds up -------- */

/* Every rank's group holds an all-reduce of 256 ints and a send of one int to rank r+2 with a
 * receive from rank r+1 into the same int (3 ranks); rank 0 makes its call only once rank 1 has said at WARN that
 * it waited for rank 0 (the harness sets the flag "go"). Meanwhile ranks 1 and 2 wait in the
 * all-reduce, each behind the other's collective too: before, rank 1, waiting on rank 2 for
 * the receive, found rank 2 in the all-reduce and failed the valid group ("rank 2 issued
 * AllReduce #1 where rank 1 issued a receive of 4 bytes"). Now a peer in a collective this
 * rank issued is behind, not mismatched. Every call succeeds, exact. 3 processes. */
static void part_group_late(void) {
  ncclComm_t comm = one_rank_part("group-late", 3);
  const int rank = g_env.proc, to = (rank + 2) % 3, from = (rank + 1) % 3;
  int32_t warm = 1;
  CHECK(ncclAllReduce(&warm, &warm, 1, ncclInt32, ncclSum, comm, TEST_STREAM));
  int32_t vals[256], x = 1000 + rank;
  for (int i = 0; i < 256; i++) vals[i] = rank * 256 + i;
  if (rank == 0) {
    test_step("waiting for the go");
    EXPECT(flag_wait("go", 30), "no go within 30 s (rank 1 did not say that it waited for rank 0)");
  }
  test_step("the group: all-reduce, send, receive");
  CHECK(ncclGroupStart());
  CHECK(ncclAllReduce(vals, vals, 256, ncclInt32, ncclMax, comm, TEST_STREAM));
  /* (In place: the send goes from a copy, which waits behind the all-reduce's local work.) */
  CHECK(ncclSend(&x, 1, ncclInt32, to, comm, TEST_STREAM));
  CHECK(ncclRecv(&x, 1, ncclInt32, from, comm, TEST_STREAM));
  ncclResult_t r = ncclGroupEnd();
  EXPECT(r == ncclSuccess, "rank %d's group -> %s: %s", rank, result_name(r), last_error(comm));
  int wrong = 0;
  for (int i = 0; i < 256 && r == ncclSuccess; i++) wrong += vals[i] != 2 * 256 + i;
  EXPECT(wrong == 0, "rank %d: %d all-reduce elements wrong", rank, wrong);
  EXPECT(r != ncclSuccess || x == 1000 + from, "rank %d received %d from rank %d, expected %d", rank, x, from, 1000 + from);
  CHECK(ncclCommDestroy(comm));
}

/* ---- held-up: every rank names the late rank that holds a collective up ------------------ */

/* n processes all-reduce 1 Mi ints; the last rank makes its call only once every other has said
 * at WARN that it has not issued that call (the harness sets the flag "go"). The ranks that
 * wait on it directly find it has not; the others wait on ranks that run the call too and
 * learn from them, or from the ranks those reached, who holds them up (before: those said
 * nothing, however long; then, only one rank further per look). Then every rank's sum is
 * exact. */
static void part_held_up(void) {
  ncclComm_t comm = one_rank_part_within("held-up", 0, 50);
  const size_t n = 1 << 20;
  const int rank = g_env.proc, ranks = g_env.nprocs, late = ranks - 1;
  int32_t* buf = TEST_ALLOC(n * sizeof(int32_t));
  for (size_t i = 0; i < n; i++) buf[i] = (int32_t)(rank + (int32_t)(i % 7));
  if (rank == late) {
    test_step("waiting for the go");
    EXPECT(flag_wait("go", 40), "no go within 40 s (the other ranks did not all say that rank %d holds them up)", late);
  }
  test_step("the all-reduce");
  ncclResult_t r = ncclAllReduce(buf, buf, n, ncclInt32, ncclSum, comm, TEST_STREAM);
  EXPECT(r == ncclSuccess, "rank %d's all-reduce -> %s: %s", rank, result_name(r), last_error(comm));
  size_t wrong = 0;
  const int32_t base = (int32_t)(ranks * (ranks - 1) / 2);
  for (size_t i = 0; i < n && r == ncclSuccess; i++) wrong += buf[i] != base + ranks * (int32_t)(i % 7);
  EXPECT(wrong == 0, "rank %d: %zu elements wrong", rank, wrong);
  CHECK(ncclCommDestroy(comm));
  free(buf);
}

/* ---- pipeline-late: every stage names the late first stage of a pipeline -----------------
 * n processes, a pipeline's forward pass: rank k receives 1 Mi ints from rank k-1, adds its
 * rank, and sends them to rank k+1. Rank 0 sends only once every other rank has said at WARN
 * that rank 0 holds it up (the harness sets the flag "go"): rank 1 waits on it directly; the
 * others wait on a rank that is in its own receive, and learn from it who holds it up (before:
 * each named only the rank before it, which "waits on that rank"). Then every rank's data is
 * exact. */
static void part_pipeline_late(void) {
  ncclComm_t comm = one_rank_part_within("pipeline-late", 0, 50);
  const size_t n = 1 << 20;
  const int rank = g_env.proc, ranks = g_env.nprocs;
  int32_t* buf = TEST_ALLOC(n * sizeof(int32_t));
  ncclResult_t r = ncclSuccess;
  if (rank == 0) {
    for (size_t i = 0; i < n; i++) buf[i] = (int32_t)(i % 7);
    test_step("waiting for the go");
    EXPECT(flag_wait("go", 40), "no go within 40 s (the other ranks did not all say that rank 0 holds them up)");
  } else {
    test_step("the receive");
    r = ncclRecv(buf, n, ncclInt32, rank - 1, comm, TEST_STREAM);
    EXPECT(r == ncclSuccess, "rank %d's receive -> %s: %s", rank, result_name(r), last_error(comm));
    size_t wrong = 0;
    const int32_t added = (int32_t)(rank * (rank - 1) / 2);
    for (size_t i = 0; i < n && r == ncclSuccess; i++) wrong += buf[i] != added + (int32_t)(i % 7);
    EXPECT(wrong == 0, "rank %d: %zu elements wrong", rank, wrong);
    for (size_t i = 0; i < n; i++) buf[i] += rank;
  }
  if (rank + 1 < ranks && r == ncclSuccess) {
    test_step("the send");
    r = ncclSend(buf, n, ncclInt32, rank + 1, comm, TEST_STREAM);
    EXPECT(r == ncclSuccess, "rank %d's send -> %s: %s", rank, result_name(r), last_error(comm));
  }
  CHECK(ncclCommDestroy(comm));
  free(buf);
}

/* ---- stopped-remote: a stopped process of another host, seen by a rank of that host ------
 * 3 processes; NCCL_HOSTID (set by tests/faults.rs) makes process 0 one host and processes 1
 * and 2 another. Process 2 stops itself (SIGSTOP) before its send to rank 0. Rank 0, in the
 * receive, cannot see that process from its host; it must ask rank 1, of that host, and say at
 * WARN, about 2 s in, that rank 2's process is stopped, as rank 1 sees it (before: after
 * 10 s, only that its host did not answer). Rank 1 waits outside NCCL meanwhile (its bootstrap
 * service answers on a thread of its own), until rank 0 has its data (the flag "done"). The
 * harness sends SIGCONT on that line; the data must be exact. */
static void part_stopped_remote(void) {
  ncclComm_t comm = one_rank_part("stopped-remote", 3);
  const int rank = g_env.proc;
  int32_t buf[64];
  ncclResult_t r = ncclSuccess;
  if (rank == 2) {
    tlog("STOPPING");
    raise(SIGSTOP);
    tlog("resumed");
    for (int i = 0; i < 64; i++) buf[i] = 700 + i;
    test_step("the send to rank 0");
    r = ncclSend(buf, 64, ncclInt32, 0, comm, TEST_STREAM);
  } else if (rank == 0) {
    test_step("the receive from the stopped rank 2");
    r = ncclRecv(buf, 64, ncclInt32, 2, comm, TEST_STREAM);
    int wrong = 0;
    for (int i = 0; i < 64 && r == ncclSuccess; i++) wrong += buf[i] != 700 + i;
    EXPECT(wrong == 0, "from rank 2: %d elements wrong", wrong);
    flag_set("done");
  } else {
    test_step("waiting outside NCCL for rank 0's receive");
    EXPECT(flag_wait("done", 35), "rank 0 did not receive from rank 2 within 35 s");
  }
  EXPECT(r == ncclSuccess, "rank %d's call -> %s: %s", rank, result_name(r), last_error(comm));
  CHECK(ncclCommDestroy(comm));
}

/* ---- held-elsewhere: a peer held up in a call on another communicator ------------------- */

/* Ranks 1 and 2 split off a communicator of their own; rank 1 all-reduces on it, then sends
 * to rank 0 on the first. Rank 2 makes its all-reduce only once rank 0 has named it (the
 * flag "go"); rank 0 makes its receive only once rank 1 has said at WARN that rank 2 has not
 * issued the all-reduce (the flag "recv"), so rank 1 has found what holds it up. Rank 0, in
 * the receive, finds rank 1 in a call on the other communicator and must say that rank 2
 * holds it up there (before: only "ranks that call communicators in different orders wait
 * for each other", which they do not). Then every call succeeds, exact. */
static void part_held_elsewhere(void) {
  ncclComm_t world = one_rank_part("held-elsewhere", 3), pair = NULL;
  const int rank = g_env.proc;
  test_step("split");
  CHECK(ncclCommSplit(world, rank == 0 ? NCCL_SPLIT_NOCOLOR : 1, rank, &pair, NULL));
  int32_t v = 7, sum = rank;
  ncclResult_t r = ncclSuccess;
  if (rank == 0) {
    test_step("waiting for the flag recv, then the receive from rank 1");
    EXPECT(flag_wait("recv", 30), "no flag recv within 30 s (rank 1 did not say that rank 2 holds it up)");
    v = 0;
    r = ncclRecv(&v, 1, ncclInt32, 1, world, TEST_STREAM);
    EXPECT(r != ncclSuccess || v == 12, "rank 0 received %d, expected 12", (int)v);
  } else {
    if (rank == 2) {
      test_step("waiting for the go, then the all-reduce");
      EXPECT(flag_wait("go", 30), "no go within 30 s (rank 0 did not say that rank 2 holds rank 1 up)");
    }
    r = ncclAllReduce(&sum, &sum, 1, ncclInt32, ncclSum, pair, TEST_STREAM);
    EXPECT(r != ncclSuccess || sum == 3, "rank %d: the all-reduce gave %d, expected 3", rank, (int)sum);
    v = sum + 9;
    if (rank == 1 && r == ncclSuccess) r = ncclSend(&v, 1, ncclInt32, 0, world, TEST_STREAM);
  }
  EXPECT(r == ncclSuccess, "rank %d's calls -> %s: %s", rank, result_name(r), last_error(world));
  if (pair) CHECK(ncclCommDestroy(pair));
  CHECK(ncclCommDestroy(world));
}

/* ---- signal-wait: a rank waiting for signals, and its stopped sender, are named ---------- */

/* Rank 2 writes its pid and stops itself (SIGSTOP) before it signals rank 1; rank 1 waits
 * for that signal (ncclWaitSignal), then receives from rank 0, whose send waits meanwhile.
 * Rank 0 must say at WARN that rank 1 is in ncclWaitSignal waiting for rank 2's signal
 * (before: that rank 1 had not issued the call), and rank 1 that rank 2's process is stopped
 * (before: only after 10 s, and without why); tests/faults.rs then resumes rank 2, and every
 * call completes, exact. */
static void part_signal_wait(void) {
  ncclComm_t comm = one_rank_part("signal-wait", 3);
  const size_t big = 1 << 22; /* (16 MiB: a send that waits for its receive) */
  const int rank = g_env.proc;
  int32_t* data = TEST_ALLOC(big * sizeof(int32_t));
  ncclResult_t r = ncclSuccess;
  if (rank == 0) {
    test_step("the send to rank 1");
    for (size_t i = 0; i < big; i++) data[i] = (int32_t)(i * 5 + 3);
    r = ncclSend(data, big, ncclInt32, 1, comm, TEST_STREAM);
  } else if (rank == 1) {
    test_step("the wait for rank 2's signal, then the receive from rank 0");
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = 2, .sigIdx = 0, .ctx = 0};
    r = ncclWaitSignal(1, &d, comm, TEST_STREAM);
    if (r == ncclSuccess) r = ncclRecv(data, big, ncclInt32, 0, comm, TEST_STREAM);
    size_t wrong = 0;
    for (size_t i = 0; i < big && r == ncclSuccess; i++) wrong += data[i] != (int32_t)(i * 5 + 3);
    EXPECT(wrong == 0, "rank 1: %zu elements wrong", wrong);
  } else {
    flag_pid("pid");
    tlog("STOPPING");
    raise(SIGSTOP);
    tlog("resumed");
    test_step("the signal to rank 1");
    r = ncclSignal(1, 0, 0, 0, comm, TEST_STREAM);
  }
  EXPECT(r == ncclSuccess, "rank %d's calls -> %s: %s", rank, result_name(r), last_error(comm));
  CHECK(ncclCommDestroy(comm));
  free(data);
}

/* ---- ring-late: a ring of sends that a late rank unwinds is not a cycle ----------------- */

/* Each rank but 0 sends 16 MiB to the next, then receives from the one before, outside a
 * group; rank 0 receives first, then sends, but only once rank 1 has said at WARN that rank 2
 * is in a send to rank 3 (the harness sets the flag "go"). Until then ranks 1 to 3 wait on each
 * other in a chain that ends at rank 0, which has issued nothing: not a cycle, so no error.
 * Then the chain unwinds and every call succeeds, the data exact. 4 processes. */
static void part_ring_late(void) {
  ncclComm_t comm = one_rank_part("ring-late", 4);
  const size_t big = 1 << 22; /* (16 MiB: a send that waits for its receive) */
  const int rank = g_env.proc, n = g_env.nprocs, next = (rank + 1) % n, prev = (rank + n - 1) % n;
  int32_t* out = TEST_ALLOC((size_t)big * sizeof(int32_t));
  int32_t* in = TEST_ALLOC((size_t)big * sizeof(int32_t));
  for (size_t i = 0; i < big; i++) out[i] = (int32_t)(rank * 1000003 + i);
  ncclResult_t r;
  if (rank == 0) {
    test_step("waiting for the go, then the receive from rank 3 and the send to rank 1");
    EXPECT(flag_wait("go", 30), "no go within 30 s (rank 1 did not say that rank 2 waits on rank 3)");
    r = ncclRecv(in, big, ncclInt32, prev, comm, TEST_STREAM);
    if (r == ncclSuccess) r = ncclSend(out, big, ncclInt32, next, comm, TEST_STREAM);
  } else {
    test_step("the send to the next rank, then the receive from the one before");
    r = ncclSend(out, big, ncclInt32, next, comm, TEST_STREAM);
    if (r == ncclSuccess) r = ncclRecv(in, big, ncclInt32, prev, comm, TEST_STREAM);
  }
  EXPECT(r == ncclSuccess, "rank %d's calls -> %s: %s", rank, result_name(r), last_error(comm));
  size_t wrong = 0;
  for (size_t i = 0; i < big && r == ncclSuccess; i++) wrong += in[i] != (int32_t)(prev * 1000003 + i);
  EXPECT(wrong == 0, "from rank %d: %zu elements wrong", prev, wrong);
  CHECK(ncclCommDestroy(comm));
  free(out);
  free(in);
}

/* ---- hello: init and one allreduce --------------------------------------------------- */

static void part_hello(void) {
  test_deadline(40);
  double t0 = now_s();
  ncclComm_t comms[MAX_LOCAL];
  test_step("init");
  make_comms("", comms);
  double t_init = now_s() - t0;
  test_step("allreduce");
  int v = allreduce_sum_int(comms, g_env.proc + 1);
  int want = g_env.nprocs * (g_env.nprocs + 1) / 2 * g_env.local;
  tlog("init %.3f s, allreduce -> %d (expected %d)", t_init, v, want);
  tlog("TIMING init=%.3f", t_init);
  EXPECT(v == want, "allreduce gave %d, expected %d", v, want);
  destroy_comms(comms);
}

/* ---- fd-starved: the root's process has used all the file descriptors it may --------------- */

/* Process 0 makes the id of a job of the other two processes, then uses up every file
 * descriptor its limit allows, after setting the hard limit to the soft one so the library
 * cannot raise it. The root (a thread of process 0) cannot take the ranks' connections: it
 * fails the job after a moment, and each rank's init fails, pointing at the root's process;
 * process 0's log says which limit ran out (tests/faults.rs checks that). Before, the root
 * retried its accept for ever and the ranks waited in init with no end. A world communicator,
 * connected before process 0 runs out, keeps the processes in step. */
static void part_fd_starved(void) {
  test_deadline(60);
  if (g_env.nprocs != 3 || g_env.local != 1) {
    fprintf(stderr, "fd-starved: run as 3 processes of 1 rank\n");
    exit(2);
  }
  ncclComm_t world = NULL;
  test_step("init of the world");
  make_comms("", &world);
  test_step("the job's id, from process 0");
  int id_words[sizeof(ncclUniqueId) / sizeof(int)];
  memset(id_words, 0, sizeof id_words);
  if (g_env.proc == 0) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id));
    memcpy(id_words, &id, sizeof id);
  }
  const size_t nwords = sizeof id_words / sizeof id_words[0];
  CHECK(ncclAllReduce(id_words, id_words, nwords, ncclInt32, ncclSum, world, TEST_STREAM));
  ncclUniqueId id;
  memcpy(&id, id_words, sizeof id);
  int held[1 << 16], nheld = 0;
  if (g_env.proc == 0) {
    test_step("process 0 uses up its file descriptors");
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
      perror("getrlimit");
      exit(2);
    }
    EXPECT(rl.rlim_cur < (rlim_t)(sizeof held / sizeof held[0]), "the open-file limit %llu is too high for this test",
           (unsigned long long)rl.rlim_cur);
    rl.rlim_max = rl.rlim_cur;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      perror("setrlimit");
      exit(2);
    }
    int fd;
    while (nheld < (int)(sizeof held / sizeof held[0]) && (fd = dup(2)) >= 0) held[nheld++] = fd;
    EXPECT(errno == EMFILE, "dup stopped with %s, not EMFILE", strerror(errno));
    tlog("holding %d more descriptors: none left under the limit %llu", nheld, (unsigned long long)rl.rlim_cur);
  }
  /* (The same all-reduce as above: it needs no connection it did not make then.) */
  CHECK(ncclAllReduce(id_words, id_words, nwords, ncclInt32, ncclSum, world, TEST_STREAM));
  if (g_env.proc != 0) {
    test_step("the job's ranks join; its root cannot take them");
    ncclComm_t comm = NULL;
    double t0 = now_s();
    ncclResult_t r = ncclCommInitRank(&comm, 2, id, g_env.proc - 1);
    double took = now_s() - t0;
    const char* text = last_error(NULL);
    tlog("ncclCommInitRank -> %s after %.3f s: %s", result_name(r), took, text);
    EXPECT(r == ncclRemoteError || r == ncclSystemError, "init with a starved root -> %s: %s", result_name(r), text);
    EXPECT(took < 20.0, "init with a starved root failed only after %.3f s", took);
    EXPECT(strstr(text, "root") != NULL, "the error does not point at the root: %s", text);
  }
  CHECK(ncclAllReduce(id_words, id_words, nwords, ncclInt32, ncclSum, world, TEST_STREAM));
  while (nheld > 0) close(held[--nheld]);
  CHECK(ncclCommDestroy(world));
}

/* ---- no-threads: a member's split or shrink cannot start ------------------------------------ */

/* Rank 2's process cannot start a thread when the three ranks split (FAULTS_CASE=split, the
 * default) or shrink (shrink) their communicator (nonblocking with FAULTS_NONBLOCKING=1): it
 * runs as user nobody with a thread limit of 1 (RLIMIT_NPROC; root is exempt), so its call
 * fails before it sends its part of the exchange. The parts go round the members, so no part
 * gets past rank 2: ranks 0 and 1 must fail within seconds with ncclRemoteError naming rank 2
 * and why, not wait for ever (NCCL_INIT_TIMEOUT_S unset, as PyTorch leaves it). Needs root
 * (to become nobody and back): without, it says so and passes. */
static void part_no_threads(void) {
  test_deadline(60);
  if (g_env.nprocs != 3 || g_env.local != 1) {
    fprintf(stderr, "no-threads: run as 3 processes of 1 rank\n");
    exit(2);
  }
  const char* which = getenv("FAULTS_CASE") && *getenv("FAULTS_CASE") ? getenv("FAULTS_CASE") : "split";
  const int nonblocking = env_int_or("FAULTS_NONBLOCKING", 0);
  if (geteuid() != 0) {
    tlog("no-threads: not root, cannot run a rank as another user: skipped");
    return;
  }
  test_step("init");
  ncclComm_t world = make_one_comm("", nonblocking);
  int one = 1;
  ncclResult_t ar = ncclAllReduce(&one, &one, 1, ncclInt32, ncclSum, world, TEST_STREAM);
  if (ar == ncclInProgress) ar = wait_comm(world);
  EXPECT(ar == ncclSuccess && one == 3, "the all-reduce before: %s, %d", result_name(ar), one);
  struct rlimit was;
  if (getrlimit(RLIMIT_NPROC, &was) != 0) {
    perror("getrlimit");
    exit(2);
  }
  if (g_env.proc == 2) {
    /* Real and effective user nobody (saved: root, to come back), at most one task of it. */
    struct rlimit one_task = {1, was.rlim_max};
    if (setresuid(65534, 65534, 0) != 0 || setrlimit(RLIMIT_NPROC, &one_task) != 0) {
      perror("no-threads: become nobody with a thread limit");
      exit(2);
    }
  }
  test_step(which);
  ncclComm_t child = NULL;
  double t0 = now_s();
  ncclResult_t r = !strcmp(which, "shrink") ? ncclCommShrink(world, NULL, 0, &child, NULL, NCCL_SHRINK_DEFAULT)
                                             : ncclCommSplit(world, 0, g_env.proc, &child, NULL);
  /* Nonblocking: a split's parent tells when it is done; a shrink's child, handed back at once. */
  ncclComm_t polled = !strcmp(which, "shrink") && child ? child : world;
  if (r == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress && now_s() - t0 < 40) {
      CHECK(ncclCommGetAsyncError(polled, &state));
      if (state == ncclInProgress) sleep_ms(5);
    }
    r = state;
  }
  const double took = now_s() - t0;
  const char* text = last_error(polled);
  tlog("%s -> %s after %.3f s: %s", which, result_name(r), took, text);
  /* Rank 2 lifts its thread limit, then only this thread becomes root again, by the system
   * call. glibc's setresuid() changes every thread (it signals each and waits for all), and
   * glibc 2.36's deadlocks if another thread's pthread_create is failing meanwhile: the walk
   * over threads waits for the half-made one while holding the lock its creator needs to
   * free it (a loop of failing pthread_create beside setresuid hangs at once). The library
   * may be starting a thread then (its bootstrap service reads each peer's connection on a
   * thread of its own), which is the likely cause of this test's one 60 s hang here. The
   * other threads stay user nobody, with no thread limit: they only wait to be stopped. */
  if (g_env.proc == 2 && (setrlimit(RLIMIT_NPROC, &was) != 0 || syscall(SYS_setresuid, 0, 0, 0) != 0)) {
    perror("no-threads: back to root");
    exit(2);
  }
  if (g_env.proc == 2) tlog("%s: back to root", which);
  /* Rank 2's process stays (as a program that handles the error does) until the others are
   * done: they must not learn it from its exit. */
  const char* id_file = getenv("NCCL_TEST_ID_FILE");
  char done[4096];
  if (g_env.proc == 2) {
    EXPECT(r != ncclSuccess && strstr(text, "thread"), "rank 2's %s without threads -> %s: %s", which, result_name(r),
           text);
    for (int p = 0; p < 2; p++) {
      snprintf(done, sizeof done, "%s.no-threads-%d", id_file ? id_file : "/tmp/nccl-rs-no-threads", p);
      while (access(done, F_OK) != 0 && now_s() - t0 < 40) sleep_ms(5);
      EXPECT(access(done, F_OK) == 0, "process %d never said it was done", p);
    }
  } else {
    EXPECT(r == ncclRemoteError, "%s with rank 2 unable to take part -> %s, expected ncclRemoteError", which,
           result_name(r));
    EXPECT(names_rank(text, 2) && strstr(text, "cannot take part") && strstr(text, "thread"),
           "the error does not name rank 2 and why: %s", text);
    EXPECT(took < 15.0, "%s failed only after %.3f s", which, took);
    snprintf(done, sizeof done, "%s.no-threads-%d", id_file ? id_file : "/tmp/nccl-rs-no-threads", g_env.proc);
    FILE* f = fopen(done, "w");
    if (f) fclose(f);
  }
  if (child) ncclCommAbort(child);
  CHECK(ncclCommAbort(world));
}

static const struct {
  const char* name;
  void (*run)(void);
} PARTS[] = {
    {"loop", part_loop},         {"abort", part_abort},           {"abort-init", part_abort_init},
    {"mismatch", part_mismatch}, {"hello", part_hello},           {"gone-early", part_gone_early},
    {"closed-early", part_closed_early}, {"stopped", part_stopped}, {"crossed", part_crossed},
    {"culprit", part_culprit},
    {"sent-early", part_sent_early}, {"p2p-order", part_p2p_order},
    {"ring-late", part_ring_late}, {"held-up", part_held_up}, {"pipeline-late", part_pipeline_late}, {"stopped-remote", part_stopped_remote},
    {"held-elsewhere", part_held_elsewhere}, {"signal-wait", part_signal_wait}, {"p2p-done", part_p2p_done},
    {"coll-done", part_coll_done}, {"group-late", part_group_late}, {"fd-starved", part_fd_starved},
    {"no-threads", part_no_threads},
};

int main(int argc, char** argv) {
  test_init(argc, argv);
  const char* part = g_env.only ? g_env.only : "";
  size_t k = 0;
  while (k < sizeof PARTS / sizeof PARTS[0] && strcmp(part, PARTS[k].name)) k++;
  if (k == sizeof PARTS / sizeof PARTS[0]) {
    fprintf(stderr, "usage: faults --only");
    for (k = 0; k < sizeof PARTS / sizeof PARTS[0]; k++) fprintf(stderr, "%s%s", k ? "|" : " ", PARTS[k].name);
    fprintf(stderr, "\n");
    return 2;
  }
  PARTS[k].run();
  return test_finish();
}
