/*
 * lifecycle.c - communicator life cycle: version, the parameter API, ncclSetEncryption,
 * queries, host-mode ncclMemAlloc and registration (one-sided RMA refused), suspend and
 * resume, configs (current, older headers, wrong
 * magic), blocking and nonblocking init, finalize, destroy, abort, scalable init, group
 * nesting, group simulation, group errors, the async-error watchdog thread of PyTorch, and a
 * stale unique id.
 *
 *   lifecycle [--only STEP]     STEP: one of the names printed as "step: NAME"
 *   (LIFECYCLE_TEST_SKIP=STEP[,STEP...] leaves those steps out)
 *
 * Every process runs the same steps in the same order (each new communicator takes the
 * next unique id, named by its tag).
 */
#include "common.h"

#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static uint32_t g_salt = 1;

/* LIFECYCLE_TEST_SKIP=step[,step...]: those steps are left out of a run of every step. */
static int begin(const char* name) {
  if (g_env.only ? strcasecmp(g_env.only, name) != 0 : test_skipped("LIFECYCLE_TEST_SKIP", name)) return 0;
  test_step(name);
  tlog("step: %s", name);
  return 1;
}

/* ---- helpers ------------------------------------------------------------------------- */

typedef struct {
  gbuf_t sb[MAX_LOCAL], rb[MAX_LOCAL];
  size_t count;
  uint32_t salt;
} ar_bufs_t;

static void ar_setup(ar_bufs_t* b, size_t count) {
  b->count = count;
  b->salt = 0x5000u + 31u * g_salt++;
  for (int l = 0; l < g_env.local; l++) {
    void* s = gbuf_alloc(&b->sb[l], count * 4);
    gbuf_alloc(&b->rb[l], count * 4);
    fill_values(ncclFloat32, ncclSum, g_env.nranks, g_env.first_rank + l, s, 0, count, b->salt);
    gbuf_poison(&b->rb[l], b->salt);
  }
}

static ncclResult_t ar_issue(ar_bufs_t* b, ncclComm_t comm, int l) {
  return ncclAllReduce(gbuf_ptr(&b->sb[l]), gbuf_ptr(&b->rb[l]), b->count, ncclFloat32, ncclSum,
                       comm, TEST_STREAM);
}

static int ar_untouched(ar_bufs_t* b) {
  int ok = 1;
  for (int l = 0; l < g_env.local; l++) ok &= gbuf_poison_intact(&b->rb[l], b->salt, 0, b->rb[l].bytes);
  return ok;
}

static void ar_verify_free(ar_bufs_t* b, const char* what) {
  for (int l = 0; l < g_env.local; l++) {
    check_values(what, ncclFloat32, ncclSum, g_env.nranks, gbuf_ptr(&b->rb[l]), 0, b->count, b->salt, 0);
    check_guards(what, &b->sb[l]);
    check_guards(what, &b->rb[l]);
    gbuf_free(&b->sb[l]);
    gbuf_free(&b->rb[l]);
  }
}

/* One float32 sum allreduce on every local comm, checked. On nonblocking communicators the
 * calls may return ncclInProgress; NCCL: poll ncclCommGetAsyncError until ncclSuccess. */
static void allreduce_check(ncclComm_t* comms, int nonblocking, const char* what) {
  ar_bufs_t b;
  ar_setup(&b, 1000);
  ncclResult_t first = ncclSuccess;
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t r = ar_issue(&b, comms[l], l);
    if (r != ncclSuccess && !(nonblocking && r == ncclInProgress) && first == ncclSuccess) first = r;
  }
  if (g_env.local > 1) {
    ncclResult_t r = ncclGroupEnd();
    if (r != ncclSuccess && !(nonblocking && r == ncclInProgress) && first == ncclSuccess) first = r;
  }
  if (first != ncclSuccess) test_check_fail(__FILE__, __LINE__, what, first);
  if (nonblocking) {
    for (int l = 0; l < g_env.local; l++) {
      ncclResult_t s = wait_comm(comms[l]);
      if (s != ncclSuccess) test_check_fail(__FILE__, __LINE__, what, s);
    }
  }
  ar_verify_free(&b, what);
}

static void query_check(ncclComm_t* comms, const char* what) {
  for (int l = 0; l < g_env.local; l++) {
    int n = -1, r = -1, dev = -12345;
    CHECK(ncclCommCount(comms[l], &n));
    CHECK(ncclCommUserRank(comms[l], &r));
    CHECK(ncclCommCuDevice(comms[l], &dev));
    EXPECT(n == g_env.nranks, "%s: ncclCommCount = %d, expected %d", what, n, g_env.nranks);
    EXPECT(r == g_env.first_rank + l, "%s: ncclCommUserRank = %d, expected %d", what, r,
           g_env.first_rank + l);
    EXPECT(dev != -12345, "%s: ncclCommCuDevice did not write the device", what);
    if (l == 0) tlog("%s: count %d, rank %d, cuDevice %d", what, n, r, dev);
  }
}

/* Blocking init of every local rank from one id (grouped when LOCAL > 1). */
static void init_from_id(ncclUniqueId id, ncclComm_t* comms) {
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommInitRank(&comms[l], g_env.nranks, id, g_env.first_rank + l));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
}

/* ---- steps ----------------------------------------------------------------------------- */

static void step_version(void) {
  if (!begin("version")) return;
  int v = -1;
  CHECK(ncclGetVersion(&v));
  EXPECT(v == 23203, "ncclGetVersion = %d, expected 23203", v);
  EXPECT(NCCL_VERSION_CODE == 23203, "NCCL_VERSION_CODE = %d", NCCL_VERSION_CODE);
  EXPECT(NCCL_VERSION(2, 32, 3) == 23203, "NCCL_VERSION(2,32,3) = %d", NCCL_VERSION(2, 32, 3));
  EXPECT(v >= NCCL_VERSION(2, 19, 0), "version %d older than 2.19", v);
}

