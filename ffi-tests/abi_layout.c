/*
 * abi_layout.c - prints the ABI facts of an nccl.h, one "name value" per line.
 *
 * Built against include/nccl.h and against NVIDIA's nccl.h (as C11 and as C++17, with
 * and without NCCL_OS_LINUX); abi_layout.sh requires the outputs to be byte-identical.
 * Covers: size, alignment and signedness of every type, offset, size (and, in C++, the
 * mangled type) of every field, every enum constant, every macro's value and type, the
 * fields produced by every *_INITIALIZER, and, in C++, every function's type.
 *
 * Copyright nccl-rs authors. SPDX-License-Identifier: Apache-2.0
 */
#include <nccl.h>

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
#include <type_traits>
#include <typeinfo>
#define ALIGNOF(T) alignof(T)
#define SAME_TYPE(A, B) (std::is_same<A, B>::value ? 1 : 0)
#define IS_SIGNED(T) (std::is_signed<std::underlying_type<T>::type>::value ? 1 : 0)
#define TYPE_NAME(x) typeid(x).name()
#else
#define ALIGNOF(T) _Alignof(T)
#define SAME_TYPE(A, B) _Generic((A*)0, B*: 1, default: 0)
#define IS_SIGNED(T) ((T)-1 > 0 ? 0 : 1)
#define TYPE_NAME(x) _Generic((x),                                            \
    int: "int", unsigned int: "unsigned int",                                 \
    long: "long", unsigned long: "unsigned long",                             \
    long long: "long long", unsigned long long: "unsigned long long",         \
    float: "float", double: "double",                                         \
    char*: "char*", const char*: "const char*", void*: "void*",               \
    default: "other")
#endif

/* ---- value printers: integers, floats, strings, pointers (null or not) ---- */

static inline void pv_ll(const char* n, long long v) { printf("%s %lld\n", n, v); }
static inline void pv_ull(const char* n, unsigned long long v) { printf("%s %llu\n", n, v); }
static inline void pv_d(const char* n, double v) { printf("%s %.9g\n", n, v); }
static inline void pv_s(const char* n, const char* v) {
  if (v) printf("%s \"%s\"\n", n, v); else printf("%s null\n", n);
}
static inline void pv_p(const char* n, const void* v) { printf("%s %s\n", n, v ? "nonnull" : "null"); }

#ifdef __cplusplus
static inline void pv(const char* n, int v) { pv_ll(n, v); }
static inline void pv(const char* n, long v) { pv_ll(n, v); }
static inline void pv(const char* n, long long v) { pv_ll(n, v); }
static inline void pv(const char* n, unsigned int v) { pv_ull(n, v); }
static inline void pv(const char* n, unsigned long v) { pv_ull(n, v); }
static inline void pv(const char* n, unsigned long long v) { pv_ull(n, v); }
static inline void pv(const char* n, float v) { pv_d(n, v); }
static inline void pv(const char* n, double v) { pv_d(n, v); }
static inline void pv(const char* n, const char* v) { pv_s(n, v); }
static inline void pv(const char* n, const void* v) { pv_p(n, v); }
#define VALUE(n, x) pv(n, x)
#else
#define VALUE(n, x) _Generic((x),                                             \
    int: pv_ll, long: pv_ll, long long: pv_ll,                                \
    unsigned int: pv_ull, unsigned long: pv_ull, unsigned long long: pv_ull,  \
    float: pv_d, double: pv_d,                                                \
    char*: pv_s, const char*: pv_s,                                           \
    default: pv_p)(n, x)
#endif

/* ---- what is printed for each kind of name ---- */

