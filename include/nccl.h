/*
 * nccl.h - public API of nccl-rs, a drop-in replacement for NVIDIA's NCCL.
 *
 * Copyright nccl-rs authors. SPDX-License-Identifier: Apache-2.0
 *
 * Source-compatible with NVIDIA's NCCL 2.32.3 header: the same names, values, struct
 * layouts and prototypes (ffi-tests/abi_layout.sh checks this against NVIDIA's own).
 * Every function ncclX has a profiling twin pncclX with the same signature.
 *
 * CUDA's headers are included when the compiler can find them; otherwise only the two
 * CUDA handle types this API needs are declared, exactly as CUDA declares them, so that
 * <cuda_runtime.h> may still be included later.
 */

#ifndef NCCL_H_
#define NCCL_H_

#if defined(__has_include)
#if __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#if __has_include(<cuda_fp16.h>)
#include <cuda_fp16.h>
#endif
#if defined(CUDART_VERSION) && CUDART_VERSION >= 11000 && __has_include(<cuda_bf16.h>)
#include <cuda_bf16.h>
#endif
#if defined(__cplusplus) && defined(CUDART_VERSION) && CUDART_VERSION >= 11080 && \
    __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#endif
#else /* no CUDA: the same typedefs as CUDA's driver_types.h */
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
#else /* cannot look: behave as NVIDIA's header does */
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#if CUDART_VERSION >= 11000
#include <cuda_bf16.h>
#endif
#if defined(__cplusplus) && CUDART_VERSION >= 11080
#include <cuda_fp8.h>
#endif
#endif

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#define NCCL_MAJOR 2
#define NCCL_MINOR 32
#define NCCL_PATCH 3
#define NCCL_SUFFIX ""

#define NCCL_VERSION_CODE 23203
/* Codes before 2.9 used two digits for the minor version and patch together. */
#define NCCL_VERSION(X,Y,Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Handles and identifiers ---- */

typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
/* Opaque bytes from ncclGetUniqueId, passed to every rank out of band. */
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

typedef enum { ncclSuccess            = 0,
               ncclUnhandledCudaError = 1,
               ncclSystemError        = 2,
               ncclInternalError      = 3,
               ncclInvalidArgument    = 4,
               ncclInvalidUsage       = 5,
               ncclRemoteError        = 6,
               ncclInProgress         = 7,
               ncclTimeout            = 8,
               ncclNumResults         = 9 } ncclResult_t;

/* ---- Configuration constants ---- */

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_UNDEF_FLOAT -1.0f

/* Magic word of versioned structs (size/magic/version header); set by the initializers. */
#define NCCL_API_MAGIC 0xcafebeef

/* winFlags of ncclCommWindowRegister */
#define NCCL_WIN_DEFAULT 0x00
#define NCCL_WIN_COLL_SYMMETRIC 0x01
#define NCCL_WIN_STRICT_ORDERING 0x02
#define NCCL_WIN_GIN_ONLY 0x04
#define NCCL_WIN_CFT_COUNTED 0x08

#define NCCL_WIN_REQUIRED_ALIGNMENT 4096

/* ncclConfig_t.CTAPolicy, ncclCollConfig_t.CTAPolicy */
#define NCCL_CTA_POLICY_DEFAULT 0x00
#define NCCL_CTA_POLICY_EFFICIENCY 0x01
#define NCCL_CTA_POLICY_ZERO 0x02

/* shrinkFlags of ncclCommShrink */
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01

/* revokeFlags of ncclCommRevoke (only 0 is valid) */
#define NCCL_REVOKE_DEFAULT 0x00

/* ncclConfig_t.hostCftMode */
typedef enum {
  ncclHostCftDefault  = NCCL_CONFIG_UNDEF_INT,
  ncclHostCftEnable   = 1,
  ncclHostCftDisable  = 2,
  ncclHostCftFallback = 3
} ncclHostCftMode_t;

/* ncclConfig_t.nvlsHostMode: the Disable* flags may be OR-ed together. */
typedef enum {
  ncclNvlsHostModeDefault                  = NCCL_CONFIG_UNDEF_INT,
  ncclNvlsHostModeEnable                   = 0,
  ncclNvlsHostModeDisableTransport         = 1 << 0,
  ncclNvlsHostModeDisableSymmetricMultimem = 1 << 1,
  ncclNvlsHostModeDisable                  = INT_MAX
} ncclNvlsHostMode_t;

/* ---- Versioned configuration structs ----
 * Each starts with size/magic/version and must be created from its *_INITIALIZER;
 * fields are only ever appended, so older programs pass a shorter struct. */