/* The parameter API: NCCL_BUFFSIZE (from the environment, else its default of 4 MiB) read
 * through a handle as integers and text, by key, and among all keys; unknown keys refused. */
static void step_params(void) {
  if (!begin("params")) return;
  const char* env = getenv("NCCL_BUFFSIZE");
  const long long want = env && *env ? strtoll(env, NULL, 0) : 4194304;
  char want_text[32];
  snprintf(want_text, sizeof want_text, "%s", env && *env ? env : "4194304");
  ncclParamHandle_t h = NULL, h2 = NULL;
  CHECK(ncclParamBind(&h, "NCCL_BUFFSIZE"));
  CHECK(ncclParamBind(&h2, "BUFFSIZE"));
  EXPECT(h && h == h2, "NCCL_BUFFSIZE and BUFFSIZE bound to different handles (%p, %p)", (void*)h, (void*)h2);
  int64_t i64 = -1;
  uint64_t u64 = 0;
  int32_t i32 = -1;
  CHECK(ncclParamGetI64(h, &i64));
  CHECK(ncclParamGetU64(h, &u64));
  CHECK(ncclParamGetI32(h, &i32));
  EXPECT(i64 == want && u64 == (uint64_t)want && i32 == want, "NCCL_BUFFSIZE read as %lld, %llu, %d; expected %lld",
         (long long)i64, (unsigned long long)u64, (int)i32, want);
  const char* str = NULL;
  CHECK(ncclParamGetStr(h, &str));
  EXPECT(str && !strcmp(str, want_text), "NCCL_BUFFSIZE as text: '%s', expected '%s'", str ? str : "(null)", want_text);
  char raw[64];
  int len = -1;
  CHECK(ncclParamGet(h, raw, (int)sizeof raw, &len));
  EXPECT(len == (int)strlen(want_text) + 1 && !strcmp(raw, want_text), "ncclParamGet: '%s', %d bytes", raw, len);
  EXPECT(ncclParamGet(h, raw, 2, &len) == ncclInvalidArgument, "ncclParamGet into 2 bytes was not ncclInvalidArgument");
  const char* value = NULL;
  CHECK(ncclParamGetParameter("NCCL_BUFFSIZE", &value, &len));
  EXPECT(value && !strcmp(value, want_text) && len == (int)strlen(want_text), "ncclParamGetParameter: '%s', %d",
         value ? value : "(null)", len);
  const char** keys = NULL;
  int nkeys = 0, found = 0;
  CHECK(ncclParamGetAllParameterKeys(&keys, &nkeys));
  for (int i = 0; i < nkeys; i++) found += keys[i] && (!strcmp(keys[i], "NCCL_BUFFSIZE") || !strcmp(keys[i], "NCCL_DEBUG"));
  EXPECT(nkeys > 10 && found == 2, "%d keys, NCCL_BUFFSIZE and NCCL_DEBUG among them: %d of 2", nkeys, found);
  EXPECT(ncclParamBind(&h, "NCCL_NO_SUCH_PARAMETER") == ncclInvalidArgument, "an unknown key was bound");
  EXPECT(ncclParamGetParameter("NO_SUCH_PARAMETER", &value, &len) == ncclInvalidArgument, "an unknown key was read");
  /* The narrow getters: a value that fits, or ncclInvalidArgument (defaults: NCCL_BUFFSIZE
   * 4 MiB, NCCL_RS_PEER_MAPS 256, NCCL_SOCKET_NTHREADS 1). */
  uint32_t u32 = 0;
  int16_t i16 = 0;
  uint16_t u16 = 0;
  int8_t i8 = 0;
  uint8_t u8 = 0;
  CHECK(ncclParamGetU32(h, &u32));
  EXPECT(u32 == (uint32_t)want, "NCCL_BUFFSIZE as u32: %u", u32);
  EXPECT(ncclParamGetU16(h, &u16) == ncclInvalidArgument && ncclParamGetI8(h, &i8) == ncclInvalidArgument,
         "NCCL_BUFFSIZE (%lld) read into 16 or 8 bits", want);
  if (!getenv("NCCL_RS_PEER_MAPS") && !getenv("NCCL_SOCKET_NTHREADS")) {
    ncclParamHandle_t maps = NULL, threads = NULL;
    CHECK(ncclParamBind(&maps, "NCCL_RS_PEER_MAPS"));
    CHECK(ncclParamBind(&threads, "NCCL_SOCKET_NTHREADS"));
    CHECK(ncclParamGetI16(maps, &i16));
    CHECK(ncclParamGetU16(maps, &u16));
    EXPECT(i16 == 256 && u16 == 256, "NCCL_RS_PEER_MAPS as i16/u16: %d, %u (expected 256)", i16, u16);
    EXPECT(ncclParamGetI8(maps, &i8) == ncclInvalidArgument && ncclParamGetU8(maps, &u8) == ncclInvalidArgument,
           "NCCL_RS_PEER_MAPS (256) read into 8 bits");
    CHECK(ncclParamGetI8(threads, &i8));
    CHECK(ncclParamGetU8(threads, &u8));
    EXPECT(i8 == 1 && u8 == 1, "NCCL_SOCKET_NTHREADS as i8/u8: %d, %u (expected 1)", i8, u8);
  }
  ncclParamDumpAll(); /* one INFO line per parameter (tests/ffi.rs checks them) */
}

/* ncclMemAlloc'd host memory (host mode): page-aligned and zeroed, registered (and as a
 * window), an exact all-reduce in it, deregistered, freed; pointers it did not return are
 * refused. */
