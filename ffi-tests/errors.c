/*
 * errors.c - every exported function (ncclX and its profiling twin pncclX) called with
 * invalid arguments: the documented error code comes back, never ncclSuccess (except where
 * NCCL itself succeeds, noted below), ncclGetLastError(NULL) names the failing call, and
 * nothing crashes.
 *
 * Expected codes: NULL communicator, NULL pointer, bad datatype, bad op, out-of-range
 * rank/root/peer -> ncclInvalidArgument; ncclGroupEnd without ncclGroupStart ->
 * ncclInvalidUsage. Functions the library may not implement yet (device API, windows,
 * signals, grow/shrink/suspend, parameters, encryption, ...) may instead return
 * ncclInvalidUsage, as every unimplemented function does.
 *
 * The device-API functions are not in nccl.h (NVIDIA declares them in nccl_device/host.h,
 * C++ only); they are declared here with ABI-identical prototypes, under local names bound
 * to the exported symbols, so they cannot clash with any header.
 */
#include "common.h"

#include <string.h>

#define E_OK (1u << ncclSuccess)
#define E_IA (1u << ncclInvalidArgument)
#define E_IU (1u << ncclInvalidUsage)
#define E_UNIMPL (E_IA | E_IU) /* may be unimplemented: ncclInvalidUsage is acceptable */
#define E_SE (1u << ncclSystemError)

/* ---- device API prototypes (nccl_device/host.h, core.h) ------------------------------ */

typedef struct {
  int nRanks, rank, stride;
} test_team_t; /* struct ncclTeam, returned by value */
typedef struct {
  void* mcBasePtr;
} test_multimem_t; /* struct ncclMultimemHandle, passed by value */
struct ncclCommProperties;
struct ncclDevCommRequirements;
struct ncclDevComm;
struct ncclLsaBarrierHandle;
struct ncclGinBarrierHandle;
struct ncclLLA2AHandle;
struct ncclDevResourceRequirements;
struct ncclGinOutboxHandle;
struct ncclGinInboxA2AHandle;

#define DEV_API(ret, name, params)         \
  ret dev_##name params __asm__(#name);    \
  ret dev_p##name params __asm__("p" #name);

DEV_API(ncclResult_t, ncclCommQueryProperties, (ncclComm_t comm, struct ncclCommProperties* props))
DEV_API(ncclResult_t, ncclDevCommCreate,
        (ncclComm_t comm, const struct ncclDevCommRequirements* reqs, struct ncclDevComm* outDevComm))
DEV_API(ncclResult_t, ncclDevCommDestroy, (ncclComm_t comm, const struct ncclDevComm* devComm))
DEV_API(ncclResult_t, ncclGetLsaMultimemDevicePointer, (ncclWindow_t window, size_t offset, void** outPtr))
DEV_API(ncclResult_t, ncclGetMultimemDevicePointer,
        (ncclWindow_t window, size_t offset, test_multimem_t multimem, void** outPtr))
DEV_API(ncclResult_t, ncclGetLsaDevicePointer, (ncclWindow_t window, size_t offset, int lsaRank, void** outPtr))
DEV_API(ncclResult_t, ncclGetPeerDevicePointer, (ncclWindow_t window, size_t offset, int peer, void** outPtr))
DEV_API(ncclResult_t, ncclGetMultimemDeviceLeInfo,
        (ncclWindow_t window, size_t offset, uint32_t* leId, size_t* leOffset))
DEV_API(ncclResult_t, ncclGetCftDeviceLeInfo,
        (ncclWindow_t window, size_t offset, int peerCft, test_team_t cftTeam, uint32_t* leId, size_t* leOffset))
DEV_API(ncclResult_t, ncclGetPeerDeviceLeInfo,
        (ncclWindow_t window, size_t offset, int peerWorld, uint32_t* leId, size_t* leOffset))
DEV_API(test_team_t, ncclTeamWorld, (ncclComm_t comm))
DEV_API(test_team_t, ncclTeamLsa, (ncclComm_t comm))
DEV_API(test_team_t, ncclTeamCft, (ncclComm_t comm, int mode))
DEV_API(test_team_t, ncclTeamCftMultimem, (ncclComm_t comm))
DEV_API(test_team_t, ncclTeamRail, (ncclComm_t comm))
DEV_API(int, ncclTeamRankToWorld, (ncclComm_t comm, test_team_t team, int rank))
DEV_API(int, ncclTeamRankToLsa, (ncclComm_t comm, test_team_t team, int rank))
DEV_API(ncclResult_t, ncclLsaBarrierCreateRequirement,
        (test_team_t team, int nBarriers, struct ncclLsaBarrierHandle* outHandle,
         struct ncclDevResourceRequirements* outReq))
