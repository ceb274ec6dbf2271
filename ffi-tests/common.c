/*
 * common.c - shared helpers for the nccl-rs C test programs (see common.h).
 * Linked into every test program; has no main().
 */
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <strings.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

test_env_t g_env;

static int g_passed, g_failed;
static const int MAX_PRINTED_FAILURES = 60;

/* ---- results -------------------------------------------------------------------------- */

const char* result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    case ncclTimeout: return "ncclTimeout";
    default: return "(unknown ncclResult_t)";
  }
}

void tlog(const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  printf("[proc %d] %s\n", g_env.proc, msg);
  fflush(stdout);
}

void test_fatal(const char* file, int line, const char* what) {
  fprintf(stderr, "[proc %d] %s:%d %s: %s\n", g_env.proc, file, line, what, strerror(errno));
  fprintf(stderr, "[proc %d] RESULT: %d passed, %d failed (+1 fatal)\n", g_env.proc, g_passed, g_failed);
  fflush(stdout);
  fflush(stderr);
  exit(1);
}

void* test_alloc(const char* file, int line, size_t bytes) {
  void* p = calloc(1, bytes ? bytes : 1);
  if (!p) test_fatal(file, line, "out of memory");
  return p;
}

void test_thread(const char* file, int line, pthread_t* t, void* (*fn)(void*), void* arg) {
  int e = pthread_create(t, NULL, fn, arg);
  if (e != 0) {
    errno = e;
    test_fatal(file, line, "cannot start a thread");
  }
}

void test_check_fail(const char* file, int line, const char* call, ncclResult_t r) {
  const char* s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(NULL);
  fprintf(stderr, "[proc %d] %s:%d %s -> %d %s: %s\n", g_env.proc, file, line, call, (int)r,
          s ? s : "(null)", last ? last : "(null)");
  fprintf(stderr, "[proc %d] RESULT: %d passed, %d failed (+1 fatal)\n", g_env.proc, g_passed,
          g_failed);
  fflush(stdout);
  fflush(stderr);
  exit(1);
}

int test_expect(int ok, const char* file, int line, const char* cond, const char* fmt, ...) {
  if (ok) {
    g_passed++;
    return 1;
  }
  g_failed++;
  if (g_failed <= MAX_PRINTED_FAILURES) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("[proc %d] FAIL %s:%d (%s): %s\n", g_env.proc, file, line, cond, msg);
  } else if (g_failed == MAX_PRINTED_FAILURES + 1) {
    printf("[proc %d] (further failures are counted, not printed)\n", g_env.proc);
  }
  fflush(stdout);
  return 0;
}

int test_finish(void) {
  printf("[proc %d] RESULT: %d passed, %d failed\n", g_env.proc, g_passed, g_failed);
  fflush(stdout);
  return g_failed ? 1 : 0;
}

/* ---- crash reports -------------------------------------------------------------------- */

static const char* volatile g_step = "start";
static char g_crash_prefix[64];

void test_step(const char* static_name) { g_step = static_name; }

void test_deadline(unsigned seconds) { alarm(seconds); }

/* Where crash lines go: stderr's descriptor (another number under NCCL_TEST_CLOSE_STDIO). */
static int g_err_fd = 2;

static void write_str(const char* s) {
  size_t n = strlen(s);
  while (n > 0) {
    ssize_t w = write(g_err_fd, s, n);
    if (w <= 0) return;
    s += w;
    n -= (size_t)w;
  }
}

/* Async-signal-safe: says which step crashed, then dies of the same signal. */
static void on_crash(int sig) {
  write_str(g_crash_prefix);
  write_str(sig == SIGSEGV   ? "SIGSEGV"
            : sig == SIGBUS  ? "SIGBUS"
            : sig == SIGABRT ? "SIGABRT"
            : sig == SIGFPE  ? "SIGFPE"
            : sig == SIGALRM ? "deadline passed (hang?)"
                             : "SIGILL");
  write_str(" during: ");
  write_str(g_step);
  write_str("\n");
  signal(sig, SIG_DFL);
  raise(sig);
}