static void step_memory(ncclComm_t* comms) {
  if (!begin("memory")) return;
  const size_t count = 100000, bytes = count * sizeof(float);
  void *s[MAX_LOCAL], *r[MAX_LOCAL], *h[MAX_LOCAL][2];
  const uint32_t salt = 0x7100u;
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclMemAlloc(&s[l], bytes));
    CHECK(ncclMemAlloc(&r[l], bytes));
    EXPECT(((uintptr_t)s[l] | (uintptr_t)r[l]) % 4096 == 0, "ncclMemAlloc returned %p and %p: not page-aligned", s[l], r[l]);
    size_t nonzero = 0;
    for (size_t j = 0; j < bytes; j++) nonzero += ((unsigned char*)r[l])[j] != 0;
    EXPECT(nonzero == 0, "ncclMemAlloc memory has %zu non-zero bytes", nonzero);
    CHECK(ncclCommRegister(comms[l], s[l], bytes, &h[l][0]));
    CHECK(ncclCommRegister(comms[l], r[l], bytes, &h[l][1]));
    EXPECT(h[l][0] && h[l][1], "ncclCommRegister handed back a NULL handle");
    fill_values(ncclFloat32, ncclSum, g_env.nranks, g_env.first_rank + l, s[l], 0, count, salt);
  }
  /* Windows (collective registration, in a group): each knows its buffer; collectives on
   * window buffers run as on any other (one-sided operations on them: rma.c). */
  ncclWindow_t win[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommWindowRegister(comms[l], r[l], bytes, &win[l], NCCL_WIN_COLL_SYMMETRIC));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    void* user = NULL;
    CHECK(ncclWinGetUserPtr(comms[l], win[l], &user));
    EXPECT(user == r[l], "ncclWinGetUserPtr: %p, not the registered buffer %p", user, r[l]);
    EXPECT(ncclCommWindowRegister(comms[l], r[l], bytes, &win[l], 0x100) == ncclInvalidArgument, "window flags 0x100 accepted");
  }
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclAllReduce(s[l], r[l], count, ncclFloat32, ncclSum, comms[l], TEST_STREAM));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    check_values("all-reduce in ncclMemAlloc'd, registered memory", ncclFloat32, ncclSum, g_env.nranks, r[l], 0, count,
                 salt, 0);
    CHECK(ncclCommWindowDeregister(comms[l], win[l]));
    EXPECT(ncclCommWindowDeregister(comms[l], win[l]) == ncclInvalidArgument, "a window deregistered twice");
    void* user = NULL;
    EXPECT(ncclWinGetUserPtr(comms[l], win[l], &user) == ncclInvalidArgument, "a deregistered window's buffer was given");
    CHECK(ncclCommDeregister(comms[l], h[l][0]));
    CHECK(ncclCommDeregister(comms[l], h[l][1]));
    CHECK(ncclMemFree(s[l]));
    CHECK(ncclMemFree(r[l]));
    EXPECT(ncclMemFree(s[l]) == ncclInvalidArgument, "a second ncclMemFree of %p was not ncclInvalidArgument", s[l]);
  }
  CHECK(ncclMemFree(NULL));
  void* foreign = NULL;
  EXPECT(posix_memalign(&foreign, 4096, 8192) == 0, "posix_memalign failed");
  EXPECT(ncclMemFree(foreign) == ncclInvalidArgument, "ncclMemFree of memory it did not allocate was accepted");
  free(foreign);
}

/* Suspend (with and without NCCL_SUSPEND_MEM, which frees nothing in host mode) refuses
 * calls until resumed; resuming twice, and unknown flags, are refused. */
/* ncclSetEncryption: plaintext (mode NONE) is what sockets carry anyway; a pre-shared key is
 * not implemented, and says so; a wrong magic is an invalid argument. */
static void step_encryption(void) {
  if (!begin("encryption")) return;
  ncclEncryptionConfig_t cfg = NCCL_ENCRYPTION_CONFIG_INITIALIZER;
  ncclResult_t r = ncclSetEncryption(&cfg);
  EXPECT(r == ncclSuccess, "ncclSetEncryption(mode NONE) -> %s: %s", result_name(r), ncclGetLastError(NULL));
  cfg.mode = NCCL_ENCRYPTION_MODE_PSK;
  cfg.psk = "0123456789abcdef0123456789abcdef";
  r = ncclSetEncryption(&cfg);
  const char* msg = ncclGetLastError(NULL);
  EXPECT(r == ncclInvalidUsage && msg && strstr(msg, "not implemented"),
         "ncclSetEncryption(mode PSK) -> %s (%s), not ncclInvalidUsage saying it is not implemented", result_name(r),
         msg ? msg : "no message");
  cfg.mode = NCCL_ENCRYPTION_MODE_NONE;
  cfg.magic ^= 1;
  r = ncclSetEncryption(&cfg);
  EXPECT(r == ncclInvalidArgument, "ncclSetEncryption with a wrong magic -> %s", result_name(r));
}

static void step_suspend(ncclComm_t* comms) {
  if (!begin("suspend")) return;
  for (int flags = 0; flags <= NCCL_SUSPEND_MEM; flags++) {
    for (int l = 0; l < g_env.local; l++) {
      uint64_t v = 99;
      CHECK(ncclCommSuspend(comms[l], flags));
      CHECK(ncclCommMemStats(comms[l], ncclStatGpuMemSuspended, &v));
      EXPECT(v == 1, "ncclStatGpuMemSuspended %llu while suspended", (unsigned long long)v);
      CHECK(ncclCommMemStats(comms[l], ncclStatGpuMemSuspend, &v));
      EXPECT(v == 0, "host mode: %llu suspendable bytes", (unsigned long long)v);
      int32_t x = 1;
      ncclResult_t r = ncclAllReduce(&x, &x, 1, ncclInt32, ncclSum, comms[l], TEST_STREAM);
      EXPECT(r == ncclInvalidUsage, "an all-reduce on a suspended communicator: %s", result_name(r));
      CHECK(ncclCommResume(comms[l]));
      EXPECT(ncclCommResume(comms[l]) == ncclInvalidUsage, "resuming a communicator that is not suspended was accepted");
    }
    allreduce_check(comms, 0, "all-reduce after ncclCommResume");
  }
  EXPECT(ncclCommSuspend(comms[0], 0x40) == ncclInvalidArgument, "ncclCommSuspend flags 0x40 accepted");
}

