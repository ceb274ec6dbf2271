/*
 * cuda.c - CUDA mode: collectives on device memory, ordered with the caller's streams.
 *
 *   [CUDA_TEST_SKIP=Part,...] cuda [--quick] [--only Gated|Collectives|InPlace|P2P|P2PPairings|Mixed|Order|PreMul|Capture|MemAlloc|Rma|RmaPageable|PeerPointers|RmaErrors|Context|GroupMix|Torch|Churn|Streams|Recycle|Leaks|Backlog|Pageable|CaptureElsewhere|Graph|GraphRefused|Suspend|DroppedGroup|Ahead]
 *   CUDA_TEST_FAULT=1|graph|shrink cuda (2 processes; the harness kills process 1 once it prints
 *                                LOOPING; graph: the all-reduces are launches of a captured graph;
 *                                shrink: 3 processes, the survivors shrink and go on)
 *   CUDA_TEST_MISMATCH=1|small|p2p cuda   (2 processes issuing all-reduces of different
 *                                     counts, or a send and a receive of different sizes)
 *   CUDA_TEST_ABORT_HELD=N cuda (ncclCommAbort while the call's stream is held before it: an
 *                                all-reduce of N floats, 1 meaning 1024; with
 *                                CUDA_TEST_ABORT_HELD_ALLTOALL=1 an in-place all-to-all)
 *   CUDA_TEST_LAUNCH_FAIL=1 cuda (2 processes; process 1 with NCCL_RS_STUB_LAUNCH_FAILS=1)
 *   CUDA_TEST_STREAM_HELD=FILE cuda (2 processes: process 1 holds its stream before an
 *                                all-reduce until FILE exists; both check the result)
 *   CUDA_TEST_GRAPH_HELD=FILE cuda (2 processes, NCCL_RS_GRAPH_CAPTURE=1: process 1 launches its
 *                                graph's second time once FILE exists)
 *   CUDA_TEST_P2P_LATE=FILE cuda (2 processes: process 1 issues its receive of process 0's direct
 *                                send once FILE exists)
 *   CUDA_TEST_CLOSED_EARLY=1 cuda (2 processes: process 1 destroys its communicator after init
 *                                and stays; process 0's direct receive from it must fail saying so)
 *   CUDA_TEST_SHRINK_STUCK=FILE cuda (3 processes: process 2 issues nothing until FILE exists;
 *                                the others shrink it away with NCCL_SHRINK_ABORT and go on)
 *   CUDA_TEST_VMM=1 cuda        (device buffers from the virtual memory API, placed as PyTorch's
 *                                expandable segments place them: see vmm_alloc)
 *   CUDA_TEST_VMM=private cuda  (the same, but allocations no other process can map: device
 *                                memory peers cannot read, as a stream-ordered allocator's pools)
 *   NCCL_RS_GRAPH_CAPTURE=1 cuda --only Graph (collectives captured into CUDA graphs, launched
 *                                three times with new inputs, behind held streams)
 *   CUDA_TEST_RMA_LATE=FILE cuda --only RmaLate (2 processes: rank 1 signals once FILE exists)
 *   CUDA_TEST_RMA_RELEASE=FILE cuda --only RmaStreams (3 processes: a held stream holds up no other peer)
 *   cuda --only RmaGone         (2+ processes: a stream waits for signals of a rank that leaves)
 *   cuda --only RmaStopped      (2 processes: rank 1 stops itself, for the harness to resume;
 *                                rank 0's put into its window names it)
 *   cuda --only HeldBySignal    (3 processes: rank 2 stops itself before it signals rank 1, whose
 *                                stream waits for that before a send to rank 0: rank 0 names rank 2)
 *   cuda --only RmaFailed       (2 processes: rank 0's communicator fails in a one-sided operation
 *                                on a stream; both ranks' streams waiting for signals are let go)
 *   [CUDA_TEST_TRACE_CALLS=1] cuda --only Calls (stand-in: driver calls per warm call, each named
 *                               with the variable set)
 *   NCCL_RS_STUB_DEVICES=N NCCL_TEST_LOCAL=N cuda --only Devices (one thread, a communicator per device)
 *   cuda --only Suspend         (several processes: ncclCommSuspend(NCCL_SUSPEND_MEM) closes the
 *                                peer mappings that keep freed device memory alive)
 *   CUDA_TEST_NO_PTRACE=1 cuda  (the process refuses ptrace access by others, as under Yama:
 *                                no peer can take its descriptors with pidfd_getfd, nor read
 *                                it with CMA)
 *
 * Runs where libcuda.so.1 loads: a GPU machine, or CI with the stand-in driver of
 * tests/cuda-stub on LD_LIBRARY_PATH. The driver API is reached through dlopen, so the program
 * builds without CUDA headers. Every local rank uses device NCCL_TEST_CUDA_DEVICE (default 0):
 * several ranks share one GPU, which nccl-rs allows.
 *
 * NCCL's stream semantics checked here: the call returns before the stream has reached it
 * (Gated: the stream is held by a wait on host memory while the call is made); the operation
 * sees what the stream did before it (inputs are uploaded on the same stream) and work after
 * it sees its result (results are downloaded on the same stream); cuStreamSynchronize is the
 * only synchronisation the program does.
 *
 * The program is this file and those of ffi-tests/cuda/ (each names its parts; shared.h says
 * what they share), compiled together.
 */
#include "common.h"
#include "cuda/shared.h"

struct cu_api cu;
struct vmm_state g_vmm;

static void* sym(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) {
    tlog("FATAL: libcuda.so.1 has no %s", name);
    exit(1);
  }
  return p;
}

static void load_driver(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    tlog("FATAL: cannot load libcuda.so.1: %s", dlerror());
    exit(1);
  }
  *(void**)&cu.Init = sym(lib, "cuInit");
  *(void**)&cu.DeviceGet = sym(lib, "cuDeviceGet");
  *(void**)&cu.DeviceGetCount = sym(lib, "cuDeviceGetCount");
  *(void**)&cu.PrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
  *(void**)&cu.CtxSetCurrent = sym(lib, "cuCtxSetCurrent");
  *(void**)&cu.CtxGetCurrent = sym(lib, "cuCtxGetCurrent");
  *(void**)&cu.MemAlloc = sym(lib, "cuMemAlloc_v2");
  *(void**)&cu.MemFree = sym(lib, "cuMemFree_v2");
  *(void**)&cu.MemAllocManaged = sym(lib, "cuMemAllocManaged");
  *(void**)&cu.MemHostAlloc = sym(lib, "cuMemHostAlloc");
  *(void**)&cu.MemFreeHost = sym(lib, "cuMemFreeHost");
  *(void**)&cu.MemHostGetDevicePointer = sym(lib, "cuMemHostGetDevicePointer_v2");
  *(void**)&cu.MemcpyAsync = sym(lib, "cuMemcpyAsync");
  *(void**)&cu.StreamCreate = sym(lib, "cuStreamCreate");
  *(void**)&cu.StreamDestroy = sym(lib, "cuStreamDestroy_v2");
  *(void**)&cu.StreamSynchronize = sym(lib, "cuStreamSynchronize");
  *(void**)&cu.StreamQuery = sym(lib, "cuStreamQuery");
  *(void**)&cu.StreamWaitValue32 = sym(lib, "cuStreamWaitValue32_v2");
  *(void**)&cu.StreamBeginCapture = sym(lib, "cuStreamBeginCapture_v2");
  *(void**)&cu.StreamEndCapture = sym(lib, "cuStreamEndCapture");
  *(void**)&cu.GraphDestroy = sym(lib, "cuGraphDestroy");
  *(void**)&cu.ThreadExchangeStreamCaptureMode = sym(lib, "cuThreadExchangeStreamCaptureMode");
  *(void**)&cu.GraphInstantiate = sym(lib, "cuGraphInstantiateWithFlags");
  *(void**)&cu.GraphLaunch = sym(lib, "cuGraphLaunch");
  *(void**)&cu.GraphExecDestroy = sym(lib, "cuGraphExecDestroy");
  *(void**)&cu.PointerGetAttribute = sym(lib, "cuPointerGetAttribute");
  *(void**)&cu.EventCreate = sym(lib, "cuEventCreate");
  *(void**)&cu.EventDestroy = sym(lib, "cuEventDestroy_v2");
  *(void**)&cu.EventRecord = sym(lib, "cuEventRecord");
  *(void**)&cu.StreamWaitEvent = sym(lib, "cuStreamWaitEvent");
  *(void**)&cu.MemGetInfo = dlsym(lib, "cuMemGetInfo_v2");
  *(void**)&cu.StubPeerMemory = dlsym(lib, "nccl_rs_stub_peer_memory");
  *(void**)&cu.StubOwnMemory = dlsym(lib, "nccl_rs_stub_own_memory");
  *(void**)&cu.StubPointerQueriesFail = dlsym(lib, "nccl_rs_stub_pointer_queries_fail");
  *(void**)&cu.StubThreadCalls = dlsym(lib, "nccl_rs_stub_thread_calls");
  if (getenv("CUDA_TEST_VMM")) {
    *(void**)&cu.MemGetAllocationGranularity = sym(lib, "cuMemGetAllocationGranularity");
    *(void**)&cu.MemCreate = sym(lib, "cuMemCreate");
    *(void**)&cu.MemRelease = sym(lib, "cuMemRelease");
    *(void**)&cu.MemAddressReserve = sym(lib, "cuMemAddressReserve");
    *(void**)&cu.MemMap = sym(lib, "cuMemMap");
    *(void**)&cu.MemUnmap = sym(lib, "cuMemUnmap");
    *(void**)&cu.MemSetAccess = sym(lib, "cuMemSetAccess");
  }
}

ncclComm_t g_comms[MAX_LOCAL];
CUstream g_streams[MAX_LOCAL];
static CUcontext g_ctx;
static int g_device;

/* CUDA_TEST_SKIP=Part[,Part...]: those parts are left out of a run of every part. */
static int wanted(const char* name) {
  if (!g_env.only) return !test_skipped("CUDA_TEST_SKIP", name);
  return !strcasecmp(g_env.only, name);
}

/* nccl-rs's host-wait mode (NCCL_RS_HOST_WAIT=1, or CUDA_DEVICE_MAX_CONNECTIONS below 8, or a
 * driver that refuses stream waits: the stand-in's NCCL_RS_STUB_WAIT_VALUE_REFUSED): a call
 * returns once its operation is done, so a stream held before the call cannot be. */
int host_wait_mode(void) {
  const char* hw = getenv("NCCL_RS_HOST_WAIT");
  const char* conns = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const char* refused = getenv("NCCL_RS_STUB_WAIT_VALUE_REFUSED");
  if (refused && atoi(refused) != 0) return 1;
  if (hw && *hw) return atoi(hw) != 0;
  return conns && *conns && atoi(conns) < 8;
}

/* Pinned host memory, so copies on a stream are truly asynchronous. */
void* host_alloc(size_t bytes) {
  void* p = NULL;
  CU(cu.MemHostAlloc(&p, bytes ? bytes : 1, CU_MEMHOSTALLOC_DEVICEMAP));
  return p;
}

/* A zeroed word of pinned host memory streams can wait on (`*dev`: its device address),
 * released by the host storing 1: holds a stream before a call. */
uint32_t* gate_word(CUdeviceptr* dev) {
  uint32_t* flag = host_alloc(64);
  *(volatile uint32_t*)flag = 0;
  CU(cu.MemHostGetDevicePointer(dev, flag, 0));
  return flag;
}

static mem_prop_t vmm_prop(void) {
  mem_prop_t p = {MEM_PINNED, g_vmm.private ? 0 : MEM_HANDLE_POSIX_FD, MEM_LOCATION_DEVICE, g_device, NULL, {0}};
  return p;
}

static CUdeviceptr vmm_alloc(size_t bytes) {
  if (!g_vmm.base) {
    mem_prop_t prop = vmm_prop();
    CU(cu.MemGetAllocationGranularity(&g_vmm.gran, &prop, 0));
    g_vmm.reserved = (size_t)1 << 31;
    CU(cu.MemAddressReserve(&g_vmm.base, g_vmm.reserved, g_vmm.gran, 0, 0));
  }
  size_t at = (g_vmm.used + 255) & ~(size_t)255;
  if (at + bytes > g_vmm.reserved) {
    tlog("FATAL: the test's expandable segment is full (%zu + %zu bytes)", at, bytes);
    exit(1);
  }
  while (g_vmm.mapped < at + bytes) {
    mem_prop_t prop = vmm_prop();
    unsigned long long h = 0;
    CU(cu.MemCreate(&h, g_vmm.gran, &prop, 0));
    CU(cu.MemMap(g_vmm.base + g_vmm.mapped, g_vmm.gran, 0, h, 0));
    CU(cu.MemRelease(h)); /* the mapping holds it */
    mem_access_t rw = {MEM_LOCATION_DEVICE, g_device, MEM_ACCESS_RW};
    CU(cu.MemSetAccess(g_vmm.base + g_vmm.mapped, g_vmm.gran, &rw, 1));
    g_vmm.mapped += g_vmm.gran;
  }
  g_vmm.used = at + bytes;
  g_vmm.live++;
  return g_vmm.base + at;
}

static void vmm_free(void) {
  if (--g_vmm.live > 0) return;
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamSynchronize(g_streams[l]));
  for (size_t off = 0; off < g_vmm.mapped; off += g_vmm.gran) CU(cu.MemUnmap(g_vmm.base + off, g_vmm.gran));
  g_vmm.mapped = g_vmm.used = 0;
}

CUdeviceptr dev_alloc(size_t bytes) {
  if (g_vmm.on) return vmm_alloc(bytes ? bytes : 1);
  CUdeviceptr p = 0;
  CU(cu.MemAlloc(&p, bytes ? bytes : 1));
  return p;
}

void dev_free(CUdeviceptr p) {
  if (g_vmm.on) vmm_free();
  else CU(cu.MemFree(p));
}

/* CUDA_TEST_NO_PTRACE=1: no other process may ptrace this one (it is not dumpable and drops
 * CAP_SYS_PTRACE, which root would use to override that), as under Yama's ptrace_scope:
 * pidfd_getfd and process_vm_readv on it fail. */
static void refuse_ptrace(void) {
  struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct caps[2];
  if (syscall(SYS_capget, &hdr, caps) != 0) {
    tlog("FATAL: capget: %s", strerror(errno));
    exit(1);
  }
  caps[CAP_TO_INDEX(CAP_SYS_PTRACE)].effective &= ~CAP_TO_MASK(CAP_SYS_PTRACE);
  caps[CAP_TO_INDEX(CAP_SYS_PTRACE)].permitted &= ~CAP_TO_MASK(CAP_SYS_PTRACE);
  caps[CAP_TO_INDEX(CAP_SYS_PTRACE)].inheritable &= ~CAP_TO_MASK(CAP_SYS_PTRACE);
  if (syscall(SYS_capset, &hdr, caps) != 0 || prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    tlog("FATAL: refusing ptrace: %s", strerror(errno));
    exit(1);
  }
}

/* Value j of rank r's input: small integers, exact in float sums of up to 16 ranks. */
float in_value(int r, size_t j, int salt) { return (float)((r + 1) * 3 + (int)(j % 13) + salt); }