/* NCCL_TEST_SIGNAL_STORM_US=N: SIGUSR2 to the process every N µs, from a thread of its own
 * (which blocks it), to a handler installed without SA_RESTART, as Python installs its handlers
 * (and as a profiler's signals come): any other thread of the process, the library's included,
 * may take it, and a blocking system call of that thread then fails with EINTR. The library
 * must carry on. */
static int env_int(const char* name, int dflt);
static void on_storm_signal(int sig) { (void)sig; }

static void* signal_storm(void* arg) {
  const long us = (long)(intptr_t)arg;
  struct timespec every = {us / 1000000, (us % 1000000) * 1000};
  for (;;) {
    nanosleep(&every, NULL);
    kill(getpid(), SIGUSR2);
  }
  return NULL;
}

static void start_signal_storm(void) {
  int us = env_int("NCCL_TEST_SIGNAL_STORM_US", 0);
  if (us <= 0) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_storm_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0; /* no SA_RESTART */
  sigset_t usr2, old;
  sigemptyset(&usr2);
  sigaddset(&usr2, SIGUSR2);
  pthread_t th;
  /* The storm's thread starts with SIGUSR2 blocked (it inherits this mask), the others not. */
  if (sigaction(SIGUSR2, &sa, NULL) != 0 || pthread_sigmask(SIG_BLOCK, &usr2, &old) != 0 ||
      pthread_create(&th, NULL, signal_storm, (void*)(intptr_t)us) != 0 || pthread_sigmask(SIG_SETMASK, &old, NULL) != 0) {
    fprintf(stderr, "signal storm: %s\n", strerror(errno));
    exit(2);
  }
  pthread_detach(th);
  tlog("signal storm: SIGUSR2 every %d us, handler without SA_RESTART", us);
}

static void lower_open_file_limit(void) {
  int n = env_int("NCCL_TEST_NOFILE", 0);
  if (n <= 0) return;
  struct rlimit rl;
  errno = 0;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || (rlim_t)n > rl.rlim_max) {
    fprintf(stderr, "NCCL_TEST_NOFILE=%d: %s\n", n, errno ? strerror(errno) : "above the hard limit");
    exit(2);
  }
  rl.rlim_cur = (rlim_t)n;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    fprintf(stderr, "NCCL_TEST_NOFILE=%d: %s\n", n, strerror(errno));
    exit(2);
  }
  tlog("open-file limit: soft %d, hard %llu", n, (unsigned long long)rl.rlim_max);
}

static void install_crash_handlers(void) {
  snprintf(g_crash_prefix, sizeof g_crash_prefix, "[proc %d] CRASH: ", g_env.proc);
  int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL, SIGALRM};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], on_crash);
}

/* ---- environment -------------------------------------------------------------------- */

static int env_int(const char* name, int dflt) {
  const char* s = getenv(name);
  if (!s || !*s) return dflt;
  char* end;
  long v = strtol(s, &end, 10);
  if (*end) {
    fprintf(stderr, "%s=%s is not an integer\n", name, s);
    exit(2);
  }
  return (int)v;
}

/* NCCL_TEST_CLOSE_STDIO=1: start as a daemon may, with descriptors 0, 1 and 2 closed, so that
 * the next descriptors opened, the library's, would take their numbers. The program's own
 * lines go on through copies of stdout and stderr at other numbers. */
static void close_stdio(void) {
  const char* v = getenv("NCCL_TEST_CLOSE_STDIO");
  if (!v || strcmp(v, "1")) return;
  int out = fcntl(1, F_DUPFD_CLOEXEC, 3), err = fcntl(2, F_DUPFD_CLOEXEC, 3);
  FILE* fout = out < 0 ? NULL : fdopen(out, "w");
  FILE* ferr = err < 0 ? NULL : fdopen(err, "w");
  if (!fout || !ferr) {
    fprintf(stderr, "NCCL_TEST_CLOSE_STDIO: %s\n", strerror(errno));
    exit(2);
  }
  fflush(stdout);
  fflush(stderr);
  close(0);
  close(1);
  close(2);
  stdout = fout;
  stderr = ferr;
  g_err_fd = err;
  setvbuf(stderr, NULL, _IONBF, 0);
}