static void step_queries(ncclComm_t* comms) {
  if (!begin("queries")) return;
  query_check(comms, "queries");
  allreduce_check(comms, 0, "queries allreduce");
  EXPECT(allreduce_sum_int(comms, 1) == g_env.nranks, "allreduce of 1 per rank != nranks");
  /* After collectives the communicator holds connection buffers: reported, a few MiB per peer. */
  for (int l = 0; l < g_env.local; l++) {
    uint64_t total = 0, persist = 0, suspended = 1;
    CHECK(ncclCommMemStats(comms[l], ncclStatGpuMemTotal, &total));
    CHECK(ncclCommMemStats(comms[l], ncclStatGpuMemPersist, &persist));
    CHECK(ncclCommMemStats(comms[l], ncclStatGpuMemSuspended, &suspended));
    uint64_t peers = (uint64_t)(g_env.nranks - 1);
    EXPECT(peers == 0 || total > 0, "ncclCommMemStats total is 0 after collectives on %d ranks", g_env.nranks);
    EXPECT(total <= peers * 2 * (8u << 20), "ncclCommMemStats total %llu bytes for %llu peers: more than 16 MiB per peer",
           (unsigned long long)total, (unsigned long long)peers);
    EXPECT(persist == total, "persistent %llu != total %llu", (unsigned long long)persist, (unsigned long long)total);
    EXPECT(suspended == 0, "a running communicator reports suspended = %llu", (unsigned long long)suspended);
  }
}

/* PyTorch's watchdog polls ncclCommGetAsyncError from its own thread while the main thread
 * issues collectives. */
typedef struct {
  ncclComm_t* comms;
  atomic_int stop;
  atomic_long polls;
  atomic_long bad;
  ncclResult_t bad_r, bad_state;
} watchdog_t;

static void* watchdog_main(void* arg) {
  watchdog_t* w = arg;
  while (!atomic_load(&w->stop)) {
    for (int l = 0; l < g_env.local; l++) {
      ncclResult_t state = ncclInternalError;
      ncclResult_t r = ncclCommGetAsyncError(w->comms[l], &state);
      if (r != ncclSuccess || state != ncclSuccess) {
        w->bad_r = r;
        w->bad_state = state;
        atomic_fetch_add(&w->bad, 1);
      }
      atomic_fetch_add(&w->polls, 1);
    }
    sched_yield();
  }
  return NULL;
}

static void step_watchdog(ncclComm_t* comms) {
  if (!begin("watchdog")) return;
  watchdog_t w;
  memset(&w, 0, sizeof w);
  w.comms = comms;
  atomic_init(&w.stop, 0);
  atomic_init(&w.polls, 0);
  atomic_init(&w.bad, 0);
  pthread_t t;
  if (pthread_create(&t, NULL, watchdog_main, &w) != 0) {
    EXPECT(0, "pthread_create failed");
    return;
  }
  double deadline = now_s() + 10;
  while (atomic_load(&w.polls) == 0 && now_s() < deadline) sleep_ms(1);
  for (int i = 0; i < 200; i++) allreduce_check(comms, 0, "watchdog allreduce");
  atomic_store(&w.stop, 1);
  pthread_join(t, NULL);
  long polls = atomic_load(&w.polls), bad = atomic_load(&w.bad);
  tlog("watchdog: %ld polls during 200 allreduces", polls);
  EXPECT(polls > 0, "the watchdog thread never polled");
  EXPECT(bad == 0, "%ld polls reported an error (last: call %s, state %s)", bad,
         result_name(w.bad_r), result_name(w.bad_state));
}

/* NCCL's communicators are not thread-safe: one thread at a time. A second thread's call on a
 * communicator that the first holds in its open group is refused (ncclInvalidUsage, saying
 * so), and the group then runs as issued; once it has closed, another thread may take the
 * communicators over. */
typedef struct {
  ncclComm_t* comms;
  ncclResult_t r;
  char msg[512];
} intruder_t;

static void* intruder_main(void* arg) {
  intruder_t* t = arg;
  float junk[4] = {0};
  t->r = ncclAllReduce(junk, junk, 4, ncclFloat32, ncclSum, t->comms[0], TEST_STREAM);
  snprintf(t->msg, sizeof t->msg, "%s", ncclGetLastError(t->comms[0]));
  return NULL;
}

static void* takeover_main(void* arg) {
  allreduce_check(arg, 0, "allreduce from another thread after the group closed");
  return NULL;
}

static void step_threads(ncclComm_t* comms) {
  if (!begin("threads")) return;
  ar_bufs_t b;
  ar_setup(&b, 1000);
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ar_issue(&b, comms[l], l));
  intruder_t t = {comms, ncclSuccess, ""};
  pthread_t th;
  if (pthread_create(&th, NULL, intruder_main, &t) != 0) {
    EXPECT(0, "pthread_create failed");
    CHECK(ncclGroupEnd());
    return;
  }
  test_deadline(30); /* (an intruder let in waits for peers that never make its call) */
  pthread_join(th, NULL);
  test_deadline(0);
  EXPECT(t.r == ncclInvalidUsage, "a second thread's call on a communicator held in an open group -> %s",
         result_name(t.r));
  EXPECT(strstr(t.msg, "one thread at a time") != NULL, "the refusal does not say why: %s", t.msg);
  CHECK(ncclGroupEnd());
  ar_verify_free(&b, "the group of the thread that held the communicators");
  if (pthread_create(&th, NULL, takeover_main, comms) != 0) {
    EXPECT(0, "pthread_create failed");
    return;
  }
  pthread_join(th, NULL);
}