static void make_cuda_comms(void) {
  ncclUniqueId id;
  get_unique_id("", &id);
  CU(cu.CtxSetCurrent(g_ctx));
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommInitRank(&g_comms[l], g_env.nranks, id, g_env.first_rank + l));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamCreate(&g_streams[l], CU_STREAM_NON_BLOCKING));
    int dev = -1;
    CHECK(ncclCommCuDevice(g_comms[l], &dev));
    EXPECT(dev == g_device, "ncclCommCuDevice says %d, the current device is %d", dev, g_device);
  }
}

static const char* COLL_NAME[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "AlltoAll", "Gather", "Scatter"};

/* Element counts of the send and receive buffers of `c` for `count` (NCCL's argument). */
static void coll_sizes(coll_t c, size_t count, int n, size_t* ns, size_t* nr) {
  switch (c) {
    case C_ALLGATHER:
    case C_GATHER: *ns = count; *nr = count * n; break;
    case C_REDUCESCATTER:
    case C_SCATTER: *ns = count * n; *nr = count; break;
    case C_ALLTOALL: *ns = count * n; *nr = count * n; break;
    default: *ns = count; *nr = count; break;
  }
}

float expected(coll_t c, size_t count, int n, int rank, size_t j, int salt) {
  const int root = n - 1;
  switch (c) {
    case C_ALLREDUCE:
    case C_REDUCE: {
      float s = 0;
      for (int r = 0; r < n; r++) s += in_value(r, j, salt);
      return s;
    }
    case C_ALLGATHER:
    case C_GATHER: return in_value((int)(j / count), j % count, salt);
    case C_SCATTER: return in_value(root, (size_t)rank * count + j, salt);
    case C_REDUCESCATTER: {
      float s = 0;
      for (int r = 0; r < n; r++) s += in_value(r, (size_t)rank * count + j, salt);
      return s;
    }
    case C_BROADCAST: return in_value(root, j, salt);
    case C_ALLTOALL: {
      /* block b of my output is block `rank` of rank b's input */
      size_t b = j / count, k = j % count;
      return in_value((int)b, (size_t)rank * count + k, salt);
    }
  }
  return -1;
}

static ncclResult_t issue(coll_t c, const void* s, void* r, size_t count, ncclComm_t comm, CUstream st, int n) {
  switch (c) {
    case C_ALLREDUCE: return ncclAllReduce(s, r, count, ncclFloat32, ncclSum, comm, st);
    case C_ALLGATHER: return ncclAllGather(s, r, count, ncclFloat32, comm, st);
    case C_REDUCESCATTER: return ncclReduceScatter(s, r, count, ncclFloat32, ncclSum, comm, st);
    case C_BROADCAST: return ncclBroadcast(s, r, count, ncclFloat32, n - 1, comm, st);
    case C_REDUCE: return ncclReduce(s, r, count, ncclFloat32, ncclSum, n - 1, comm, st);
    case C_ALLTOALL: return ncclAlltoAll(s, r, count, ncclFloat32, comm, st);
    case C_GATHER: return ncclGather(s, r, count, ncclFloat32, n - 1, comm, st);
    case C_SCATTER: return ncclScatter(s, r, count, ncclFloat32, n - 1, comm, st);
  }
  return ncclInvalidArgument;
}

/* One collective on every local rank: upload, call, download on the rank's stream; then
 * synchronise and compare. `gate`: the streams first wait on a host word, released only
 * after every call returned (a call that waited for its stream would never return). */
/* Every local communicator reports no asynchronous error after `what`. */
void expect_no_async_error(const char* what) {
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t async = ncclSuccess;
    CHECK(ncclCommGetAsyncError(g_comms[l], &async));
    EXPECT(async == ncclSuccess, "%s: async error %s: %s", what, result_name(async), ncclGetLastError(g_comms[l]));
  }
}

void run_coll(coll_t c, size_t count, int in_place, int gate, int salt) {
  const int n = g_env.nranks;
  size_t ns, nr;
  coll_sizes(c, count, n, &ns, &nr);
  CUdeviceptr dsend[MAX_LOCAL], drecv[MAX_LOCAL];
  float *hin[MAX_LOCAL], *hout[MAX_LOCAL];
  CUdeviceptr dflag = 0;
  uint32_t* flag = gate_word(&dflag);
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    drecv[l] = dev_alloc(nr * sizeof(float));
    hin[l] = host_alloc(ns * sizeof(float));
    hout[l] = host_alloc(nr * sizeof(float));
    for (size_t j = 0; j < ns; j++) hin[l][j] = in_value(rank, j, salt);
    memset(hout[l], 0xff, nr * sizeof(float));
    if (in_place) {
      /* NCCL's in-place layouts: allgather's input is my block of the output, reducescatter's
       * output my block of the input; the others share one buffer. */
      size_t big = ns > nr ? ns : nr;
      dev_free(drecv[l]);
      drecv[l] = dev_alloc(big * sizeof(float));
      dsend[l] = drecv[l];
      if (c == C_ALLGATHER || c == C_GATHER) dsend[l] = drecv[l] + (CUdeviceptr)rank * count * sizeof(float);
      if (c == C_REDUCESCATTER || c == C_SCATTER) drecv[l] = dsend[l] + (CUdeviceptr)rank * count * sizeof(float);
    } else {
      dsend[l] = dev_alloc(ns * sizeof(float));
    }
    if (gate) CU(cu.StreamWaitValue32(g_streams[l], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
    CU(cu.MemcpyAsync(dsend[l], (CUdeviceptr)(uintptr_t)hin[l], ns * sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(issue(c, (const void*)(uintptr_t)dsend[l], (void*)(uintptr_t)drecv[l], count, g_comms[l], g_streams[l], n));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++)
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hout[l], drecv[l], nr * sizeof(float), g_streams[l]));
  if (gate) {
    for (int l = 0; l < g_env.local; l++)
      EXPECT(cu.StreamQuery(g_streams[l]) == CUDA_ERROR_NOT_READY,
             "%s: rank %d's stream finished while it was held before the call", COLL_NAME[c], g_env.first_rank + l);
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  }
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamSynchronize(g_streams[l]));
    int rank = g_env.first_rank + l;
    int is_root = rank == n - 1;
    if ((c == C_REDUCE || c == C_GATHER) && !is_root) continue; /* only the root's output is defined */
    size_t bad = 0, first = 0;
    for (size_t j = 0; j < nr; j++) {
      float want = expected(c, count, n, rank, j, salt);
      if (hout[l][j] != want && bad++ == 0) first = j;
    }
    EXPECT(bad == 0, "%s count %zu%s%s rank %d: %zu wrong values, first at %zu: %g, expected %g", COLL_NAME[c], count,
           in_place ? " in-place" : "", gate ? " gated" : "", rank, bad, first, bad ? hout[l][first] : 0.0,
           bad ? expected(c, count, n, rank, first, salt) : 0.0);
  }
  for (int l = 0; l < g_env.local; l++) {
    if (in_place) {
      dev_free(c == C_REDUCESCATTER || c == C_SCATTER ? dsend[l] : drecv[l]);
    } else {
      dev_free(dsend[l]);
      dev_free(drecv[l]);
    }
    CU(cu.MemFreeHost(hin[l]));
    CU(cu.MemFreeHost(hout[l]));
  }
  CU(cu.MemFreeHost(flag));
  expect_no_async_error(COLL_NAME[c]);
}

/* Every local rank: fresh device memory d[l] and pinned h[l] of `count` floats, inputs
 * (in_value with `salt`) uploaded on its stream, then one in-place sum all-reduce per rank
 * on `comms` in a group. */
static void fresh_allreduce_on(ncclComm_t* comms, CUdeviceptr* d, float** h, size_t count, int salt) {
  for (int l = 0; l < g_env.local; l++) {
    d[l] = dev_alloc(count * sizeof(float));
    h[l] = host_alloc(count * sizeof(float));
    for (size_t j = 0; j < count; j++) h[l][j] = in_value(g_env.first_rank + l, j, salt);
    CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, comms[l], g_streams[l]));
  CHECK(ncclGroupEnd());
}

static void fresh_allreduce(CUdeviceptr* d, float** h, size_t count, int salt) {
  fresh_allreduce_on(g_comms, d, h, count, salt);
}

/* Host-wait mode: when the call (the group) returns, the operation is done: another stream,
 * not ordered after the call's, reads the result. */
static void host_wait(void) {
  test_step("host-wait");
  const size_t count = 100000;
  CUdeviceptr d[MAX_LOCAL];
  float* h[MAX_LOCAL];
  CUstream side;
  CU(cu.StreamCreate(&side, CU_STREAM_NON_BLOCKING));
  fresh_allreduce(d, h, count, 5);
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), side));
    CU(cu.StreamSynchronize(side));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, 5);
    EXPECT(bad == 0, "host-wait mode: rank %d's result incomplete when the call returned (%zu values)", g_env.first_rank + l, bad);
    CU(cu.StreamSynchronize(g_streams[l]));
    dev_free(d[l]);
    CU(cu.MemFreeHost(h[l]));
  }
  CU(cu.StreamDestroy(side));
}

/* Host-wait mode on nonblocking communicators: a call does not wait for its operation, it
 * returns ncclInProgress at once (even while a peer has yet to make it) and the communicator
 * says ncclInProgress until the operation is done, as with host buffers. The last rank joins
 * only after a blocking barrier the others reach once their calls returned: a call that
 * waited would never return. Then a call the last rank never makes, polled, and aborted. */
static void host_wait_nonblocking(void) {
  test_step("host-wait-nonblocking");
  const int n = g_env.nranks, last = n - 1;
  const size_t counts[2] = {1000, 100000}; /* staged, direct */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t nb[MAX_LOCAL];
  CHECK(make_comms_config("host-wait-nonblocking", nb, &cfg));
  CUdeviceptr d[MAX_LOCAL][2];
  float* h[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    h[l] = host_alloc(counts[1] * sizeof(float));
    for (int k = 0; k < 2; k++) {
      d[l][k] = dev_alloc(counts[k] * sizeof(float));
      for (size_t j = 0; j < counts[k]; j++) h[l][j] = in_value(g_env.first_rank + l, j, 11 + k);
      CU(cu.MemcpyAsync(d[l][k], (CUdeviceptr)(uintptr_t)h[l], counts[k] * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
    }
  }
  /* Round k: one all-reduce of counts[k] (k = 1: in a group even with one local rank). */
  for (int k = 0; k < 2; k++)
    for (int late = 0; late < 2; late++) {
      int issued = 0;
      ncclResult_t r = ncclSuccess;
      if (k == 1 || g_env.local > 1) CHECK(ncclGroupStart());
      for (int l = 0; l < g_env.local; l++)
        if ((g_env.first_rank + l == last) == late) {
          r = ncclAllReduce((void*)(uintptr_t)d[l][k], (void*)(uintptr_t)d[l][k], counts[k], ncclFloat32, ncclSum,
                            nb[l], g_streams[l]);
          EXPECT(r == ncclSuccess || r == ncclInProgress, "the all-reduce of %zu returned %s", counts[k], result_name(r));
          issued++;
        }
      if (k == 1 || g_env.local > 1) r = ncclGroupEnd();
      EXPECT(!issued || r == ncclInProgress, "host-wait mode: a nonblocking all-reduce of %zu%s returned %s, not "
             "ncclInProgress", counts[k], late ? "" : " a peer has yet to join", result_name(r));
      if (!late) expect_in_progress_then_barrier(nb, g_comms);
    }
  for (int l = 0; l < g_env.local; l++) {
    const int rank = g_env.first_rank + l;
    ncclResult_t state = wait_comm(nb[l]);
    EXPECT(state == ncclSuccess, "rank %d: the nonblocking all-reduces ended in %s: %s", rank, result_name(state),
           ncclGetLastError(nb[l]) ? ncclGetLastError(nb[l]) : "");
    for (int k = 0; k < 2; k++) {
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l][k], counts[k] * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t bad = 0;
      for (size_t j = 0; j < counts[k]; j++) bad += h[l][j] != expected(C_ALLREDUCE, counts[k], n, 0, j, 11 + k);
      EXPECT(bad == 0, "rank %d: %zu wrong values after the nonblocking all-reduce of %zu", rank, bad, counts[k]);
    }
  }
  /* The last rank never makes this call: the others poll, then abort. */
  int issued = 0;
  if (g_env.local > 1) CHECK(ncclGroupStart());
  ncclResult_t r = ncclSuccess;
  for (int l = 0; l < g_env.local; l++)
    if (g_env.first_rank + l != last) {
      r = ncclAllReduce((void*)(uintptr_t)d[l][1], (void*)(uintptr_t)d[l][1], counts[1], ncclFloat32, ncclSum, nb[l],
                        g_streams[l]);
      issued++;
    }
  if (g_env.local > 1) r = ncclGroupEnd();
  EXPECT(!issued || r == ncclInProgress, "an all-reduce the last rank never makes returned %s", result_name(r));
  EXPECT(allreduce_sum_int(g_comms, 1) == n, "the barrier before the abort");
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t state = ncclInternalError;
    CHECK(ncclCommGetAsyncError(nb[l], &state));
    EXPECT(g_env.first_rank + l == last || state == ncclInProgress, "rank %d: state %s, the last rank away",
           g_env.first_rank + l, result_name(state));
  }
  /* Every rank has looked before any aborts: the last rank's abort ends the others' wait (with
   * ncclRemoteError, at once), which would race the look above. */
  EXPECT(allreduce_sum_int(g_comms, 1) == n, "the barrier after the look");
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclCommAbort(nb[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    for (int k = 0; k < 2; k++) dev_free(d[l][k]);
    CU(cu.MemFreeHost(h[l]));
  }
  tlog("HostWaitNonblocking: in progress at once, done in the background, aborted while waiting");
}

static void gated(void) {
  test_step("gated");
  run_coll(C_ALLREDUCE, 1000, 0, 1, 1);
  run_coll(C_ALLGATHER, 777, 0, 1, 2);
}

static void collectives(void) {
  test_step("collectives");
  size_t counts[] = {1, 1000, 100000, 300001};
  /* --quick: one size below the direct path's threshold and one above. */
  int first = g_env.quick ? 1 : 0, last = g_env.quick ? 3 : 4;
  for (int c = C_ALLREDUCE; c <= C_SCATTER; c++)
    for (int k = first; k < last; k++) run_coll((coll_t)c, counts[k], 0, 0, c + k);
}

static void in_place(void) {
  test_step("in-place");
  for (int c = C_ALLREDUCE; c <= C_SCATTER; c++) run_coll((coll_t)c, 40099, 1, 0, 7 + c);
}

/* A ring of sends and receives in one group, on device memory, four rounds, the last in place.
 * Each round sends three messages to the next rank: large, small, large — the large ones go
 * direct between ranks of a host, the small one is staged, and each must still land in its
 * own buffer. */
static void p2p(void) {
  test_step("p2p");
  const int n = g_env.nranks;
  const size_t counts[3] = {70000, 1000, 70001};
  const size_t offs[3] = {0, 70000, 71000}, total = 141001;
  /* Rounds 3 and 5 are in place: each rank sends from and receives into one buffer, so a
   * peer must have what was there before the receives wrote it. Rounds 4 and 5 receive into
   * pinned host memory (round 4 from device memory a peer maps: the copy out of it into pinned
   * memory is device work, queued on the caller's stream, never the worker's; round 5 sends
   * from that pinned memory too). */
  for (int round = 0; round < 6; round++) {
    const int in_place = round == 3 || round == 5, pinned_out = round >= 4, pinned_in = round == 5;
    CUdeviceptr ds[MAX_LOCAL], dr[MAX_LOCAL];
    float *hin[MAX_LOCAL], *hout[MAX_LOCAL], *pr[MAX_LOCAL];
    for (int l = 0; l < g_env.local; l++) {
      int rank = g_env.first_rank + l;
      hin[l] = host_alloc(total * sizeof(float));
      hout[l] = host_alloc(total * sizeof(float));
      pr[l] = pinned_out ? host_alloc(total * sizeof(float)) : NULL;
      for (size_t j = 0; j < total; j++) hin[l][j] = in_value(rank, j, round);
      if (pinned_in) {
        ds[l] = (CUdeviceptr)(uintptr_t)pr[l];
        memcpy(pr[l], hin[l], total * sizeof(float));
      } else {
        ds[l] = dev_alloc(total * sizeof(float));
        CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)hin[l], total * sizeof(float), g_streams[l]));
      }
      dr[l] = in_place ? ds[l] : pinned_out ? (CUdeviceptr)(uintptr_t)pr[l] : dev_alloc(total * sizeof(float));
    }
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) {
      int rank = g_env.first_rank + l;
      for (int m = 0; m < 3; m++) {
        CUdeviceptr off = (CUdeviceptr)offs[m] * sizeof(float);
        CHECK(ncclSend((const void*)(uintptr_t)(ds[l] + off), counts[m], ncclFloat32, (rank + 1) % n, g_comms[l], g_streams[l]));
        CHECK(ncclRecv((void*)(uintptr_t)(dr[l] + off), counts[m], ncclFloat32, (rank + n - 1) % n, g_comms[l], g_streams[l]));
      }
    }
    CHECK(ncclGroupEnd());
    for (int l = 0; l < g_env.local; l++) {
      /* (No stream copy between two host buffers: it would wait on this thread.) */
      if (!pinned_out) CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hout[l], dr[l], total * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      const float* got = pinned_out ? pr[l] : hout[l];
      int rank = g_env.first_rank + l, from = (rank + n - 1) % n;
      size_t bad = 0;
      for (size_t j = 0; j < total; j++) bad += got[j] != in_value(from, j, round);
      EXPECT(bad == 0, "p2p round %d%s%s rank %d: %zu wrong values from rank %d", round, in_place ? " (in place)" : "",
             pinned_out ? " (into pinned memory)" : "", rank, bad, from);
      if (!pinned_in) dev_free(ds[l]);
      if (!in_place && !pinned_out) dev_free(dr[l]);
      if (pinned_out) CU(cu.MemFreeHost(pr[l]));
      CU(cu.MemFreeHost(hin[l]));
      CU(cu.MemFreeHost(hout[l]));
    }
  }
}

