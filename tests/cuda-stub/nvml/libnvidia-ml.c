/* A test-only stand-in for NVML (libnvidia-ml.so.1): the NVLink queries nccl-rs makes, answered
 * from NCCL_RS_STUB_NVLINKS, a ';' list of links "BUS>REMOTE" (REMOTE a GPU's PCI bus id, or
 * "switch" for an NVSwitch at 0000:90:00.0), link k of BUS being its k-th entry. Unset, NVML
 * "is not loaded" (nvmlInit_v2 fails). NCCL_RS_STUB_NVML_NO_TYPE=1: the remote device type
 * query fails as on drivers before R460, so the caller reads the remote's PCI class.
 * Built by tests/common beside the stand-in libcuda.so.1; never shipped. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6,
       NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_FUNCTION_NOT_FOUND = 13 };
enum { MAX_LINKS = 18 };

typedef struct {
  char busIdLegacy[16];
  unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
} nvmlPciInfo_t;

typedef struct stub_device* nvmlDevice_t;
struct stub_device {
  char bus[32]; /* normalized: "0000:04:00.0" */
};

static int g_init;

/* "00000000:3B:00.0" or "0000:3b:00.0" as "0000:3b:00.0". */
static int normalize(const char* id, char out[32]) {
  unsigned domain, bus, dev, fn;
  if (!id || sscanf(id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4) return 0;
  snprintf(out, 32, "%04x:%02x:%02x.%x", domain, bus, dev, fn);
  return 1;
}

/* The remote end of `bus`'s link `link`, or NULL (no such link); *any: whether `bus` has links. */
static const char* remote_of(const char* bus, unsigned link, char out[32], int* any) {
  const char* spec = getenv("NCCL_RS_STUB_NVLINKS");
  unsigned k = 0;
  *any = 0;
  for (const char* p = spec; p && *p;) {
    const char* end = strchr(p, ';');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    char entry[80] = {0}, left[32];
    if (n < sizeof entry) memcpy(entry, p, n);
    char* gt = strchr(entry, '>');
    if (gt) {
      *gt = 0;
      if (normalize(entry, left) && !strcmp(left, bus)) {
        *any = 1;
        if (k++ == link) {
          if (!strcmp(gt + 1, "switch")) {
            strcpy(out, "0000:90:00.0");
            return out;
          }
          return normalize(gt + 1, out) ? out : NULL;
        }
      }
    }
    p = end ? end + 1 : NULL;
  }
  return NULL;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
  if (!getenv("NCCL_RS_STUB_NVLINKS")) return NVML_ERROR_DRIVER_NOT_LOADED;
  g_init = 1;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* id, nvmlDevice_t* device) {
  if (!g_init) return NVML_ERROR_DRIVER_NOT_LOADED;
  char bus[32];
  if (!device || !normalize(id, bus)) return NVML_ERROR_INVALID_ARGUMENT;
  struct stub_device* d = calloc(1, sizeof *d); /* (a handle lives as long as the process) */
  if (!d) return NVML_ERROR_NOT_FOUND;
  strcpy(d->bus, bus);
  *device = d;
  return NVML_SUCCESS;
}

/* The checks every link query makes (`out`: its output pointer), then the link's remote end
 * (*remote: NULL if none; *any: whether the device has links). */
static nvmlReturn_t link_query(nvmlDevice_t device, unsigned link, const void* out, char buf[32], const char** remote,
                               int* any) {
  if (!g_init) return NVML_ERROR_DRIVER_NOT_LOADED;
  if (!device || !out || link >= MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
  *remote = remote_of(device->bus, link, buf, any);
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned link, unsigned* isActive) {
  char out[32];
  const char* r = NULL;
  int any = 0;
  nvmlReturn_t e = link_query(device, link, isActive, out, &r, &any);
  if (e != NVML_SUCCESS) return e;
  if (!any) return NVML_ERROR_NOT_SUPPORTED; /* a GPU without NVLink */
  *isActive = r != NULL;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned link, nvmlPciInfo_t* pci) {
  char out[32];
  const char* r = NULL;
  int any = 0;
  nvmlReturn_t e = link_query(device, link, pci, out, &r, &any);
  if (e != NVML_SUCCESS) return e;
  if (!r) return any ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
  unsigned domain, bus, dev, fn;
  sscanf(r, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
  memset(pci, 0, sizeof *pci);
  pci->domain = domain, pci->bus = bus, pci->device = dev;
  /* As NVML writes them: an eight-digit domain, upper case. */
  snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
  snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, dev, fn);
  return NVML_SUCCESS;
}

/* nvmlIntNvLinkDeviceType_t: 0 GPU, 1 IBM NPU, 2 switch. */
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned link, unsigned* type) {
  const char* no_type = getenv("NCCL_RS_STUB_NVML_NO_TYPE");
  if (g_init && no_type && atoi(no_type)) return NVML_ERROR_FUNCTION_NOT_FOUND;
  char out[32];
  const char* r = NULL;
  int any = 0;
  nvmlReturn_t e = link_query(device, link, type, out, &r, &any);
  if (e != NVML_SUCCESS) return e;
  if (!r) return NVML_ERROR_INVALID_ARGUMENT;
  *type = !strcmp(r, "0000:90:00.0") ? 2 : 0;
  return NVML_SUCCESS;
}