static void step_nested_groups(ncclComm_t* comms) {
  if (!begin("nested-groups")) return;
  ar_bufs_t b;
  ar_setup(&b, 100);
  CHECK(ncclGroupStart());
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ar_issue(&b, comms[l], l));
  CHECK(ncclGroupEnd());
  /* NCCL: nothing is launched until the outermost ncclGroupEnd. */
  EXPECT(ar_untouched(&b), "an inner ncclGroupEnd ran the operations of the outer group");
  CHECK(ncclGroupEnd());
  ar_verify_free(&b, "nested groups");
}

/* Only process 0 simulates (a job may estimate on one rank): the operations it simulated
 * take no place among the communicators' calls, so the next all-reduce still meets the
 * other processes'. */
static void step_simulate(ncclComm_t* comms) {
  if (!begin("group-simulate")) return;
  ar_bufs_t b;
  ar_setup(&b, 4096); /* (everywhere: the next all-reduce's values follow the same salt) */
  if (g_env.proc != 0) {
    for (int l = 0; l < g_env.local; l++) {
      gbuf_free(&b.sb[l]);
      gbuf_free(&b.rb[l]);
    }
    allreduce_check(comms, 0, "allreduce after ncclGroupSimulateEnd");
    return;
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ar_issue(&b, comms[l], l));
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  ncclResult_t r = ncclGroupSimulateEnd(&sim);
  EXPECT(r == ncclSuccess, "ncclGroupSimulateEnd -> %s: %s", result_name(r), ncclGetLastError(NULL));
  EXPECT(sim.estimatedTime >= 0, "ncclGroupSimulateEnd left estimatedTime = %g", (double)sim.estimatedTime);
  tlog("group-simulate: estimatedTime %g", (double)sim.estimatedTime);
  /* NCCL only simulates: the operations are not launched. */
  EXPECT(ar_untouched(&b), "ncclGroupSimulateEnd ran the operations");
  for (int l = 0; l < g_env.local; l++) {
    gbuf_free(&b.sb[l]);
    gbuf_free(&b.rb[l]);
  }
  allreduce_check(comms, 0, "allreduce after ncclGroupSimulateEnd");
}

/* NCCL: an invalid call inside a group fails at once (ncclInvalidArgument), the error is
 * returned again by the outermost ncclGroupEnd, and the whole group is discarded; the
 * communicator stays usable. */
static void step_group_error(ncclComm_t* comms) {
  if (!begin("group-error")) return;
  /* The failed call: a bad datatype, a NULL communicator, a per-collective config with a
   * wrong magic; an ncclCommSplit with a NULL newcomm (splits take part in groups too). */
  for (int bad = 0; bad < 4; bad++) {
    static const char* const what[4] = {"datatype 99", "a NULL communicator", "a config with a wrong magic",
                                        "a split with a NULL newcomm"};
    ar_bufs_t b;
    ar_setup(&b, 64);
    float junk[4] = {0};
    ncclCollConfig_t cfg = NCCL_COLLCONFIG_INITIALIZER;
    cfg.magic ^= 1;
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) CHECK(ar_issue(&b, comms[l], l));
    ncclResult_t r = bad == 0   ? ncclAllReduce(junk, junk, 1, (ncclDataType_t)99, ncclSum, comms[0], TEST_STREAM)
                     : bad == 1 ? ncclAllReduce(junk, junk, 1, ncclFloat32, ncclSum, NULL, TEST_STREAM)
                     : bad == 2 ? ncclAllReduceConfig(junk, junk, 1, ncclFloat32, ncclSum, comms[0], TEST_STREAM, &cfg)
                                : ncclCommSplit(comms[0], 0, 0, NULL, NULL);
    EXPECT(r == ncclInvalidArgument, "a call with %s inside a group -> %s", what[bad], result_name(r));
    r = ncclGroupEnd();
    EXPECT(r == ncclInvalidArgument,
           "ncclGroupEnd after a call with %s failed in the group -> %s (NCCL: ncclInvalidArgument)", what[bad],
           result_name(r));
    EXPECT(ar_untouched(&b), "the valid operations of a group whose call with %s failed were run", what[bad]);
    for (int l = 0; l < g_env.local; l++) {
      gbuf_free(&b.sb[l]);
      gbuf_free(&b.rb[l]);
    }
  }
  allreduce_check(comms, 0, "allreduce after a failed group");
}

/* Waits up to `seconds` for a forked child (killed after): NULL if it exited 0, else "hung" or
 * "failed" (its wait status in `status`). */
static const char* wait_child(pid_t child, double seconds, int* status) {
  double deadline = now_s() + seconds;
  pid_t done = 0;
  while ((done = waitpid(child, status, WNOHANG)) == 0 && now_s() < deadline) sleep_ms(1);
  if (done == 0) kill(child, SIGKILL), waitpid(child, status, 0);
  if (done == 0) return "hung";
  return done == child && WIFEXITED(*status) && WEXITSTATUS(*status) == 0 ? NULL : "failed";
}

/* A child forked after init (PyTorch's DataLoader workers are) inherits the handles, not the
 * communicators: every call on one is ncclInvalidUsage saying so, and ncclCommDestroy and
 * ncclCommAbort succeed and leave the parent's connections and threads alone. The parent's
 * communicators (and every other process's) then still work. */
static void step_fork(ncclComm_t* comms) {
  if (!begin("fork")) return;
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) {
    EXPECT(0, "fork failed");
    return;
  }
  if (child == 0) {
    int bad = 0;
    float x[4] = {1, 2, 3, 4};
    int n = 0;
    ncclResult_t r = ncclAllReduce(x, x, 4, ncclFloat32, ncclSum, comms[0], TEST_STREAM);
    const char* msg = ncclGetLastError(comms[0]);
    bad |= r != ncclInvalidUsage || !msg || !strstr(msg, "fork");
    if (bad) fprintf(stderr, "child: all-reduce on an inherited communicator -> %s: %s\n", result_name(r), msg);
    r = ncclCommCount(comms[0], &n);
    bad |= (r != ncclInvalidUsage) << 1;
    for (int l = 0; l < g_env.local; l++) {
      r = l % 2 ? ncclCommAbort(comms[l]) : ncclCommDestroy(comms[l]);
      bad |= (r != ncclSuccess) << 2;
      if (r != ncclSuccess) fprintf(stderr, "child: destroy/abort -> %s: %s\n", result_name(r), ncclGetLastError(NULL));
    }
    _exit(bad);
  }
  int status = 0;
  const char* how = wait_child(child, 20, &status);
  EXPECT(how == NULL, "the forked child %s (status %#x: bit 0 the all-reduce, 1 ncclCommCount, 2 destroy/abort)", how,
         status);
  allreduce_check(comms, 0, "allreduce after a forked child destroyed its inherited communicators");
}

