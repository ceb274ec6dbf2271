/*
 * leaks.c - 200 cycles of init + one allreduce + one signal to the next rank (its one-sided
 * connection and reader thread) + destroy must not leak file descriptors, threads,
 * shared-memory segments (/dev/shm entries named "nccl-rs*") or memory.
 *
 *   leaks [--quick]        (--quick: 50 cycles)
 *
 * Both measurements are taken at the same point of a cycle: a communicator exists and an
 * allreduce on it has completed on every rank (so every rank has finished destroying the
 * previous communicator). Run alone: other jobs creating /dev/shm entries would be counted.
 */
#include "common.h"

#include <dirent.h>
#include <string.h>

#define SHM_PREFIX "nccl-rs"

typedef struct {
  long fds, threads, shm, rss_kb;
} usage_t;

static long count_dir(const char* path, const char* prefix) {
  DIR* d = opendir(path);
  if (!d) return -1;
  long n = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    if (prefix && strncmp(e->d_name, prefix, strlen(prefix))) continue;
    n++;
  }
  closedir(d);
  return n;
}

static long status_field(const char* key) {
  FILE* f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long v = -1;
  size_t klen = strlen(key);
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, key, klen) && line[klen] == ':') {
      v = strtol(line + klen + 1, NULL, 10);
      break;
    }
  }
  fclose(f);
  return v;
}

static usage_t measure(void) {
  usage_t u;
  u.fds = count_dir("/proc/self/fd", NULL) - 1; /* minus the directory being read */
  u.threads = status_field("Threads");
  u.shm = count_dir("/dev/shm", SHM_PREFIX);
  u.rss_kb = status_field("VmRSS");
  return u;
}

static void list_shm(void) {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  struct dirent* e;
  while ((e = readdir(d)) != NULL)
    if (!strncmp(e->d_name, SHM_PREFIX, strlen(SHM_PREFIX))) tlog("  /dev/shm/%s", e->d_name);
  closedir(d);
}

/* One cycle: init, one allreduce (checked), a signal to the next rank and a wait for the
 * previous one's, destroy. */
static void cycle(const char* tag) {
  ncclComm_t comms[MAX_LOCAL];
  make_comms(tag, comms);
  int sum = allreduce_sum_int(comms, 1);
  if (sum != g_env.nranks) {
    EXPECT(0, "%s: allreduce gave %d, expected %d", tag, sum, g_env.nranks);
  }
  const int n = g_env.nranks;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclSignal((g_env.first_rank + l + 1) % n, 0, 0, 0, comms[l], TEST_STREAM));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    ncclWaitSignalDesc_t d = {.opCnt = 1, .peer = (g_env.first_rank + l + n - 1) % n, .sigIdx = 0, .ctx = 0};
    CHECK(ncclWaitSignal(1, &d, comms[l], TEST_STREAM));
  }
  destroy_comms(comms);
}

/* Measures with a live, synchronised communicator, then destroys it. */
static usage_t measure_synced(const char* tag) {
  ncclComm_t comms[MAX_LOCAL];
  make_comms(tag, comms);
  allreduce_sum_int(comms, 1);
  usage_t u = measure();
  destroy_comms(comms);
  return u;
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  const int cycles = g_env.quick ? 50 : 200;
  char tag[64];
  /* Warm-up: lazily created process-wide state (logging, thread pools) is not a leak. */
  for (int i = 0; i < 5; i++) {
    snprintf(tag, sizeof tag, "warmup-%d", i);
    cycle(tag);
  }
  usage_t before = measure_synced("before");
  double t0 = now_s();
  for (int i = 0; i < cycles; i++) {
    snprintf(tag, sizeof tag, "cycle-%d", i);
    test_step("cycle");
    cycle(tag);
  }
  double dt = now_s() - t0;
  usage_t after = measure_synced("after");

  tlog("%d cycles in %.2f s (%.1f ms per init+allreduce+destroy)", cycles, dt, 1000 * dt / cycles);
  tlog("open fds:         %ld -> %ld", before.fds, after.fds);
  tlog("threads:          %ld -> %ld", before.threads, after.threads);
  tlog("/dev/shm/" SHM_PREFIX "*: %ld -> %ld", before.shm, after.shm);
  tlog("VmRSS:            %ld kB -> %ld kB", before.rss_kb, after.rss_kb);

  EXPECT(after.fds <= before.fds + 4, "file descriptors leak: %ld before, %ld after %d cycles",
         before.fds, after.fds, cycles);
  EXPECT(after.threads <= before.threads + 2, "threads leak: %ld before, %ld after %d cycles",
         before.threads, after.threads, cycles);
  if (!EXPECT(after.shm <= before.shm + 2, "/dev/shm entries leak: %ld before, %ld after %d cycles",
              before.shm, after.shm, cycles))
    list_shm();
  EXPECT(after.rss_kb <= before.rss_kb + 8 * 1024, "memory grows: VmRSS %ld kB before, %ld kB after %d cycles",
         before.rss_kb, after.rss_kb, cycles);
  return test_finish();
}