void test_init(int argc, char** argv) {
  close_stdio();
  setvbuf(stdout, NULL, _IOLBF, 0);
  memset(&g_env, 0, sizeof g_env);
  g_env.nprocs = env_int("NCCL_TEST_NPROCS", 1);
  g_env.proc = env_int("NCCL_TEST_PROC", 0);
  g_env.local = env_int("NCCL_TEST_LOCAL", 1);
  if (g_env.nprocs < 1 || g_env.proc < 0 || g_env.proc >= g_env.nprocs || g_env.local < 1 ||
      g_env.local > MAX_LOCAL) {
    fprintf(stderr, "bad environment: NCCL_TEST_NPROCS=%d NCCL_TEST_PROC=%d NCCL_TEST_LOCAL=%d\n",
            g_env.nprocs, g_env.proc, g_env.local);
    exit(2);
  }
  g_env.nranks = g_env.nprocs * g_env.local;
  g_env.first_rank = g_env.proc * g_env.local;
  install_crash_handlers();
  start_signal_storm();
  lower_open_file_limit();
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) {
      g_env.quick = 1;
    } else if (!strcmp(argv[i], "--full")) {
      g_env.full = 1;
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      g_env.only = argv[++i];
    } else {
      fprintf(stderr, "usage: %s [--quick] [--full] [--only NAME]\n", argv[0]);
      exit(2);
    }
  }
  tlog("pid %d: %d process(es) x %d local rank(s) = %d ranks; my ranks %d..%d%s%s", (int)getpid(),
       g_env.nprocs, g_env.local, g_env.nranks, g_env.first_rank,
       g_env.first_rank + g_env.local - 1, g_env.quick ? " (quick)" : "",
       g_env.full ? " (full)" : "");
}

int test_skipped(const char* var, const char* name) {
  const char* skip = getenv(var);
  size_t n = strlen(name);
  for (const char* p = skip; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
    if (!strncasecmp(p, name, n) && (p[n] == ',' || p[n] == '\0')) return 1;
  return 0;
}

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int wait_for_file(const char* file, double seconds) {
  const double until = now_s() + seconds;
  while (access(file, F_OK) != 0 && now_s() < until) usleep(10000);
  return access(file, F_OK) == 0;
}

void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ---- unique ids ----------------------------------------------------------------------- */

static void id_path(const char* tag, char* out, size_t n) {
  const char* f = getenv("NCCL_TEST_ID_FILE");
  if (tag && *tag)
    snprintf(out, n, "%s.%s", f, tag);
  else
    snprintf(out, n, "%s", f);
}

static void publish_id(const char* path, const ncclUniqueId* id) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) {
    fprintf(stderr, "[proc %d] cannot create %s: %s\n", g_env.proc, tmp, strerror(errno));
    exit(1);
  }
  size_t done = 0;
  while (done < sizeof *id) {
    ssize_t w = write(fd, (const char*)id + done, sizeof *id - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      fprintf(stderr, "[proc %d] cannot write %s: %s\n", g_env.proc, tmp, strerror(errno));
      exit(1);
    }
    done += (size_t)w;
  }
  close(fd);
  if (rename(tmp, path) != 0) {
    fprintf(stderr, "[proc %d] cannot rename %s: %s\n", g_env.proc, tmp, strerror(errno));
    exit(1);
  }
}

static void fetch_id(const char* path, ncclUniqueId* id) {
  double deadline = now_s() + ID_DEADLINE_S;
  for (;;) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0) {
      size_t done = 0;
      while (done < sizeof *id) {
        ssize_t r = read(fd, (char*)id + done, sizeof *id - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        done += (size_t)r;
      }
      close(fd);
      if (done == sizeof *id) return;
    }
    if (now_s() > deadline) {
      fprintf(stderr, "[proc %d] no unique id in %s after %.0f s\n", g_env.proc, path,
              ID_DEADLINE_S);
      exit(1);
    }
    sleep_ms(2);
  }
}