/* Communicator configuration (ncclCommInitRankConfig, ncclCommSplit, ...). */
typedef struct ncclConfig_v23100 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
  int trafficClass;
  const char *commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
  int graphUsageMode;
  int numRmaCtx;
  int maxP2pPeers;
  int graphStreamOrdering;
  int launchOrderImplicit;
  int numRmaSig;
  int rmaEagerInit;
  int hostCftMode;
  int nvlsHostMode;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER {                                          \
  sizeof(ncclConfig_t), NCCL_API_MAGIC, NCCL_VERSION_CODE,                 \
  NCCL_CONFIG_UNDEF_INT, /* blocking */                                    \
  NCCL_CONFIG_UNDEF_INT, /* cgaClusterSize */                              \
  NCCL_CONFIG_UNDEF_INT, /* minCTAs */                                     \
  NCCL_CONFIG_UNDEF_INT, /* maxCTAs */                                     \
  NCCL_CONFIG_UNDEF_PTR, /* netName */                                     \
  NCCL_CONFIG_UNDEF_INT, /* splitShare */                                  \
  NCCL_CONFIG_UNDEF_INT, /* trafficClass */                                \
  NCCL_CONFIG_UNDEF_PTR, /* commName */                                    \
  NCCL_CONFIG_UNDEF_INT, /* collnetEnable */                               \
  NCCL_CONFIG_UNDEF_INT, /* CTAPolicy */                                   \
  NCCL_CONFIG_UNDEF_INT, /* shrinkShare */                                 \
  NCCL_CONFIG_UNDEF_INT, /* nvlsCTAs */                                    \
  NCCL_CONFIG_UNDEF_INT, /* nChannelsPerNetPeer */                         \
  NCCL_CONFIG_UNDEF_INT, /* nvlinkCentricSched */                          \
  NCCL_CONFIG_UNDEF_INT, /* graphUsageMode */                              \
  NCCL_CONFIG_UNDEF_INT, /* numRmaCtx */                                   \
  NCCL_CONFIG_UNDEF_INT, /* maxP2pPeers */                                 \
  NCCL_CONFIG_UNDEF_INT, /* graphStreamOrdering */                         \
  NCCL_CONFIG_UNDEF_INT, /* launchOrderImplicit */                         \
  NCCL_CONFIG_UNDEF_INT, /* numRmaSig */                                   \
  NCCL_CONFIG_UNDEF_INT, /* rmaEagerInit */                                \
  NCCL_CONFIG_UNDEF_INT, /* hostCftMode */                                 \
  NCCL_CONFIG_UNDEF_INT, /* nvlsHostMode */                                \
}

/* One vendor-specific option of a ncclCollConfig_t, in a NULL-terminated list.
 * NVIDIA's library ignores every extension. */
typedef struct ncclConfigExt {
  struct ncclConfigExt* next;
  struct {
    int vendorId; /* non-zero, below 2^24, chosen by each vendor */
    int optionId;
  } key;
  union {
    int i;
    const char* s;
    void* raw;
  } val;
} ncclConfigExt_t;

/* Per-call configuration of the nccl*Config collectives; must match on every rank. */
typedef struct ncclCollConfig_v23200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  ncclConfigExt_t* ext;
  int minCTAs;
  int maxCTAs;
  int nvlsCTAs;
  int cgaClusterSize;
  const char* algSelection;
  int forceAlgSelection;
  int CTAPolicy;
  uint64_t userProfilerTag;             /* handed to profiler plugins; MSB set is reserved */
  cudaEvent_t launchCompletionEvent;    /* recorded when the collective is launched */
} ncclCollConfig_t;

#define NCCL_COLLCONFIG_INITIALIZER {                                      \
  sizeof(ncclCollConfig_t), NCCL_API_MAGIC, NCCL_VERSION_CODE,             \
  NCCL_CONFIG_UNDEF_PTR, /* ext */                                         \
  NCCL_CONFIG_UNDEF_INT, /* minCTAs */                                     \
  NCCL_CONFIG_UNDEF_INT, /* maxCTAs */                                     \
  NCCL_CONFIG_UNDEF_INT, /* nvlsCTAs */                                    \
  NCCL_CONFIG_UNDEF_INT, /* cgaClusterSize */                              \
  NCCL_CONFIG_UNDEF_PTR, /* algSelection */                                \
  1,                     /* forceAlgSelection */                           \
  NCCL_CONFIG_UNDEF_INT, /* CTAPolicy */                                   \
  0,                     /* userProfilerTag */                             \
  NCCL_CONFIG_UNDEF_PTR, /* launchCompletionEvent */                       \
}