/* One rank of its own, nonblocking, one all-reduce on it, waited for (with a deadline): 0 if
 * all went well, else which part failed (1: init, 2: the all-reduce, 4: its value, 8: destroy). */
static int nonblocking_alone(void) {
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return 1;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t c = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&c, 1, id, 0, &cfg);
  if ((r != ncclSuccess && r != ncclInProgress) || wait_comm(c) != ncclSuccess) return 1;
  float x[64];
  for (int i = 0; i < 64; i++) x[i] = (float)i;
  r = ncclAllReduce(x, x, 64, ncclFloat32, ncclSum, c, TEST_STREAM);
  if ((r != ncclSuccess && r != ncclInProgress) || wait_comm(c) != ncclSuccess) return 2;
  int bad = x[63] != 63.0f ? 4 : 0;
  return bad | (ncclCommDestroy(c) != ncclSuccess ? 8 : 0);
}

/* Forks a child that runs nonblocking_alone() and waits up to `seconds` for it: NULL if it
 * passed, else "fork failed", "hung" or "failed" (its wait status in `status`). */
static const char* fork_alone(double seconds, int* status) {
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) return "fork failed";
  if (child == 0) _exit(nonblocking_alone());
  return wait_child(child, seconds, status);
}

/* A child forked after its parent ran nonblocking operations makes a communicator of its own
 * and runs nonblocking calls on it (multiprocessing's fork start method does this): they
 * finish. The child inherits the parent's list of idle threads for such calls, not the
 * threads; before, it handed its calls to them, and they stayed in progress for ever. */
static void step_fork_new(void) {
  if (!begin("fork-new")) return;
  EXPECT(nonblocking_alone() == 0, "the parent's nonblocking communicator of one rank");
  int status = 0;
  const char* how = fork_alone(30, &status);
  EXPECT(how == NULL, "the forked child's nonblocking communicator %s (status %#x: bit 0 init, 1 the all-reduce, 2 its "
         "value, 3 destroy)", how, status);
}

/* Threads that keep a communicator busy while the process forks: one polls
 * ncclCommGetAsyncError as fast as it can (PyTorch's watchdog does, every few milliseconds),
 * one runs all-reduces on it. */
typedef struct {
  ncclComm_t comm;
  atomic_int stop, failed;
} busy_t;

static void* busy_polling(void* arg) {
  busy_t* b = arg;
  ncclResult_t st;
  while (!atomic_load(&b->stop))
    if (ncclCommGetAsyncError(b->comm, &st) != ncclSuccess) atomic_store(&b->failed, 1);
  return NULL;
}

static void* busy_reducing(void* arg) {
  busy_t* b = arg;
  float x[256] = {0};
  while (!atomic_load(&b->stop))
    if (ncclAllReduce(x, x, 256, ncclFloat32, ncclSum, b->comm, TEST_STREAM) != ncclSuccess) atomic_store(&b->failed, 1);
  return NULL;
}

/* Children forked while other threads of the parent are inside the library, each making a
 * communicator of its own (multiprocessing's fork start method, under a training loop whose
 * watchdog polls): each finishes. A lock such a thread held at the fork stays held for ever in
 * the child; before, a third of the children hung in their first ncclCommInitRank (the
 * handle table's lock). */
static void step_fork_busy(void) {
  if (!begin("fork-busy")) return;
  busy_t b = {.comm = NULL};
  atomic_init(&b.stop, 0);
  atomic_init(&b.failed, 0);
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  CHECK(ncclCommInitRank(&b.comm, 1, id, 0));
  pthread_t polling, reducing;
  TEST_THREAD(&polling, busy_polling, &b);
  TEST_THREAD(&reducing, busy_reducing, &b);
  int forks = 20, hung = 0, failed = 0, last = 0;
  for (int i = 0; i < forks; i++) {
    sleep_ms(i % 3);
    int status = 0;
    const char* how = fork_alone(10, &status);
    hung += how && !strcmp(how, "hung");
    failed += how && strcmp(how, "hung");
    if (how) last = status;
    if (how) break; /* (one is enough: each hang costs its 10 s) */
  }
  atomic_store(&b.stop, 1);
  pthread_join(polling, NULL);
  pthread_join(reducing, NULL);
  EXPECT(hung == 0 && failed == 0, "of %d children forked while threads were in the library, %d hung and %d failed (the "
         "rest not forked; last status %#x: bit 0 init, 1 the all-reduce, 2 its value, 3 destroy)", forks, hung, failed, last);
  EXPECT(!atomic_load(&b.failed), "the parent's busy threads saw a call fail");
  CHECK(ncclCommDestroy(b.comm));
}

static void step_config_blocking(void) {
  if (!begin("config-blocking")) return;
  ncclComm_t comms[MAX_LOCAL];
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.commName = "lifecycle-blocking";
  ncclResult_t r = make_comms_config("cfg-blocking", comms, &cfg);
  if (!EXPECT(r == ncclSuccess, "blocking ncclCommInitRankConfig -> %s: %s", result_name(r), ncclGetLastError(NULL)))
    return;
  query_check(comms, "config-blocking");
  allreduce_check(comms, 0, "config-blocking allreduce");
  destroy_comms(comms);
}

