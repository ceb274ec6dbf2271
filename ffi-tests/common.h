/*
 * common.h - shared helpers for the nccl-rs C test programs.
 *
 * The programs use the library exactly as a user would: the public nccl.h, host buffers
 * (host mode: stream = NULL), one process per "proc" and one or more ranks per process.
 *
 * Environment contract (set by tests/ffi.rs, or by hand):
 *   NCCL_TEST_NPROCS   number of processes (default 1)
 *   NCCL_TEST_PROC     index of this process (default 0)
 *   NCCL_TEST_LOCAL    ranks per process (default 1); nranks = NPROCS * LOCAL and this
 *                      process owns ranks PROC*LOCAL .. PROC*LOCAL+LOCAL-1
 *   NCCL_TEST_ID_FILE  path through which process 0 hands out unique ids (needed when
 *                      NPROCS > 1 unless NCCL_COMM_ID is set)
 *   NCCL_TEST_SIGNAL_STORM_US  if set, SIGUSR2 every N µs to a handler without SA_RESTART
 *                      (system calls of any thread may fail with EINTR)
 *   NCCL_TEST_NOFILE   if set, the soft limit on open files is lowered to N at start (the hard
 *                      limit stays: the library may raise the soft one when it runs out)
 *   NCCL_TEST_CLOSE_STDIO  if 1, descriptors 0, 1 and 2 are closed at start (as a daemon's);
 *                      the program's own lines go to copies of stdout and stderr
 *   NCCL_COMM_ID       if set, every process calls ncclGetUniqueId itself (NCCL then gives
 *                      every rank the same id and rank 0 hosts the bootstrap root)
 */
#ifndef NCCL_RS_FFI_TESTS_COMMON_H
#define NCCL_RS_FFI_TESTS_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <nccl.h>
#include <pthread.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MAX_LOCAL 16
#define TEST_STREAM ((cudaStream_t)0)
#define ID_DEADLINE_S 60.0
#define ASYNC_DEADLINE_S 60.0

/* ---- results -------------------------------------------------------------------------- */