void get_unique_id(const char* tag, ncclUniqueId* id) {
  /* NCCL: with NCCL_COMM_ID set every rank gets the same id from ncclGetUniqueId. */
  if (getenv("NCCL_COMM_ID") || g_env.nprocs == 1) {
    CHECK(ncclGetUniqueId(id));
    return;
  }
  if (!getenv("NCCL_TEST_ID_FILE")) {
    fprintf(stderr, "[proc %d] NCCL_TEST_ID_FILE (or NCCL_COMM_ID) must be set for %d processes\n",
            g_env.proc, g_env.nprocs);
    exit(2);
  }
  char path[4096];
  id_path(tag, path, sizeof path);
  if (g_env.proc == 0) {
    CHECK(ncclGetUniqueId(id));
    publish_id(path, id);
  } else {
    fetch_id(path, id);
  }
}

/* ---- communicators ------------------------------------------------------------------- */

void make_comms(const char* tag, ncclComm_t* comms) {
  ncclUniqueId id;
  if (g_env.local == 1) {
    get_unique_id(tag, &id);
    CHECK(ncclCommInitRank(&comms[0], g_env.nranks, id, g_env.first_rank));
  } else if (g_env.nprocs == 1) {
    CHECK(ncclCommInitAll(comms, g_env.local, NULL));
  } else {
    get_unique_id(tag, &id);
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclCommInitRank(&comms[l], g_env.nranks, id, g_env.first_rank + l));
    CHECK(ncclGroupEnd());
  }
}

ncclResult_t wait_comm(ncclComm_t comm) {
  double deadline = now_s() + ASYNC_DEADLINE_S;
  for (;;) {
    ncclResult_t state = ncclInternalError;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (now_s() > deadline) return ncclInProgress;
    sleep_ms(1);
  }
}

ncclResult_t finish_async(ncclResult_t r, ncclComm_t* comms, int n) {
  if (r != ncclInProgress) return r;
  ncclResult_t out = ncclSuccess;
  for (int i = 0; i < n; i++) {
    if (!comms[i]) continue;
    ncclResult_t s = wait_comm(comms[i]);
    if (s != ncclSuccess && out == ncclSuccess) out = s;
  }
  return out;
}

ncclResult_t make_comms_config(const char* tag, ncclComm_t* comms, ncclConfig_t* config) {
  ncclUniqueId id;
  get_unique_id(tag, &id);
  for (int l = 0; l < g_env.local; l++) comms[l] = NULL;
  ncclResult_t r;
  if (g_env.local == 1) {
    r = ncclCommInitRankConfig(&comms[0], g_env.nranks, id, g_env.first_rank, config);
  } else {
    ncclResult_t first_err = ncclSuccess;
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) {
      ncclResult_t rl =
          ncclCommInitRankConfig(&comms[l], g_env.nranks, id, g_env.first_rank + l, config);
      if (rl != ncclSuccess && rl != ncclInProgress && first_err == ncclSuccess) first_err = rl;
    }
    r = ncclGroupEnd();
    if (first_err != ncclSuccess) return first_err;
  }
  return finish_async(r, comms, g_env.local);
}

void expect_in_progress_then_barrier(ncclComm_t* comms, ncclComm_t* world) {
  const int last = g_env.nranks - 1;
  for (int l = 0; l < g_env.local; l++) {
    if (g_env.first_rank + l == last) continue;
    ncclResult_t state = ncclInternalError;
    CHECK(ncclCommGetAsyncError(comms[l], &state));
    EXPECT(state == ncclInProgress, "rank %d: state %s while the last rank has not joined", g_env.first_rank + l,
           result_name(state));
  }
  EXPECT(allreduce_sum_int(world, 1) == g_env.nranks, "the barrier on the blocking communicator");
}

void destroy_comms(ncclComm_t* comms) {
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclCommDestroy(comms[l]));
    comms[l] = NULL;
  }
}

int allreduce_sum_int(ncclComm_t* comms, int local_value) {
  int32_t send[MAX_LOCAL], recv[MAX_LOCAL];
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    send[l] = local_value;
    recv[l] = -1;
    CHECK(ncclAllReduce(&send[l], &recv[l], 1, ncclInt32, ncclSum, comms[l], TEST_STREAM));
  }
  if (g_env.local > 1) CHECK(ncclGroupEnd());
  return recv[0];
}