/* An all-to-all as PyTorch issues one with uneven splits: in one group, each rank sends a
 * chunk to every rank, itself included, and receives one from each. The chunks between two
 * ranks of a host are large enough to go direct; a rank's chunk to itself is staged, and runs
 * on the worker's thread before the direct ones (it waits for no peer). Chunk sizes differ per
 * pair; every value is checked. */
static void p2p_all_to_all(void) {
  test_step("p2p all-to-all");
  const int n = g_env.nranks, round = 11;
  const size_t base = 70000;
  /* Chunk from rank f to rank t: base + 7f + 3t floats; f's send buffer holds its chunks in
   * order of t, t's receive buffer the chunks it gets in order of f. */
#define A2A_COUNT(f, t) (base + 7 * (size_t)(f) + 3 * (size_t)(t))
  CUdeviceptr ds[MAX_LOCAL], dr[MAX_LOCAL];
  float* h[MAX_LOCAL];
  size_t total_send[MAX_LOCAL], total_recv[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    total_send[l] = total_recv[l] = 0;
    for (int p = 0; p < n; p++) total_send[l] += A2A_COUNT(rank, p), total_recv[l] += A2A_COUNT(p, rank);
    size_t most = total_send[l] > total_recv[l] ? total_send[l] : total_recv[l];
    h[l] = host_alloc(most * sizeof(float));
    for (size_t j = 0; j < total_send[l]; j++) h[l][j] = in_value(rank, j, round);
    ds[l] = dev_alloc(total_send[l] * sizeof(float));
    dr[l] = dev_alloc(total_recv[l] * sizeof(float));
    CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)h[l], total_send[l] * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    size_t so = 0, ro = 0;
    for (int p = 0; p < n; p++) {
      CHECK(ncclSend((const void*)(uintptr_t)(ds[l] + so * sizeof(float)), A2A_COUNT(rank, p), ncclFloat32, p,
                     g_comms[l], g_streams[l]));
      CHECK(ncclRecv((void*)(uintptr_t)(dr[l] + ro * sizeof(float)), A2A_COUNT(p, rank), ncclFloat32, p,
                     g_comms[l], g_streams[l]));
      so += A2A_COUNT(rank, p);
      ro += A2A_COUNT(p, rank);
    }
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], dr[l], total_recv[l] * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t ro = 0;
    for (int f = 0; f < n; f++) {
      /* Where rank f's chunk to this rank starts in f's send buffer. */
      size_t fo = 0, bad = 0;
      for (int t = 0; t < rank; t++) fo += A2A_COUNT(f, t);
      for (size_t j = 0; j < A2A_COUNT(f, rank); j++) bad += h[l][ro + j] != in_value(f, fo + j, round);
      EXPECT(bad == 0, "p2p all-to-all rank %d: %zu wrong values from rank %d", rank, bad, f);
      ro += A2A_COUNT(f, rank);
    }
    dev_free(ds[l]);
    dev_free(dr[l]);
    CU(cu.MemFreeHost(h[l]));
  }
#undef A2A_COUNT
}

/* How a rank of part P2PPairings issues its send to and receive from its partner. */
enum { PAIR_GROUP, PAIR_SEND_FIRST, PAIR_RECV_FIRST, PAIR_GROUP_RECV_FIRST, PAIR_MODES };
static const char* const pair_mode_name[PAIR_MODES] = {"group{send,recv}", "send;recv", "recv;send", "group{recv,send}"};

/* Part P2PPairings (even rank counts; ranks 2k and 2k+1 are partners): each pair exchanges a
 * large message in every way the two ranks may issue it, grouped or as separate calls in
 * either order, each end its own way (both sending first, or both receiving first, would
 * deadlock as in NCCL, and are left out), from device or pinned host memory; when both group,
 * a small message (through the host transports) travels in the same group. Every byte is
 * checked. (Ranks of one process pair up in one group only.) */
static void p2p_pairings(void) {
  test_step("p2p pairings");
  const int n = g_env.nranks;
  if (n % 2) return;
  const size_t big = 70000, small = 1000;
  int round = 0;
  for (int pinned = 0; pinned < 2; pinned++)
    for (int m0 = 0; m0 < PAIR_MODES; m0++)
      for (int m1 = 0; m1 < PAIR_MODES; m1++, round++) {
        if (m0 == m1 && (m0 == PAIR_SEND_FIRST || m0 == PAIR_RECV_FIRST)) continue;
        const int grouped = (m0 == PAIR_GROUP || m0 == PAIR_GROUP_RECV_FIRST) &&
                            (m1 == PAIR_GROUP || m1 == PAIR_GROUP_RECV_FIRST);
        /* One thread's ranks pair up in one group (as NCCL asks: a call returns once done in
         * host-wait mode, and streams sharing one hardware queue wait behind each other). */
        const int outer = g_env.local > 1;
        if (!grouped && outer) continue;
        CUdeviceptr ds[MAX_LOCAL], dr[MAX_LOCAL], dss[MAX_LOCAL], dsr[MAX_LOCAL];
        float *hin[MAX_LOCAL], *hout[MAX_LOCAL], *hsmall[MAX_LOCAL];
        for (int l = 0; l < g_env.local; l++) {
          int rank = g_env.first_rank + l;
          ds[l] = dev_alloc(big * sizeof(float));
          dr[l] = dev_alloc(big * sizeof(float));
          dss[l] = dev_alloc(small * sizeof(float));
          dsr[l] = dev_alloc(small * sizeof(float));
          hin[l] = host_alloc(big * sizeof(float));
          hout[l] = host_alloc(big * sizeof(float));
          hsmall[l] = host_alloc(small * sizeof(float));
          for (size_t j = 0; j < big; j++) hin[l][j] = in_value(rank, j, round);
          for (size_t j = 0; j < small; j++) hsmall[l][j] = in_value(rank, j, round + 100);
          CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)hin[l], big * sizeof(float), g_streams[l]));
          CU(cu.MemcpyAsync(dss[l], (CUdeviceptr)(uintptr_t)hsmall[l], small * sizeof(float), g_streams[l]));
          /* The pinned source is read on the stream, after the upload above is queued. */
          CU(cu.StreamSynchronize(g_streams[l]));
        }
        if (outer) CHECK(ncclGroupStart());
        for (int l = 0; l < g_env.local; l++) {
          int rank = g_env.first_rank + l, partner = rank ^ 1, mode = rank % 2 ? m1 : m0;
          const void* src = pinned ? (const void*)hin[l] : (const void*)(uintptr_t)ds[l];
          void* dst = (void*)(uintptr_t)dr[l];
          ncclComm_t c = g_comms[l];
          CUstream st = g_streams[l];
          switch (mode) {
            case PAIR_GROUP:
            case PAIR_GROUP_RECV_FIRST:
              /* Messages of a pair match in order: the large one first each way. */
              CHECK(ncclGroupStart());
              for (int k = 0; k < 2; k++) {
                if ((k == 0) == (mode == PAIR_GROUP)) {
                  CHECK(ncclSend(src, big, ncclFloat32, partner, c, st));
                  if (grouped) CHECK(ncclSend((const void*)(uintptr_t)dss[l], small, ncclFloat32, partner, c, st));
                } else {
                  CHECK(ncclRecv(dst, big, ncclFloat32, partner, c, st));
                  if (grouped) CHECK(ncclRecv((void*)(uintptr_t)dsr[l], small, ncclFloat32, partner, c, st));
                }
              }
              CHECK(ncclGroupEnd());
              break;
            case PAIR_SEND_FIRST:
              CHECK(ncclSend(src, big, ncclFloat32, partner, c, st));
              CHECK(ncclRecv(dst, big, ncclFloat32, partner, c, st));
              break;
            default:
              CHECK(ncclRecv(dst, big, ncclFloat32, partner, c, st));
              CHECK(ncclSend(src, big, ncclFloat32, partner, c, st));
          }
        }
        if (outer) CHECK(ncclGroupEnd());
        for (int l = 0; l < g_env.local; l++) {
          int rank = g_env.first_rank + l, partner = rank ^ 1;
          CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hout[l], dr[l], big * sizeof(float), g_streams[l]));
          CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hsmall[l], dsr[l], small * sizeof(float), g_streams[l]));
          CU(cu.StreamSynchronize(g_streams[l]));
          size_t bad = 0, bad_small = 0;
          for (size_t j = 0; j < big; j++) bad += hout[l][j] != in_value(partner, j, round);
          for (size_t j = 0; grouped && j < small; j++) bad_small += hsmall[l][j] != in_value(partner, j, round + 100);
          EXPECT(bad == 0 && bad_small == 0, "p2p %s %s / %s, rank %d: %zu wrong values of the large message, %zu of the "
                 "small one", pinned ? "pinned" : "device", pair_mode_name[m0], pair_mode_name[m1], rank, bad, bad_small);
          dev_free(ds[l]);
          dev_free(dr[l]);
          dev_free(dss[l]);
          dev_free(dsr[l]);
          CU(cu.MemFreeHost(hin[l]));
          CU(cu.MemFreeHost(hout[l]));
          CU(cu.MemFreeHost(hsmall[l]));
        }
      }
}

/* Every local rank's input uploaded (through hin, pinned) to new device memory ds, then
 * all-reduced from there into `out`, memory of the kind `what` names, and checked through a
 * copy in pageable memory (the host must not touch device memory). */
