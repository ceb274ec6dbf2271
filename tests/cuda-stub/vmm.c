/*
 * The virtual memory API of the stub driver, as PyTorch's expandable segments and NVIDIA's
 * ncclMemAlloc use it: cuMemCreate makes a physical allocation (a memfd), cuMemAddressReserve
 * an inaccessible range of addresses, cuMemMap maps an allocation over part of a reservation
 * (still inaccessible: cuMemSetAccess opens it), and an allocation created with the POSIX file
 * descriptor handle type exports as a descriptor of its memfd, which another process takes
 * (pidfd_getfd, or a Unix socket) and imports. As on a GPU, cuMemGetAddressRange names one
 * mapping, and the IPC handles of cuIpcGetMemHandle do not cover this memory.
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

/* A GPU's allocation granularity. */
#define GRANULARITY ((size_t)2 << 20)

enum {
  ALLOCATION_TYPE_PINNED = 1,
  LOCATION_TYPE_DEVICE = 1,
  HANDLE_TYPE_POSIX_FD = 1,
  ACCESS_NONE = 0,
  ACCESS_READ = 1,
  ACCESS_READWRITE = 3,
};

typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
  int type;
  int id;
} CUmemLocation;
/* cuda.h's CUmemAllocationProp (CUDA 12). */
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

/* A physical allocation, held by its handles and its mappings (refs, under g_mem_lock). */
struct phys {
  struct phys *next;
  int fd;
  size_t size;
  int dev;
  int handle_types;
  int refs;
  int imported; /* from a descriptor (cuMemImportFromShareableHandle), not created here */
};

/* A range of addresses from cuMemAddressReserve. */
struct resv {
  struct resv *next;
  uintptr_t base;
  size_t size;
};

static struct phys *g_phys;
static struct resv *g_resv;

/* The live allocation a handle names, else NULL (callers hold g_mem_lock). */
static struct phys *phys_of(CUmemGenericAllocationHandle h) {
  for (struct phys *p = g_phys; p; p = p->next)
    if ((CUmemGenericAllocationHandle)(uintptr_t)p == h) return p;
  return NULL;
}

static CUmemGenericAllocationHandle phys_new(int fd, size_t size, int dev, int handle_types, int imported) {
  struct phys *p = calloc(1, sizeof *p);
  if (!p) abort();
  *p = (struct phys){g_phys, fd, size, dev, handle_types, 1, imported};
  g_phys = p;
  return (CUmemGenericAllocationHandle)(uintptr_t)p;
}

/* Drops one reference; the last frees the memory (callers hold g_mem_lock). */
static void phys_put(struct phys *p) {
  if (--p->refs > 0) return;
  for (struct phys **pp = &g_phys; *pp; pp = &(*pp)->next) {
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  }
  close(p->fd);
  free(p);
}

int vmm_handle_types(const struct phys *p) { return p->handle_types; }

int vmm_imported(size_t *bytes) {
  int n = 0;
  for (struct phys *p = g_phys; p; p = p->next) {
    if (!p->imported) continue;
    n++;
    *bytes += p->size;
  }
  return n;
}