/* ---- data types ------------------------------------------------------------------------ */

const dt_info_t DT_INFO[NUM_DTYPES] = {
    {ncclInt8, "int8", 1, KIND_SINT, 0, 0, 127},
    {ncclUint8, "uint8", 1, KIND_UINT, 0, 0, 255},
    {ncclInt32, "int32", 4, KIND_SINT, 0, 0, 8000},
    {ncclUint32, "uint32", 4, KIND_UINT, 0, 0, 8000},
    {ncclInt64, "int64", 8, KIND_SINT, 0, 0, 8000},
    {ncclUint64, "uint64", 8, KIND_UINT, 0, 0, 8000},
    {ncclFloat16, "float16", 2, KIND_FLOAT, 5, 10, 2048},
    {ncclFloat32, "float32", 4, KIND_FLOAT, 8, 23, 8000},
    {ncclFloat64, "float64", 8, KIND_FLOAT, 11, 52, 8000},
    {ncclBfloat16, "bfloat16", 2, KIND_FLOAT, 8, 7, 256},
    {ncclFloat8e4m3, "float8e4m3", 1, KIND_FLOAT, 4, 3, 16},
    {ncclFloat8e5m2, "float8e5m2", 1, KIND_FLOAT, 5, 2, 8},
};

const dt_info_t* dt_info(ncclDataType_t dt) {
  int i = (int)dt;
  if (i < 0 || i >= NUM_DTYPES) {
    fprintf(stderr, "dt_info: bad datatype %d\n", i);
    exit(2);
  }
  return &DT_INFO[i];
}

const char* op_name(int op) {
  switch (op) {
    case ncclSum: return "sum";
    case ncclProd: return "prod";
    case ncclMax: return "max";
    case ncclMin: return "min";
    case ncclAvg: return "avg";
    case OP_PREMUL: return "premulsum";
    default: return "none";
  }
}

/* e4m3 (OCP FP8 "fn"): no infinities, one NaN mantissa at the top exponent. */
static int is_fn(const dt_info_t* t) { return t->dt == ncclFloat8e4m3; }

/* Exact encoding of v into a small IEEE-like format; 0 if v is not representable. */
static int mini_encode(double v, const dt_info_t* t, uint32_t* out) {
  const int eb = t->ebits, mb = t->mbits, bias = (1 << (eb - 1)) - 1;
  uint32_t sign = 0, bits;
  if (signbit(v)) {
    sign = 1;
    v = -v;
  }
  if (isnan(v) || isinf(v)) return 0;
  if (v == 0) {
    bits = 0;
  } else {
    int e;
    double f = frexp(v, &e); /* v = f * 2^e, f in [0.5, 1) */
    int field = e - 1 + bias;
    if (field >= 1) {
      double m = ldexp(2 * f - 1, mb);
      int top = (1 << eb) - 1;
      if (m != floor(m)) return 0;
      if (is_fn(t) ? (field > top || (field == top && (uint32_t)m == (1u << mb) - 1u))
                   : field >= top)
        return 0;
      bits = ((uint32_t)field << mb) | (uint32_t)m;
    } else {
      double m = ldexp(v, bias - 1 + mb); /* subnormal: v / 2^(1 - bias - mb) */
      if (m != floor(m) || m >= (double)(1u << mb)) return 0;
      bits = (uint32_t)m;
    }
  }
  *out = (sign << (eb + mb)) | bits;
  return 1;
}

static double mini_decode(uint32_t b, const dt_info_t* t) {
  const int eb = t->ebits, mb = t->mbits, bias = (1 << (eb - 1)) - 1;
  const uint32_t top = (1u << eb) - 1u, mmask = (1u << mb) - 1u;
  uint32_t sign = (b >> (eb + mb)) & 1u, field = (b >> mb) & top, m = b & mmask;
  double v;
  if (field == 0)
    v = ldexp((double)m, 1 - bias - mb);
  else if (!is_fn(t) && field == top)
    v = m ? NAN : INFINITY;
  else if (is_fn(t) && field == top && m == mmask)
    v = NAN;
  else
    v = ldexp((double)((1u << mb) | m), (int)field - bias - mb);
  return sign ? -v : v;
}