/* Exits the process with status 1 when `call` does not return ncclSuccess. */
#define CHECK(call)                                                                  \
  do {                                                                               \
    ncclResult_t check_r_ = (call);                                                  \
    if (check_r_ != ncclSuccess) test_check_fail(__FILE__, __LINE__, #call, check_r_); \
  } while (0)

/* Records a failure (and its message) without exiting, so one run reports every failure. */
#define EXPECT(cond, ...) test_expect((cond) ? 1 : 0, __FILE__, __LINE__, #cond, __VA_ARGS__)

void test_check_fail(const char* file, int line, const char* call, ncclResult_t r);
int test_expect(int ok, const char* file, int line, const char* cond, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Prints "RESULT: N passed, N failed"; returns the process exit status. */
int test_finish(void);
void tlog(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/* The program cannot go on (`what`, with errno's text): says so, with the counts, and exits 1. */
void test_fatal(const char* file, int line, const char* what) __attribute__((noreturn));
/* malloc that is fatal when it fails (a program under a memory limit says why it stopped). */
void* test_alloc(const char* file, int line, size_t bytes);
#define TEST_ALLOC(bytes) test_alloc(__FILE__, __LINE__, (bytes))
/* pthread_create that is fatal when it fails (the step cannot run without the thread). */
void test_thread(const char* file, int line, pthread_t* t, void* (*fn)(void*), void* arg);
#define TEST_THREAD(t, fn, arg) test_thread(__FILE__, __LINE__, (t), (fn), (arg))
const char* result_name(ncclResult_t r);

/* ---- environment, ids, communicators -------------------------------------------------- */

typedef struct {
  int nprocs, proc, local, nranks;
  int first_rank; /* PROC * LOCAL */
  int quick, full;
  const char* only; /* --only NAME: run only the named part (for debugging by hand) */
} test_env_t;

extern test_env_t g_env;

/* Reads the environment contract and the common flags (--quick, --full, --only NAME). */
void test_init(int argc, char** argv);
/* Whether the comma-separated list in environment variable `var` names part `name` (any
 * case): such parts are left out of a run of every part (CUDA_TEST_SKIP, LIFECYCLE_TEST_SKIP). */
int test_skipped(const char* var, const char* name);
double now_s(void);
void sleep_ms(int ms);
/* Polls (every 10 ms, `seconds` at most) until FILE exists (a harness makes it); whether it does. */
int wait_for_file(const char* file, double seconds);
/* Names what the program is doing; a crash (SIGSEGV, SIGABRT, ...) reports the last step. */
void test_step(const char* static_name);
/* Ends the process (reporting the step) if it is still running `seconds` from now, so a
 * call that must not hang fails fast and says where; 0 cancels. */
void test_deadline(unsigned seconds);

/* The unique id for this communicator: `tag` names it ("" for the first one), so a program
 * can create several communicators in sequence. Process 0 creates and publishes it. */
void get_unique_id(const char* tag, ncclUniqueId* id);

/* One communicator per local rank, with ncclCommInitRank / ncclCommInitAll / a group of
 * ncclCommInitRank, as the environment asks. Blocking communicators. */
void make_comms(const char* tag, ncclComm_t* comms);
/* Same through ncclCommInitRankConfig (always one call per local rank, grouped when
 * LOCAL > 1). Returns the result of the init (after polling nonblocking communicators
 * to completion); comms are written even on failure (NULL when NCCL wrote NULL). */
ncclResult_t make_comms_config(const char* tag, ncclComm_t* comms, ncclConfig_t* config);
void destroy_comms(ncclComm_t* comms);

/* Polls ncclCommGetAsyncError until it is not ncclInProgress (deadline ASYNC_DEADLINE_S).
 * Returns the final state, or ncclInProgress if the deadline passed. */
ncclResult_t wait_comm(ncclComm_t comm);
/* For a call on nonblocking communicators: ncclSuccess as is, ncclInProgress -> wait every
 * comm in `comms` (n of them), anything else as is. */
ncclResult_t finish_async(ncclResult_t r, ncclComm_t* comms, int n);
/* The late-peer check of the nonblocking parts: each local rank's communicator (`comms`) but
 * the last rank's still says ncclInProgress; then a barrier on the blocking `world`, which
 * the last rank reaches only before it joins. */
void expect_in_progress_then_barrier(ncclComm_t* comms, ncclComm_t* world);

/* A sum allreduce of one int32 over all ranks (one call per local comm, grouped). */
int allreduce_sum_int(ncclComm_t* comms, int local_value);

/* ---- data types ---------------------------------------------------------------------- */

typedef enum { KIND_SINT, KIND_UINT, KIND_FLOAT } dt_kind_t;

typedef struct {
  ncclDataType_t dt;
  const char* name;
  size_t size;
  dt_kind_t kind;
  int ebits, mbits; /* floats: exponent and stored mantissa bits */
  double sum_limit; /* |partial sums| up to this are exact (or do not overflow) */
} dt_info_t;

#define NUM_DTYPES 12
extern const dt_info_t DT_INFO[NUM_DTYPES];
const dt_info_t* dt_info(ncclDataType_t dt);
const char* op_name(int op);

/* Exact encoding of small values: returns 0 when v is not exactly representable in dt
 * (a test design error, reported as a failure by the callers). */
int dt_store(ncclDataType_t dt, void* buf, size_t idx, double v);
double dt_load(ncclDataType_t dt, const void* buf, size_t idx);

/* ---- exact test values ----------------------------------------------------------------
 * Inputs are small integers (halves for PreMulSum scalars) chosen per datatype and op so
 * every partial result is exact in the datatype, whatever order the library reduces in:
 * the expected value is computed here, in one place, and compared bit for bit. The one
 * exception is ncclAvg on floating types with a non-power-of-two rank count: NCCL computes
 * it as a PreMulSum by 1/nranks rounded to the datatype, so it is compared with a
 * tolerance there (exact for 1, 2, 4, 8 ranks).
 */
#define OP_PREMUL (-2)       /* PreMulSum with per-rank scalar premul_scalar(dt, rank, variant) */
uint32_t hash3(uint32_t a, uint32_t b, uint32_t c);
double input_value(ncclDataType_t dt, int op, int nranks, int rank, size_t j, uint32_t salt);
double premul_scalar(ncclDataType_t dt, int rank, int changed);
/* The exact reduction of input_value over all ranks at index j. For OP_PREMUL `changed`
 * selects which scalar (see premul_scalar) each rank contributed. */
double expected_value(ncclDataType_t dt, int op, int nranks, size_t j, uint32_t salt, int changed);

void fill_values(ncclDataType_t dt, int op, int nranks, int rank, void* buf, size_t j0,
                 size_t count, uint32_t salt);
/* Checks buf[0..count) against expected_value(j0 + i); one EXPECT for the whole region. */
int check_values(const char* what, ncclDataType_t dt, int op, int nranks, const void* buf,
                 size_t j0, size_t count, uint32_t salt, int changed);

/* Opaque byte patterns for data-movement operations: byte k of element j of rank r. */
void fill_bytes(void* buf, size_t elsize, int rank, size_t j0, size_t count, uint32_t salt);
int check_bytes(const char* what, const void* buf, size_t elsize, int rank, size_t j0,
                size_t count, uint32_t salt);

/* ---- guarded buffers ------------------------------------------------------------------
 * GUARD bytes of a known pattern before and after the user region; check_guards() says
 * whether the library wrote outside the buffer it was given. */
#define GUARD 64
typedef struct {
  unsigned char* mem;
  size_t bytes;
} gbuf_t;
void* gbuf_alloc(gbuf_t* b, size_t bytes);
void* gbuf_ptr(const gbuf_t* b);
/* Fills the user region with a recognisable "never written" pattern. */
void gbuf_poison(gbuf_t* b, uint32_t salt);
int gbuf_poison_intact(const gbuf_t* b, uint32_t salt, size_t off, size_t len);
int check_guards(const char* what, const gbuf_t* b);
void gbuf_free(gbuf_t* b);

#endif