/* Result of ncclGroupSimulateEnd. */
typedef struct ncclSimInfo_v22200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimatedTime;
} ncclSimInfo_t;

/* Note: this struct has its own magic word, not NCCL_API_MAGIC. */
#define NCCL_SIM_INFO_INITIALIZER {                                        \
  sizeof(ncclSimInfo_t), 0x74685283, NCCL_VERSION_CODE,                    \
  NCCL_UNDEF_FLOAT       /* estimatedTime */                               \
}

/* ---- Memory, version, unique id ---- */

ncclResult_t  ncclMemAlloc(void** ptr, size_t size);
ncclResult_t pncclMemAlloc(void** ptr, size_t size);

ncclResult_t  ncclMemFree(void *ptr);
ncclResult_t pncclMemFree(void *ptr);

/* Writes NCCL_VERSION_CODE of the library (not of this header). */
ncclResult_t  ncclGetVersion(int *version);
ncclResult_t pncclGetVersion(int *version);

ncclResult_t  ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t pncclGetUniqueId(ncclUniqueId* uniqueId);

/* ---- Communicator life cycle ---- */

ncclResult_t  ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
ncclResult_t pncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);

ncclResult_t  ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t pncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);

/* ndev communicators of one process; devlist NULL means devices 0..ndev-1. */
ncclResult_t  ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
ncclResult_t pncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);

ncclResult_t  ncclCommFinalize(ncclComm_t comm);
ncclResult_t pncclCommFinalize(ncclComm_t comm);

ncclResult_t  ncclCommDestroy(ncclComm_t comm);
ncclResult_t pncclCommDestroy(ncclComm_t comm);

ncclResult_t  ncclCommAbort(ncclComm_t comm);
ncclResult_t pncclCommAbort(ncclComm_t comm);

/* revokeFlags must be NCCL_REVOKE_DEFAULT. */
ncclResult_t  ncclCommRevoke(ncclComm_t comm, int revokeFlags);
ncclResult_t pncclCommRevoke(ncclComm_t comm, int revokeFlags);

/* color NCCL_SPLIT_NOCOLOR: this rank joins no new communicator (*newcomm = NULL). */
ncclResult_t  ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t* config);
ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t* config);

ncclResult_t  ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
ncclResult_t pncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);

/* Unique id for one ncclCommGrow of comm. */
ncclResult_t  ncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId* uniqueId);
ncclResult_t pncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId* uniqueId);

ncclResult_t  ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank, ncclComm_t* newcomm, ncclConfig_t* config);
ncclResult_t pncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank, ncclComm_t* newcomm, ncclConfig_t* config);

/* Like ncclCommInitRankConfig with nId unique ids, the same on every rank. */
ncclResult_t  ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds, ncclConfig_t* config);
ncclResult_t pncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds, ncclConfig_t* config);

/* ---- Errors ---- */

const char*  ncclGetErrorString(ncclResult_t result);
const char* pncclGetErrorString(ncclResult_t result);

const char*  ncclGetLastError(ncclComm_t comm);
const char* pncclGetLastError(ncclComm_t comm);

/* Declared only when NCCL_OS_LINUX is defined (as in NVIDIA's header); a no-op otherwise. */
#ifdef NCCL_OS_LINUX
__attribute__((deprecated("ncclResetDebugInit is not part of the NCCL API and will be removed")))
void  ncclResetDebugInit();
__attribute__((deprecated("pncclResetDebugInit is not part of the NCCL API and will be removed")))
void pncclResetDebugInit();
#else
#define ncclResetDebugInit()
#define pncclResetDebugInit()
#endif

ncclResult_t  ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);

/* ---- Communicator queries, registration, suspend ---- */

ncclResult_t  ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t pncclCommCount(const ncclComm_t comm, int* count);

ncclResult_t  ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int* device);

ncclResult_t  ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t pncclCommUserRank(const ncclComm_t comm, int* rank);

ncclResult_t  ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
ncclResult_t pncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);

ncclResult_t  ncclCommDeregister(const ncclComm_t comm, void* handle);
ncclResult_t pncclCommDeregister(const ncclComm_t comm, void* handle);

/* flags of ncclCommSuspend */
#define NCCL_SUSPEND_MEM 0x01

ncclResult_t  ncclCommSuspend(ncclComm_t comm, int flags);
ncclResult_t pncclCommSuspend(ncclComm_t comm, int flags);

ncclResult_t  ncclCommResume(ncclComm_t comm);
ncclResult_t pncclCommResume(ncclComm_t comm);