int dt_store(ncclDataType_t dt, void* buf, size_t idx, double v) {
  const dt_info_t* t = dt_info(dt);
  unsigned char* p = (unsigned char*)buf + idx * t->size;
  if (t->kind != KIND_FLOAT) {
    if (v != floor(v)) return 0;
    switch (dt) {
      case ncclInt8: { if (v < -128 || v > 127) return 0; int8_t x = (int8_t)v; memcpy(p, &x, 1); return 1; }
      case ncclUint8: { if (v < 0 || v > 255) return 0; uint8_t x = (uint8_t)v; memcpy(p, &x, 1); return 1; }
      case ncclInt32: { if (fabs(v) > 2e9) return 0; int32_t x = (int32_t)v; memcpy(p, &x, 4); return 1; }
      case ncclUint32: { if (v < 0 || v > 4e9) return 0; uint32_t x = (uint32_t)v; memcpy(p, &x, 4); return 1; }
      case ncclInt64: { if (fabs(v) > 9e15) return 0; int64_t x = (int64_t)v; memcpy(p, &x, 8); return 1; }
      case ncclUint64: { if (v < 0 || v > 9e15) return 0; uint64_t x = (uint64_t)v; memcpy(p, &x, 8); return 1; }
      default: return 0;
    }
  }
  if (dt == ncclFloat32) {
    float x = (float)v;
    if ((double)x != v) return 0;
    memcpy(p, &x, 4);
    return 1;
  }
  if (dt == ncclFloat64) {
    memcpy(p, &v, 8);
    return 1;
  }
  uint32_t bits;
  if (!mini_encode(v, t, &bits)) return 0;
  if (t->size == 2) {
    uint16_t x = (uint16_t)bits;
    memcpy(p, &x, 2);
  } else {
    *p = (unsigned char)bits;
  }
  return 1;
}

double dt_load(ncclDataType_t dt, const void* buf, size_t idx) {
  const dt_info_t* t = dt_info(dt);
  const unsigned char* p = (const unsigned char*)buf + idx * t->size;
  switch (dt) {
    case ncclInt8: { int8_t x; memcpy(&x, p, 1); return x; }
    case ncclUint8: { uint8_t x; memcpy(&x, p, 1); return x; }
    case ncclInt32: { int32_t x; memcpy(&x, p, 4); return x; }
    case ncclUint32: { uint32_t x; memcpy(&x, p, 4); return x; }
    case ncclInt64: { int64_t x; memcpy(&x, p, 8); return (double)x; }
    case ncclUint64: { uint64_t x; memcpy(&x, p, 8); return (double)x; }
    case ncclFloat32: { float x; memcpy(&x, p, 4); return x; }
    case ncclFloat64: { double x; memcpy(&x, p, 8); return x; }
    default: break;
  }
  if (t->size == 2) {
    uint16_t x;
    memcpy(&x, p, 2);
    return mini_decode(x, t);
  }
  return mini_decode(*p, t);
}

/* ---- exact test values --------------------------------------------------------------- */

static uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

uint32_t hash3(uint32_t a, uint32_t b, uint32_t c) {
  return mix32(a * 0x9e3779b9u ^ mix32(b + 0x632be5abu) ^ mix32(c * 0x85ebca6bu + 1u));
}

/* Largest |input| such that every partial result stays exact (see common.h). */
static long value_range(const dt_info_t* t, int op, int nranks) {
  double lim = t->sum_limit;
  if (op == ncclMax || op == ncclMin) return (long)lim; /* no arithmetic: any exact value */
  double div = (double)nranks * (op == OP_PREMUL ? 4.0 : 1.0);
  long r = (long)(lim / div);
  return r < 1 ? 1 : r;
}