static void allreduce_to_host(size_t count, CUdeviceptr* ds, float** hin, float** out, const char* what) {
  for (int l = 0; l < g_env.local; l++) {
    ds[l] = dev_alloc(count * sizeof(float));
    hin[l] = host_alloc(count * sizeof(float));
    for (size_t j = 0; j < count; j++) hin[l][j] = in_value(g_env.first_rank + l, j, 5);
    CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)hin[l], count * sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce((const void*)(uintptr_t)ds[l], out[l], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  float* got = TEST_ALLOC(count * sizeof(float));
  if (!got) abort();
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamSynchronize(g_streams[l]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)got, (CUdeviceptr)(uintptr_t)out[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += got[j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, 5);
    EXPECT(bad == 0, "device/%s allreduce rank %d: %zu wrong values", what, g_env.first_rank + l, bad);
  }
  free(got);
}

/* A device send buffer with a pinned host receive buffer, which peers cannot read: the
 * all-reduce runs on a device copy of it, copied out after, or (NCCL_RS_INPLACE_SCRATCH=0)
 * the ranks agree that the direct path cannot take it, and stage it alike. */
static void mixed(void) {
  test_step("mixed");
  const size_t count = 50000; /* large enough to try the direct path */
  CUdeviceptr ds[MAX_LOCAL];
  float *hin[MAX_LOCAL], *hr[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) hr[l] = host_alloc(count * sizeof(float));
  allreduce_to_host(count, ds, hin, hr, "pinned");

  /* A send from pinned host memory to a device buffer: the sender cannot publish it; its
   * stream copies it into device memory that goes direct, or (NCCL_RS_INPLACE_SCRATCH=0) it
   * sends the bytes. */
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l, n = g_env.nranks;
    CHECK(ncclSend(hin[l], count, ncclFloat32, (rank + 1) % n, g_comms[l], g_streams[l]));
    CHECK(ncclRecv((void*)(uintptr_t)ds[l], count, ncclFloat32, (rank + n - 1) % n, g_comms[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l, from = (rank + g_env.nranks - 1) % g_env.nranks;
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hr[l], ds[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += hr[l][j] != in_value(from, j, 5);
    EXPECT(bad == 0, "pinned-to-device send, rank %d: %zu wrong values from rank %d", rank, bad, from);
    dev_free(ds[l]);
    CU(cu.MemFreeHost(hin[l]));
    CU(cu.MemFreeHost(hr[l]));
  }
}

/* Only the last rank's output is pinned memory (no CUDA IPC handle): with
 * NCCL_RS_INPLACE_SCRATCH=0 that rank declines the direct path for this one operation while
 * its peers offer device buffers, so every rank stages it, exact; the next all-device
 * operation goes direct again (tests/cuda_mode.rs checks that no rank said it "can never" read
 * directly). By default that rank's all-reduce runs on a device copy, copied out to its
 * pinned output, and goes direct too. Only when asked (--only DeclineOne). */
static void checked_allreduce(CUdeviceptr* d, size_t count, int salt, const char* what);

static void decline_one(void) {
  test_step("decline-one");
  const size_t count = 50000; /* a direct-path size */
  CUdeviceptr ds[MAX_LOCAL], dout[MAX_LOCAL];
  float *hin[MAX_LOCAL], *out[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    const int last = g_env.first_rank + l == g_env.nranks - 1;
    dout[l] = last ? 0 : dev_alloc(count * sizeof(float));
    /* (allreduce_to_host reads every output through a copy.) */
    out[l] = last ? host_alloc(count * sizeof(float)) : (float*)(uintptr_t)dout[l];
  }
  allreduce_to_host(count, ds, hin, out, "one rank's output pinned");
  for (int l = 0; l < g_env.local; l++) {
    dev_free(ds[l]);
    CU(cu.MemFreeHost(hin[l]));
    if (dout[l]) dev_free(dout[l]);
    else CU(cu.MemFreeHost(out[l]));
  }
  CUdeviceptr d[MAX_LOCAL];
  checked_allreduce(d, count, 9, "the all-device allreduce after a declined one");
  for (int l = 0; l < g_env.local; l++) dev_free(d[l]);
}

/* A device send buffer with a pageable (malloc) receive buffer, large enough for the direct
 * path, which must not take it (its kernels cannot reach pageable memory), also between ranks
 * of one process, which publish buffers by address. Only when asked (--only Pageable): the
 * stream worker stages such a mix on its own stream, which the one-queue tests rule out. */
static void pageable(void) {
  test_step("pageable");
  const size_t count = 50000;
  CUdeviceptr ds[MAX_LOCAL];
  float *hin[MAX_LOCAL], *out[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) out[l] = TEST_ALLOC((size_t)count * sizeof(float));
  allreduce_to_host(count, ds, hin, out, "pageable");
  for (int l = 0; l < g_env.local; l++) {
    dev_free(ds[l]);
    CU(cu.MemFreeHost(hin[l]));
    free(out[l]);
  }
}

/* One group, one communicator, two streams: a small all-reduce (staged) and a large one
 * (direct) on the first, an all-gather and a ring of sends/receives on the second, each
 * stream uploading its inputs and downloading its results, synchronised only with itself. */
static void two_streams(void) {
  test_step("two-streams");
  enum { NOPS = 4 };
  const int n = g_env.nranks;
  const size_t counts[NOPS] = {3000, 60000, 2000, 5000}; /* small AR, large AR, AG, p2p */
  CUstream other[MAX_LOCAL];
  CUdeviceptr din[MAX_LOCAL][NOPS], dout[MAX_LOCAL][NOPS];
  float *hin[MAX_LOCAL][NOPS], *hout[MAX_LOCAL][NOPS];
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CU(cu.StreamCreate(&other[l], CU_STREAM_NON_BLOCKING));
    for (int k = 0; k < NOPS; k++) {
      size_t out = k == 2 ? counts[k] * n : counts[k];
      CUstream st = k < 2 ? g_streams[l] : other[l];
      din[l][k] = dev_alloc(counts[k] * sizeof(float));
      dout[l][k] = dev_alloc(out * sizeof(float));
      hin[l][k] = host_alloc(counts[k] * sizeof(float));
      hout[l][k] = host_alloc(out * sizeof(float));
      for (size_t j = 0; j < counts[k]; j++) hin[l][k][j] = in_value(rank, j, 60 + k);
      CU(cu.MemcpyAsync(din[l][k], (CUdeviceptr)(uintptr_t)hin[l][k], counts[k] * sizeof(float), st));
    }
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    void* in[NOPS];
    void* out[NOPS];
    for (int k = 0; k < NOPS; k++) {
      in[k] = (void*)(uintptr_t)din[l][k];
      out[k] = (void*)(uintptr_t)dout[l][k];
    }
    CHECK(ncclAllReduce(in[0], out[0], counts[0], ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
    CHECK(ncclAllGather(in[2], out[2], counts[2], ncclFloat32, g_comms[l], other[l]));
    CHECK(ncclAllReduce(in[1], out[1], counts[1], ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
    CHECK(ncclSend(in[3], counts[3], ncclFloat32, (rank + 1) % n, g_comms[l], other[l]));
    CHECK(ncclRecv(out[3], counts[3], ncclFloat32, (rank + n - 1) % n, g_comms[l], other[l]));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l, from = (rank + n - 1) % n;
    for (int k = 0; k < NOPS; k++) {
      size_t out = k == 2 ? counts[k] * n : counts[k];
      CUstream st = k < 2 ? g_streams[l] : other[l];
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hout[l][k], dout[l][k], out * sizeof(float), st));
    }
    CU(cu.StreamSynchronize(g_streams[l]));
    CU(cu.StreamSynchronize(other[l]));
    for (int k = 0; k < NOPS; k++) {
      size_t out = k == 2 ? counts[k] * n : counts[k], bad = 0;
      for (size_t j = 0; j < out; j++) {
        float want = k < 2 ? expected(C_ALLREDUCE, counts[k], n, rank, j, 60 + k)
                   : k == 2 ? in_value((int)(j / counts[k]), j % counts[k], 60 + k)
                            : in_value(from, j, 60 + k);
        bad += hout[l][k][j] != want;
      }
      EXPECT(bad == 0, "two streams, operation %d, rank %d: %zu wrong values", k, rank, bad);
      dev_free(din[l][k]);
      dev_free(dout[l][k]);
      CU(cu.MemFreeHost(hin[l][k]));
      CU(cu.MemFreeHost(hout[l][k]));
    }
    CU(cu.StreamDestroy(other[l]));
    /* The pinned staging pool is counted (4 MiB at least, unless caller staging is off). */
    const char* cs = getenv("NCCL_RS_CALLER_STAGING");
    uint64_t total = 0;
    CHECK(ncclCommMemStats(g_comms[l], ncclStatGpuMemTotal, &total));
    if (!(cs && atoi(cs) == 0)) EXPECT(total >= (4u << 20), "ncclCommMemStats total %llu, without the 4 MiB pool", (unsigned long long)total);
  }
}

/* Device-memory and host-memory calls alternate on one communicator with no synchronisation
 * between them: every rank must run them in issue order (a host-memory call runs at once on the
 * calling thread, after what the streams already hold). */
static void order(void) {
  test_step("order");
  const size_t count = 1024;
  const int rounds = g_env.quick ? 5 : 20;
  CUdeviceptr d[MAX_LOCAL];
  float *hd[MAX_LOCAL], *hh[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    d[l] = dev_alloc(count * sizeof(float));
    hd[l] = host_alloc(count * sizeof(float));
    hh[l] = TEST_ALLOC(count * sizeof(float));
  }
  for (int k = 0; k < rounds; k++) {
    for (int l = 0; l < g_env.local; l++) {
      int rank = g_env.first_rank + l;
      for (size_t j = 0; j < count; j++) {
        hd[l][j] = in_value(rank, j, k);
        hh[l][j] = in_value(rank, j, k + 100);
      }
      CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)hd[l], count * sizeof(float), g_streams[l]));
    }
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
    CHECK(ncclGroupEnd());
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclAllGather(hh[l] + (size_t)(g_env.first_rank + l) * (count / g_env.nranks), hh[l], count / g_env.nranks,
                          ncclFloat32, g_comms[l], NULL));
    CHECK(ncclGroupEnd());
    for (int l = 0; l < g_env.local; l++) {
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hd[l], d[l], count * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t bad = 0, per = count / g_env.nranks;
      for (size_t j = 0; j < count; j++) bad += hd[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, k);
      for (size_t j = 0; j < per * g_env.nranks; j++)
        bad += hh[l][j] != in_value((int)(j / per), (j / per) * per + j % per, k + 100);
      EXPECT(bad == 0, "order round %d rank %d: %zu wrong values", k, g_env.first_rank + l, bad);
    }
  }
  for (int l = 0; l < g_env.local; l++) {
    dev_free(d[l]);
    CU(cu.MemFreeHost(hd[l]));
    free(hh[l]);
  }
}

/* PreMulSum with the scalar in device memory (ncclScalarDevice), written on the stream just
 * before the call: the operation must use the value the stream left there (on the direct path
 * the stream copies it next to the scaled input, for the scaling kernel). Also with the
 * scalar in pinned host memory (device-visible too), the stream held while the copy and the
 * call are queued, so that reading the scalar before the stream got there shows. */
static void premul_case(int pinned) {
  const size_t count = 20000; /* 80 KB: a direct-path size (declined: its scalar is in memory) */
  const int gate = pinned && !host_wait_mode();
  CUdeviceptr d[MAX_LOCAL], sc[MAX_LOCAL], ds[MAX_LOCAL];
  float *h[MAX_LOCAL], *hs[MAX_LOCAL];
  ncclRedOp_t ops[MAX_LOCAL];
  CUdeviceptr dflag = 0;
  uint32_t* flag = gate_word(&dflag);
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    d[l] = dev_alloc(count * sizeof(float));
    sc[l] = pinned ? (CUdeviceptr)(uintptr_t)host_alloc(sizeof(float)) : dev_alloc(sizeof(float));
    if (pinned) *(float*)(uintptr_t)sc[l] = -1000.0f; /* what a read before the stream's copy sees */
    h[l] = host_alloc(count * sizeof(float));
    hs[l] = host_alloc(sizeof(float));
    for (size_t j = 0; j < count; j++) h[l][j] = in_value(rank, j, 3);
    hs[l][0] = (float)(rank + 2); /* (not 1: a one-rank job must scale too) */
    CHECK(ncclRedOpCreatePreMulSum(&ops[l], (void*)(uintptr_t)sc[l], ncclFloat32, ncclScalarDevice, g_comms[l]));
    CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), g_streams[l]));
    /* The value goes through device memory: a copy between two host buffers (into a pinned
     * scalar) would wait for the held stream (CUDA's API synchronization behavior). */
    ds[l] = dev_alloc(sizeof(float));
    CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)hs[l], sizeof(float), g_streams[l]));
  }
  for (int l = 0; l < g_env.local; l++) {
    if (gate) CU(cu.StreamWaitValue32(g_streams[l], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
    CU(cu.MemcpyAsync(sc[l], ds[l], sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ops[l], g_comms[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
  if (gate) __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) {
      float want = 0;
      for (int r = 0; r < g_env.nranks; r++) want += (float)(r + 2) * in_value(r, j, 3);
      bad += h[l][j] != want;
    }
    EXPECT(bad == 0, "PreMulSum with %s scalars, rank %d: %zu wrong values", pinned ? "pinned" : "device",
           g_env.first_rank + l, bad);
    CHECK(ncclRedOpDestroy(ops[l], g_comms[l]));
    dev_free(d[l]);
    dev_free(ds[l]);
    if (pinned) CU(cu.MemFreeHost((void*)(uintptr_t)sc[l]));
    else dev_free(sc[l]);
    CU(cu.MemFreeHost(h[l]));
    CU(cu.MemFreeHost(hs[l]));
  }
  CU(cu.MemFreeHost(flag));
}

/* PreMulSum with host-immediate scalars (PyTorch's _make_nccl_premul_sum(float), which FSDP
 * uses for its gradients' reduce-scatters), each rank's scalar rank + 1, at a direct-path size:
 * all-reduce out of place and in place, reduce-scatter and reduce; each caller's stream scales
 * a copy of its input, which peers read. With `mixed`, the last rank's scalar is in device
 * memory (its stream copies it next to its input, where the scaling kernel reads it). */
static void premul_host_case(int mixed) {
  const size_t count = 30000;
  const int n = g_env.nranks, root = n - 1;
  const coll_t kinds[4] = {C_ALLREDUCE, C_ALLREDUCE, C_REDUCESCATTER, C_REDUCE};
  for (int k = 0; k < 4; k++) {
    const coll_t c = kinds[k];
    const int in_place = k == 1, salt = 11 + k + 4 * mixed;
    const size_t ns = c == C_REDUCESCATTER ? count * (size_t)n : count;
    CUdeviceptr ds[MAX_LOCAL], dr[MAX_LOCAL], sc[MAX_LOCAL];
    float* h[MAX_LOCAL];
    ncclRedOp_t ops[MAX_LOCAL];
    for (int l = 0; l < g_env.local; l++) {
      const int rank = g_env.first_rank + l;
      float scalar = (float)(rank + 2); /* (not 1: a one-rank job must scale too) */
      ds[l] = dev_alloc(ns * sizeof(float));
      dr[l] = in_place ? ds[l] : dev_alloc(count * sizeof(float));
      h[l] = host_alloc(ns * sizeof(float));
      for (size_t j = 0; j < ns; j++) h[l][j] = in_value(rank, j, salt);
      CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)h[l], ns * sizeof(float), g_streams[l]));
      sc[l] = 0;
      if (mixed && rank == n - 1) {
        sc[l] = dev_alloc(sizeof(float));
        CU(cu.MemcpyAsync(sc[l], (CUdeviceptr)(uintptr_t)&scalar, sizeof(float), g_streams[l]));
        CU(cu.StreamSynchronize(g_streams[l])); /* (from this stack frame) */
        CHECK(ncclRedOpCreatePreMulSum(&ops[l], (void*)(uintptr_t)sc[l], ncclFloat32, ncclScalarDevice, g_comms[l]));
      } else {
        CHECK(ncclRedOpCreatePreMulSum(&ops[l], &scalar, ncclFloat32, ncclScalarHostImmediate, g_comms[l]));
      }
    }
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) {
      const void* src = (const void*)(uintptr_t)ds[l];
      void* dst = (void*)(uintptr_t)dr[l];
      if (c == C_ALLREDUCE) CHECK(ncclAllReduce(src, dst, count, ncclFloat32, ops[l], g_comms[l], g_streams[l]));
      if (c == C_REDUCESCATTER) CHECK(ncclReduceScatter(src, dst, count, ncclFloat32, ops[l], g_comms[l], g_streams[l]));
      if (c == C_REDUCE) CHECK(ncclReduce(src, dst, count, ncclFloat32, ops[l], root, g_comms[l], g_streams[l]));
    }
    CHECK(ncclGroupEnd());
    for (int l = 0; l < g_env.local; l++) {
      const int rank = g_env.first_rank + l;
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], dr[l], count * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t bad = 0, first = 0;
      const size_t at = c == C_REDUCESCATTER ? (size_t)rank * count : 0;
      for (size_t j = 0; j < count && (c != C_REDUCE || rank == root); j++) {
        float want = 0;
        for (int r = 0; r < n; r++) want += (float)(r + 2) * in_value(r, at + j, salt);
        if (h[l][j] != want && bad++ == 0) first = j;
      }
      EXPECT(bad == 0, "PreMulSum %s%s with host scalars%s, rank %d: %zu wrong values, first at %zu", COLL_NAME[c],
             in_place ? " in place" : "", mixed ? " (the last rank's in device memory)" : "", rank, bad, first);
      CHECK(ncclRedOpDestroy(ops[l], g_comms[l]));
      if (!in_place) dev_free(dr[l]);
      dev_free(ds[l]);
      if (sc[l]) dev_free(sc[l]);
      CU(cu.MemFreeHost(h[l]));
    }
  }
  expect_no_async_error("PreMulSum with host scalars");
}

static void premul(void) {
  test_step("premul");
  premul_case(0);
  premul_case(1);
  premul_host_case(0);
  premul_host_case(1);
}

/* ncclMemAlloc gives device memory in CUDA mode; registered, it works in collectives like any
 * device buffer; deregistered and freed, nothing is left. */
