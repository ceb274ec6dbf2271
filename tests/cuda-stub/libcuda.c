#define _GNU_SOURCE
/*
 * A stand-in for libcuda.so.1, for tests only (never shipped): the CUDA driver entry points
 * that src/device/cuda calls, implemented on host memory with the driver's documented
 * semantics, so that CUDA mode's device layer can be tested on machines without a GPU.
 *
 * - N fake devices: NCCL_RS_STUB_DEVICES (default 1; 0 makes cuInit fail with NO_DEVICE).
 *   NCCL_RS_STUB_DRIVER_VERSION (default 12040) is what cuDriverGetVersion reports;
 *   NCCL_RS_STUB_WAIT_VALUE_NOR=0 makes the devices deny CU_STREAM_WAIT_VALUE_NOR.
 * - Streams are ordered queues, each run by a worker thread (the legacy NULL stream of each
 *   device too). Events complete when their stream reaches them. cuStreamWaitValue32_v2 holds
 *   its stream until the word satisfies the condition; cuStreamWriteValue32_v2 writes in order
 *   (streams.c). NCCL_RS_STUB_OP_DELAY_US=N holds each operation 0..N µs before it runs: a
 *   device that lags the host, as a GPU does.
 * - "Device memory" is a memfd mapping, so an IPC handle (pid, fd, id) opens in another process
 *   as the same bytes (through /proc/<pid>/fd). Addresses are host addresses (UVA), but the
 *   host cannot touch device memory: it faults, as on a GPU, while the stand-in's streams and
 *   kernels reach it through an alias (stub.h: strict device memory; memory.c, vmm.c).
 *   NCCL_RS_STUB_HOST_SEES_DEVICE=1 lets the host read and write it, as before.
 *   Opening an IPC handle again in a process returns the same mapping, counted, as the driver
 *   documents (the last cuIpcCloseMemHandle unmaps it).
 *   A mapping of a peer's memory (IPC, or an imported allocation) keeps it alive after the
 *   peer frees it; nccl_rs_stub_peer_memory, not a driver call, counts what a process holds.
 * - cuModuleLoadData(Ex) accepts PTX text (it must contain ".version"); cuModuleGetFunction finds
 *   the kernels of kernels/reduce.ptx (the name must be an .entry of the module) and binds them
 *   to C implementations with the semantics of src/device/host/reduce.rs (kernels.c);
 *   cuLaunchKernel enqueues the call. The grid does not matter: the kernels are grid-stride.
 * - Graph capture records a stream's copies, memsets, memory operations, kernels and host
 *   functions into a graph (streams join a capture through events, as in CUDA), which cuGraphInstantiateWithFlags and cuGraphLaunch run again;
 *   user objects are reference counted and destroyed on a thread of their own. What a capture
 *   prohibits is CUDA's: a potentially unsafe call (allocating or freeing memory, IPC
 *   mappings, loading modules, querying or synchronising streams, events, contexts) made while
 *   a capture forbids it fails and invalidates that capture, following each thread's capture
 *   interaction mode (streams.c). Host functions and user objects' destructors may make no
 *   driver call (stub.h: callback_refuses).
 *
 * This file: initialisation, devices, primary contexts, error names.
 * Built by tests/cuda_layer.rs: cc -Wall -Wextra -Werror -O2 -pthread -shared -fPIC
 * -fvisibility=hidden *.c.
 */
#include <stdio.h>
#include <stdlib.h>

#include <pthread.h>
#include <string.h>
#include "stub.h"

int g_initialized;
int g_ndev;
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
__thread struct ctx *t_current;
__thread int t_in_callback;

/* Driver calls of the calling thread so far, and whether to name each on stderr. */
static __thread unsigned long t_calls;
static __thread int t_trace_calls;

void count_call(const char *name) {
  t_calls++;
  if (t_trace_calls) fprintf(stderr, "cuda-stub: call %s\n", name);
}

CUresult uncounted(CUresult r) {
  t_calls--;
  return r;
}