#define TYPE(T)                                                               \
  do {                                                                        \
    printf("sizeof(%s) %zu\n", #T, sizeof(T));                                \
    printf("alignof(%s) %zu\n", #T, (size_t)ALIGNOF(T));                      \
    TYPEID(#T, T);                                                            \
  } while (0)

#define ENUM_TYPE(T)                                                          \
  do {                                                                        \
    TYPE(T);                                                                  \
    printf("signed(%s) %d\n", #T, IS_SIGNED(T));                              \
  } while (0)

#define FIELD(T, f)                                                           \
  do {                                                                        \
    printf("offsetof(%s,%s) %zu\n", #T, #f, offsetof(T, f));                  \
    printf("sizeof(%s.%s) %zu\n", #T, #f, sizeof(((T*)0)->f));                \
    TYPEID(#T "." #f, decltype(((T*)0)->f));                                  \
  } while (0)

#define CONSTANT(x)                                                           \
  do {                                                                        \
    VALUE(#x, x);                                                             \
    printf("type(%s) %s\n", #x, TYPE_NAME(x));                                \
  } while (0)

/* NULL-valued macros: in C++ NULL is an integer constant, so print it as a pointer. */
#define NULL_CONSTANT(x)                                                      \
  do {                                                                        \
    VALUE(#x, (const void*)(x));                                              \
    printf("type(%s) %s\n", #x, TYPE_NAME(x));                                \
  } while (0)

#define SAME(A, B) printf("same(%s,%s) %d\n", #A, #B, SAME_TYPE(A, B))

#ifdef __cplusplus
#define TYPEID(label, T) printf("typeid(%s) %s\n", label, typeid(T).name())
#else
#define TYPEID(label, T) ((void)0)
#endif

/* Every function but ncclResetDebugInit (declared only under NCCL_OS_LINUX). */
#define FUNCTIONS(F)                                                          \
  F(ncclAllGather) F(ncclAllGatherConfig) F(ncclAllReduce)                    \
  F(ncclAllReduceConfig) F(ncclAlltoAll) F(ncclAlltoAllConfig) F(ncclBcast)   \
  F(ncclBroadcast) F(ncclBroadcastConfig) F(ncclCommAbort) F(ncclCommCount)   \
  F(ncclCommCuDevice) F(ncclCommDeregister) F(ncclCommDestroy)                \
  F(ncclCommFinalize) F(ncclCommGetAsyncError) F(ncclCommGetUniqueId)         \
  F(ncclCommGrow) F(ncclCommInitAll) F(ncclCommInitRank)                      \
  F(ncclCommInitRankConfig) F(ncclCommInitRankScalable) F(ncclCommMemStats)   \
  F(ncclCommRegister) F(ncclCommResume) F(ncclCommRevoke) F(ncclCommShrink)   \
  F(ncclCommSplit) F(ncclCommSuspend) F(ncclCommUserRank)                     \
  F(ncclCommWindowDeregister) F(ncclCommWindowRegister) F(ncclGather)         \
  F(ncclGatherConfig) F(ncclGetErrorString) F(ncclGetLastError)               \
  F(ncclGetUniqueId) F(ncclGetVersion) F(ncclGroupEnd) F(ncclGroupSimulateEnd)\
  F(ncclGroupStart) F(ncclMemAlloc) F(ncclMemFree) F(ncclParamBind)           \
  F(ncclParamDumpAll) F(ncclParamGet) F(ncclParamGetAllParameterKeys)         \
  F(ncclParamGetI16) F(ncclParamGetI32) F(ncclParamGetI64) F(ncclParamGetI8)  \
  F(ncclParamGetParameter) F(ncclParamGetStr) F(ncclParamGetU16)              \
  F(ncclParamGetU32) F(ncclParamGetU64) F(ncclParamGetU8) F(ncclPutSignal)    \
  F(ncclRecv) F(ncclRedOpCreatePreMulSum) F(ncclRedOpDestroy) F(ncclReduce)   \
  F(ncclReduceConfig) F(ncclReduceScatter) F(ncclReduceScatterConfig)         \
  F(ncclScatter) F(ncclScatterConfig) F(ncclSend) F(ncclSetEncryption)        \
  F(ncclSignal) F(ncclWaitSignal) F(ncclWinGetUserPtr)

/* The profiling twin p##f must have f's type; in C++ the type itself is printed too. */
#ifdef __cplusplus
#define FUNCTION(f)                                                           \
  printf("functype(%s) %s\n", #f, typeid(decltype(f)).name());                \
  printf("twin(%s) %d\n", #f, SAME_TYPE(decltype(f), decltype(p##f)));
#else
#define FUNCTION(f)                                                           \
  printf("twin(%s) %d\n", #f, _Generic(&p##f, __typeof__(&f): 1, default: 0));
#endif

/* Every integer macro must also work in #if; this fails to compile if one does not. */
#if NCCL_MAJOR + NCCL_MINOR + NCCL_PATCH + NCCL_VERSION_CODE + NCCL_UNIQUE_ID_BYTES + \
    NCCL_CONFIG_UNDEF_INT + NCCL_SPLIT_NOCOLOR + NCCL_API_MAGIC + NCCL_WIN_DEFAULT +  \
    NCCL_WIN_COLL_SYMMETRIC + NCCL_WIN_STRICT_ORDERING + NCCL_WIN_GIN_ONLY +          \
    NCCL_WIN_CFT_COUNTED + NCCL_WIN_REQUIRED_ALIGNMENT + NCCL_CTA_POLICY_DEFAULT +     \
    NCCL_CTA_POLICY_EFFICIENCY + NCCL_CTA_POLICY_ZERO + NCCL_SHRINK_DEFAULT +         \
    NCCL_SHRINK_ABORT + NCCL_REVOKE_DEFAULT + NCCL_SUSPEND_MEM == 0
#error "unexpected sum of integer macros"
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 32, 3) && NCCL_VERSION(2, 8, 0) == 2800
#define PP_VERSION_CHECK 1
#else
#define PP_VERSION_CHECK 0
#endif

/* File scope: each initializer must be a constant expression. */
static const ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
static const ncclCollConfig_t coll_config = NCCL_COLLCONFIG_INITIALIZER;
static const ncclSimInfo_t sim_info = NCCL_SIM_INFO_INITIALIZER;
static const ncclEncryptionConfig_t encryption_config = NCCL_ENCRYPTION_CONFIG_INITIALIZER;

static void types(void) {
  TYPE(ncclComm_t);
  TYPE(ncclWindow_t);
  TYPE(ncclParamHandle_t);
  TYPE(cudaStream_t);
  TYPE(cudaEvent_t);
  TYPE(ncclUniqueId);
  TYPE(ncclConfig_t);
  TYPE(ncclConfigExt_t);
  TYPE(ncclCollConfig_t);
  TYPE(ncclSimInfo_t);
  TYPE(ncclWaitSignalDesc_t);
  TYPE(ncclEncryptionConfig_t);
  ENUM_TYPE(ncclResult_t);
  ENUM_TYPE(ncclHostCftMode_t);
  ENUM_TYPE(ncclNvlsHostMode_t);
  ENUM_TYPE(ncclCommMemStat_t);
  ENUM_TYPE(ncclRedOp_dummy_t);
  ENUM_TYPE(ncclRedOp_t);
  ENUM_TYPE(ncclDataType_t);
  ENUM_TYPE(ncclScalarResidence_t);
  ENUM_TYPE(ncclEncryptionMode_t);
  /* struct tags and pointee types */
  SAME(ncclComm_t, struct ncclComm*);
  SAME(ncclWindow_t, struct ncclWindow_vidmem*);
  SAME(ncclParamHandle_t, struct ncclParamHandle*);
  SAME(cudaStream_t, struct CUstream_st*);
  SAME(cudaEvent_t, struct CUevent_st*);
  SAME(ncclConfig_t, struct ncclConfig_v23100);
  SAME(ncclConfigExt_t, struct ncclConfigExt);
  SAME(ncclCollConfig_t, struct ncclCollConfig_v23200);
  SAME(ncclSimInfo_t, struct ncclSimInfo_v22200);
  SAME(ncclEncryptionConfig_t, struct ncclEncryptionConfig_v23200);
}

static void fields(void) {
  FIELD(ncclUniqueId, internal);

  FIELD(ncclConfig_t, size);
  FIELD(ncclConfig_t, magic);
  FIELD(ncclConfig_t, version);
  FIELD(ncclConfig_t, blocking);
  FIELD(ncclConfig_t, cgaClusterSize);
  FIELD(ncclConfig_t, minCTAs);
  FIELD(ncclConfig_t, maxCTAs);
  FIELD(ncclConfig_t, netName);
  FIELD(ncclConfig_t, splitShare);
  FIELD(ncclConfig_t, trafficClass);
  FIELD(ncclConfig_t, commName);
  FIELD(ncclConfig_t, collnetEnable);
  FIELD(ncclConfig_t, CTAPolicy);
  FIELD(ncclConfig_t, shrinkShare);
  FIELD(ncclConfig_t, nvlsCTAs);
  FIELD(ncclConfig_t, nChannelsPerNetPeer);
  FIELD(ncclConfig_t, nvlinkCentricSched);
  FIELD(ncclConfig_t, graphUsageMode);
  FIELD(ncclConfig_t, numRmaCtx);
  FIELD(ncclConfig_t, maxP2pPeers);
  FIELD(ncclConfig_t, graphStreamOrdering);
  FIELD(ncclConfig_t, launchOrderImplicit);
  FIELD(ncclConfig_t, numRmaSig);
  FIELD(ncclConfig_t, rmaEagerInit);
  FIELD(ncclConfig_t, hostCftMode);
  FIELD(ncclConfig_t, nvlsHostMode);

  FIELD(ncclConfigExt_t, next);
  FIELD(ncclConfigExt_t, key);
  FIELD(ncclConfigExt_t, key.vendorId);
  FIELD(ncclConfigExt_t, key.optionId);
  FIELD(ncclConfigExt_t, val);
  FIELD(ncclConfigExt_t, val.i);
  FIELD(ncclConfigExt_t, val.s);
  FIELD(ncclConfigExt_t, val.raw);

  FIELD(ncclCollConfig_t, size);
  FIELD(ncclCollConfig_t, magic);
  FIELD(ncclCollConfig_t, version);
  FIELD(ncclCollConfig_t, ext);
  FIELD(ncclCollConfig_t, minCTAs);
  FIELD(ncclCollConfig_t, maxCTAs);
  FIELD(ncclCollConfig_t, nvlsCTAs);
  FIELD(ncclCollConfig_t, cgaClusterSize);
  FIELD(ncclCollConfig_t, algSelection);
  FIELD(ncclCollConfig_t, forceAlgSelection);
  FIELD(ncclCollConfig_t, CTAPolicy);
  FIELD(ncclCollConfig_t, userProfilerTag);
  FIELD(ncclCollConfig_t, launchCompletionEvent);

  FIELD(ncclSimInfo_t, size);
  FIELD(ncclSimInfo_t, magic);
  FIELD(ncclSimInfo_t, version);
  FIELD(ncclSimInfo_t, estimatedTime);

  FIELD(ncclWaitSignalDesc_t, opCnt);
  FIELD(ncclWaitSignalDesc_t, peer);
  FIELD(ncclWaitSignalDesc_t, sigIdx);
  FIELD(ncclWaitSignalDesc_t, ctx);

  FIELD(ncclEncryptionConfig_t, size);
  FIELD(ncclEncryptionConfig_t, magic);
  FIELD(ncclEncryptionConfig_t, version);
  FIELD(ncclEncryptionConfig_t, mode);
  FIELD(ncclEncryptionConfig_t, psk);
}

static void enum_constants(void) {
  CONSTANT(ncclSuccess);
  CONSTANT(ncclUnhandledCudaError);
  CONSTANT(ncclSystemError);
  CONSTANT(ncclInternalError);
  CONSTANT(ncclInvalidArgument);
  CONSTANT(ncclInvalidUsage);
  CONSTANT(ncclRemoteError);
  CONSTANT(ncclInProgress);
  CONSTANT(ncclTimeout);
  CONSTANT(ncclNumResults);

  CONSTANT(ncclHostCftDefault);
  CONSTANT(ncclHostCftEnable);
  CONSTANT(ncclHostCftDisable);
  CONSTANT(ncclHostCftFallback);

  CONSTANT(ncclNvlsHostModeDefault);
  CONSTANT(ncclNvlsHostModeEnable);
  CONSTANT(ncclNvlsHostModeDisableTransport);
  CONSTANT(ncclNvlsHostModeDisableSymmetricMultimem);
  CONSTANT(ncclNvlsHostModeDisable);

  CONSTANT(ncclStatGpuMemSuspend);
  CONSTANT(ncclStatGpuMemSuspended);
  CONSTANT(ncclStatGpuMemPersist);
  CONSTANT(ncclStatGpuMemTotal);

  CONSTANT(ncclNumOps_dummy);
  CONSTANT(ncclSum);
  CONSTANT(ncclProd);
  CONSTANT(ncclMax);
  CONSTANT(ncclMin);
  CONSTANT(ncclAvg);
  CONSTANT(ncclNumOps);
  CONSTANT(ncclMaxRedOp);

  CONSTANT(ncclInt8);
  CONSTANT(ncclChar);
  CONSTANT(ncclUint8);
  CONSTANT(ncclInt32);
  CONSTANT(ncclInt);
  CONSTANT(ncclUint32);
  CONSTANT(ncclInt64);
  CONSTANT(ncclUint64);
  CONSTANT(ncclFloat16);
  CONSTANT(ncclHalf);
  CONSTANT(ncclFloat32);
  CONSTANT(ncclFloat);
  CONSTANT(ncclFloat64);
  CONSTANT(ncclDouble);
  CONSTANT(ncclBfloat16);
  CONSTANT(ncclFloat8e4m3);
  CONSTANT(ncclFloat8e5m2);
  CONSTANT(ncclNumTypes);

  CONSTANT(ncclScalarDevice);
  CONSTANT(ncclScalarHostImmediate);

  CONSTANT(NCCL_ENCRYPTION_MODE_NONE);
  CONSTANT(NCCL_ENCRYPTION_MODE_PSK);
}

static void macros(void) {
  CONSTANT(NCCL_MAJOR);
  CONSTANT(NCCL_MINOR);
  CONSTANT(NCCL_PATCH);
  CONSTANT(NCCL_SUFFIX);
  CONSTANT(NCCL_VERSION_CODE);
  CONSTANT(NCCL_VERSION(2,32,3));
  CONSTANT(NCCL_VERSION(2,8,0));
  CONSTANT(NCCL_VERSION(2,9,0));
  CONSTANT(NCCL_VERSION(2,18,1));
  CONSTANT(NCCL_VERSION(3,0,0));
  printf("pp(NCCL_VERSION) %d\n", PP_VERSION_CHECK);
  NULL_CONSTANT(NCCL_COMM_NULL);
  CONSTANT(NCCL_UNIQUE_ID_BYTES);
  CONSTANT(NCCL_CONFIG_UNDEF_INT);
  NULL_CONSTANT(NCCL_CONFIG_UNDEF_PTR);
  CONSTANT(NCCL_SPLIT_NOCOLOR);
  CONSTANT(NCCL_UNDEF_FLOAT);
  CONSTANT(NCCL_API_MAGIC);
  CONSTANT(NCCL_WIN_DEFAULT);
  CONSTANT(NCCL_WIN_COLL_SYMMETRIC);
  CONSTANT(NCCL_WIN_STRICT_ORDERING);
  CONSTANT(NCCL_WIN_GIN_ONLY);
  CONSTANT(NCCL_WIN_CFT_COUNTED);
  CONSTANT(NCCL_WIN_REQUIRED_ALIGNMENT);
  CONSTANT(NCCL_CTA_POLICY_DEFAULT);
  CONSTANT(NCCL_CTA_POLICY_EFFICIENCY);
  CONSTANT(NCCL_CTA_POLICY_ZERO);
  CONSTANT(NCCL_SHRINK_DEFAULT);
  CONSTANT(NCCL_SHRINK_ABORT);
  CONSTANT(NCCL_REVOKE_DEFAULT);
  CONSTANT(NCCL_SUSPEND_MEM);
#ifdef ncclResetDebugInit
  printf("macro(ncclResetDebugInit) 1\n");
  ncclResetDebugInit(); /* must expand to nothing */
#else
  printf("macro(ncclResetDebugInit) 0\n");
#endif
}

#define INIT(var, T, f) VALUE(#T "{INITIALIZER}." #f, var.f)

static void initializers(void) {
  INIT(config, ncclConfig_t, size);
  INIT(config, ncclConfig_t, magic);
  INIT(config, ncclConfig_t, version);
  INIT(config, ncclConfig_t, blocking);
  INIT(config, ncclConfig_t, cgaClusterSize);
  INIT(config, ncclConfig_t, minCTAs);
  INIT(config, ncclConfig_t, maxCTAs);
  INIT(config, ncclConfig_t, netName);
  INIT(config, ncclConfig_t, splitShare);
  INIT(config, ncclConfig_t, trafficClass);
  INIT(config, ncclConfig_t, commName);
  INIT(config, ncclConfig_t, collnetEnable);
  INIT(config, ncclConfig_t, CTAPolicy);
  INIT(config, ncclConfig_t, shrinkShare);
  INIT(config, ncclConfig_t, nvlsCTAs);
  INIT(config, ncclConfig_t, nChannelsPerNetPeer);
  INIT(config, ncclConfig_t, nvlinkCentricSched);
  INIT(config, ncclConfig_t, graphUsageMode);
  INIT(config, ncclConfig_t, numRmaCtx);
  INIT(config, ncclConfig_t, maxP2pPeers);
  INIT(config, ncclConfig_t, graphStreamOrdering);
  INIT(config, ncclConfig_t, launchOrderImplicit);
  INIT(config, ncclConfig_t, numRmaSig);
  INIT(config, ncclConfig_t, rmaEagerInit);
  INIT(config, ncclConfig_t, hostCftMode);
  INIT(config, ncclConfig_t, nvlsHostMode);

  INIT(coll_config, ncclCollConfig_t, size);
  INIT(coll_config, ncclCollConfig_t, magic);
  INIT(coll_config, ncclCollConfig_t, version);
  INIT(coll_config, ncclCollConfig_t, ext);
  INIT(coll_config, ncclCollConfig_t, minCTAs);
  INIT(coll_config, ncclCollConfig_t, maxCTAs);
  INIT(coll_config, ncclCollConfig_t, nvlsCTAs);
  INIT(coll_config, ncclCollConfig_t, cgaClusterSize);
  INIT(coll_config, ncclCollConfig_t, algSelection);
  INIT(coll_config, ncclCollConfig_t, forceAlgSelection);
  INIT(coll_config, ncclCollConfig_t, CTAPolicy);
  INIT(coll_config, ncclCollConfig_t, userProfilerTag);
  INIT(coll_config, ncclCollConfig_t, launchCompletionEvent);

  INIT(sim_info, ncclSimInfo_t, size);
  INIT(sim_info, ncclSimInfo_t, magic);
  INIT(sim_info, ncclSimInfo_t, version);
  INIT(sim_info, ncclSimInfo_t, estimatedTime);

  INIT(encryption_config, ncclEncryptionConfig_t, size);
  INIT(encryption_config, ncclEncryptionConfig_t, magic);
  INIT(encryption_config, ncclEncryptionConfig_t, version);
  INIT(encryption_config, ncclEncryptionConfig_t, mode);
  INIT(encryption_config, ncclEncryptionConfig_t, psk);

  /* Block scope too, as programs usually write it. */
  {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    ncclCollConfig_t cc = NCCL_COLLCONFIG_INITIALIZER;
    ncclSimInfo_t s = NCCL_SIM_INFO_INITIALIZER;
    ncclEncryptionConfig_t e = NCCL_ENCRYPTION_CONFIG_INITIALIZER;
    VALUE("ncclConfig_t{local}.size", c.size);
    VALUE("ncclCollConfig_t{local}.size", cc.size);
    VALUE("ncclSimInfo_t{local}.size", s.size);
    VALUE("ncclEncryptionConfig_t{local}.size", e.size);
  }
}

static void functions(void) {
  FUNCTIONS(FUNCTION)
#ifdef NCCL_OS_LINUX
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  FUNCTION(ncclResetDebugInit)
#pragma GCC diagnostic pop
#endif
}

int main(void) {
  types();
  fields();
  enum_constants();
  macros();
  initializers();
  functions();
  return 0;
}