double input_value(ncclDataType_t dt, int op, int nranks, int rank, size_t j, uint32_t salt) {
  const dt_info_t* t = dt_info(dt);
  uint32_t h = hash3((uint32_t)rank, (uint32_t)j, salt);
  if (op == ncclProd) {
    /* |v| in {1, 2}; twos only on ranks 0..7, at most 2 per element: |product| <= 4 at any size. */
    double mag = (rank < 8 && ((size_t)rank + j) % 4 == 0) ? 2.0 : 1.0;
    return (t->kind != KIND_UINT && h % 3 == 0) ? -mag : mag;
  }
  /* Beyond 8 ranks only ranks 0..7 contribute (the others add 0), so every partial result
   * stays exactly representable even in fp8; fp8 averages over so many ranks are not exact
   * for any non-zero input, so they average zeros. */
  if (nranks > 8 && rank >= 8) return 0.0;
  if (nranks > 8 && op == ncclAvg && t->sum_limit < 100) return 0.0;
  long r = value_range(t, op, nranks > 8 ? 8 : nranks);
  /* ncclAvg on integers truncates: keep the sums non-negative so truncation == floor. */
  if (t->kind == KIND_UINT || (op == ncclAvg && t->kind == KIND_SINT))
    return (double)(h % (uint32_t)(r + 1));
  return (double)((long)(h % (uint32_t)(2 * r + 1)) - r);
}

double premul_scalar(ncclDataType_t dt, int rank, int changed) {
  if (dt_info(dt)->kind == KIND_FLOAT) return 0.5 * (double)(rank % 3 + 1) + (changed ? 0.5 : 0.0);
  return (double)(rank % 3 + 1) + (changed ? 1.0 : 0.0);
}

double expected_value(ncclDataType_t dt, int op, int nranks, size_t j, uint32_t salt, int changed) {
  double acc = 0;
  for (int r = 0; r < nranks; r++) {
    double v = input_value(dt, op, nranks, r, j, salt);
    if (r == 0 && (op == ncclProd || op == ncclMax || op == ncclMin)) {
      acc = v;
      continue;
    }
    switch (op) {
      case ncclProd: acc *= v; break;
      case ncclMax: acc = v > acc ? v : acc; break;
      case ncclMin: acc = v < acc ? v : acc; break;
      case OP_PREMUL: acc += premul_scalar(dt, r, changed) * v; break;
      default: acc += v; break; /* sum, avg */
    }
  }
  if (op == ncclAvg) {
    acc /= nranks;
    if (dt_info(dt)->kind != KIND_FLOAT) acc = floor(acc); /* sums are >= 0: truncation */
  }
  return acc;
}

void fill_values(ncclDataType_t dt, int op, int nranks, int rank, void* buf, size_t j0,
                 size_t count, uint32_t salt) {
  for (size_t i = 0; i < count; i++) {
    double v = input_value(dt, op, nranks, rank, j0 + i, salt);
    if (!dt_store(dt, buf, i, v)) {
      fprintf(stderr, "test bug: input %g not exact in %s\n", v, dt_info(dt)->name);
      exit(2);
    }
  }
}

static int is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

int check_values(const char* what, ncclDataType_t dt, int op, int nranks, const void* buf,
                 size_t j0, size_t count, uint32_t salt, int changed) {
  const dt_info_t* t = dt_info(dt);
  /* NCCL's float average is a PreMulSum by (1/nranks rounded to dt): inexact unless 2^k. */
  int approx = op == ncclAvg && t->kind == KIND_FLOAT && !is_pow2(nranks);
  size_t bad = 0, first = 0;
  double first_got = 0, first_exp = 0;
  int design_error = 0;
  for (size_t i = 0; i < count; i++) {
    double e = expected_value(dt, op, nranks, j0 + i, salt, changed);
    double got = dt_load(dt, buf, i);
    int ok;
    if (approx) {
      double scale = fabs(e);
      double abs_sum = 0;
      for (int r = 0; r < nranks; r++) abs_sum += fabs(input_value(dt, op, nranks, r, j0 + i, salt));
      if (abs_sum / nranks > scale) scale = abs_sum / nranks;
      double tol = (nranks + 2) * ldexp(1.0, -t->mbits) * scale + ldexp(1.0, -24);
      ok = fabs(got - e) <= tol;
    } else {
      unsigned char want[8];
      if (!dt_store(dt, want, 0, e)) {
        design_error = 1;
        ok = 0;
      } else if (t->kind == KIND_FLOAT && e == 0 && got == 0) {
        ok = 1; /* +0 and -0 */
      } else {
        ok = memcmp(want, (const unsigned char*)buf + i * t->size, t->size) == 0;
      }
    }
    if (!ok) {
      if (!bad) {
        first = i;
        first_got = got;
        first_exp = e;
      }
      bad++;
    }
  }
  return EXPECT(bad == 0, "%s: %zu of %zu elements wrong (%s %s, %d ranks%s); first at [%zu]: got %g, expected %g%s",
                what, bad, count, t->name, op_name(op), nranks, approx ? ", with tolerance" : "",
                first, first_got, first_exp,
                design_error ? " (TEST BUG: expected value not representable)" : "");
}