/* Not the driver's: for tests, how many driver calls this thread has made, to count what one
 * library call costs; with `trace` set, each later call of this thread is named on stderr. */
EXPORT unsigned long nccl_rs_stub_thread_calls(int trace) {
  t_trace_calls = trace;
  return t_calls;
}

int callback_refuses(const char *call) {
  if (!t_in_callback) return 0;
  fprintf(stderr, "cuda-stub: %s from a host function or a user object's destructor: CUDA_ERROR_NOT_PERMITTED\n", call);
  return 1;
}
static struct ctx g_ctx[MAX_DEVICES];

/* Device attributes (cuda.h's CUdevice_attribute values). */
enum {
  ATTR_MAX_THREADS_PER_BLOCK = 1,
  ATTR_MULTIPROCESSOR_COUNT = 16,
  ATTR_CAN_MAP_HOST_MEMORY = 19,
  ATTR_UNIFIED_ADDRESSING = 41,
  ATTR_COMPUTE_CAPABILITY_MAJOR = 75,
  ATTR_COMPUTE_CAPABILITY_MINOR = 76,
  ATTR_CAN_USE_STREAM_MEM_OPS_V1 = 92,
  ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V1 = 94,
  ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V2 = 123,
  ATTR_END = 140,
};

int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

void note_worker_call(const char *name) {
  if (!env_int("NCCL_RS_STUB_REPORT_WORKER_CALLS", 0)) return;
  char thread[32] = "";
  if (pthread_getname_np(pthread_self(), thread, sizeof thread) != 0) return;
  if (strncmp(thread, "nccl-rs-stream", 14) == 0) fprintf(stderr, "cuda-stub: %s from the stream worker %s\n", name, thread);
}

EXPORT CUresult cuInit(unsigned flags) {
  count_call(__func__);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  int n = env_int("NCCL_RS_STUB_DEVICES", 1);
  if (n <= 0) return CUDA_ERROR_NO_DEVICE;
  pthread_mutex_lock(&g_lock);
  if (!g_initialized) {
    g_ndev = n > MAX_DEVICES ? MAX_DEVICES : n;
    for (int i = 0; i < g_ndev; i++) g_ctx[i].dev = i;
    g_initialized = 1;
  }
  pthread_mutex_unlock(&g_lock);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
  count_call(__func__);
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = env_int("NCCL_RS_STUB_DRIVER_VERSION", 12040);
  return CUDA_SUCCESS;
}