static void memalloc(void) {
  test_step("memalloc");
  const size_t count = 3000;
  void *s[MAX_LOCAL], *r[MAX_LOCAL], *hs[MAX_LOCAL], *hr[MAX_LOCAL];
  void* handles[MAX_LOCAL][2];
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CHECK(ncclMemAlloc(&s[l], count * sizeof(float)));
    CHECK(ncclMemAlloc(&r[l], count * sizeof(float)));
    unsigned type = 0;
    CU(cu.PointerGetAttribute(&type, 2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */, (CUdeviceptr)(uintptr_t)s[l]));
    EXPECT(type == 2 /* CU_MEMORYTYPE_DEVICE */, "ncclMemAlloc returned memory of type %u, not device memory", type);
    CHECK(ncclCommRegister(g_comms[l], s[l], count * sizeof(float), &handles[l][0]));
    CHECK(ncclCommRegister(g_comms[l], r[l], count * sizeof(float), &handles[l][1]));
    hs[l] = host_alloc(count * sizeof(float));
    hr[l] = host_alloc(count * sizeof(float));
    for (size_t j = 0; j < count; j++) ((float*)hs[l])[j] = in_value(rank, j, 11);
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)s[l], (CUdeviceptr)(uintptr_t)hs[l], count * sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce(s[l], r[l], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hr[l], (CUdeviceptr)(uintptr_t)r[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += ((float*)hr[l])[j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, 11);
    EXPECT(bad == 0, "allreduce on ncclMemAlloc'd buffers, rank %d: %zu wrong values", g_env.first_rank + l, bad);
    CHECK(ncclCommDeregister(g_comms[l], handles[l][0]));
    CHECK(ncclCommDeregister(g_comms[l], handles[l][1]));
    CHECK(ncclMemFree(s[l]));
    CHECK(ncclMemFree(r[l]));
    CU(cu.MemFreeHost(hs[l]));
    CU(cu.MemFreeHost(hr[l]));
  }
  /* Device memory it did not allocate (a framework's) is refused and left alone. */
  CUdeviceptr theirs = 0;
  CU(cu.MemAlloc(&theirs, 4096));
  EXPECT(ncclMemFree((void*)(uintptr_t)theirs) == ncclInvalidArgument, "ncclMemFree freed memory it did not allocate");
  CU(cu.MemFree(theirs)); /* still the caller's to free */
}

/* Round 1 issues the sends and receives first: their steps on the stream must still come
 * after the all-reduce's, in the order the worker opens them (it runs a group's collectives
 * first); queued in issue order, the stream waited at the receive's gate while the worker
 * waited for the all-reduce's flag. */
static void group_mix_round(int round) {
  const size_t count = 100000, pc = 70000;
  CUdeviceptr d[MAX_LOCAL], ps[MAX_LOCAL], pr[MAX_LOCAL];
  float* h[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    d[l] = dev_alloc(count * sizeof(float));
    ps[l] = dev_alloc(pc * sizeof(float));
    pr[l] = dev_alloc(pc * sizeof(float));
    h[l] = host_alloc(count * sizeof(float));
    for (size_t j = 0; j < count; j++) h[l][j] = in_value(rank, j, 21);
    CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), g_streams[l]));
    CU(cu.MemcpyAsync(ps[l], (CUdeviceptr)(uintptr_t)h[l], pc * sizeof(float), g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    if (round == 0)
      CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
    if (rank < 2) {
      CHECK(ncclSend((void*)(uintptr_t)ps[l], pc, ncclFloat32, 1 - rank, g_comms[l], g_streams[l]));
      CHECK(ncclRecv((void*)(uintptr_t)pr[l], pc, ncclFloat32, 1 - rank, g_comms[l], g_streams[l]));
    }
    if (round == 1)
      CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, 21);
    EXPECT(bad == 0, "all-reduce grouped with p2p on some ranks (round %d), rank %d: %zu wrong values", round, rank, bad);
    if (rank < 2) {
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], pr[l], pc * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t badp = 0;
      for (size_t j = 0; j < pc; j++) badp += h[l][j] != in_value(1 - rank, j, 21);
      EXPECT(badp == 0, "send/recv grouped with an all-reduce, rank %d: %zu wrong values", rank, badp);
    }
    dev_free(d[l]);
    dev_free(ps[l]);
    dev_free(pr[l]);
    CU(cu.MemFreeHost(h[l]));
  }
}

static void group_mix(void) {
  test_step("group-mix");
  if (g_env.nranks < 3) return;
  group_mix_round(0);
  group_mix_round(1);
}

/* More direct all-reduces queued ahead of their stream than a communicator has slots for the
 * kernels of calls (512): the stream is held before the first and let go after the last;
 * those past the slots run on the worker's stream, in issue order with the others. Before
 * each call the stream uploads a new input into the same buffer, so a call that ran early, or
 * one that let its stream go on before the peers had read its input, shows in the results. */
static void backlog(void) {
  test_step("backlog");
  enum { CALLS = 600, INPUTS = 5, OUTPUTS = 4 };
  const size_t count = 16384; /* 64 KiB: the direct path */
  CUdeviceptr din[MAX_LOCAL], dout[MAX_LOCAL][OUTPUTS];
  float* hin[MAX_LOCAL][INPUTS];
  float* hout[MAX_LOCAL];
  CUdeviceptr dflag = 0;
  uint32_t* flag = gate_word(&dflag);
  for (int l = 0; l < g_env.local; l++) {
    din[l] = dev_alloc(count * sizeof(float));
    for (int k = 0; k < OUTPUTS; k++) dout[l][k] = dev_alloc(count * sizeof(float));
    for (int k = 0; k < INPUTS; k++) {
      hin[l][k] = host_alloc(count * sizeof(float));
      for (size_t j = 0; j < count; j++) hin[l][k][j] = in_value(g_env.first_rank + l, j, k);
    }
    hout[l] = host_alloc(count * sizeof(float));
    CU(cu.StreamWaitValue32(g_streams[l], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
  }
  for (int i = 0; i < CALLS; i++) {
    for (int l = 0; l < g_env.local; l++)
      CU(cu.MemcpyAsync(din[l], (CUdeviceptr)(uintptr_t)hin[l][i % INPUTS], count * sizeof(float), g_streams[l]));
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclAllReduce((const void*)(uintptr_t)din[l], (void*)(uintptr_t)dout[l][i % OUTPUTS], count, ncclFloat32,
                          ncclSum, g_comms[l], g_streams[l]));
    CHECK(ncclGroupEnd());
  }
  __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  for (int l = 0; l < g_env.local; l++) {
    for (int k = 0; k < OUTPUTS; k++) {
      const int last = CALLS - OUTPUTS + k; /* the last call that wrote output k */
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hout[l], dout[l][last % OUTPUTS], count * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t bad = 0;
      for (size_t j = 0; j < count; j++) bad += hout[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, last % INPUTS);
      EXPECT(bad == 0, "backlog: rank %d, call %d: %zu wrong values", g_env.first_rank + l, last, bad);
    }
    dev_free(din[l]);
    for (int k = 0; k < OUTPUTS; k++) dev_free(dout[l][k]);
    for (int k = 0; k < INPUTS; k++) CU(cu.MemFreeHost(hin[l][k]));
    CU(cu.MemFreeHost(hout[l]));
  }
  CU(cu.MemFreeHost(flag));
}

/* A communicator per local rank, of a unique id of its own for `part`'s round `round`. */
static void init_round_comms(ncclComm_t* c, const char* part, int round) {
  ncclUniqueId id;
  char tag[32];
  snprintf(tag, sizeof tag, "%s%d", part, round);
  get_unique_id(tag, &id);
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommInitRank(&c[l], g_env.nranks, id, g_env.first_rank + l));
  CHECK(ncclGroupEnd());
}

/* Communicators made after others were destroyed take over their pinned pool and board
 * (numbers and slots as they were: a stream may still have steps of the old ones ahead of
 * it): a direct and a staged all-reduce on each of three successive sets are exact. */
static void recycle(void) {
  test_step("recycle");
  const int n = g_env.nranks;
  for (int round = 0; round < 3; round++) {
    ncclComm_t c[MAX_LOCAL];
    init_round_comms(c, "recycle", round);
    const size_t counts[2] = {100000, 1000}; /* the direct path, and staging */
    for (int k = 0; k < 2; k++) {
      const size_t count = counts[k];
      const int salt = round * 2 + k;
      CUdeviceptr d[MAX_LOCAL];
      float* h[MAX_LOCAL];
      fresh_allreduce_on(c, d, h, count, salt);
      for (int l = 0; l < g_env.local; l++) {
        CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
        CU(cu.StreamSynchronize(g_streams[l]));
        size_t bad = 0;
        for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, n, 0, j, salt);
        EXPECT(bad == 0, "recycle round %d, %zu floats, rank %d: %zu wrong values", round, count, g_env.first_rank + l, bad);
        dev_free(d[l]);
        CU(cu.MemFreeHost(h[l]));
      }
    }
    for (int l = 0; l < g_env.local; l++) CHECK(ncclCommDestroy(c[l]));
  }
}

/* Part Leaks (only when asked; the stand-in only): communicators created, used on every path
 * that allocates memory of its own (the direct path and its copies of inputs and outputs, the
 * pinned pool, sends from pinned memory) and destroyed, three times: the memory this process
 * holds afterwards (the stand-in's count of live allocations) is the same after each round,
 * so nothing a communicator allocated outlives it (the first round may leave what the process
 * keeps for good: loaded kernels, recycled staging). */