/* stat of ncclCommMemStats: sizes in bytes, except GpuMemSuspended (0 or 1) */
typedef enum {
  ncclStatGpuMemSuspend   = 0,
  ncclStatGpuMemSuspended = 1,
  ncclStatGpuMemPersist   = 2,
  ncclStatGpuMemTotal     = 3
} ncclCommMemStat_t;

ncclResult_t  ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t* value);
ncclResult_t pncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t* value);

/* ---- Memory windows ---- */

ncclResult_t  ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
ncclResult_t pncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);

ncclResult_t  ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
ncclResult_t pncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);

ncclResult_t  ncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void** outUserPtr);
ncclResult_t pncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void** outUserPtr);

/* ---- Reduction operators and data types ---- */

/* Only its size matters: it bounds ncclMaxRedOp below. */
typedef enum { ncclNumOps_dummy = 5 } ncclRedOp_dummy_t;

/* Values >= ncclNumOps are operators made by ncclRedOpCreatePreMulSum. */
typedef enum { ncclSum      = 0,
               ncclProd     = 1,
               ncclMax      = 2,
               ncclMin      = 3,
               ncclAvg      = 4,
               ncclNumOps   = 5,
               /* largest signed value that keeps sizeof(ncclRedOp_t) unchanged */
               ncclMaxRedOp = 0x7fffffff>>(32-8*sizeof(ncclRedOp_dummy_t))
             } ncclRedOp_t;

typedef enum { ncclInt8       = 0, ncclChar   = 0,
               ncclUint8      = 1,
               ncclInt32      = 2, ncclInt    = 2,
               ncclUint32     = 3,
               ncclInt64      = 4,
               ncclUint64     = 5,
               ncclFloat16    = 6, ncclHalf   = 6,
               ncclFloat32    = 7, ncclFloat  = 7,
               ncclFloat64    = 8, ncclDouble = 8,
               ncclBfloat16   = 9,
               ncclFloat8e4m3 = 10,
               ncclFloat8e5m2 = 11,
               ncclNumTypes   = 12
} ncclDataType_t;

/* Where the scalar of ncclRedOpCreatePreMulSum lives and when it is read. */
typedef enum {
  ncclScalarDevice        = 0, /* device memory, read while the collective runs */
  ncclScalarHostImmediate = 1  /* host memory, read before the create call returns */
} ncclScalarResidence_t;

ncclResult_t  ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype, ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t pncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype, ncclScalarResidence_t residence, ncclComm_t comm);

ncclResult_t  ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
ncclResult_t pncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);

/* ---- Collectives ----
 * Enqueued on stream; called once per rank (from separate threads or processes, or
 * inside a ncclGroupStart/ncclGroupEnd). */

ncclResult_t  ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);

/* Deprecated in-place form of ncclBroadcast. */
ncclResult_t  ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);

/* sendbuff holds nranks*recvcount elements. */
ncclResult_t  ncclReduceScatter(const void* sendbuff, void* recvbuff,
    size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
    cudaStream_t stream);
ncclResult_t pncclReduceScatter(const void* sendbuff, void* recvbuff,
    size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
    cudaStream_t stream);

