/*
 * Memory of the stub driver: device memory (memfd mappings, shareable by IPC handle), managed
 * memory, pinned host memory, what cuPointerGetAttribute(s) report, and CUDA IPC. The virtual
 * memory API (cuMemCreate, cuMemMap, ...) is in vmm.c, on the same table of ranges.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stub.h"

enum {
  MEMORYTYPE_HOST = 1,
  MEMORYTYPE_DEVICE = 2,
  PTR_ATTR_CONTEXT = 1,
  PTR_ATTR_MEMORY_TYPE = 2,
  PTR_ATTR_DEVICE_POINTER = 3,
  PTR_ATTR_HOST_POINTER = 4,
  PTR_ATTR_BUFFER_ID = 7,
  PTR_ATTR_IS_MANAGED = 8,
  PTR_ATTR_DEVICE_ORDINAL = 9,
  PTR_ATTR_ALLOWED_HANDLE_TYPES = 14,
  MEMHOSTALLOC_ALL = 7, /* PORTABLE | DEVICEMAP | WRITECOMBINED */
  MEM_ATTACH_GLOBAL = 1,
  MEM_ATTACH_HOST = 2,
  IPC_LAZY_ENABLE_PEER_ACCESS = 1,
};

#define IPC_MAGIC 0x4e525349u

/* What an IPC handle carries, in its 64 bytes. */
struct ipc {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  int32_t dev;
  uint64_t id;
  uint64_t size;
};
_Static_assert(sizeof(struct ipc) <= sizeof(CUipcMemHandle), "IPC handle too small");

static struct range *g_ranges;
static uint64_t g_next_id = 1;
static uint64_t g_next_buffer_id = 1;
pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;

struct range *mem_find(uintptr_t p) {
  for (struct range *r = g_ranges; r; r = r->next)
    if (p >= r->base && p - r->base < r->size) return r;
  return NULL;
}

int mem_overlaps(uintptr_t p, size_t n) {
  for (struct range *r = g_ranges; r; r = r->next)
    if (r->base < p + n && p < r->base + r->size) return 1;
  return 0;
}

struct range *mem_add(uintptr_t base, size_t size, enum mem_kind kind, int dev, int fd, uint64_t id) {
  struct range *r = calloc(1, sizeof *r);
  if (!r) abort();
  *r = (struct range){g_ranges, base, size, kind, dev, fd, id, g_next_buffer_id++, NULL, 0, 0};
  g_ranges = r;
  return r;
}

struct range *mem_take(uintptr_t p, unsigned kinds) {
  for (struct range **pr = &g_ranges; *pr; pr = &(*pr)->next) {
    struct range *r = *pr;
    if (r->base == p && (kinds & (1u << r->kind))) {
      *pr = r->next;
      return r;
    }
  }
  return NULL;
}

/* Mappings of the virtual memory API that follow each other make one range of addresses,
 * as on a GPU (PyTorch's expandable segments map every 20 MiB on its own). */
enum mem_kind mem_lookup(uintptr_t p, size_t n) {
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find(p);
  while (r && r->kind == MEM_VMM && n > r->size - (p - r->base)) {
    n -= r->size - (p - r->base);
    p = r->base + r->size;
    r = mem_find(p);
    if (r && r->kind != MEM_VMM) r = NULL;
  }
  enum mem_kind k = r && n <= r->size - (p - r->base) ? r->kind : MEM_PAGEABLE;
  pthread_mutex_unlock(&g_mem_lock);
  return k;
}

int peer_enabled(int from, int to);

int device_reaches(int dev, uintptr_t p) {
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find(p);
  int other = r && r->kind == MEM_DEVICE && dev >= 0 ? r->dev : -1;
  pthread_mutex_unlock(&g_mem_lock);
  return other < 0 || other == dev || peer_enabled(dev, other);
}

int strict_device(void) {
  static int strict = -1;
  if (strict < 0) strict = !env_int("NCCL_RS_STUB_HOST_SEES_DEVICE", 0);
  return strict;
}

static int device_kind(enum mem_kind k) { return k == MEM_DEVICE || k == MEM_IPC || k == MEM_VMM; }

void *dev_view(uintptr_t p) {
  if (!p || !strict_device()) return (void *)p;
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find(p);
  int aliased = r && device_kind(r->kind);
  pthread_mutex_unlock(&g_mem_lock);
  return (void *)(aliased ? p - DEVICE_ALIAS : p);
}