static void leaks_round(int round) {
  const int n = g_env.nranks;
  ncclComm_t c[MAX_LOCAL];
  init_round_comms(c, "leaks", round);
  const size_t count = 70000, small = 1000, a2a = count * (size_t)n;
  CUdeviceptr d[MAX_LOCAL], a[MAX_LOCAL];
  float *h[MAX_LOCAL], *pinned[MAX_LOCAL], *pinned_in[MAX_LOCAL], *pinned_out[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    d[l] = dev_alloc(count * sizeof(float));
    a[l] = dev_alloc(a2a * sizeof(float));
    h[l] = host_alloc(a2a * sizeof(float));
    pinned[l] = host_alloc(count * sizeof(float));
    pinned_in[l] = host_alloc(count * sizeof(float));
    pinned_out[l] = host_alloc(count * sizeof(float));
    for (size_t j = 0; j < count; j++) pinned[l][j] = in_value(g_env.first_rank + l, j, round);
    for (size_t j = 0; j < a2a; j++) h[l][j] = in_value(g_env.first_rank + l, j, round);
    CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), g_streams[l]));
    CU(cu.MemcpyAsync(a[l], (CUdeviceptr)(uintptr_t)h[l], a2a * sizeof(float), g_streams[l]));
  }
  /* In place: a ring exchange of one buffer, an all-to-all; then a large and a small
   * all-reduce; then sends from pinned memory, and an all-reduce of pinned memory (peers
   * read device copies of its input and output). */
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    const int rank = g_env.first_rank + l;
    CHECK(ncclSend((const void*)(uintptr_t)d[l], count, ncclFloat32, (rank + 1) % n, c[l], g_streams[l]));
    CHECK(ncclRecv((void*)(uintptr_t)d[l], count, ncclFloat32, (rank + n - 1) % n, c[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAlltoAll((const void*)(uintptr_t)a[l], (void*)(uintptr_t)a[l], count, ncclFloat32, c[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  for (size_t len = count; len >= small; len = len == count ? small : 0) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclAllReduce((const void*)(uintptr_t)a[l], (void*)(uintptr_t)a[l], len, ncclFloat32, ncclSum, c[l], g_streams[l]));
    CHECK(ncclGroupEnd());
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    const int rank = g_env.first_rank + l;
    CHECK(ncclSend(pinned[l], count, ncclFloat32, (rank + 1) % n, c[l], g_streams[l]));
    CHECK(ncclRecv(pinned_in[l], count, ncclFloat32, (rank + n - 1) % n, c[l], g_streams[l]));
  }
  CHECK(ncclGroupEnd());
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce(pinned[l], pinned_out[l], count, ncclFloat32, ncclSum, c[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    const int rank = g_env.first_rank + l, from = (rank + n - 1) % n;
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0, sum_bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != in_value(from, j, round) || pinned_in[l][j] != in_value(from, j, round);
    for (size_t j = 0; j < count; j++) sum_bad += pinned_out[l][j] != expected(C_ALLREDUCE, count, n, 0, j, round);
    EXPECT(bad == 0, "leaks round %d rank %d: %zu wrong values from rank %d", round, rank, bad, from);
    EXPECT(sum_bad == 0, "leaks round %d rank %d: %zu wrong values in the all-reduce of pinned memory", round, rank,
           sum_bad);
    dev_free(d[l]);
    dev_free(a[l]);
    CU(cu.MemFreeHost(h[l]));
    CU(cu.MemFreeHost(pinned[l]));
    CU(cu.MemFreeHost(pinned_in[l]));
    CU(cu.MemFreeHost(pinned_out[l]));
  }
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommDestroy(c[l]));
}

/* Part Ahead (only when asked; not in host-wait mode): the host issues all-reduces ahead of
 * the device (every stream held on a host word), each on pinned memory peers cannot read, so
 * each holds a carve of the device scratch until its result is copied out: more of them than
 * one block holds (NCCL_RS_INPLACE_SCRATCH, set by the harness) all go direct all the same,
 * from further blocks (tests/cuda_mode.rs checks that none is staged), exact once released. */
static void ahead(void) {
  test_step("ahead");
  enum { OPS = 6 };
  const size_t count = (size_t)1 << 19; /* 2 MiB */
  const int n = g_env.nranks;
  float *in[MAX_LOCAL][OPS], *out[MAX_LOCAL][OPS];
  CUdeviceptr dflag = 0;
  uint32_t* flag = gate_word(&dflag);
  for (int l = 0; l < g_env.local; l++) {
    for (int k = 0; k < OPS; k++) {
      in[l][k] = host_alloc(count * sizeof(float));
      out[l][k] = host_alloc(count * sizeof(float));
      for (size_t j = 0; j < count; j++) in[l][k][j] = in_value(g_env.first_rank + l, j, 20 + k);
    }
    CU(cu.StreamWaitValue32(g_streams[l], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
  }
  for (int k = 0; k < OPS; k++) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      CHECK(ncclAllReduce(in[l][k], out[l][k], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
    CHECK(ncclGroupEnd());
  }
  __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamSynchronize(g_streams[l]));
    for (int k = 0; k < OPS; k++) {
      size_t bad = 0;
      for (size_t j = 0; j < count; j++) bad += out[l][k][j] != expected(C_ALLREDUCE, count, n, 0, j, 20 + k);
      EXPECT(bad == 0, "all-reduce %d issued ahead, rank %d: %zu wrong values", k, g_env.first_rank + l, bad);
      CU(cu.MemFreeHost(in[l][k]));
      CU(cu.MemFreeHost(out[l][k]));
    }
  }
  CU(cu.MemFreeHost(flag));
}

/* Part DroppedGroup (1 process, 1 rank; only when asked): a group whose later communicator
 * refuses its part (two streams while one captures a graph: ncclInvalidUsage) drops the
 * earlier communicator's part, which had already copied its pinned buffers into device
 * scratch; that part's carve must come back, or the scratch ring fills behind it and later
 * all-reduces through it are staged (tests/cuda_mode.rs checks that none is). 40 all-reduces
 * of 4 MiB then go through a 64 MiB scratch, exact. */
static void dropped_group(void) {
  test_step("dropped group");
  const size_t count = (size_t)1 << 20;
  ncclComm_t other;
  CHECK(ncclCommSplit(g_comms[0], 0, 0, &other, NULL));
  float *in = host_alloc(count * sizeof(float)), *out = host_alloc(count * sizeof(float));
  for (size_t j = 0; j < count; j++) in[j] = in_value(0, j, 3);
  CUdeviceptr d = dev_alloc(count * sizeof(float));
  CUstream s1, s2;
  CU(cu.StreamCreate(&s1, CU_STREAM_NON_BLOCKING));
  CU(cu.StreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  CU(cu.StreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_RELAXED));
  CHECK(ncclGroupStart());
  CHECK(ncclAllReduce(in, out, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
  CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, other, s1));
  CHECK(ncclAllReduce((void*)(uintptr_t)d, (void*)(uintptr_t)d, count, ncclFloat32, ncclSum, other, s2));
  ncclResult_t r = ncclGroupEnd();
  void* graph = NULL;
  CU(cu.StreamEndCapture(s1, &graph));
  if (graph) CU(cu.GraphDestroy(graph));
  EXPECT(r == ncclInvalidUsage, "a group with a part on two streams while one captures returned %s", result_name(r));
  for (int k = 0; k < 40; k++) {
    CHECK(ncclAllReduce(in, out, count, ncclFloat32, ncclSum, g_comms[0], g_streams[0]));
    CU(cu.StreamSynchronize(g_streams[0]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += out[j] != in[j];
    EXPECT(bad == 0, "all-reduce %d of pinned memory after the dropped group: %zu wrong values", k, bad);
  }
  CU(cu.StreamDestroy(s1));
  CU(cu.StreamDestroy(s2));
  dev_free(d);
  CU(cu.MemFreeHost(in));
  CU(cu.MemFreeHost(out));
  CHECK(ncclCommDestroy(other));
}

static void leaks(void) {
  test_step("leaks");
  if (!cu.StubOwnMemory || g_vmm.on) {
    tlog("leaks: skipped (needs the stand-in's count of live allocations, and cuMemAlloc buffers)");
    return;
  }
  int live[3];
  size_t bytes[3];
  for (int round = 0; round < 3; round++) {
    leaks_round(round);
    live[round] = cu.StubOwnMemory(&bytes[round]);
    tlog("leaks: after round %d, %d allocations (%zu bytes) live", round, live[round], bytes[round]);
  }
  EXPECT(live[1] == live[0] && live[2] == live[0] && bytes[1] == bytes[0] && bytes[2] == bytes[0],
         "memory left by communicators created and destroyed: %d allocations (%zu bytes) after the first round, "
         "%d (%zu) after the second, %d (%zu) after the third", live[0], bytes[0], live[1], bytes[1], live[2], bytes[2]);
}

/* Fresh device memory for every all-reduce (large enough to read peers directly), as a
 * caching allocator's churn looks to the peers: first kept allocated (more allocations than
 * the mappings a worker keeps: the oldest are closed), then freed after each call (new
 * allocations at addresses the peers have mapped before). Every result exact. */
static void churn(void) {
  test_step("churn");
  enum { ROUNDS_MAX = 300 };
  const int full = g_env.only && !strcasecmp(g_env.only, "Churn");
  const int rounds = full ? ROUNDS_MAX : 12, kept = full ? 270 : 6;
  static CUdeviceptr live[ROUNDS_MAX][MAX_LOCAL];
  for (int i = 0; i < rounds; i++) {
    const size_t count = 20000 + (size_t)(i % 7) * 1000;
    CUdeviceptr* d = live[i];
    float* h[MAX_LOCAL];
    fresh_allreduce(d, h, count, i % 5);
    for (int l = 0; l < g_env.local; l++) {
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t bad = 0;
      for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, i % 5);
      EXPECT(bad == 0, "churn round %d, rank %d: %zu wrong values", i, g_env.first_rank + l, bad);
      if (i >= kept) dev_free(d[l]);
      CU(cu.MemFreeHost(h[l]));
    }
  }
  for (int i = 0; i < kept && i < rounds; i++)
    for (int l = 0; l < g_env.local; l++) dev_free(live[i][l]);
}

/* Direct all-reduces on fresh buffers of `count` floats (salt `salt`), checked; the buffers
 * are left allocated, in d. */
static void checked_allreduce(CUdeviceptr* d, size_t count, int salt, const char* what) {
  float* h[MAX_LOCAL];
  fresh_allreduce(d, h, count, salt);
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, salt);
    EXPECT(bad == 0, "%s, rank %d: %zu wrong values", what, g_env.first_rank + l, bad);
    CU(cu.MemFreeHost(h[l]));
  }
}

static uint64_t mem_stat(ncclComm_t c, ncclCommMemStat_t stat) {
  uint64_t v = 0;
  CHECK(ncclCommMemStats(c, stat, &v));
  return v;
}

static size_t device_free(void) {
  size_t free_b = 0, total = 0;
  if (cu.MemGetInfo) CU(cu.MemGetInfo(&free_b, &total));
  return free_b;
}

/* ncclCommSuspend(NCCL_SUSPEND_MEM) gives back the peers' device memory the direct path keeps
 * mapped (--only Suspend, several processes). After direct all-reduces every rank frees its
 * buffers; the peers' mappings still hold that memory (ncclStatGpuMemSuspend counts it) until
 * they suspend. Suspended, a call is refused; resumed, direct all-reduces are exact again.
 * Against the stand-in, its count of open peer memory must fall to 0; on a GPU, how much the
 * device's free memory rose is reported (whether a mapping keeps freed memory alive there is
 * what the line tells). */
static void suspend_mem(void) {
  test_step("suspend");
  const size_t count = (size_t)1 << 20; /* 4 MiB: direct */
  const char* p2p_off = getenv("NCCL_P2P_DISABLE");
  const int mapped = g_env.nprocs > 1 && !(p2p_off && atoi(p2p_off) == 1);
  CUdeviceptr d[MAX_LOCAL];
  checked_allreduce(d, count, 70, "before ncclCommSuspend");
  for (int l = 0; l < g_env.local; l++) {
    uint64_t susp = mem_stat(g_comms[l], ncclStatGpuMemSuspend), persist = mem_stat(g_comms[l], ncclStatGpuMemPersist);
    uint64_t total = mem_stat(g_comms[l], ncclStatGpuMemTotal);
    EXPECT(mapped ? susp >= count * sizeof(float) : susp == 0, "rank %d: ncclStatGpuMemSuspend %llu after direct all-reduces "
           "of %zu bytes (peers mapped: %d)", g_env.first_rank + l, (unsigned long long)susp, count * sizeof(float), mapped);
    EXPECT(total == persist + susp, "rank %d: total %llu is not persistent %llu + suspendable %llu", g_env.first_rank + l,
           (unsigned long long)total, (unsigned long long)persist, (unsigned long long)susp);
    dev_free(d[l]);
  }
  if (!(p2p_off && atoi(p2p_off) == 1)) {
    /* An all-reduce into pinned memory, which peers cannot read: it runs on a copy in the
     * communicator's device scratch, suspendable memory that ncclCommSuspend frees below. */
    CUdeviceptr ds[MAX_LOCAL];
    float *hin[MAX_LOCAL], *pinned[MAX_LOCAL];
    for (int l = 0; l < g_env.local; l++) pinned[l] = host_alloc(count * sizeof(float));
    allreduce_to_host(count, ds, hin, pinned, "pinned, before ncclCommSuspend");
    for (int l = 0; l < g_env.local; l++) {
      uint64_t susp = mem_stat(g_comms[l], ncclStatGpuMemSuspend);
      EXPECT(susp >= count * sizeof(float), "rank %d: ncclStatGpuMemSuspend %llu after an all-reduce through the device "
             "scratch", g_env.first_rank + l, (unsigned long long)susp);
      dev_free(ds[l]);
      CU(cu.MemFreeHost(hin[l]));
      CU(cu.MemFreeHost(pinned[l]));
    }
  }
  size_t held = 0;
  int open = cu.StubPeerMemory ? cu.StubPeerMemory(&held) : -1;
  if (cu.StubPeerMemory)
    EXPECT(mapped ? open > 0 && held >= count * sizeof(float) : open == 0,
           "%d peer allocations (%zu bytes) held open after the peers freed them (peers mapped: %d)", open, held, mapped);
  allreduce_sum_int(g_comms, 0); /* every rank has freed its buffers */
  const size_t free_before = device_free();
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclCommSuspend(g_comms[l], NCCL_SUSPEND_MEM));
    EXPECT(mem_stat(g_comms[l], ncclStatGpuMemSuspended) == 1, "rank %d: not reported suspended", g_env.first_rank + l);
    EXPECT(mem_stat(g_comms[l], ncclStatGpuMemSuspend) == 0, "rank %d: suspendable memory left after ncclCommSuspend",
           g_env.first_rank + l);
  }
  if (cu.StubPeerMemory) {
    size_t after = 0;
    int left = cu.StubPeerMemory(&after);
    EXPECT(left == 0, "%d peer allocations (%zu bytes) still held open after ncclCommSuspend", left, after);
    tlog("suspend: %d peer allocation(s) of %zu bytes held open before ncclCommSuspend, %d after", open, held, left);
  }
  CUdeviceptr x = dev_alloc(sizeof(float));
  ncclResult_t r = ncclAllReduce((void*)(uintptr_t)x, (void*)(uintptr_t)x, 1, ncclFloat32, ncclSum, g_comms[0], g_streams[0]);
  EXPECT(r == ncclInvalidUsage, "an all-reduce on a suspended communicator returned %d, not ncclInvalidUsage", (int)r);
  dev_free(x);
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommResume(g_comms[l]));
  allreduce_sum_int(g_comms, 0); /* every rank has suspended */
  if (cu.MemGetInfo && !cu.StubPeerMemory) {
    const double mib = 1024.0 * 1024.0;
    tlog("suspend: device free memory %.0f MiB before every rank suspended, %.0f MiB after (the processes freed %.0f "
         "MiB in all)", free_before / mib, device_free() / mib, (double)count * sizeof(float) * g_env.nranks / mib);
  }
  for (int l = 0; l < g_env.local; l++)
    EXPECT(mem_stat(g_comms[l], ncclStatGpuMemSuspended) == 0, "rank %d: reported suspended after ncclCommResume",
           g_env.first_rank + l);
  checked_allreduce(d, count, 71, "after ncclCommResume");
  for (int l = 0; l < g_env.local; l++) {
    uint64_t susp = mem_stat(g_comms[l], ncclStatGpuMemSuspend);
    EXPECT(mapped ? susp >= count * sizeof(float) : susp == 0, "rank %d: ncclStatGpuMemSuspend %llu after resuming",
           g_env.first_rank + l, (unsigned long long)susp);
    dev_free(d[l]);
  }
  /* Suspended with an all-reduce still on the streams (NCCL asks that none be): the mappings
   * close only once it is done, so it stays exact. */
  float* h[MAX_LOCAL];
  fresh_allreduce(d, h, count, 72);
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommSuspend(g_comms[l], NCCL_SUSPEND_MEM));
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, 0, j, 72);
    EXPECT(bad == 0, "suspended behind an all-reduce, rank %d: %zu wrong values", g_env.first_rank + l, bad);
    CU(cu.MemFreeHost(h[l]));
    CHECK(ncclCommResume(g_comms[l]));
    dev_free(d[l]);
  }
}

/* A call leaves the caller's current context alone (here: none), as NCCL does. */
static void context(void) {
  test_step("context");
  const size_t count = 20000;
  CUdeviceptr d[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    d[l] = dev_alloc(count * sizeof(float));
    CU(cu.MemcpyAsync(d[l], d[l], 0, g_streams[l]));
  }
  CU(cu.CtxSetCurrent(NULL));
  /* The thread's capture interaction mode comes back too (the calls relax it meanwhile). */
  int mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
  CU(cu.ThreadExchangeStreamCaptureMode(&mode));
  const int before = mode;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  CUcontext now = (CUcontext)1;
  CU(cu.CtxGetCurrent(&now));
  EXPECT(now == NULL, "the calls changed the caller's current context (%p, expected none)", now);
  mode = before;
  CU(cu.ThreadExchangeStreamCaptureMode(&mode));
  EXPECT(mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, "the calls changed the thread's capture mode (%d, expected %d)", mode,
         CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  CU(cu.CtxSetCurrent(g_ctx));
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.StreamSynchronize(g_streams[l]));
    dev_free(d[l]);
  }
  /* ncclCommInitAll on a device the driver does not have: refused, as NCCL refuses it. */
  int devices = 0;
  CU(cu.DeviceGetCount(&devices));
  ncclComm_t none[2] = {NULL, NULL};
  ncclResult_t r = ncclCommInitAll(none, 2, (const int[]){0, devices});
  const char* msg = ncclGetLastError(NULL);
  EXPECT(r == ncclInvalidArgument, "ncclCommInitAll on device %d of %d returned %s", devices, devices, result_name(r));
  EXPECT(msg && strstr(msg, "CUDA device"), "its error does not say why: '%s'", msg ? msg : "(null)");
}

/* Pinned and managed buffers alone keep NCCL's stream order, as device buffers do: the
 * input is written by a copy queued on the call's stream, while that stream is held, just
 * before the call; the call must not read it earlier, and a copy queued after the call sees
 * its result. Small (staged through the pool) and large sizes. */
static void host_buffers_in_order(void) {
  if (host_wait_mode()) return; /* the call returns once done: a stream held before it cannot be */
  enum { PINNED, MANAGED };
  static const size_t counts[] = {1000, 70000};
  for (int kind = PINNED; kind <= MANAGED; kind++) {
    for (int ci = 0; ci < 2; ci++) {
      const size_t count = counts[ci], bytes = count * sizeof(float);
      const int salt = 40 + 2 * kind + ci;
      CUdeviceptr src[MAX_LOCAL], in[MAX_LOCAL], out[MAX_LOCAL];
      float* h[MAX_LOCAL];
      CUdeviceptr dflag = 0;
      uint32_t* flag = gate_word(&dflag);
      for (int l = 0; l < g_env.local; l++) {
        h[l] = host_alloc(bytes);
        for (size_t j = 0; j < count; j++) h[l][j] = in_value(g_env.first_rank + l, j, salt);
        src[l] = dev_alloc(bytes);
        CU(cu.MemcpyAsync(src[l], (CUdeviceptr)(uintptr_t)h[l], bytes, g_streams[l]));
        CU(cu.StreamSynchronize(g_streams[l]));
        if (kind == PINNED) {
          in[l] = (CUdeviceptr)(uintptr_t)host_alloc(bytes);
          out[l] = (CUdeviceptr)(uintptr_t)host_alloc(bytes);
        } else {
          CU(cu.MemAllocManaged(&in[l], bytes, 1));
          CU(cu.MemAllocManaged(&out[l], bytes, 1));
        }
        memset((void*)(uintptr_t)in[l], 0xff, bytes); /* NaN until the stream's copy lands */
        memset((void*)(uintptr_t)out[l], 0xff, bytes);
      }
      /* Held only once every rank's source is uploaded (streams may share a hardware queue). */
      for (int l = 0; l < g_env.local; l++) {
        CU(cu.StreamWaitValue32(g_streams[l], dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
        CU(cu.MemcpyAsync(in[l], src[l], bytes, g_streams[l]));
      }
      CHECK(ncclGroupStart());
      for (int l = 0; l < g_env.local; l++)
        CHECK(ncclAllReduce((void*)(uintptr_t)in[l], (void*)(uintptr_t)out[l], count, ncclFloat32, ncclSum, g_comms[l],
                            g_streams[l]));
      CHECK(ncclGroupEnd());
      /* Read back in stream order through device memory (src is free again): a copy between
       * two host buffers would wait for the held stream (CUDA's API synchronization behavior). */
      for (int l = 0; l < g_env.local; l++) {
        CU(cu.MemcpyAsync(src[l], out[l], bytes, g_streams[l]));
        EXPECT(cu.StreamQuery(g_streams[l]) == CUDA_ERROR_NOT_READY, "%s count %zu: the held stream finished",
               kind == PINNED ? "pinned" : "managed", count);
      }
      __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
      for (int l = 0; l < g_env.local; l++) {
        CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], src[l], bytes, g_streams[l]));
        CU(cu.StreamSynchronize(g_streams[l]));
        size_t bad = 0, first = 0;
        for (size_t j = 0; j < count; j++) {
          float want = expected(C_ALLREDUCE, count, g_env.nranks, g_env.first_rank + l, j, salt);
          if (h[l][j] != want && bad++ == 0) first = j;
        }
        EXPECT(bad == 0, "%s buffers, count %zu, rank %d: %zu wrong values in stream order, first at %zu: %g, expected %g",
               kind == PINNED ? "pinned" : "managed", count, g_env.first_rank + l, bad, first, bad ? h[l][first] : 0.0,
               bad ? expected(C_ALLREDUCE, count, g_env.nranks, g_env.first_rank + l, first, salt) : 0.0);
        dev_free(src[l]);
        if (kind == PINNED) {
          CU(cu.MemFreeHost((void*)(uintptr_t)in[l]));
          CU(cu.MemFreeHost((void*)(uintptr_t)out[l]));
        } else {
          CU(cu.MemFree(in[l]));
          CU(cu.MemFree(out[l]));
        }
        CU(cu.MemFreeHost(h[l]));
      }
      CU(cu.MemFreeHost(flag));
    }
  }
  expect_no_async_error("host buffers in order");
}