/* recvbuff holds nranks*sendcount elements. */
ncclResult_t  ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclGather(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclGather(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclScatter(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclScatter(const void* sendbuff, void* recvbuff, size_t count,
    ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);

/* The same collectives with a per-call config; config NULL means the plain call. */
ncclResult_t  ncclAllReduceConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclAllReduceConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclBroadcastConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclBroadcastConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclReduceConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclReduceConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclAllGatherConfig(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclAllGatherConfig(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclReduceScatterConfig(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclReduceScatterConfig(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclAlltoAllConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclAlltoAllConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclGatherConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclGatherConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

ncclResult_t  ncclScatterConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
ncclResult_t pncclScatterConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);

/* ---- Point to point ---- */

ncclResult_t  ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    ncclComm_t comm, cudaStream_t stream);

/* ---- One-sided: put and signals on registered windows ---- */

ncclResult_t  ncclPutSignal(const void* localbuff, size_t count, ncclDataType_t datatype,
    int peer, ncclWindow_t peerWin, size_t peerWinOffset,
    int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclPutSignal(const void* localbuff, size_t count, ncclDataType_t datatype,
    int peer, ncclWindow_t peerWin, size_t peerWinOffset,
    int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);

ncclResult_t  ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);

/* Wait for opCnt signals from peer on (sigIdx, ctx). */
typedef struct {
  int opCnt;
  int peer;
  int sigIdx;
  int ctx;
} ncclWaitSignalDesc_t;

ncclResult_t  ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclWaitSignal(int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm, cudaStream_t stream);

/* ---- Groups ----
 * Calls between ncclGroupStart and the outermost ncclGroupEnd are launched together. */

ncclResult_t  ncclGroupStart();
ncclResult_t pncclGroupStart();

ncclResult_t  ncclGroupEnd();
ncclResult_t pncclGroupEnd();

ncclResult_t  ncclGroupSimulateEnd(ncclSimInfo_t* simInfo);
ncclResult_t pncclGroupSimulateEnd(ncclSimInfo_t* simInfo);

/* ---- Encryption of TCP sockets ---- */

typedef enum {
  NCCL_ENCRYPTION_MODE_NONE = 0,
  NCCL_ENCRYPTION_MODE_PSK  = 1  /* pre-shared key in psk */
} ncclEncryptionMode_t;

typedef struct ncclEncryptionConfig_v23200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int mode;                             /* an ncclEncryptionMode_t */
  const char* psk;
} ncclEncryptionConfig_t;

#define NCCL_ENCRYPTION_CONFIG_INITIALIZER {                               \
  sizeof(ncclEncryptionConfig_t), NCCL_API_MAGIC, NCCL_VERSION_CODE,       \
  NCCL_ENCRYPTION_MODE_NONE, /* mode */                                    \
  NCCL_CONFIG_UNDEF_PTR,     /* psk */                                     \
}

ncclResult_t  ncclSetEncryption(const ncclEncryptionConfig_t* config);
ncclResult_t pncclSetEncryption(const ncclEncryptionConfig_t* config);

/* ---- Parameters (NCCL_* settings) ----
 * Returned handles, strings and tables belong to the library; strings and tables stay
 * valid until the next call of the same function on the same thread. */

typedef struct ncclParamHandle* ncclParamHandle_t;

ncclResult_t  ncclParamBind(ncclParamHandle_t* out, const char* key);
ncclResult_t pncclParamBind(ncclParamHandle_t* out, const char* key);

ncclResult_t  ncclParamGetI8(ncclParamHandle_t h, int8_t* out);
ncclResult_t pncclParamGetI8(ncclParamHandle_t h, int8_t* out);

ncclResult_t  ncclParamGetI16(ncclParamHandle_t h, int16_t* out);
ncclResult_t pncclParamGetI16(ncclParamHandle_t h, int16_t* out);

ncclResult_t  ncclParamGetI32(ncclParamHandle_t h, int32_t* out);
ncclResult_t pncclParamGetI32(ncclParamHandle_t h, int32_t* out);

ncclResult_t  ncclParamGetI64(ncclParamHandle_t h, int64_t* out);
ncclResult_t pncclParamGetI64(ncclParamHandle_t h, int64_t* out);

ncclResult_t  ncclParamGetU8(ncclParamHandle_t h, uint8_t* out);
ncclResult_t pncclParamGetU8(ncclParamHandle_t h, uint8_t* out);

ncclResult_t  ncclParamGetU16(ncclParamHandle_t h, uint16_t* out);
ncclResult_t pncclParamGetU16(ncclParamHandle_t h, uint16_t* out);

ncclResult_t  ncclParamGetU32(ncclParamHandle_t h, uint32_t* out);
ncclResult_t pncclParamGetU32(ncclParamHandle_t h, uint32_t* out);

ncclResult_t  ncclParamGetU64(ncclParamHandle_t h, uint64_t* out);
ncclResult_t pncclParamGetU64(ncclParamHandle_t h, uint64_t* out);

ncclResult_t  ncclParamGetStr(ncclParamHandle_t h, const char** out);
ncclResult_t pncclParamGetStr(ncclParamHandle_t h, const char** out);

/* Copies the raw value into out (maxLen bytes); *len receives its length. */
ncclResult_t  ncclParamGet(ncclParamHandle_t h, void* out, int maxLen, int* len);
ncclResult_t pncclParamGet(ncclParamHandle_t h, void* out, int maxLen, int* len);

ncclResult_t  ncclParamGetParameter(const char* key, const char** value, int* valueLen);
ncclResult_t pncclParamGetParameter(const char* key, const char** value, int* valueLen);

/* Documented keys only, unless NCCL_PARAM_DUMP_ALL is set. */
ncclResult_t  ncclParamGetAllParameterKeys(const char*** table, int* tableLen);
ncclResult_t pncclParamGetAllParameterKeys(const char*** table, int* tableLen);

void  ncclParamDumpAll(void);
void pncclParamDumpAll(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* NCCL_H_ */