void *map_device(int fd, size_t size) {
  if (!strict_device()) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
  }
  void *p = mmap(NULL, size, PROT_NONE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return NULL;
  void *want = (void *)((uintptr_t)p - DEVICE_ALIAS), *alias = MAP_FAILED;
  if ((uintptr_t)p > DEVICE_ALIAS)
    alias = mmap(want, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
  if (alias != want) {
    if (alias != MAP_FAILED) munmap(alias, size);
    munmap(p, size);
    fprintf(stderr, "cuda-stub: no room for the alias of device memory at %p\n", p);
    return NULL;
  }
  return p;
}

/* The alias goes first: once the address the driver handed out is free, another thread may be
 * handed it again and must find its alias's place free too. */
void unmap_device(void *p, size_t size) {
  if (strict_device()) munmap((void *)((uintptr_t)p - DEVICE_ALIAS), size);
  munmap(p, size);
}

/* Shared memory of `size` bytes backed by a new memfd named after `id`: device memory
 * (map_device) for MEM_DEVICE, else the host's. */
static void *map_memfd(size_t size, uint64_t id, enum mem_kind kind, int *fd_out) {
  char name[64];
  snprintf(name, sizeof name, "nccl-rs-stub-%llu", (unsigned long long)id);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return NULL;
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return NULL;
  }
  void *p = NULL;
  if (kind == MEM_DEVICE) {
    p = map_device(fd, size);
  } else {
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) p = NULL;
  }
  if (!p) {
    close(fd);
    return NULL;
  }
  *fd_out = fd;
  return p;
}