static int prop_ok(const CUmemAllocationProp *prop) {
  return prop && prop->type == ALLOCATION_TYPE_PINNED && prop->location.type == LOCATION_TYPE_DEVICE &&
         prop->location.id >= 0 && prop->location.id < g_ndev;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!granularity || !prop_ok(prop) || option < 0 || option > 1) return CUDA_ERROR_INVALID_VALUE;
  *granularity = GRANULARITY;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemCreate");
  note_worker_call("cuMemCreate");
  REQUIRE_INIT();
  if (!handle || !prop_ok(prop) || flags || size == 0 || size % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  char name[64];
  /* The device is in the name, so an importer knows it. */
  snprintf(name, sizeof name, "nccl-rs-stub-vmm-%d", prop->location.id);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_lock(&g_mem_lock);
  *handle = phys_new(fd, size, prop->location.id, prop->requestedHandleTypes, 0);
  pthread_mutex_unlock(&g_mem_lock);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemRelease");
  REQUIRE_INIT();
  pthread_mutex_lock(&g_mem_lock);
  struct phys *p = phys_of(handle);
  if (p) phys_put(p);
  pthread_mutex_unlock(&g_mem_lock);
  return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemAddressReserve");
  (void)addr; /* a hint */
  REQUIRE_INIT();
  if (!ptr || size == 0 || size % 4096 || flags || (alignment & (alignment - 1))) return CUDA_ERROR_INVALID_VALUE;
  size_t align = alignment > GRANULARITY ? alignment : GRANULARITY;
  size_t total = size + align;
  void *m = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t start = (uintptr_t)m, base = (start + align - 1) & ~(uintptr_t)(align - 1);
  if (base > start) munmap(m, base - start);
  if (start + total > base + size) munmap((void *)(base + size), start + total - (base + size));
  if (strict_device()) {
    /* The alias of strict device memory (stub.h), reserved alike. */
    void *want = (void *)(base - DEVICE_ALIAS), *alias = MAP_FAILED;
    if (base > DEVICE_ALIAS)
      alias = mmap(want, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (alias != want) {
      if (alias != MAP_FAILED) munmap(alias, size);
      munmap((void *)base, size);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  struct resv *r = calloc(1, sizeof *r);
  if (!r) abort();
  pthread_mutex_lock(&g_mem_lock);
  *r = (struct resv){g_resv, base, size};
  g_resv = r;
  pthread_mutex_unlock(&g_mem_lock);
  *ptr = base;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemAddressFree");
  REQUIRE_INIT();
  pthread_mutex_lock(&g_mem_lock);
  struct resv **pr = &g_resv;
  while (*pr && ((*pr)->base != ptr || (*pr)->size != size)) pr = &(*pr)->next;
  struct resv *r = *pr;
  int ok = r && !mem_overlaps(ptr, size);
  if (ok) {
    *pr = r->next;
    if (strict_device()) munmap((void *)((uintptr_t)ptr - DEVICE_ALIAS), size); /* alias first (unmap_device) */
    munmap((void *)(uintptr_t)ptr, size);
    free(r);
  }
  pthread_mutex_unlock(&g_mem_lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* [p, p + n) lies in one reservation (callers hold g_mem_lock). */
static int reserved(uintptr_t p, size_t n) {
  for (struct resv *r = g_resv; r; r = r->next)
    if (p >= r->base && p + n <= r->base + r->size) return 1;
  return 0;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemMap");
  REQUIRE_INIT();
  uintptr_t p = (uintptr_t)ptr;
  if (offset || flags || size == 0 || size % GRANULARITY || p % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  struct phys *ph = phys_of(handle);
  CUresult res = CUDA_SUCCESS;
  if (!ph || size > ph->size || !reserved(p, size) || mem_overlaps(p, size)) {
    res = CUDA_ERROR_INVALID_VALUE;
  } else if (mmap((void *)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, 0) == MAP_FAILED ||
             (strict_device() &&
              mmap((void *)(p - DEVICE_ALIAS), size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, 0) == MAP_FAILED)) {
    res = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    mem_add(p, size, MEM_VMM, ph->dev, -1, 0)->phys = ph;
    ph->refs++;
  }
  pthread_mutex_unlock(&g_mem_lock);
  return res;
}

/* [p, p + n) is exactly a run of whole mappings that follow each other (g_mem_lock held). */
static int whole_mappings(uintptr_t p, size_t n) {
  if (n == 0) return 0;
  for (uintptr_t a = p; a < p + n;) {
    struct range *r = mem_find(a);
    if (!r || r->kind != MEM_VMM || r->base != a || r->size > p + n - a) return 0;
    a += r->size;
  }
  return 1;
}

/* [p, p + n) is mapped (by mappings that follow each other, at any offset; g_mem_lock held). */
static int covered(uintptr_t p, size_t n) {
  if (n == 0) return 0;
  for (uintptr_t a = p; a < p + n;) {
    struct range *r = mem_find(a);
    if (!r || r->kind != MEM_VMM) return 0;
    a = r->base + r->size;
  }
  return 1;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  count_call(__func__);
  note_worker_call(__func__);
  device_sync(__func__);
  REFUSE_DURING_CAPTURE("cuMemUnmap");
  REQUIRE_INIT();
  uintptr_t p = (uintptr_t)ptr;
  pthread_mutex_lock(&g_mem_lock);
  int ok = whole_mappings(p, size);
  for (uintptr_t a = p; ok && a < p + size;) {
    struct range *r = mem_take(a, 1u << MEM_VMM);
    /* Back to reserved, inaccessible addresses. */
    mmap((void *)r->base, r->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (strict_device())
      mmap((void *)(r->base - DEVICE_ALIAS), r->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
           -1, 0);
    a += r->size;
    phys_put(r->phys);
    free(r);
  }
  pthread_mutex_unlock(&g_mem_lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; i++) {
    const CUmemAccessDesc *d = &desc[i];
    if (d->location.type != LOCATION_TYPE_DEVICE || d->location.id < 0 || d->location.id >= g_ndev)
      return CUDA_ERROR_INVALID_DEVICE;
    if (d->flags == ACCESS_READWRITE) prot = PROT_READ | PROT_WRITE;
    else if (d->flags == ACCESS_READ) prot |= PROT_READ;
    else if (d->flags != ACCESS_NONE) return CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_lock(&g_mem_lock);
  /* Strict device memory: the host's view stays inaccessible; the device's (the alias) opens. */
  uintptr_t view = strict_device() ? (uintptr_t)ptr - DEVICE_ALIAS : (uintptr_t)ptr;
  int ok = covered((uintptr_t)ptr, size) && mprotect((void *)view, size, prot) == 0;
  pthread_mutex_unlock(&g_mem_lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  struct range *r = mem_find((uintptr_t)addr);
  int ok = r && r->kind == MEM_VMM;
  if (ok) {
    r->phys->refs++;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)r->phys;
  }
  pthread_mutex_unlock(&g_mem_lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type,
                                             unsigned long long flags) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!shareable || flags || type != HANDLE_TYPE_POSIX_FD) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mem_lock);
  struct phys *p = phys_of(handle);
  CUresult res = CUDA_SUCCESS;
  if (!p) {
    res = CUDA_ERROR_INVALID_VALUE;
  } else if (!(p->handle_types & HANDLE_TYPE_POSIX_FD)) {
    res = CUDA_ERROR_NOT_PERMITTED; /* created without that handle type */
  } else {
    int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) res = CUDA_ERROR_OUT_OF_MEMORY;
    else *(int *)shareable = fd;
  }
  pthread_mutex_unlock(&g_mem_lock);
  return res;
}

/* A descriptor from cuMemExportToShareableHandle (of this process or another): the memfd of
 * an allocation of this stub, whose name says its device. The caller keeps its descriptor. */
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuMemImportFromShareableHandle");
  REQUIRE_INIT();
  if (!handle || type != HANDLE_TYPE_POSIX_FD) return CUDA_ERROR_INVALID_VALUE;
  int fd = (int)(intptr_t)os_handle;
  char path[64], link[128];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t len = readlink(path, link, sizeof link - 1);
  if (len < 0) return CUDA_ERROR_INVALID_VALUE;
  link[len] = 0;
  int dev = -1;
  struct stat st;
  if (sscanf(link, "/memfd:nccl-rs-stub-vmm-%d", &dev) != 1 || dev < 0 || dev >= g_ndev || fstat(fd, &st) != 0 ||
      st.st_size <= 0)
    return CUDA_ERROR_INVALID_VALUE;
  int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (mine < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&g_mem_lock);
  *handle = phys_new(mine, (size_t)st.st_size, dev, HANDLE_TYPE_POSIX_FD, 1);
  pthread_mutex_unlock(&g_mem_lock);
  return CUDA_SUCCESS;
}
