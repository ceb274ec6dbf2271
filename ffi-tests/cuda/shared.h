/*
 * shared.h - what the parts of the CUDA-mode test program (ffi-tests/cuda.c and the files of
 * this folder) share: the driver API reached through dlopen (`cu`), the communicators and
 * streams of the run, buffer helpers, and the parts main runs.
 */
#ifndef NCCL_RS_FFI_CUDA_SHARED_H
#define NCCL_RS_FFI_CUDA_SHARED_H

#include "../common.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <linux/capability.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* CUstream;
typedef void* CUcontext;

struct cu_api {
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGet)(int*, int);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*PrimaryCtxRetain)(CUcontext*, int);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemAllocManaged)(CUdeviceptr*, size_t, unsigned);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemHostAlloc)(void**, size_t, unsigned);
  CUresult (*MemFreeHost)(void*);
  CUresult (*MemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned);
  CUresult (*MemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*StreamQuery)(CUstream);
  CUresult (*StreamWaitValue32)(CUstream, CUdeviceptr, unsigned, unsigned);
  CUresult (*StreamBeginCapture)(CUstream, int);
  CUresult (*StreamEndCapture)(CUstream, void**);
  CUresult (*GraphDestroy)(void*);
  CUresult (*ThreadExchangeStreamCaptureMode)(int*);
  CUresult (*GraphInstantiate)(void**, void*, unsigned long long);
  CUresult (*GraphLaunch)(void*, CUstream);
  CUresult (*GraphExecDestroy)(void*);
  CUresult (*PointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*EventCreate)(void**, unsigned);
  CUresult (*EventDestroy)(void*);
  CUresult (*EventRecord)(void*, CUstream);
  CUresult (*StreamWaitEvent)(CUstream, void*, unsigned);
  CUresult (*MemGetInfo)(size_t*, size_t*);
  /* The stand-in's own (NULL on a GPU): the peers' device memory this process holds open. */
  int (*StubPeerMemory)(size_t*);
  /* The stand-in's own: the memory this process allocated and has not freed. */
  int (*StubOwnMemory)(size_t*);
  void (*StubPointerQueriesFail)(int);
  unsigned long (*StubThreadCalls)(int);
  /* The virtual memory API, loaded with CUDA_TEST_VMM=1. */
  CUresult (*MemGetAllocationGranularity)(size_t*, const void*, int);
  CUresult (*MemCreate)(unsigned long long*, size_t, const void*, unsigned long long);
  CUresult (*MemRelease)(unsigned long long);
  CUresult (*MemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const void*, size_t);
};
extern struct cu_api cu;

#define CU(call)                                                                  \
  do {                                                                            \
    CUresult cu_r_ = (call);                                                      \
    if (cu_r_ != 0) {                                                             \
      tlog("FATAL %s:%d: %s returned CUDA error %d", __FILE__, __LINE__, #call, cu_r_); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

#define CU_STREAM_NON_BLOCKING 1
#define CU_MEMHOSTALLOC_DEVICEMAP 2
#define CU_STREAM_WAIT_VALUE_GEQ 0
#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
#define CUDA_ERROR_NOT_READY 600
#define CU_EVENT_DISABLE_TIMING 2

/* cuda.h's CUmemAllocationProp and CUmemAccessDesc (CUDA 12), for the virtual memory API. */
typedef struct {
  int type, requested_handle_types, location_type, location_id;
  void* win32;
  unsigned char alloc_flags[8];
} mem_prop_t;
typedef struct {
  int location_type, location_id, flags;
} mem_access_t;
enum { MEM_PINNED = 1, MEM_LOCATION_DEVICE = 1, MEM_HANDLE_POSIX_FD = 1, MEM_ACCESS_RW = 3 };

/* CUDA_TEST_VMM=1: device buffers as PyTorch's expandable segments carve them. One range of
 * addresses is reserved; allocations of the granularity (2 MiB on a GPU), each its own
 * cuMemCreate shareable as a POSIX descriptor, are mapped into it as buffers need them; buffers
 * follow each other at 256-byte alignment, so most start inside an allocation and many span
 * several. When the last buffer is freed, every allocation is unmapped and released (as
 * empty_cache does) and later buffers get new allocations at the same addresses. */
struct vmm_state {
  int on;
  int private; /* CUDA_TEST_VMM=private: allocations without a shareable handle type */
  size_t gran, reserved;
  CUdeviceptr base;
  size_t mapped, used; /* bytes mapped from base, bytes handed out */
  int live;
};
extern struct vmm_state g_vmm;

typedef enum { C_ALLREDUCE, C_ALLGATHER, C_REDUCESCATTER, C_BROADCAST, C_REDUCE, C_ALLTOALL, C_GATHER, C_SCATTER } coll_t;

/* The run's communicators and streams (one per local rank), and what the parts share: device
 * and pinned buffers, a held stream's gate, the collectives' inputs and expected values
 * (cuda.c), and whether nccl-rs reaches other ranks' windows directly (cuda/rma.c). */
CUdeviceptr dev_alloc(size_t bytes);
void dev_free(CUdeviceptr p);
void expect_no_async_error(const char* what);
float expected(coll_t c, size_t count, int n, int rank, size_t j, int salt);
extern ncclComm_t g_comms[MAX_LOCAL];
extern CUstream g_streams[MAX_LOCAL];
uint32_t* gate_word(CUdeviceptr* dev);
void* host_alloc(size_t bytes);
int host_wait_mode(void);
float in_value(int r, size_t j, int salt);
void run_coll(coll_t c, size_t count, int in_place, int gate, int salt);
int peer_access(void);

/* The parts of cuda/faults.c main runs. */
int abort_held(void);
int closed_early(void);
int fault(void);
int graph_held(void);
int launch_fail(void);
int mismatch(void);
int p2p_late(void);
int pointer_fails(void);
int shrink_stuck(void);
int stream_held(void);

/* The parts of cuda/graph.c main runs. */
void capture(void);
void capture_elsewhere(void);
void graph(void);
void graph_refused(void);

/* The parts of cuda/rma.c main runs. */
void held_by_signal(void);
void peer_pointers(void);
void rma(void);
void rma_errors(void);
void rma_failed(void);
void rma_gone(void);
void rma_late(void);
void rma_no_sender(void);
void rma_pageable(void);
void rma_stopped(void);
void rma_streams(void);

/* The parts of cuda/torch.c main runs. */
void torch_like(void);

/* The parts of cuda/soak.c main runs. */
void soak(void);

#endif