DEV_API(ncclResult_t, ncclGinBarrierCreateRequirement,
        (ncclComm_t comm, test_team_t team, int nBarriers, struct ncclGinBarrierHandle* outHandle,
         struct ncclDevResourceRequirements* outReq))
DEV_API(int, ncclLLA2ACalcSlots, (int maxElts, int maxEltSize))
DEV_API(ncclResult_t, ncclLLA2ACreateRequirement,
        (int nBlocks, int nSlots, struct ncclLLA2AHandle* outHandle, struct ncclDevResourceRequirements* outReq))
DEV_API(ncclResult_t, ncclGinOutboxCreateRequirement,
        (int nBlocks, int size_log2, struct ncclGinOutboxHandle* outHandle, struct ncclDevResourceRequirements* outReq))
DEV_API(ncclResult_t, ncclGinInboxA2ACreateRequirement,
        (test_team_t peers, int nBlocks, int size_log2, struct ncclGinInboxA2AHandle* outHandle,
         struct ncclDevResourceRequirements* outReq))
/* NVIDIA's nccl.h declares ncclResetDebugInit only under NCCL_OS_LINUX (and deprecated);
 * ncclResetDebugInitInternal has no profiling twin. */
DEV_API(void, ncclResetDebugInit, (void))
void dev_ncclResetDebugInitInternal(void) __asm__("ncclResetDebugInitInternal");

/* ---- checking ------------------------------------------------------------------------ */

static int g_calls;

static const char* expect_names(unsigned mask) {
  if (mask == E_OK) return "ncclSuccess";
  if (mask == E_IA) return "ncclInvalidArgument";
  if (mask == E_IU) return "ncclInvalidUsage";
  if (mask == E_SE) return "ncclSystemError";
  if (mask == E_UNIMPL) return "ncclInvalidArgument (or ncclInvalidUsage if unimplemented)";
  return "ncclSuccess, ncclInvalidArgument or ncclInvalidUsage";
}

static void check_rc(const char* name, const char* args, ncclResult_t r, unsigned expect) {
  g_calls++;
  int ok = (unsigned)r < 32u && (expect & (1u << (unsigned)r));
  EXPECT(ok, "%s(%s) -> %d %s; expected %s", name, args, (int)r, result_name(r), expect_names(expect));
  if (r == ncclSuccess || r == ncclInProgress) return;
  /* The library prefixes each message with the call's name; the p-twin shares the body. */
  const char* base = name[0] == 'p' ? name + 1 : name;
  const char* msg = ncclGetLastError(NULL);
  EXPECT(msg && msg[0], "%s(%s): ncclGetLastError(NULL) is empty after an error", name, args);
  EXPECT(msg && strstr(msg, base), "%s(%s): ncclGetLastError(NULL) = \"%s\" does not name %s", name, args,
         msg ? msg : "(null)", base);
}