static void finalize_destroy(ncclComm_t* comms, int nonblocking, const char* what) {
  ncclResult_t r = ncclSuccess;
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t rl = ncclCommFinalize(comms[l]);
    if (rl != ncclSuccess && r == ncclSuccess) r = rl;
  }
  if (g_env.local > 1) {
    ncclResult_t rg = ncclGroupEnd();
    if (rg != ncclSuccess && (r == ncclSuccess || r == ncclInProgress)) r = rg;
  }
  if (nonblocking) r = finish_async(r, comms, g_env.local);
  EXPECT(r == ncclSuccess, "%s: ncclCommFinalize -> %s: %s", what, result_name(r), ncclGetLastError(NULL));
  for (int l = 0; l < g_env.local; l++) {
    r = ncclCommDestroy(comms[l]);
    EXPECT(r == ncclSuccess, "%s: ncclCommDestroy after finalize -> %s", what, result_name(r));
  }
}

/* A nonblocking init in one group with operations on other (nonblocking, ready)
 * communicators: ncclGroupEnd may return ncclInProgress for the init, and the operations run
 * all the same; the new communicator then works. */
static void group_with_init(ncclComm_t* comms, ncclConfig_t* cfg) {
  ncclUniqueId id;
  get_unique_id("group-with-init", &id);
  ncclComm_t fresh[MAX_LOCAL];
  ar_bufs_t b;
  ar_setup(&b, 300);
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t r = ncclCommInitRankConfig(&fresh[l], g_env.nranks, id, g_env.first_rank + l, cfg);
    EXPECT(r == ncclSuccess || r == ncclInProgress, "nonblocking init in a group -> %s", result_name(r));
    r = ar_issue(&b, comms[l], l);
    EXPECT(r == ncclSuccess || r == ncclInProgress, "allreduce in a group with an init -> %s", result_name(r));
  }
  ncclResult_t r = ncclGroupEnd();
  EXPECT(r == ncclSuccess || r == ncclInProgress, "ncclGroupEnd of an init and an allreduce -> %s: %s",
         result_name(r), ncclGetLastError(NULL));
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t s = wait_comm(comms[l]);
    EXPECT(s == ncclSuccess, "the allreduce beside an init -> %s", result_name(s));
  }
  ar_verify_free(&b, "allreduce in a group with a nonblocking init");
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t s = wait_comm(fresh[l]);
    if (!EXPECT(s == ncclSuccess, "init in a group with an allreduce -> %s: %s", result_name(s),
                ncclGetLastError(fresh[l])))
      return;
  }
  allreduce_check(fresh, 1, "allreduce on the communicator made beside an allreduce");
  finalize_destroy(fresh, 1, "group-with-init");
}

static void step_config_nonblocking(void) {
  if (!begin("config-nonblocking")) return;
  ncclComm_t comms[MAX_LOCAL];
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  /* make_comms_config accepts ncclInProgress and polls ncclCommGetAsyncError. */
  ncclResult_t r = make_comms_config("cfg-nonblocking", comms, &cfg);
  if (!EXPECT(r == ncclSuccess, "nonblocking init -> %s: %s", result_name(r), ncclGetLastError(NULL)))
    return;
  query_check(comms, "config-nonblocking");
  for (int i = 0; i < 3; i++) allreduce_check(comms, 1, "nonblocking allreduce");
  group_with_init(comms, &cfg);
  finalize_destroy(comms, 1, "config-nonblocking");
}

static void step_null_config(void) {
  if (!begin("config-null")) return;
  ncclComm_t comms[MAX_LOCAL];
  ncclResult_t r = make_comms_config("cfg-null", comms, NULL);
  if (!EXPECT(r == ncclSuccess, "ncclCommInitRankConfig(config NULL) -> %s: %s", result_name(r),
              ncclGetLastError(NULL)))
    return;
  allreduce_check(comms, 0, "config-null allreduce");
  destroy_comms(comms);
}

/* A program built against an older nccl.h passes a smaller ncclConfig_t: the first `size`
 * bytes of today's layout. It is placed at the very end of a page followed by an
 * inaccessible page, so reading past `size` bytes crashes (reported as this step). */
static ncclConfig_t* old_config(size_t size, unsigned version, int blocking, char** map, size_t* maplen) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  char* m = mmap(NULL, 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED || mprotect(m + pg, pg, PROT_NONE) != 0) {
    fprintf(stderr, "mmap/mprotect failed\n");
    exit(1);
  }
  ncclConfig_t full = NCCL_CONFIG_INITIALIZER;
  full.size = size;
  full.version = version;
  full.blocking = blocking;
  char* p = m + pg - size;
  memcpy(p, &full, size);
  *map = m;
  *maplen = 2 * pg;
  return (ncclConfig_t*)(void*)p;
}

static void step_old_configs(void) {
  if (!begin("config-old-headers")) return;
  EXPECT(sizeof(ncclConfig_t) == 120, "sizeof(ncclConfig_t) = %zu, expected 120", sizeof(ncclConfig_t));
  static const struct {
    size_t size;
    unsigned version;
    int blocking;
    const char* tag;
  } olds[] = {
      {72, 22705, 1, "cfg-2.27"},
      {80, 22809, 1, "cfg-2.28"},
      {96, 23007, 1, "cfg-2.30"},
      {72, 22705, 0, "cfg-2.27-nonblocking"},
  };
  for (size_t i = 0; i < sizeof olds / sizeof olds[0]; i++) {
    char* map;
    size_t maplen;
    ncclConfig_t* cfg = old_config(olds[i].size, olds[i].version, olds[i].blocking, &map, &maplen);
    ncclComm_t comms[MAX_LOCAL];
    tlog("config of %zu bytes, version %u, blocking %d", olds[i].size, olds[i].version, olds[i].blocking);
    ncclResult_t r = make_comms_config(olds[i].tag, comms, cfg);
    if (EXPECT(r == ncclSuccess, "init with a %zu-byte config (version %u) -> %s: %s", olds[i].size,
               olds[i].version, result_name(r), ncclGetLastError(NULL))) {
      allreduce_check(comms, !olds[i].blocking, "allreduce on a communicator from an old config");
      destroy_comms(comms);
    }
    munmap(map, maplen);
  }
}