static const char *error_name(CUresult r) {
  switch (r) {
#define NAME(x) \
  case x:       \
    return #x;
    NAME(CUDA_SUCCESS)
    NAME(CUDA_ERROR_INVALID_VALUE)
    NAME(CUDA_ERROR_OUT_OF_MEMORY)
    NAME(CUDA_ERROR_NOT_INITIALIZED)
    NAME(CUDA_ERROR_NO_DEVICE)
    NAME(CUDA_ERROR_INVALID_DEVICE)
    NAME(CUDA_ERROR_INVALID_IMAGE)
    NAME(CUDA_ERROR_INVALID_CONTEXT)
    NAME(CUDA_ERROR_INVALID_PTX)
    NAME(CUDA_ERROR_MAP_FAILED)
    NAME(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)
    NAME(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    NAME(CUDA_ERROR_LAUNCH_FAILED)
    NAME(CUDA_ERROR_INVALID_HANDLE)
    NAME(CUDA_ERROR_NOT_FOUND)
    NAME(CUDA_ERROR_NOT_READY)
    NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
    NAME(CUDA_ERROR_NOT_PERMITTED)
    NAME(CUDA_ERROR_NOT_SUPPORTED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
    NAME(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    NAME(CUDA_ERROR_CAPTURED_EVENT)
#undef NAME
    default:
      return NULL;
  }
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **s) {
  count_call(__func__);
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  *s = error_name(r);
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s) {
  count_call(__func__);
  /* The stub has no prose: the name is the description. */
  return uncounted(cuGetErrorName(r, s));
}

EXPORT CUresult cuDeviceGetCount(int *count) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = g_ndev;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

/* Device d's PCI bus id: the d-th of NCCL_RS_STUB_PCI_BUS_IDS (a comma list), else
 * 0000:(d+1):00.0, in upper case as the driver writes it. */
EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!bus || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  char id[32];
  snprintf(id, sizeof id, "0000:%02X:00.0", dev + 1);
  const char *list = getenv("NCCL_RS_STUB_PCI_BUS_IDS");
  for (int i = 0; list && *list; i++) {
    const char *end = strchr(list, ',');
    size_t n = end ? (size_t)(end - list) : strlen(list);
    if (i == dev && n < sizeof id) {
      memcpy(id, list, n);
      id[n] = 0;
      break;
    }
    list = end ? end + 1 : NULL;
  }
  if ((int)strlen(id) >= len) return CUDA_ERROR_INVALID_VALUE;
  strcpy(bus, id);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(name, (size_t)len, "nccl-rs stub device %d", dev);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *value, int attr, CUdevice dev) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!value || attr <= 0 || attr >= ATTR_END) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  switch (attr) {
    case ATTR_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    case ATTR_MULTIPROCESSOR_COUNT: *value = 4; break;
    case ATTR_CAN_MAP_HOST_MEMORY: *value = 1; break;
    case ATTR_UNIFIED_ADDRESSING: *value = 1; break;
    case ATTR_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case ATTR_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    /* The legacy V1 operations are off, as without the module's NVreg_EnableStreamMemOPs=1;
     * the V2 ones (all that the stub implements) are always on. */
    case ATTR_CAN_USE_STREAM_MEM_OPS_V1: *value = 0; break;
    case ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V1: *value = 0; break;
    case ATTR_CAN_USE_STREAM_WAIT_VALUE_NOR_V2: *value = env_int("NCCL_RS_STUB_WAIT_VALUE_NOR", 1) != 0; break;
    default: *value = 0;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(struct ctx **pctx, CUdevice dev) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_lock);
  g_ctx[dev].refs++;
  pthread_mutex_unlock(&g_lock);
  *pctx = &g_ctx[dev];
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  count_call(__func__);
  REQUIRE_INIT();
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_lock);
  CUresult r = CUDA_ERROR_INVALID_CONTEXT;
  if (g_ctx[dev].refs > 0) {
    g_ctx[dev].refs--;
    r = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

EXPORT CUresult cuCtxSetCurrent(struct ctx *c) {
  count_call(__func__);
  REQUIRE_INIT();
  if (c && (c < g_ctx || c >= g_ctx + g_ndev)) return CUDA_ERROR_INVALID_CONTEXT;
  t_current = c;
  return CUDA_SUCCESS;
}

/* Peer access: [from][to], enabled by cuCtxEnablePeerAccess with `from` current. Every pair
 * of devices can have it unless NCCL_RS_STUB_NO_PEER_ACCESS=1. */
static int g_peer[MAX_DEVICES][MAX_DEVICES];
__thread int t_kernel_dev = -1;

int peer_enabled(int from, int to) { return from >= 0 && to >= 0 && __atomic_load_n(&g_peer[from][to], __ATOMIC_ACQUIRE); }

EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!can) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_ndev || peer < 0 || peer >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  *can = dev != peer && !env_int("NCCL_RS_STUB_NO_PEER_ACCESS", 0);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxEnablePeerAccess(struct ctx *peer, unsigned flags) {
  count_call(__func__);
  REQUIRE_CTX();
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!peer || peer < g_ctx || peer >= g_ctx + g_ndev) return CUDA_ERROR_INVALID_CONTEXT;
  if (peer == t_current) return CUDA_ERROR_INVALID_DEVICE;
  if (env_int("NCCL_RS_STUB_NO_PEER_ACCESS", 0)) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  if (__atomic_exchange_n(&g_peer[t_current->dev][peer->dev], 1, __ATOMIC_ACQ_REL)) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(struct ctx **pctx) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  *pctx = t_current;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
  count_call(__func__);
  REQUIRE_CTX();
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  *dev = t_current->dev;
  return CUDA_SUCCESS;
}