static unsigned char pattern_byte(int rank, size_t j, size_t k, uint32_t salt) {
  uint32_t h = hash3((uint32_t)rank + 0x1000u, (uint32_t)j, salt ^ (uint32_t)(k / 4) * 0x51ed27u);
  return (unsigned char)(h >> (8 * (k % 4)));
}

void fill_bytes(void* buf, size_t elsize, int rank, size_t j0, size_t count, uint32_t salt) {
  unsigned char* p = (unsigned char*)buf;
  for (size_t i = 0; i < count; i++)
    for (size_t k = 0; k < elsize; k++) p[i * elsize + k] = pattern_byte(rank, j0 + i, k, salt);
}

int check_bytes(const char* what, const void* buf, size_t elsize, int rank, size_t j0,
                size_t count, uint32_t salt) {
  const unsigned char* p = (const unsigned char*)buf;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < count; i++) {
    for (size_t k = 0; k < elsize; k++) {
      if (p[i * elsize + k] != pattern_byte(rank, j0 + i, k, salt)) {
        if (!bad) first = i;
        bad++;
        break;
      }
    }
  }
  return EXPECT(bad == 0, "%s: %zu of %zu elements wrong (data of rank %d from element %zu); first at [%zu]",
                what, bad, count, rank, j0, first);
}

/* ---- guarded buffers ----------------------------------------------------------------- */

static unsigned char guard_byte(size_t i) { return (unsigned char)(0x5a + i * 7); }

static unsigned char poison_byte(size_t i, uint32_t salt) {
  return (unsigned char)(hash3((uint32_t)(i / 4), salt, 0xbeefu) >> (8 * (i % 4)));
}

void* gbuf_alloc(gbuf_t* b, size_t bytes) {
  size_t total = (bytes + 2 * GUARD + 63) / 64 * 64;
  b->mem = aligned_alloc(64, total);
  if (!b->mem) {
    fprintf(stderr, "out of memory (%zu bytes)\n", total);
    exit(1);
  }
  b->bytes = bytes;
  for (size_t i = 0; i < GUARD; i++) {
    b->mem[i] = guard_byte(i);
    b->mem[GUARD + bytes + i] = guard_byte(i + GUARD);
  }
  return b->mem + GUARD;
}

void* gbuf_ptr(const gbuf_t* b) { return b->mem + GUARD; }

void gbuf_poison(gbuf_t* b, uint32_t salt) {
  for (size_t i = 0; i < b->bytes; i++) b->mem[GUARD + i] = poison_byte(i, salt);
}

int gbuf_poison_intact(const gbuf_t* b, uint32_t salt, size_t off, size_t len) {
  for (size_t i = off; i < off + len; i++)
    if (b->mem[GUARD + i] != poison_byte(i, salt)) return 0;
  return 1;
}

int check_guards(const char* what, const gbuf_t* b) {
  size_t before = 0, after = 0;
  for (size_t i = 0; i < GUARD; i++) {
    if (b->mem[i] != guard_byte(i)) before++;
    if (b->mem[GUARD + b->bytes + i] != guard_byte(i + GUARD)) after++;
  }
  return EXPECT(before == 0 && after == 0,
                "%s: library wrote outside the buffer: %zu guard byte(s) changed before, %zu after",
                what, before, after);
}

void gbuf_free(gbuf_t* b) {
  free(b->mem);
  b->mem = NULL;
}