static CUresult alloc_shared(CUdeviceptr *dptr, size_t size, enum mem_kind kind) {
  REQUIRE_CTX();
  if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  uint64_t id = g_next_id++;
  int fd = -1;
  void *p = map_memfd(size, id, kind, &fd);
  if (p) mem_add((uintptr_t)p, size, kind, t_current->dev, fd, id);
  pthread_mutex_unlock(&g_mem_lock);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  *dptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemAlloc_v2");
  note_worker_call("cuMemAlloc_v2");
  return alloc_shared(dptr, size, MEM_DEVICE);
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemAllocManaged");
  if (flags != MEM_ATTACH_GLOBAL && flags != MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
  return alloc_shared(dptr, size, MEM_MANAGED);
}

static void unmap(struct range *r) {
  if (device_kind(r->kind)) unmap_device((void *)r->base, r->size);
  else munmap((void *)r->base, r->size);
  if (r->fd >= 0) close(r->fd);
  free(r);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  count_call(__func__);
  device_sync(__func__);
  REFUSE_DURING_CAPTURE("cuMemFree_v2");
  note_worker_call("cuMemFree_v2");
  REQUIRE_INIT();
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_take((uintptr_t)p, 1u << MEM_DEVICE | 1u << MEM_MANAGED);
  pthread_mutex_unlock(&g_mem_lock);
  if (!r) return CUDA_ERROR_INVALID_VALUE;
  unmap(r);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemHostAlloc");
  note_worker_call("cuMemHostAlloc");
  REQUIRE_CTX();
  if (!pp || size == 0 || (flags & ~(unsigned)MEMHOSTALLOC_ALL)) return CUDA_ERROR_INVALID_VALUE;
  /* NCCL_RS_STUB_HOST_ALLOC_FAILS=N:BYTES: the first N allocations of exactly BYTES fail, as
   * when pinned memory runs out. */
  static int failed;
  const char *fails = getenv("NCCL_RS_STUB_HOST_ALLOC_FAILS");
  int times = 0;
  unsigned long long bytes = 0;
  if (fails && sscanf(fails, "%d:%llu", &times, &bytes) == 2 && size == bytes && __atomic_fetch_add(&failed, 1, __ATOMIC_RELAXED) < times)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&g_mem_lock);
  mem_add((uintptr_t)p, size, MEM_HOST_PINNED, t_current->dev, -1, 0);
  pthread_mutex_unlock(&g_mem_lock);
  *pp = p;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned flags) {
  count_call(__func__);
  REQUIRE_CTX();
  if (!pdptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (mem_lookup((uintptr_t)p, 1) != MEM_HOST_PINNED) return CUDA_ERROR_INVALID_VALUE;
  *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeHost(void *p) {
  count_call(__func__);
  device_sync(__func__);
  REFUSE_DURING_CAPTURE("cuMemFreeHost");
  note_worker_call("cuMemFreeHost");
  REQUIRE_INIT();
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_take((uintptr_t)p, 1u << MEM_HOST_PINNED);
  pthread_mutex_unlock(&g_mem_lock);
  if (!r) return CUDA_ERROR_INVALID_VALUE;
  unmap(r);
  return CUDA_SUCCESS;
}

/* One attribute of a known range (g_mem_lock held). */
static CUresult attribute(void *data, int attr, const struct range *r, uintptr_t p) {
  int host = r->kind == MEM_HOST_PINNED, managed = r->kind == MEM_MANAGED;
  switch (attr) {
    case PTR_ATTR_CONTEXT: *(void **)data = NULL; return CUDA_SUCCESS; /* no user contexts */
    case PTR_ATTR_MEMORY_TYPE: *(unsigned *)data = host ? MEMORYTYPE_HOST : MEMORYTYPE_DEVICE; return CUDA_SUCCESS;
    case PTR_ATTR_DEVICE_POINTER: *(CUdeviceptr *)data = p; return CUDA_SUCCESS;
    case PTR_ATTR_HOST_POINTER:
      if (!host && !managed) return CUDA_ERROR_INVALID_VALUE;
      *(void **)data = (void *)p;
      return CUDA_SUCCESS;
    case PTR_ATTR_BUFFER_ID:
      if (r->kind == MEM_HOST_PINNED) return CUDA_ERROR_INVALID_VALUE;
      *(unsigned long long *)data = r->buffer_id;
      return CUDA_SUCCESS;
    case PTR_ATTR_IS_MANAGED: *(unsigned *)data = managed; return CUDA_SUCCESS;
    case PTR_ATTR_DEVICE_ORDINAL: *(int *)data = r->dev; return CUDA_SUCCESS;
    case PTR_ATTR_ALLOWED_HANDLE_TYPES:
      /* What the allocation can be exported as: only the virtual memory API's are. */
      *(unsigned long long *)data = r->kind == MEM_VMM ? vmm_handle_types(r->phys) : 0;
      return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

/* The singular call: memory the driver does not know is CUDA_ERROR_INVALID_VALUE. */
EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find((uintptr_t)ptr);
  CUresult res = r ? attribute(data, attr, r, (uintptr_t)ptr) : CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&g_mem_lock);
  return res;
}

/* Not the driver's: for tests, make pointer queries fail as they do once a context has hit a
 * sticky error (CUDA_ERROR_ILLEGAL_ADDRESS), or work again. */
static int g_pointer_queries_fail;
EXPORT void nccl_rs_stub_pointer_queries_fail(int on) { __atomic_store_n(&g_pointer_queries_fail, on, __ATOMIC_RELEASE); }

/* The plural call: memory the driver does not know gets null values (memory type 0, device
 * ordinal -2) and CUDA_SUCCESS, as the driver documents. */
EXPORT CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr ptr) {
  count_call(__func__);
  REQUIRE_INIT();
  if (__atomic_load_n(&g_pointer_queries_fail, __ATOMIC_ACQUIRE)) return CUDA_ERROR_ILLEGAL_ADDRESS;
  if (!attrs || !data) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find((uintptr_t)ptr);
  CUresult res = CUDA_SUCCESS;
  for (unsigned i = 0; i < n && res == CUDA_SUCCESS; i++) {
    if (r) {
      res = attribute(data[i], attrs[i], r, (uintptr_t)ptr);
    } else if (attrs[i] == PTR_ATTR_DEVICE_ORDINAL) {
      *(int *)data[i] = -2;
    } else if (attrs[i] == PTR_ATTR_MEMORY_TYPE || attrs[i] == PTR_ATTR_IS_MANAGED) {
      *(unsigned *)data[i] = 0;
    } else if (attrs[i] == PTR_ATTR_CONTEXT || attrs[i] == PTR_ATTR_HOST_POINTER) {
      *(void **)data[i] = NULL;
    } else if (attrs[i] == PTR_ATTR_DEVICE_POINTER) {
      *(CUdeviceptr *)data[i] = 0;
    } else {
      res = CUDA_ERROR_INVALID_VALUE;
    }
  }
  pthread_mutex_unlock(&g_mem_lock);
  return res;
}

/* The allocation (device, managed or an opened IPC mapping) that contains p; for the virtual
 * memory API, the one mapping (cuMemMap) that contains it, as the driver reports. */
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  count_call(__func__);
  REQUIRE_INIT();
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find((uintptr_t)p);
  int ok = r && r->kind != MEM_HOST_PINNED;
  if (ok) {
    if (base) *base = r->base;
    if (size) *size = r->size;
  }
  pthread_mutex_unlock(&g_mem_lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find((uintptr_t)p);
  struct ipc h = {0};
  /* The driver wants the start of the allocation (cuMemGetAddressRange finds it). */
  if (r && r->kind == MEM_DEVICE && r->base == (uintptr_t)p)
    h = (struct ipc){IPC_MAGIC, (int32_t)getpid(), r->fd, r->dev, r->id, r->size};
  pthread_mutex_unlock(&g_mem_lock);
  if (!h.magic) return CUDA_ERROR_INVALID_VALUE;
  memset(handle, 0, sizeof *handle);
  memcpy(handle, &h, sizeof h);
  return CUDA_SUCCESS;
}

/* Maps the peer's memfd through /proc/<pid>/fd, checking it is the allocation the handle
 * names (the fd number may have been reused since). */
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned flags) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuIpcOpenMemHandle_v2");
  REQUIRE_CTX();
  struct ipc h;
  memcpy(&h, &handle, sizeof h);
  if (!pdptr || (flags & ~(unsigned)IPC_LAZY_ENABLE_PEER_ACCESS) || h.magic != IPC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  /* The real driver refuses a handle of the calling process. */
  if (h.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;
  /* For tests: GPUs without peer access to each other (NCCL_RS_STUB_NO_PEER_ACCESS=1). */
  if (env_int("NCCL_RS_STUB_NO_PEER_ACCESS", 0)) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  /* "If the memory handle has already been opened by the current context, the reference count
   * on the handle is incremented by 1 and the existing device pointer is returned." */
  pthread_mutex_lock(&g_mem_lock);
  for (struct range *r = g_ranges; r; r = r->next) {
    if (r->kind == MEM_IPC && r->owner_pid == h.pid && r->id == h.id) {
      r->refs++;
      *pdptr = (CUdeviceptr)r->base;
      pthread_mutex_unlock(&g_mem_lock);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&g_mem_lock);
  char path[64], link[128], want[128];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
  snprintf(want, sizeof want, "/memfd:nccl-rs-stub-%llu (deleted)", (unsigned long long)h.id);
  ssize_t len = readlink(path, link, sizeof link - 1);
  if (len < 0) return CUDA_ERROR_INVALID_HANDLE;
  link[len] = 0;
  if (strcmp(link, want) != 0) return CUDA_ERROR_INVALID_HANDLE;
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_MAP_FAILED;
  struct stat st;
  void *p = NULL;
  if (fstat(fd, &st) == 0 && (uint64_t)st.st_size == h.size) p = map_device(fd, h.size);
  close(fd);
  if (!p) return CUDA_ERROR_MAP_FAILED;
  pthread_mutex_lock(&g_mem_lock);
  struct range *added = mem_add((uintptr_t)p, h.size, MEM_IPC, h.dev, -1, h.id);
  added->owner_pid = h.pid;
  added->refs = 1;
  pthread_mutex_unlock(&g_mem_lock);
  *pdptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  count_call(__func__);
  note_worker_call(__func__);
  device_sync(__func__);
  REFUSE_DURING_CAPTURE("cuIpcCloseMemHandle");
  REQUIRE_CTX();
  pthread_mutex_lock(&g_mem_lock);
  /* The last close unmaps. */
  struct range *open = mem_find((uintptr_t)p);
  struct range *r = NULL;
  if (open && open->kind == MEM_IPC && open->base == (uintptr_t)p && --open->refs == 0)
    r = mem_take((uintptr_t)p, 1u << MEM_IPC);
  int known = open && open->kind == MEM_IPC && open->base == (uintptr_t)p;
  pthread_mutex_unlock(&g_mem_lock);
  if (!known) return CUDA_ERROR_INVALID_VALUE;
  if (r) unmap(r);
  return CUDA_SUCCESS;
}

/* Not the driver's: for tests, the memory this process allocated and has not freed (device,
 * managed and pinned host allocations): how many, their bytes in *bytes. */
EXPORT int nccl_rs_stub_own_memory(size_t *bytes) {
  size_t total = 0;
  int n = 0;
  pthread_mutex_lock(&g_mem_lock);
  for (struct range *r = g_ranges; r; r = r->next) {
    if (r->kind != MEM_DEVICE && r->kind != MEM_MANAGED && r->kind != MEM_HOST_PINNED) continue;
    n++;
    total += r->size;
  }
  pthread_mutex_unlock(&g_mem_lock);
  if (bytes) *bytes = total;
  return n;
}

/* Not the driver's: for tests, the peers' device memory this process holds open (IPC
 * mappings, and allocations imported from descriptors, held by a handle or a mapping): how
 * many, their bytes in *bytes. Memory another process freed stays alive while held here. */
EXPORT int nccl_rs_stub_peer_memory(size_t *bytes) {
  size_t total = 0;
  int n = 0;
  pthread_mutex_lock(&g_mem_lock);
  for (struct range *r = g_ranges; r; r = r->next) {
    if (r->kind != MEM_IPC) continue;
    n++;
    total += r->size;
  }
  n += vmm_imported(&total);
  pthread_mutex_unlock(&g_mem_lock);
  if (bytes) *bytes = total;
  return n;
}