/* Every datatype x reduction on device buffers large enough for the direct path (64 KiB and
 * more: read from the peers' memory, reduced by the kernels), as AllReduce, ReduceScatter and
 * Reduce; inputs and checks are collectives.c's (fill_values/check_values: exact, avg on
 * floats within rounding). fp16 avg reads copies of the inputs scaled by 1/n first, as the
 * staged path scales them (see streamed.rs, copy_unreadable_inputs): it must be as exact. */
static void reductions(void) {
  static const ncclDataType_t dts[] = {ncclInt8,    ncclUint8,   ncclInt32,    ncclUint32,
                                       ncclInt64,   ncclUint64,  ncclFloat16,  ncclFloat32,
                                       ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2};
  static const int ops[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};
  static const coll_t colls[] = {C_ALLREDUCE, C_REDUCESCATTER, C_REDUCE};
  const int n = g_env.nranks, root = n - 1;
  uint32_t salt = 7;
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    const size_t es = dt_info(dts[d])->size;
    const size_t count = (64 << 10) / es + 3; /* above NCCL_RS_DIRECT_MIN, not a round number */
    for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
      for (size_t c = 0; c < 3; c++, salt++) {
        const size_t nin = colls[c] == C_REDUCESCATTER ? count * (size_t)n : count;
        CUdeviceptr ds[MAX_LOCAL], dr[MAX_LOCAL];
        void *hin[MAX_LOCAL], *hout[MAX_LOCAL];
        for (int l = 0; l < g_env.local; l++) {
          const int rank = g_env.first_rank + l;
          ds[l] = dev_alloc(nin * es);
          dr[l] = dev_alloc(count * es);
          hin[l] = host_alloc(nin * es);
          hout[l] = host_alloc(count * es);
          fill_values(dts[d], ops[o], n, rank, hin[l], 0, nin, salt);
          memset(hout[l], 0xa5, count * es);
          CU(cu.MemcpyAsync(ds[l], (CUdeviceptr)(uintptr_t)hin[l], nin * es, g_streams[l]));
        }
        CHECK(ncclGroupStart());
        for (int l = 0; l < g_env.local; l++) {
          void* sb = (void*)(uintptr_t)ds[l];
          void* rb = (void*)(uintptr_t)dr[l];
          ncclRedOp_t op = (ncclRedOp_t)ops[o];
          if (colls[c] == C_ALLREDUCE) CHECK(ncclAllReduce(sb, rb, count, dts[d], op, g_comms[l], g_streams[l]));
          else if (colls[c] == C_REDUCESCATTER) CHECK(ncclReduceScatter(sb, rb, count, dts[d], op, g_comms[l], g_streams[l]));
          else CHECK(ncclReduce(sb, rb, count, dts[d], op, root, g_comms[l], g_streams[l]));
        }
        CHECK(ncclGroupEnd());
        for (int l = 0; l < g_env.local; l++) {
          CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hout[l], dr[l], count * es, g_streams[l]));
          CU(cu.StreamSynchronize(g_streams[l]));
          const int rank = g_env.first_rank + l;
          if (colls[c] != C_REDUCE || rank == root) {
            char what[96];
            snprintf(what, sizeof what, "device %s %s %s", COLL_NAME[colls[c]], dt_info(dts[d])->name, op_name(ops[o]));
            const size_t j0 = colls[c] == C_REDUCESCATTER ? (size_t)rank * count : 0;
            check_values(what, dts[d], ops[o], n, hout[l], j0, count, salt, 0);
          }
          dev_free(ds[l]);
          dev_free(dr[l]);
          CU(cu.MemFreeHost(hin[l]));
          CU(cu.MemFreeHost(hout[l]));
        }
      }
    }
  }
  /* fp16 avg high in its range: 32768 on every rank averages to 32768 (within rounding off
   * 2^k ranks); a sum before the division would overflow to infinity. */
  const size_t count = (64 << 10) / 2 + 3;
  const int exact = (n & (n - 1)) == 0;
  CUdeviceptr dh[MAX_LOCAL];
  uint16_t* hh[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) {
    dh[l] = dev_alloc(count * 2);
    hh[l] = host_alloc(count * 2);
    for (size_t j = 0; j < count; j++) dt_store(ncclFloat16, hh[l], j, 32768.0);
    CU(cu.MemcpyAsync(dh[l], (CUdeviceptr)(uintptr_t)hh[l], count * 2, g_streams[l]));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    CHECK(ncclAllReduce((void*)(uintptr_t)dh[l], (void*)(uintptr_t)dh[l], count, ncclFloat16, ncclAvg, g_comms[l], g_streams[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)hh[l], dh[l], count * 2, g_streams[l]));
    CU(cu.StreamSynchronize(g_streams[l]));
    size_t bad = 0;
    double first = 0;
    for (size_t j = 0; j < count; j++) {
      double v = dt_load(ncclFloat16, hh[l], j);
      int ok = exact ? v == 32768.0 : v == v && v < 65536.0 && fabs(v - 32768.0) <= 32768.0 * (n + 2) / 1024.0;
      if (!ok && !bad++) first = v;
    }
    EXPECT(bad == 0, "device fp16 avg of 32768 on %d ranks: %zu of %zu wrong, first %g", n, bad, count, first);
    dev_free(dh[l]);
    CU(cu.MemFreeHost(hh[l]));
  }
  expect_no_async_error("reductions");
  tlog("Reductions: 12 datatypes x 5 reductions x 3 collectives checked, and fp16 avg high in its range");
}

/* One process driving a communicator per device (ncclCommInitAll over devices 0..n-1), each
 * with its device's primary context, a stream of it, and a device buffer and a pinned host
 * buffer of `floats` floats allocated there. */
typedef struct {
  int n;
  ncclComm_t comms[MAX_LOCAL];
  CUcontext ctx[MAX_LOCAL];
  CUstream st[MAX_LOCAL];
  CUdeviceptr d[MAX_LOCAL];
  float* h[MAX_LOCAL];
} per_device_t;

static void per_device_open(per_device_t* p, int n, size_t floats) {
  int devs[MAX_LOCAL] = {0};
  p->n = n;
  for (int l = 0; l < n; l++) devs[l] = l;
  CHECK(ncclCommInitAll(p->comms, n, devs));
  for (int l = 0; l < n; l++) {
    CU(cu.PrimaryCtxRetain(&p->ctx[l], l));
    CU(cu.CtxSetCurrent(p->ctx[l]));
    CU(cu.StreamCreate(&p->st[l], CU_STREAM_NON_BLOCKING));
    p->d[l] = dev_alloc(floats * sizeof(float));
    p->h[l] = host_alloc(floats * sizeof(float));
  }
}

static void per_device_close(per_device_t* p) {
  for (int l = 0; l < p->n; l++) {
    CU(cu.CtxSetCurrent(p->ctx[l]));
    CU(cu.MemFree(p->d[l]));
    CU(cu.MemFreeHost(p->h[l]));
    CU(cu.StreamDestroy(p->st[l]));
    CHECK(ncclCommDestroy(p->comms[l]));
  }
  CU(cu.CtxSetCurrent(g_ctx));
}

/* Part Devices (1 process; only when asked, with as many devices as NCCL_TEST_LOCAL): one
 * thread drives a communicator per device (ncclCommInitAll, as nccl-tests -g N), each call on
 * device memory of its communicator's device, with another device's context current; a group
 * of all-reduces large enough to go direct, then small ones: exact, and the thread's current
 * context is the caller's again after each group. */
static void devices(void) {
  test_step("devices");
  const int n = g_env.local;
  const size_t counts[2] = {300000, 1000};
  per_device_t p;
  per_device_open(&p, n, counts[0]);
  ncclComm_t* comms = p.comms;
  CUcontext* ctx = p.ctx;
  CUstream* st = p.st;
  CUdeviceptr* d = p.d;
  float** h = p.h;
  for (int l = 0; l < n; l++) {
    int dev = -1;
    CHECK(ncclCommCuDevice(comms[l], &dev));
    EXPECT(dev == l, "communicator %d is on device %d", l, dev);
  }
  for (int k = 0; k < 2; k++) {
    const size_t count = counts[k];
    for (int l = 0; l < n; l++) {
      for (size_t j = 0; j < count; j++) h[l][j] = in_value(l, j, k);
      CU(cu.CtxSetCurrent(ctx[l]));
      CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), st[l]));
    }
    /* The last device's context is current while every device's call is made. */
    CHECK(ncclGroupStart());
    for (int l = 0; l < n; l++)
      CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, comms[l], st[l]));
    CHECK(ncclGroupEnd());
    CUcontext now = NULL;
    CU(cu.CtxGetCurrent(&now));
    EXPECT(now == ctx[n - 1], "count %zu: the group changed the caller's current context", count);
    for (int l = 0; l < n; l++) {
      CU(cu.CtxSetCurrent(ctx[l]));
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), st[l]));
      CU(cu.StreamSynchronize(st[l]));
      size_t bad = 0;
      for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, n, l, j, k);
      EXPECT(bad == 0, "count %zu, device %d: %zu wrong values", count, l, bad);
    }
  }
  per_device_close(&p);
}

/* Part WrongStream (one process, two devices, NCCL_RS_STUB_DEVICES=2 NCCL_TEST_LOCAL=2): a
 * call given a stream of another device than its communicator's (a program that forgot to
 * switch devices) is refused at the call with ncclInvalidArgument and a message naming both
 * devices; a group holding one runs none of its calls; the communicators go on working. */
static void wrong_stream(void) {
  test_step("wrong stream");
  if (!EXPECT(g_env.local == 2, "needs NCCL_TEST_LOCAL=2")) return;
  const size_t count = 1000;
  per_device_t p;
  per_device_open(&p, 2, count);
  ncclComm_t* comms = p.comms;
  CUcontext* ctx = p.ctx;
  CUstream* st = p.st;
  CUdeviceptr* d = p.d;
  float** h = p.h;
  for (int l = 0; l < 2; l++) {
    CU(cu.CtxSetCurrent(ctx[l]));
    for (size_t j = 0; j < count; j++) h[l][j] = in_value(l, j, 0);
    CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), st[l]));
  }
  /* Alone: refused at the call, whichever context is current. */
  for (int l = 0; l < 2; l++) {
    CU(cu.CtxSetCurrent(ctx[l]));
    ncclResult_t r = ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum,
                                   comms[l], st[1 - l]);
    const char* msg = ncclGetLastError(comms[l]);
    EXPECT(r == ncclInvalidArgument, "device %d: an all-reduce on device %d's stream returned %s", l, 1 - l,
           result_name(r));
    EXPECT(msg && strstr(msg, "stream"), "device %d: the refusal does not say why: '%s'", l, msg ? msg : "(null)");
    /* One-sided calls too (they need no window). */
    r = ncclSignal(1 - l, 0, 0, 0, comms[l], st[1 - l]);
    EXPECT(r == ncclInvalidArgument, "device %d: ncclSignal on device %d's stream returned %s", l, 1 - l,
           result_name(r));
    r = ncclWaitSignal(0, NULL, comms[l], st[1 - l]);
    EXPECT(r == ncclInvalidArgument, "device %d: ncclWaitSignal on device %d's stream returned %s", l, 1 - l,
           result_name(r));
  }
  /* In a group: ncclGroupEnd returns the error and runs nothing. */
  CHECK(ncclGroupStart());
  ncclResult_t r0 = ncclAllReduce((void*)(uintptr_t)d[0], (void*)(uintptr_t)d[0], count, ncclFloat32, ncclSum,
                                  comms[0], st[0]);
  ncclResult_t r1 = ncclAllReduce((void*)(uintptr_t)d[1], (void*)(uintptr_t)d[1], count, ncclFloat32, ncclSum,
                                  comms[1], st[0]);
  ncclResult_t end = ncclGroupEnd();
  EXPECT(r0 == ncclSuccess && r1 == ncclInvalidArgument, "in a group: the calls returned %s and %s", result_name(r0),
         result_name(r1));
  EXPECT(end == ncclInvalidArgument, "ncclGroupEnd of a group with a wrong stream returned %s", result_name(end));
  /* Nothing ran: the inputs are as uploaded. Then a correct call works. */
  for (int l = 0; l < 2; l++) {
    CU(cu.CtxSetCurrent(ctx[l]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), st[l]));
    CU(cu.StreamSynchronize(st[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != in_value(l, j, 0);
    EXPECT(bad == 0, "device %d: %zu values changed by a refused group", l, bad);
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < 2; l++)
    CHECK(ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, comms[l], st[l]));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < 2; l++) {
    CU(cu.CtxSetCurrent(ctx[l]));
    CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), st[l]));
    CU(cu.StreamSynchronize(st[l]));
    size_t bad = 0;
    for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, 2, l, j, 0);
    EXPECT(bad == 0, "device %d: %zu wrong values after the refusals (first %g, expected %g)", l, bad, h[l][0],
           expected(C_ALLREDUCE, count, 2, l, 0, 0));
  }
  per_device_close(&p);
}

/* Part ForeignBuffer (two devices; CUDA_TEST_PEER_ACCESS=0 where they have no peer access):
 * every rank's buffers are memory of the other device than its communicator's (a program that
 * allocated while the other device was current). With peer access the all-reduces are exact,
 * staged (small) or direct (large: the communicator's kernels read and write that memory,
 * which takes peer access nothing else of the job enabled). Without it each call is refused
 * at once with ncclInvalidArgument naming the buffer, on every rank alike, rather than left to
 * a kernel that would fault; the next all-reduce on the communicator's own memory is exact. */