/* Calls ncclX(args) and pncclX(args); the arguments are evaluated for each call. */
#define TRY(expect, fn, ...)                                           \
  do {                                                                 \
    test_step(#fn);                                                    \
    check_rc(#fn, #__VA_ARGS__, fn(__VA_ARGS__), expect);              \
    test_step("p" #fn);                                                \
    check_rc("p" #fn, #__VA_ARGS__, p##fn(__VA_ARGS__), expect);       \
  } while (0)

/* For the device API: dev_ncclX / dev_pncclX. */
#define TRY_DEV(expect, fn, ...)                                       \
  do {                                                                 \
    test_step(#fn);                                                    \
    check_rc(#fn, #__VA_ARGS__, dev_##fn(__VA_ARGS__), expect);        \
    test_step("p" #fn);                                                \
    check_rc("p" #fn, #__VA_ARGS__, dev_p##fn(__VA_ARGS__), expect);   \
  } while (0)

/* ---- the calls -------------------------------------------------------------------------- */

static ncclComm_t g_comm;
static unsigned char g_sbuf[1 << 16], g_rbuf[1 << 16];
#define SB ((void*)g_sbuf)
#define RB ((void*)g_rbuf)
#define S TEST_STREAM

static void bad_datatypes(void) {
  const ncclDataType_t bad[] = {(ncclDataType_t)99, (ncclDataType_t)-1, ncclNumTypes};
  ncclComm_t c = g_comm;
  ncclRedOp_t op;
  float scalar = 1;
  for (int i = 0; i < 3; i++) {
    ncclDataType_t dt = bad[i];
    TRY(E_IA, ncclAllReduce, SB, RB, 1, dt, ncclSum, c, S);
    TRY(E_IA, ncclAllReduceConfig, SB, RB, 1, dt, ncclSum, c, S, NULL);
    TRY(E_IA, ncclBroadcast, SB, RB, 1, dt, 0, c, S);
    TRY(E_IA, ncclBroadcastConfig, SB, RB, 1, dt, 0, c, S, NULL);
    TRY(E_IA, ncclBcast, RB, 1, dt, 0, c, S);
    TRY(E_IA, ncclReduce, SB, RB, 1, dt, ncclSum, 0, c, S);
    TRY(E_IA, ncclReduceConfig, SB, RB, 1, dt, ncclSum, 0, c, S, NULL);
    TRY(E_IA, ncclAllGather, SB, RB, 1, dt, c, S);
    TRY(E_IA, ncclAllGatherConfig, SB, RB, 1, dt, c, S, NULL);
    TRY(E_IA, ncclReduceScatter, SB, RB, 1, dt, ncclSum, c, S);
    TRY(E_IA, ncclReduceScatterConfig, SB, RB, 1, dt, ncclSum, c, S, NULL);
    TRY(E_IA, ncclAlltoAll, SB, RB, 1, dt, c, S);
    TRY(E_IA, ncclAlltoAllConfig, SB, RB, 1, dt, c, S, NULL);
    TRY(E_IA, ncclGather, SB, RB, 1, dt, 0, c, S);
    TRY(E_IA, ncclGatherConfig, SB, RB, 1, dt, 0, c, S, NULL);
    TRY(E_IA, ncclScatter, SB, RB, 1, dt, 0, c, S);
    TRY(E_IA, ncclScatterConfig, SB, RB, 1, dt, 0, c, S, NULL);
    TRY(E_IA, ncclSend, SB, 1, dt, 0, c, S);
    TRY(E_IA, ncclRecv, RB, 1, dt, 0, c, S);
    TRY(E_IA, ncclRedOpCreatePreMulSum, &op, &scalar, dt, ncclScalarHostImmediate, c);
  }
}

static void bad_ops(void) {
  /* ncclNumOps is the first dynamic op value: not created on this communicator. */
  const ncclRedOp_t bad[] = {(ncclRedOp_t)99, (ncclRedOp_t)-1, ncclNumOps, ncclMaxRedOp};
  ncclComm_t c = g_comm;
  for (int i = 0; i < 4; i++) {
    ncclRedOp_t op = bad[i];
    TRY(E_IA, ncclAllReduce, SB, RB, 1, ncclFloat32, op, c, S);
    TRY(E_IA, ncclAllReduceConfig, SB, RB, 1, ncclFloat32, op, c, S, NULL);
    TRY(E_IA, ncclReduce, SB, RB, 1, ncclFloat32, op, 0, c, S);
    TRY(E_IA, ncclReduceConfig, SB, RB, 1, ncclFloat32, op, 0, c, S, NULL);
    TRY(E_IA, ncclReduceScatter, SB, RB, 1, ncclFloat32, op, c, S);
    TRY(E_IA, ncclReduceScatterConfig, SB, RB, 1, ncclFloat32, op, c, S, NULL);
  }
  float scalar = 2;
  /* NCCL: builtin ops cannot be destroyed; unknown ops are rejected. */
  TRY(E_IA, ncclRedOpDestroy, ncclSum, c);
  TRY(E_IA, ncclRedOpDestroy, ncclAvg, c);
  TRY(E_IA, ncclRedOpDestroy, (ncclRedOp_t)12345, c);
  TRY(E_IA, ncclRedOpDestroy, (ncclRedOp_t)-1, c);
  TRY(E_IA, ncclRedOpCreatePreMulSum, NULL, &scalar, ncclFloat32, ncclScalarHostImmediate, c);
  ncclRedOp_t op;
  TRY(E_IA, ncclRedOpCreatePreMulSum, &op, NULL, ncclFloat32, ncclScalarHostImmediate, c);
  TRY(E_IA, ncclRedOpCreatePreMulSum, &op, &scalar, ncclFloat32, (ncclScalarResidence_t)99, c);
  TRY(E_IA, ncclRedOpCreatePreMulSum, &op, &scalar, ncclFloat32, ncclScalarHostImmediate, NULL);
  /* A created op is destroyed once; a second destroy is rejected. */
  test_step("ncclRedOpCreatePreMulSum (valid)");
  CHECK(ncclRedOpCreatePreMulSum(&op, &scalar, ncclFloat32, ncclScalarHostImmediate, c));
  TRY(E_IA, ncclRedOpDestroy, op, NULL);
  CHECK(ncclRedOpDestroy(op, c));
  test_step("ncclRedOpDestroy (twice)");
  check_rc("ncclRedOpDestroy", "op, c (second time)", ncclRedOpDestroy(op, c), E_IA);
}

static void bad_ranks(void) {
  const int n = g_env.nranks;
  const int bad[] = {n, -1, 1 << 30};
  ncclComm_t c = g_comm;
  for (int i = 0; i < 3; i++) {
    int root = bad[i];
    TRY(E_IA, ncclBroadcast, SB, RB, 1, ncclFloat32, root, c, S);
    TRY(E_IA, ncclBroadcastConfig, SB, RB, 1, ncclFloat32, root, c, S, NULL);
    TRY(E_IA, ncclBcast, RB, 1, ncclFloat32, root, c, S);
    TRY(E_IA, ncclReduce, SB, RB, 1, ncclFloat32, ncclSum, root, c, S);
    TRY(E_IA, ncclReduceConfig, SB, RB, 1, ncclFloat32, ncclSum, root, c, S, NULL);
    TRY(E_IA, ncclGather, SB, RB, 1, ncclFloat32, root, c, S);
    TRY(E_IA, ncclGatherConfig, SB, RB, 1, ncclFloat32, root, c, S, NULL);
    TRY(E_IA, ncclScatter, SB, RB, 1, ncclFloat32, root, c, S);
    TRY(E_IA, ncclScatterConfig, SB, RB, 1, ncclFloat32, root, c, S, NULL);
    TRY(E_IA, ncclSend, SB, 1, ncclFloat32, root, c, S);
    TRY(E_IA, ncclRecv, RB, 1, ncclFloat32, root, c, S);
  }
}

static void null_comm(void) {
  ncclComm_t c = NULL;
  int x;
  ncclResult_t st;
  TRY(E_IA, ncclAllReduce, SB, RB, 1, ncclFloat32, ncclSum, c, S);
  TRY(E_IA, ncclAllReduceConfig, SB, RB, 1, ncclFloat32, ncclSum, c, S, NULL);
  TRY(E_IA, ncclBroadcast, SB, RB, 1, ncclFloat32, 0, c, S);
  TRY(E_IA, ncclBroadcastConfig, SB, RB, 1, ncclFloat32, 0, c, S, NULL);
  TRY(E_IA, ncclBcast, RB, 1, ncclFloat32, 0, c, S);
  TRY(E_IA, ncclReduce, SB, RB, 1, ncclFloat32, ncclSum, 0, c, S);
  TRY(E_IA, ncclReduceConfig, SB, RB, 1, ncclFloat32, ncclSum, 0, c, S, NULL);
  TRY(E_IA, ncclAllGather, SB, RB, 1, ncclFloat32, c, S);
  TRY(E_IA, ncclAllGatherConfig, SB, RB, 1, ncclFloat32, c, S, NULL);
  TRY(E_IA, ncclReduceScatter, SB, RB, 1, ncclFloat32, ncclSum, c, S);
  TRY(E_IA, ncclReduceScatterConfig, SB, RB, 1, ncclFloat32, ncclSum, c, S, NULL);
  TRY(E_IA, ncclAlltoAll, SB, RB, 1, ncclFloat32, c, S);
  TRY(E_IA, ncclAlltoAllConfig, SB, RB, 1, ncclFloat32, c, S, NULL);
  TRY(E_IA, ncclGather, SB, RB, 1, ncclFloat32, 0, c, S);
  TRY(E_IA, ncclGatherConfig, SB, RB, 1, ncclFloat32, 0, c, S, NULL);
  TRY(E_IA, ncclScatter, SB, RB, 1, ncclFloat32, 0, c, S);
  TRY(E_IA, ncclScatterConfig, SB, RB, 1, ncclFloat32, 0, c, S, NULL);
  TRY(E_IA, ncclSend, SB, 1, ncclFloat32, 0, c, S);
  TRY(E_IA, ncclRecv, RB, 1, ncclFloat32, 0, c, S);
  TRY(E_IA, ncclCommCount, c, &x);
  TRY(E_IA, ncclCommCuDevice, c, &x);
  TRY(E_IA, ncclCommUserRank, c, &x);
  TRY(E_IA, ncclCommGetAsyncError, c, &st);
  ncclComm_t newcomm;
  TRY(E_UNIMPL, ncclCommSplit, c, 0, 0, &newcomm, NULL);
  /* NCCL returns ncclSuccess for a NULL communicator here (cleanup paths rely on it;
   * checked with NVIDIA's 2.32.3 library). */
  TRY(E_OK, ncclCommDestroy, c);
  TRY(E_OK, ncclCommAbort, c);
  TRY(E_OK, ncclCommFinalize, c);
}

static void null_outputs(void) {
  ncclComm_t c = g_comm;
  TRY(E_IA, ncclGetVersion, NULL);
  TRY(E_IA, ncclGetUniqueId, NULL);
  TRY(E_IA, ncclCommCount, c, NULL);
  TRY(E_IA, ncclCommCuDevice, c, NULL);
  TRY(E_IA, ncclCommUserRank, c, NULL);
  TRY(E_IA, ncclCommGetAsyncError, c, NULL);
  TRY(E_UNIMPL, ncclCommSplit, c, 0, 0, NULL, NULL);
}

static void bad_init(void) {
  ncclUniqueId id;
  test_step("ncclGetUniqueId");
  CHECK(ncclGetUniqueId(&id));
  ncclComm_t newcomm = NULL;
  ncclComm_t comms[2];
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  /* Each is rejected before any connection is attempted (else these would hang). */
  test_deadline(60);
  TRY(E_IA, ncclCommInitRank, NULL, 1, id, 0);
  TRY(E_IA, ncclCommInitRank, &newcomm, 0, id, 0);
  TRY(E_IA, ncclCommInitRank, &newcomm, -1, id, 0);
  TRY(E_IA, ncclCommInitRank, &newcomm, 2, id, 2);
  TRY(E_IA, ncclCommInitRank, &newcomm, 2, id, -1);
  TRY(E_IA, ncclCommInitRankConfig, NULL, 1, id, 0, &cfg);
  TRY(E_IA, ncclCommInitRankConfig, &newcomm, 0, id, 0, &cfg);
  TRY(E_IA, ncclCommInitRankConfig, &newcomm, 2, id, 5, NULL);
  cfg.magic = 0x12345678;
  TRY(E_IA, ncclCommInitRankConfig, &newcomm, 1, id, 0, &cfg);
  cfg = (ncclConfig_t)NCCL_CONFIG_INITIALIZER;
  TRY(E_IA, ncclCommInitAll, NULL, 1, NULL);
  TRY(E_IA, ncclCommInitAll, comms, -1, NULL);
  /* A count past any machine's GPUs (before: 2^30 communicators were made, and the process
   * was killed for memory). */
  TRY(E_IA, ncclCommInitAll, comms, 1 << 30, NULL);
  TRY(E_IA, ncclCommInitAll, comms, 2, (const int[]){0, -1});
  TRY(E_IA, ncclCommInitRankScalable, NULL, 1, 0, 1, &id, NULL);
  TRY(E_IA, ncclCommInitRankScalable, &newcomm, 1, 0, 0, &id, NULL);
  TRY(E_IA, ncclCommInitRankScalable, &newcomm, 1, 0, 1, NULL, NULL);
  TRY(E_IA, ncclCommInitRankScalable, &newcomm, 1, 3, 1, &id, NULL);
  test_deadline(0);
}

static void groups(void) {
  /* NCCL: "ncclGroupEnd: not in a group call." (these group checks behave the same with
   * NVIDIA's 2.32.3 library, checked without a GPU). */
  test_step("ncclGroupEnd");
  check_rc("ncclGroupEnd", "", ncclGroupEnd(), E_IU);
  test_step("pncclGroupEnd");
  check_rc("pncclGroupEnd", "", pncclGroupEnd(), E_IU);
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  TRY(E_IU, ncclGroupSimulateEnd, &sim);
  /* A simInfo not made with NCCL_SIM_INFO_INITIALIZER is rejected, and the group is over
   * (NCCL leaves the group before it checks the simInfo). */
  sim.magic = 0;
  test_step("ncclGroupSimulateEnd (bad magic)");
  CHECK(ncclGroupStart());
  check_rc("ncclGroupSimulateEnd", "&sim (magic 0)", ncclGroupSimulateEnd(&sim), E_IA);
  CHECK(pncclGroupStart());
  check_rc("pncclGroupSimulateEnd", "&sim (magic 0)", pncclGroupSimulateEnd(&sim), E_IA);
  /* The group depth is back to zero: another ncclGroupEnd is an error again. */
  test_step("ncclGroupEnd (after simulate)");
  check_rc("ncclGroupEnd", "", ncclGroupEnd(), E_IU);
}

/* Functions that may not be implemented yet: ncclInvalidArgument or ncclInvalidUsage. */
static void optional_api(void) {
  ncclComm_t c = g_comm;
  void* handle = NULL;
  void* ptr = NULL;
  ncclWindow_t win = NULL;
  ncclUniqueId id;
  ncclComm_t newcomm = NULL;
  uint64_t v64 = 0;
  int excl[1] = {0};
  TRY(E_UNIMPL, ncclCommRegister, NULL, SB, 64, &handle);
  TRY(E_UNIMPL, ncclCommRegister, c, SB, 64, NULL);
  TRY(E_UNIMPL, ncclCommDeregister, NULL, handle);
  TRY(E_UNIMPL, ncclCommWindowRegister, NULL, SB, 4096, &win, NCCL_WIN_DEFAULT);
  TRY(E_UNIMPL, ncclCommWindowRegister, c, SB, 4096, NULL, NCCL_WIN_DEFAULT);
  TRY(E_UNIMPL, ncclCommWindowDeregister, NULL, win);
  TRY(E_UNIMPL, ncclWinGetUserPtr, NULL, win, &ptr);
  TRY(E_UNIMPL, ncclWinGetUserPtr, c, NULL, &ptr);
  TRY(E_UNIMPL, ncclCommGetUniqueId, NULL, &id);
  TRY(E_UNIMPL, ncclCommGetUniqueId, c, NULL);
  TRY(E_UNIMPL, ncclCommGrow, NULL, 2, NULL, -1, &newcomm, NULL);
  TRY(E_UNIMPL, ncclCommGrow, c, 2, NULL, -1, NULL, NULL);
  TRY(E_UNIMPL, ncclCommShrink, NULL, excl, 1, &newcomm, NULL, NCCL_SHRINK_DEFAULT);
  TRY(E_UNIMPL, ncclCommShrink, c, excl, 1, NULL, NULL, NCCL_SHRINK_DEFAULT);
  TRY(E_UNIMPL, ncclCommSuspend, NULL, NCCL_SUSPEND_MEM);
  TRY(E_UNIMPL, ncclCommResume, NULL);
  /* NVIDIA's 2.32.3 returns ncclSuccess for these two (checked without a GPU). */
  TRY(E_OK | E_UNIMPL, ncclCommRevoke, NULL, NCCL_REVOKE_DEFAULT);
  TRY(E_UNIMPL, ncclCommMemStats, NULL, ncclStatGpuMemTotal, &v64);
  TRY(E_UNIMPL, ncclCommMemStats, c, ncclStatGpuMemTotal, NULL);
  TRY(E_UNIMPL, ncclMemAlloc, NULL, 64);
  /* NCCL's ncclMemFree(NULL) may succeed like free(NULL); it must not crash. */
  TRY(E_OK | E_UNIMPL, ncclMemFree, NULL);
  TRY(E_OK | E_UNIMPL, ncclSetEncryption, NULL);
  TRY(E_UNIMPL, ncclPutSignal, SB, 1, ncclFloat32, 0, NULL, 0, 0, 0, 0, NULL, S);
  TRY(E_UNIMPL, ncclPutSignal, SB, 1, ncclFloat32, 0, NULL, 0, 0, 0, 0, c, S);
  TRY(E_UNIMPL, ncclSignal, 0, 0, 0, 0, NULL, S);
  TRY(E_UNIMPL, ncclWaitSignal, 1, NULL, NULL, S);
  TRY(E_UNIMPL, ncclWaitSignal, 1, NULL, c, S);

  ncclParamHandle_t h = NULL;
  int8_t i8;
  int16_t i16;
  int32_t i32;
  int64_t i64;
  uint8_t u8;
  uint16_t u16;
  uint32_t u32;
  uint64_t u64;
  const char* str = NULL;
  int len = 0;
  char raw[64];
  TRY(E_UNIMPL, ncclParamBind, NULL, "NCCL_DEBUG");
  TRY(E_UNIMPL, ncclParamBind, &h, NULL);
  TRY(E_UNIMPL, ncclParamGetI8, NULL, &i8);
  TRY(E_UNIMPL, ncclParamGetI16, NULL, &i16);
  TRY(E_UNIMPL, ncclParamGetI32, NULL, &i32);
  TRY(E_UNIMPL, ncclParamGetI64, NULL, &i64);
  TRY(E_UNIMPL, ncclParamGetU8, NULL, &u8);
  TRY(E_UNIMPL, ncclParamGetU16, NULL, &u16);
  TRY(E_UNIMPL, ncclParamGetU32, NULL, &u32);
  TRY(E_UNIMPL, ncclParamGetU64, NULL, &u64);
  TRY(E_UNIMPL, ncclParamGetStr, NULL, &str);
  TRY(E_UNIMPL, ncclParamGet, NULL, raw, (int)sizeof raw, &len);
  TRY(E_UNIMPL, ncclParamGetParameter, NULL, &str, &len);
  TRY(E_UNIMPL, ncclParamGetAllParameterKeys, NULL, &len);
}

static void device_api(void) {
  ncclComm_t c = g_comm;
  unsigned char props[4096] = {0}; /* larger than ncclCommProperties_t */
  void* ptr = NULL;
  uint32_t le = 0;
  size_t leoff = 0;
  test_multimem_t mm = {NULL};
  test_team_t team = {1, 0, 1};
  TRY_DEV(E_UNIMPL, ncclCommQueryProperties, NULL, (struct ncclCommProperties*)(void*)props);
  TRY_DEV(E_UNIMPL, ncclCommQueryProperties, c, NULL);
  TRY_DEV(E_UNIMPL, ncclDevCommCreate, NULL, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclDevCommCreate, c, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclDevCommDestroy, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclGetLsaMultimemDevicePointer, NULL, 0, &ptr);
  TRY_DEV(E_UNIMPL, ncclGetMultimemDevicePointer, NULL, 0, mm, &ptr);
  TRY_DEV(E_UNIMPL, ncclGetLsaDevicePointer, NULL, 0, 0, &ptr);
  TRY_DEV(E_UNIMPL, ncclGetPeerDevicePointer, NULL, 0, 0, &ptr);
  TRY_DEV(E_UNIMPL, ncclGetMultimemDeviceLeInfo, NULL, 0, &le, &leoff);
  TRY_DEV(E_UNIMPL, ncclGetCftDeviceLeInfo, NULL, 0, 0, team, &le, &leoff);
  TRY_DEV(E_UNIMPL, ncclGetPeerDeviceLeInfo, NULL, 0, 0, &le, &leoff);
  TRY_DEV(E_UNIMPL, ncclLsaBarrierCreateRequirement, team, 1, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclGinBarrierCreateRequirement, NULL, team, 1, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclLLA2ACreateRequirement, 1, 1, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclGinOutboxCreateRequirement, 1, 10, NULL, NULL);
  TRY_DEV(E_UNIMPL, ncclGinInboxA2ACreateRequirement, team, 1, 10, NULL, NULL);

  /* No result code: these only must not crash (NULL and a real communicator). */
  ncclComm_t comms[2] = {NULL, c};
  for (int i = 0; i < 2; i++) {
    test_step("ncclTeam*");
    test_team_t w = dev_ncclTeamWorld(comms[i]);
    test_team_t pw = dev_pncclTeamWorld(comms[i]);
    (void)dev_ncclTeamLsa(comms[i]);
    (void)dev_pncclTeamLsa(comms[i]);
    (void)dev_ncclTeamCft(comms[i], 0);
    (void)dev_pncclTeamCft(comms[i], 0);
    (void)dev_ncclTeamCftMultimem(comms[i]);
    (void)dev_pncclTeamCftMultimem(comms[i]);
    (void)dev_ncclTeamRail(comms[i]);
    (void)dev_pncclTeamRail(comms[i]);
    int rw = dev_ncclTeamRankToWorld(comms[i], w, 0) + dev_pncclTeamRankToWorld(comms[i], w, 0);
    int rl = dev_ncclTeamRankToLsa(comms[i], w, 0) + dev_pncclTeamRankToLsa(comms[i], w, 0);
    tlog("ncclTeamWorld(%s) = {%d, %d, %d} (p: {%d, %d, %d}); rank sums %d %d", i ? "comm" : "NULL",
         w.nRanks, w.rank, w.stride, pw.nRanks, pw.rank, pw.stride, rw, rl);
    EXPECT(w.nRanks == pw.nRanks && w.rank == pw.rank && w.stride == pw.stride,
           "ncclTeamWorld and pncclTeamWorld differ");
  }
  test_step("ncclLLA2ACalcSlots");
  tlog("ncclLLA2ACalcSlots(16, 8) = %d, (-1, -1) = %d", dev_ncclLLA2ACalcSlots(16, 8),
       dev_pncclLLA2ACalcSlots(-1, -1));
  test_step("ncclResetDebugInit");
  dev_ncclResetDebugInit();
  dev_pncclResetDebugInit();
  test_step("ncclResetDebugInitInternal");
  dev_ncclResetDebugInitInternal();
  test_step("ncclParamDumpAll");
  ncclParamDumpAll();
  pncclParamDumpAll();
}

/* A count no host can hold scratch for: an all-reduce whose input overlaps its output (not
 * in place) is planned from a copy of the input, here 2^45 floats (128 TiB, more than an
 * x86-64 process can map). ncclSystemError naming the call, on every rank alike; before, the
 * failed allocation aborted the process. The communicator stays usable (checked after). */
static void unallocatable(ncclComm_t* comms) {
  const size_t count = (size_t)1 << 45;
  test_step("ncclAllReduce (scratch no host can give)");
  ncclResult_t r = ncclSuccess;
  if (g_env.local > 1) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t rl = ncclAllReduce(g_rbuf + 4, g_rbuf, count, ncclFloat32, ncclSum, comms[l], S);
    if (r == ncclSuccess) r = rl;
  }
  if (g_env.local > 1) {
    ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
  }
  /* (Ranks of one process call in a group: its end reports the error.) */
  check_rc(g_env.local > 1 ? "ncclGroupEnd" : "ncclAllReduce", "RB + 4, RB, 1 << 45, ncclFloat32, ncclSum, c, S", r,
           E_SE);
  const char* msg = ncclGetLastError(NULL);
  EXPECT(msg && strstr(msg, "AllReduce") && strstr(msg, "no memory for"), "the refusal does not say what and why: \"%s\"",
         msg ? msg : "(null)");
}

static void error_strings(void) {
  const int codes[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, ncclNumResults, 12345, -1};
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
    test_step("ncclGetErrorString");
    const char* s = ncclGetErrorString((ncclResult_t)codes[i]);
    const char* ps = pncclGetErrorString((ncclResult_t)codes[i]);
    EXPECT(s && s[0], "ncclGetErrorString(%d) is NULL or empty", codes[i]);
    EXPECT(ps && ps[0], "pncclGetErrorString(%d) is NULL or empty", codes[i]);
    if (s && ps) EXPECT(!strcmp(s, ps), "ncclGetErrorString(%d) = \"%s\" but pncclGetErrorString = \"%s\"", codes[i], s, ps);
  }
  test_step("ncclGetLastError");
  EXPECT(ncclGetLastError(NULL) != NULL, "ncclGetLastError(NULL) returned NULL");
  EXPECT(pncclGetLastError(g_comm) != NULL, "pncclGetLastError(comm) returned NULL");
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  ncclComm_t comms[MAX_LOCAL];
  make_comms("", comms);
  g_comm = comms[0];
  error_strings();
  null_comm();
  null_outputs();
  bad_datatypes();
  bad_ops();
  bad_ranks();
  bad_init();
  optional_api();
  device_api();
  unallocatable(comms);
  /* The communicator survived every rejected call. */
  test_step("allreduce after the errors");
  EXPECT(allreduce_sum_int(comms, 1) == g_env.nranks, "allreduce after the rejected calls is wrong");
  destroy_comms(comms);
  /* Last: a library that gets the group depth wrong here would defer every later call. */
  groups();
  tlog("%d calls made", g_calls);
  return test_finish();
}