static void step_bad_magic(void) {
  if (!begin("config-bad-magic")) return;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.magic = 0xdeadbeef;
  cfg.blocking = 1;
  ncclUniqueId id;
  get_unique_id("bad-magic", &id);
  /* Every rank passes the bad config, so a library that checks it late would hang here. */
  test_deadline(30);
  for (int l = 0; l < g_env.local; l++) {
    ncclComm_t c = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&c, g_env.nranks, id, g_env.first_rank + l, &cfg);
    EXPECT(r == ncclInvalidArgument, "ncclCommInitRankConfig with magic 0xdeadbeef -> %s", result_name(r));
  }
  test_deadline(0);
}

static void step_finalize(void) {
  if (!begin("finalize-destroy")) return;
  ncclComm_t comms[MAX_LOCAL];
  make_comms("finalize", comms);
  allreduce_check(comms, 0, "allreduce before finalize");
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommFinalize(comms[l]));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
  /* NCCL rejects a second finalize of the same communicator. */
  test_deadline(30);
  ncclResult_t r = ncclCommFinalize(comms[0]);
  EXPECT(r == ncclInvalidArgument, "second ncclCommFinalize -> %s (NCCL: ncclInvalidArgument)", result_name(r));
  /* Only ncclCommDestroy may follow: an operation is refused, saying so. */
  float junk[4] = {0};
  r = ncclAllReduce(junk, junk, 4, ncclFloat32, ncclSum, comms[0], TEST_STREAM);
  EXPECT(r == ncclInvalidUsage, "ncclAllReduce after ncclCommFinalize -> %s", result_name(r));
  EXPECT(strstr(ncclGetLastError(comms[0]), "finalized") != NULL, "the refusal does not say why: %s",
         ncclGetLastError(comms[0]));
  test_deadline(0);
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommDestroy(comms[l]));
}

static void step_abort(void) {
  if (!begin("abort")) return;
  ncclComm_t comms[MAX_LOCAL];
  make_comms("abort", comms);
  allreduce_check(comms, 0, "allreduce before abort");
  test_deadline(30);
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommAbort(comms[l]));
  test_deadline(0);
}

static void scalable(int nid) {
  ncclUniqueId ids[2];
  for (int i = 0; i < nid; i++) {
    char tag[32];
    snprintf(tag, sizeof tag, "scalable%d-%d", nid, i);
    get_unique_id(tag, &ids[i]);
  }
  ncclComm_t comms[MAX_LOCAL];
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclCommInitRankScalable(&comms[l], g_env.nranks, g_env.first_rank + l, nid, ids, NULL));
  if (g_env.local > 1) CHECK(ncclGroupEnd());
  query_check(comms, nid == 1 ? "scalable with 1 id" : "scalable with 2 ids");
  allreduce_check(comms, 0, "allreduce on a scalable-init communicator");
  destroy_comms(comms);
}

static void step_scalable(void) {
  if (!begin("init-scalable")) return;
  scalable(1);
  if (g_env.nranks >= 2)
    scalable(2);
  else
    tlog("init-scalable: 2 ids need 2 ranks (NCCL: at most one id per rank); skipped");
}

/* NCCL: a unique id serves one communicator; its bootstrap root is gone after init, so
 * reusing it must fail (not hang). With NCCL_COMM_ID every init reuses the same address by
 * design, so the step does not apply. */
static void step_stale_id(void) {
  if (!begin("stale-id")) return;
  if (getenv("NCCL_COMM_ID")) {
    tlog("stale-id: skipped under NCCL_COMM_ID");
    return;
  }
  ncclUniqueId id;
  get_unique_id("stale", &id);
  ncclComm_t comms[MAX_LOCAL];
  init_from_id(id, comms);
  allreduce_check(comms, 0, "allreduce before reusing the id");
  destroy_comms(comms);

  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t calls[MAX_LOCAL];
  test_deadline(60);
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    comms[l] = NULL;
    calls[l] = ncclCommInitRankConfig(&comms[l], g_env.nranks, id, g_env.first_rank + l, &cfg);
  }
  ncclResult_t group = g_env.local > 1 ? ncclGroupEnd() : ncclSuccess;
  double deadline = now_s() + 30;
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t state = calls[l];
    if ((state == ncclSuccess || state == ncclInProgress) && group != ncclSuccess && group != ncclInProgress)
      state = group;
    while ((state == ncclSuccess || state == ncclInProgress) && comms[l]) {
      ncclResult_t st = ncclInProgress;
      ncclResult_t r = ncclCommGetAsyncError(comms[l], &st);
      state = r != ncclSuccess ? r : st;
      if (state != ncclInProgress || now_s() > deadline) break;
      sleep_ms(5);
    }
    EXPECT(state != ncclInProgress, "init with a stale unique id still in progress after 30 s");
    EXPECT(state != ncclSuccess, "init with a stale unique id succeeded");
    tlog("stale-id: rank %d -> %s: %s", g_env.first_rank + l, result_name(state), ncclGetLastError(comms[l]));
    if (comms[l]) ncclCommAbort(comms[l]);
  }
  test_deadline(0);
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  step_version();
  step_params();
  step_encryption();

  ncclComm_t comms[MAX_LOCAL];
  make_comms("", comms);
  step_queries(comms);
  step_watchdog(comms);
  step_threads(comms);
  step_nested_groups(comms);
  step_simulate(comms);
  step_group_error(comms);
  step_fork(comms);
  step_fork_new();
  step_fork_busy();
  step_memory(comms);
  step_suspend(comms);
  destroy_comms(comms);

  step_config_blocking();
  step_config_nonblocking();
  step_null_config();
  step_old_configs();
  step_bad_magic();
  step_finalize();
  step_abort();
  step_scalable();
  step_stale_id();
  return test_finish();
}