static void foreign_buffer(void) {
  test_step("foreign buffer");
  int devices = 0;
  CU(cu.DeviceGetCount(&devices));
  if (!EXPECT(devices >= 2, "needs two devices (NCCL_RS_STUB_DEVICES=2)")) return;
  const int reachable = peer_access();
  const int other = (g_device + 1) % 2;
  CUcontext octx;
  CU(cu.PrimaryCtxRetain(&octx, other));
  const size_t counts[2] = {1000, 300000};
  for (int k = 0; k < 2; k++) {
    const size_t count = counts[k];
    CUdeviceptr d[MAX_LOCAL];
    float* h[MAX_LOCAL];
    ncclResult_t r[MAX_LOCAL];
    const char* msg[MAX_LOCAL];
    CU(cu.CtxSetCurrent(octx));
    for (int l = 0; l < g_env.local; l++) d[l] = dev_alloc(count * sizeof(float));
    CU(cu.CtxSetCurrent(g_ctx));
    for (int l = 0; l < g_env.local; l++) {
      h[l] = host_alloc(count * sizeof(float));
      for (size_t j = 0; j < count; j++) h[l][j] = in_value(g_env.first_rank + l, j, k);
      CU(cu.MemcpyAsync(d[l], (CUdeviceptr)(uintptr_t)h[l], count * sizeof(float), g_streams[l]));
    }
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++) {
      r[l] = ncclAllReduce((void*)(uintptr_t)d[l], (void*)(uintptr_t)d[l], count, ncclFloat32, ncclSum, g_comms[l],
                           g_streams[l]);
      msg[l] = ncclGetLastError(g_comms[l]);
    }
    ncclResult_t end = ncclGroupEnd();
    EXPECT(end == (reachable ? ncclSuccess : ncclInvalidArgument), "count %zu: ncclGroupEnd returned %s", count,
           result_name(end));
    for (int l = 0; l < g_env.local; l++) {
      const int rank = g_env.first_rank + l;
      CU(cu.MemcpyAsync((CUdeviceptr)(uintptr_t)h[l], d[l], count * sizeof(float), g_streams[l]));
      CU(cu.StreamSynchronize(g_streams[l]));
      size_t bad = 0;
      for (size_t j = 0; j < count; j++) bad += h[l][j] != expected(C_ALLREDUCE, count, g_env.nranks, rank, j, k);
      if (reachable) {
        EXPECT(r[l] == ncclSuccess && bad == 0, "count %zu, rank %d: call %s, %zu wrong values", count, rank,
               result_name(r[l]), bad);
      } else {
        EXPECT(r[l] == ncclInvalidArgument, "count %zu, rank %d: the call returned %s", count, rank, result_name(r[l]));
        EXPECT(msg[l] && strstr(msg[l], "cannot access"), "count %zu, rank %d: the refusal does not say why: '%s'",
               count, rank, msg[l] ? msg[l] : "(null)");
      }
      CU(cu.MemFreeHost(h[l]));
    }
    CU(cu.CtxSetCurrent(octx));
    for (int l = 0; l < g_env.local; l++) dev_free(d[l]);
    CU(cu.CtxSetCurrent(g_ctx));
  }
  run_coll(C_ALLREDUCE, 300000, 0, 0, 7); /* the communicator's own memory: still works */
}

/* Part Beyond (one process): ncclCommInitAll without a device list, more ranks than the
 * driver has devices. Ranks beyond them run calls on host buffers (the stream they are given,
 * of device 0, goes unused), in one group with a rank of a real device: exact. */
static void beyond(void) {
  test_step("beyond the devices");
  int devices = 0;
  CU(cu.DeviceGetCount(&devices));
  const int n = devices + 2;
  if (!EXPECT(n <= MAX_LOCAL, "%d devices: too many for this part", devices)) return;
  ncclComm_t comms[MAX_LOCAL];
  float x[MAX_LOCAL][64];
  CHECK(ncclCommInitAll(comms, n, NULL));
  for (int l = 0; l < n; l++)
    for (int j = 0; j < 64; j++) x[l][j] = in_value(l, (size_t)j, 3);
  CHECK(ncclGroupStart());
  for (int l = 0; l < n; l++) CHECK(ncclAllReduce(x[l], x[l], 64, ncclFloat32, ncclSum, comms[l], g_streams[0]));
  CHECK(ncclGroupEnd());
  CU(cu.StreamSynchronize(g_streams[0]));
  for (int l = 0; l < n; l++) {
    size_t bad = 0;
    for (int j = 0; j < 64; j++) bad += x[l][j] != expected(C_ALLREDUCE, 64, n, l, (size_t)j, 3);
    EXPECT(bad == 0, "rank %d of %d (%d devices): %zu wrong values", l, n, devices, bad);
    CHECK(ncclCommDestroy(comms[l]));
  }
}

/* Part Calls (stand-in only, one rank per process): how many driver calls one call makes on
 * the calling thread once warm: all-reduces below and above the direct path's threshold,
 * a send/receive pair. */
static void calls(void) {
  test_step("calls");
  if (!EXPECT(cu.StubThreadCalls != NULL, "not the stand-in driver")) return;
  const int n = g_env.nranks, rank = g_env.first_rank;
  const size_t counts[2] = {1000, 300000};
  CUdeviceptr a = dev_alloc(300000 * sizeof(float)), b = dev_alloc(300000 * sizeof(float));
  for (int k = 0; k < 2; k++) {
    unsigned long used = 0;
    for (int it = 0; it < 4; it++) {
      unsigned long before = cu.StubThreadCalls(it == 3 && getenv("CUDA_TEST_TRACE_CALLS"));
      CHECK(ncclAllReduce((const void*)(uintptr_t)a, (void*)(uintptr_t)b, counts[k], ncclFloat32, ncclSum, g_comms[0],
                          g_streams[0]));
      used = cu.StubThreadCalls(0) - before;
      CU(cu.StreamSynchronize(g_streams[0]));
    }
    tlog("calls: all-reduce of %zu floats: %lu driver calls", counts[k], used);
  }
  for (int k = 0; k < 2; k++) {
    unsigned long used = 0;
    for (int it = 0; it < 4; it++) {
      unsigned long before = cu.StubThreadCalls(it == 3 && getenv("CUDA_TEST_TRACE_CALLS"));
      CHECK(ncclGroupStart());
      CHECK(ncclSend((const void*)(uintptr_t)a, counts[k], ncclFloat32, (rank + 1) % n, g_comms[0], g_streams[0]));
      CHECK(ncclRecv((void*)(uintptr_t)b, counts[k], ncclFloat32, (rank + n - 1) % n, g_comms[0], g_streams[0]));
      CHECK(ncclGroupEnd());
      used = cu.StubThreadCalls(0) - before;
      CU(cu.StreamSynchronize(g_streams[0]));
    }
    tlog("calls: send/receive of %zu floats: %lu driver calls", counts[k], used);
  }
  dev_free(a);
  dev_free(b);
}

/* Part CheckPointers (only when asked; run with NCCL_CHECK_POINTERS=1): as NCCL's check,
 * a call on plain host memory, or on device memory of another device than the
 * communicator's (where a second device exists), fails with ncclInvalidArgument and says
 * why; a call on the communicator's device memory runs. */
static void check_pointers(void) {
  test_step("check pointers");
  const size_t count = 1000;
  float* plain = TEST_ALLOC((size_t)count * sizeof(float));
  if (!plain) abort();
  for (int l = 0; l < g_env.local; l++) {
    ncclResult_t r = ncclAllReduce(plain, plain, count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]);
    const char* why = ncclGetLastError(g_comms[l]);
    EXPECT(r == ncclInvalidArgument && strstr(why, "sendbuff") && strstr(why, "plain host memory"),
           "all-reduce on plain host memory: %s: %s", result_name(r), why);
    r = ncclSend(plain, count, ncclFloat32, g_env.first_rank + l, g_comms[l], g_streams[l]);
    why = ncclGetLastError(g_comms[l]);
    EXPECT(r == ncclInvalidArgument && strstr(why, "plain host memory"), "send of plain host memory: %s: %s",
           result_name(r), why);
  }
  free(plain);
  int other = -1;
  CUcontext ctx1 = NULL;
  if (cu.DeviceGet(&other, g_device == 0 ? 1 : 0) == 0 && cu.PrimaryCtxRetain(&ctx1, other) == 0) {
    CUdeviceptr far = 0;
    CU(cu.CtxSetCurrent(ctx1));
    CU(cu.MemAlloc(&far, count * sizeof(float)));
    CU(cu.CtxSetCurrent(g_ctx));
    for (int l = 0; l < g_env.local; l++) {
      void* p = (void*)(uintptr_t)far;
      ncclResult_t r = ncclAllReduce(p, p, count, ncclFloat32, ncclSum, g_comms[l], g_streams[l]);
      const char* why = ncclGetLastError(g_comms[l]);
      char want[64];
      snprintf(want, sizeof want, "memory of CUDA device %d", other);
      EXPECT(r == ncclInvalidArgument && strstr(why, want), "all-reduce on device %d's memory: %s: %s", other,
             result_name(r), why);
    }
    CU(cu.CtxSetCurrent(ctx1));
    CU(cu.MemFree(far));
    CU(cu.CtxSetCurrent(g_ctx));
  } else {
    tlog("check pointers: one device, no check of another device's memory");
  }
  CUdeviceptr d[MAX_LOCAL];
  checked_allreduce(d, count, 13, "an all-reduce on the communicator's device memory, pointers checked");
  for (int l = 0; l < g_env.local; l++) dev_free(d[l]);
}

/* Part HostBlind (the stand-in driver only): the host cannot touch device memory. A read
 * faults on a GPU without coherent CPU access, and the stand-in faults alike (its strict
 * device memory), so a test or a library path that reads device memory on the host fails
 * here as on the GPU. A child process reads a device buffer, and must die of it. */
static void host_blind(void) {
  if (!cu.StubThreadCalls) return;
  test_step("host-blind");
  CUdeviceptr d = dev_alloc(4096);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL);
    signal(SIGBUS, SIG_DFL);
    volatile const char* p = (const char*)(uintptr_t)d;
    _exit(*p == 0x5a ? 3 : 4); /* reached only if the host could read it */
  }
  int status = 0;
  pid_t waited;
  do waited = pid > 0 ? waitpid(pid, &status, 0) : -1;
  while (waited < 0 && errno == EINTR); /* (a signal storm: NCCL_TEST_SIGNAL_STORM_US) */
  EXPECT(pid > 0 && waited == pid, "fork or waitpid failed: %s", strerror(errno));
  EXPECT(WIFSIGNALED(status) && (WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS),
         "the host read device memory (%s) without a fault: status %#x", g_vmm.on ? "cuMemMap" : "cuMemAlloc", status);
  dev_free(d);
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  load_driver();
  g_vmm.on = getenv("CUDA_TEST_VMM") != NULL;
  g_vmm.private = g_vmm.on && !strcmp(getenv("CUDA_TEST_VMM"), "private");
  if (getenv("CUDA_TEST_NO_PTRACE")) refuse_ptrace();
  const char* dev = getenv("NCCL_TEST_CUDA_DEVICE");
  g_device = dev && *dev ? atoi(dev) : 0;
  CU(cu.Init(0));
  int cudev = 0;
  CU(cu.DeviceGet(&cudev, g_device));
  CU(cu.PrimaryCtxRetain(&g_ctx, cudev));
  CU(cu.CtxSetCurrent(g_ctx));
  make_cuda_comms();
  if (getenv("CUDA_TEST_FAULT")) return fault();
  if (getenv("CUDA_TEST_MISMATCH")) return mismatch();
  if (getenv("CUDA_TEST_POINTER_FAILS")) return pointer_fails();
  if (getenv("CUDA_TEST_LAUNCH_FAIL")) return launch_fail();
  if (getenv("CUDA_TEST_ABORT_HELD")) return abort_held();
  if (getenv("CUDA_TEST_STREAM_HELD")) return stream_held();
  if (getenv("CUDA_TEST_P2P_LATE")) return p2p_late();
  if (getenv("CUDA_TEST_CLOSED_EARLY")) return closed_early();
  if (getenv("CUDA_TEST_GRAPH_HELD")) return graph_held();
  if (getenv("CUDA_TEST_SHRINK_STUCK")) return shrink_stuck();
  if (host_wait_mode()) {
    host_wait();
    if (wanted("HostWaitNonblocking")) host_wait_nonblocking();
  } else if (wanted("Gated")) {
    gated();
  }
  if (wanted("Collectives")) collectives();
  if (wanted("InPlace")) in_place();
  if (wanted("P2P")) p2p(), p2p_all_to_all();
  if (wanted("Mixed")) mixed();
  if (wanted("P2PPairings")) p2p_pairings();
  if (wanted("HostInOrder")) host_buffers_in_order();
  if (wanted("Streams")) two_streams();
  if (wanted("Order")) order();
  if (wanted("PreMul")) premul();
  if (wanted("Capture")) capture();
  if (wanted("MemAlloc")) memalloc();
  if (wanted("Rma")) rma();
  if (wanted("RmaPageable")) rma_pageable();
  if (wanted("PeerPointers")) peer_pointers();
  if (wanted("RmaErrors")) rma_errors();
  if (wanted("Context")) context();
  if (wanted("GroupMix")) group_mix();
  if (wanted("Torch")) torch_like();
  if (wanted("Churn")) churn();
  if (wanted("Recycle")) recycle();
  if (wanted("HostBlind")) host_blind();
  if (g_env.only && !strcasecmp(g_env.only, "Backlog")) backlog(); /* only when asked: 600 calls */
  if (g_env.only && !strcasecmp(g_env.only, "Pageable")) pageable();
  if (g_env.only && !strcasecmp(g_env.only, "Calls")) calls();
  if (g_env.only && !strcasecmp(g_env.only, "Devices")) devices();
  if (g_env.only && !strcasecmp(g_env.only, "WrongStream")) wrong_stream();
  if (g_env.only && !strcasecmp(g_env.only, "ForeignBuffer")) foreign_buffer();
  if (g_env.only && !strcasecmp(g_env.only, "Beyond")) beyond();
  if (g_env.only && !strcasecmp(g_env.only, "CaptureElsewhere")) capture_elsewhere();
  if (g_env.only && !strcasecmp(g_env.only, "Graph")) graph();
  if (g_env.only && !strcasecmp(g_env.only, "GraphRefused")) graph_refused();
  if (g_env.only && !strcasecmp(g_env.only, "Suspend")) suspend_mem();
  if (g_env.only && !strcasecmp(g_env.only, "Reductions")) reductions(); /* only when asked: 180 calls */
  if (g_env.only && !strcasecmp(g_env.only, "DeclineOne")) decline_one();
  if (g_env.only && !strcasecmp(g_env.only, "RmaGone")) rma_gone();
  if (g_env.only && !strcasecmp(g_env.only, "RmaLate")) rma_late();
  if (g_env.only && !strcasecmp(g_env.only, "RmaStopped")) rma_stopped();
  if (g_env.only && !strcasecmp(g_env.only, "HeldBySignal")) held_by_signal();
  if (g_env.only && !strcasecmp(g_env.only, "RmaFailed")) rma_failed();
  if (g_env.only && !strcasecmp(g_env.only, "RmaNoSender")) rma_no_sender();
  if (g_env.only && !strcasecmp(g_env.only, "RmaStreams")) rma_streams();
  if (g_env.only && !strcasecmp(g_env.only, "Leaks")) leaks();
  if (g_env.only && !strcasecmp(g_env.only, "DroppedGroup")) dropped_group();
  if (g_env.only && !strcasecmp(g_env.only, "Ahead")) ahead();
  if (g_env.only && !strcasecmp(g_env.only, "CheckPointers")) check_pointers();
  if (wanted("Soak")) soak();
  for (int l = 0; l < g_env.local; l++) CU(cu.StreamDestroy(g_streams[l]));
  destroy_comms(g_comms);
  return test_finish();
}
