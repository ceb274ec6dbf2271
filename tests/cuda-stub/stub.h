/*
 * Shared by the files of the stub libcuda (see libcuda.c for what the stub is): the driver's
 * types and constants as cuda.h (CUDA 12) defines them, and the stub's internal interfaces.
 * Compiled with -fvisibility=hidden: only EXPORT functions are the driver API.
 */
#ifndef NCCL_RS_CUDA_STUB_H
#define NCCL_RS_CUDA_STUB_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_PTX = 218,
  CUDA_ERROR_MAP_FAILED = 205,
  CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
  CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
  CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
  CUDA_ERROR_CAPTURED_EVENT = 907,
};

#define MAX_DEVICES 64

struct stream;

/* A device's primary context (the only kind of context the stub has). */
struct ctx {
  int dev;
  int refs;
  struct stream *legacy; /* its legacy NULL stream, created on first use */
};

extern int g_initialized;
extern int g_ndev;
extern pthread_mutex_t g_lock;
extern __thread struct ctx *t_current;

/* Set while the calling thread runs a host function of a stream or graph, or a user object's
 * destructor, where CUDA forbids driver calls: the stub refuses them (CUDA_ERROR_NOT_PERMITTED),
 * saying so, wherever it checks initialisation. */
extern __thread int t_in_callback;
int callback_refuses(const char *call);
/* Every driver entry point counts itself first (see nccl_rs_stub_thread_calls). */
void count_call(const char *name);
/* What an entry point returns that the stand-in called itself: not the caller's call. */
CUresult uncounted(CUresult r);
#define REQUIRE_INIT() \
  do { \
    if (callback_refuses(__func__)) return CUDA_ERROR_NOT_PERMITTED; \
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED; \
  } while (0)
#define REQUIRE_CTX() \
  do { REQUIRE_INIT(); if (!t_current) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

int env_int(const char *name, int dflt);
/* With NCCL_RS_STUB_REPORT_WORKER_CALLS=1: a line on stderr when a thread of nccl-rs's stream
 * workers (named nccl-rs-stream-*) makes device call `name` (work, waits, memory), so tests can
 * check that the workers need no driver while callers' streams may wait for them. */
void note_worker_call(const char *name);

/* streams.c: whether a graph capture prohibits the calling thread from making potentially
 * unsafe call `call` now (see cuThreadExchangeStreamCaptureMode there). If so, the captures
 * that prohibit it are invalidated and the call must fail with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. */
int capture_refuses(const char *call);
#define REFUSE_DURING_CAPTURE(call) \
  do { \
    if (callback_refuses(call)) return CUDA_ERROR_NOT_PERMITTED; \
    if (capture_refuses(call)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; \
  } while (0)

/* memory.c: what the driver knows of an address range. */
enum mem_kind {
  MEM_PAGEABLE = 0, /* unknown to the driver: plain host memory */
  MEM_DEVICE,
  MEM_MANAGED,
  MEM_HOST_PINNED,
  MEM_IPC, /* a peer's device memory, opened by handle */
  MEM_VMM, /* device memory of the virtual memory API, mapped by cuMemMap (vmm.c) */
};
/* The kind of the one allocation that holds all of [p, p + n) (or of the adjacent cuMemMap
 * mappings that do), else MEM_PAGEABLE. */
enum mem_kind mem_lookup(uintptr_t p, size_t n);
/* Whether a kernel running on device `dev` (-1: unknown) reaches p: anything but device memory
 * of another device to which `dev` has not enabled peer access (cuCtxEnablePeerAccess). */
int device_reaches(int dev, uintptr_t p);
/* The device of the stream whose kernel the calling (stand-in) thread runs, or -1. */
extern __thread int t_kernel_dev;

/* Strict device memory (the default; NCCL_RS_STUB_HOST_SEES_DEVICE=1 turns it off): device
 * memory (cuMemAlloc, IPC mappings, cuMemMap) is PROT_NONE at the addresses the driver hands
 * out, so host code that touches it faults, as it would on a GPU; the stand-in's streams and
 * kernels reach the same pages through an alias mapping at address - DEVICE_ALIAS. */
#define DEVICE_ALIAS ((uintptr_t)1 << 45)
int strict_device(void);
/* Where the stand-in's device work reaches address p: its alias for strict device memory,
 * else p itself (host, pinned and managed memory are the host's). */
void *dev_view(uintptr_t p);
/* Maps `size` bytes of `fd` as device memory at a new address (and its alias); NULL on failure. */
void *map_device(int fd, size_t size);
/* Unmaps device memory that map_device mapped. */
void unmap_device(void *p, size_t size);

/* NCCL_RS_STUB_FREE_SYNCS=1: calls that free or unmap memory (cuMemFree, cuMemFreeHost,
 * cuIpcCloseMemHandle, cuMemUnmap) first wait for the process's device work issued before
 * them, as CUDA says they "may perform implicit synchronization"; one that waits 20 s names
 * the call and its thread and aborts (on a GPU that synchronizes, it would hang). */
void device_sync(const char *call);

struct phys;
/* One allocation the driver made or mapped. */
struct range {
  struct range *next;
  uintptr_t base;
  size_t size;
  enum mem_kind kind;
  int dev;
  int fd; /* MEM_DEVICE: the memfd, kept open for peers to open through /proc */
  uint64_t id;
  uint64_t buffer_id; /* CU_POINTER_ATTRIBUTE_BUFFER_ID: never reused in the process */
  struct phys *phys;  /* MEM_VMM: the physical allocation mapped here */
  int owner_pid;      /* MEM_IPC: the exporting process (with `id`, which allocation) */
  int refs;           /* MEM_IPC: opens not yet closed (the driver hands out one mapping) */
};
/* The table of ranges, under g_mem_lock (memory.c). */
extern pthread_mutex_t g_mem_lock;
struct range *mem_find(uintptr_t p);
struct range *mem_add(uintptr_t base, size_t size, enum mem_kind kind, int dev, int fd, uint64_t id);
/* Unlinks and returns the range starting exactly at p if its kind is one of `kinds` (bits). */
struct range *mem_take(uintptr_t p, unsigned kinds);
/* Some range overlaps [p, p + n). */
int mem_overlaps(uintptr_t p, size_t n);
/* vmm.c: allocations imported from descriptors and still held, their bytes added to *bytes
 * (g_mem_lock held). */
int vmm_imported(size_t *bytes);
/* vmm.c: the handle types a physical allocation was created with (g_mem_lock held). */
int vmm_handle_types(const struct phys *p);

/* kernels.c: the C twins of kernels/reduce.ptx. */
struct kernel;
const struct kernel *kernel_find(const char *name);
int kernel_valid(const void *f);
int kernel_is_gate(const struct kernel *k);
/* How many of the parameters (dst, a, b) are pointers to n elements of elem_size bytes. */
int kernel_pointers(const struct kernel *k);
size_t kernel_reach(const struct kernel *k, const uint64_t params[4]);
/* Runs kernel `k` with its four 64-bit parameters (dst, a, b|scalar|divisor, n), launched
 * with `grid_y` rows of blocks (an indirect kernel's row runs one descriptor). */
void kernel_run(const struct kernel *k, const uint64_t params[4], unsigned grid_y);

#endif
