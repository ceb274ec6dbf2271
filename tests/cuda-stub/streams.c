/*
 * Streams of the stub driver: ordered queues, each executed by its own worker thread (or, with
 * NCCL_RS_STUB_CONNECTIONS=N, sharing N hardware queues: see below), and what runs on them:
 * copies, memsets, event records and waits, stream memory operations and kernel launches.
 * Also events and modules.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "stub.h"

enum {
  STREAM_NON_BLOCKING = 1,
  EVENT_FLAGS_ALL = 7, /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS */
  WAIT_GEQ = 0,
  WAIT_EQ = 1,
  WAIT_AND = 2,
  WAIT_NOR = 3,
  WAIT_FLUSH = 1 << 30,
  WRITE_NO_MEMORY_BARRIER = 1,
  V2_MEM_OPS_SINCE = 11070,
};

#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x4556454eu
#define MODULE_MAGIC 0x4d4f444cu

struct event {
  uint32_t magic;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t recorded;  /* records issued */
  uint64_t completed; /* the highest record its stream has reached */
  int refs;           /* the handle, plus each pending operation that names the event */
  uint64_t captured;  /* the capture its latest record went into (an id), 0 if none */
  int cap_branch;     /* ... its branch there, and how many of the branch's ops came before, + 1 */
  uint32_t cap_pos;
  struct ctx *ctx;    /* the context current at its creation: it is recorded on that context's streams only */
};

enum op_kind { OP_COPY, OP_SET, OP_RECORD, OP_WAIT_EVENT, OP_WAIT_VALUE, OP_WRITE_VALUE, OP_KERNEL, OP_HOST };

struct op {
  struct op *next;
  enum op_kind kind;
  void *dst;
  const void *src;
  size_t n;
  unsigned char byte;
  struct event *ev;
  uint64_t seq;
  uint32_t *word;
  uint32_t value;
  unsigned cond;
  const struct kernel *kernel;
  uint64_t params[4];
  void (*fn)(void *); /* OP_HOST: cuLaunchHostFunc's function and its argument */
  void *data;
  int branch; /* in a graph, OP_WAIT_VALUE without a word: wait until branch `branch` has done `value` ops */
  uint64_t order; /* in a graph, its place in the capture's issue order (from 1) */
  struct stream *owner; /* shared hardware queues: the stream it was issued on */
  int dev;              /* OP_KERNEL: the device it runs on (its stream's), -1 if unknown */
  unsigned grid_y;      /* OP_KERNEL: rows of blocks (gridDim.y) */
};

struct queue;

struct stream {
  uint32_t magic;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* work arrived, work done, or destroying */
  struct op *head, *tail;
  uint64_t enqueued, done;
  int destroying;
  struct queue *q;      /* shared hardware queues: the one this stream's commands go to */
  int kernels_running;  /* shared hardware queues: its launched kernels still running */
  int blocking;         /* created without CU_STREAM_NON_BLOCKING: synchronizes with the legacy stream */
  struct ctx *ctx;      /* the context current at its creation (an event recorded on it must be of it) */
};

static void event_unref(struct event *e) {
  pthread_mutex_lock(&e->mu);
  int left = --e->refs;
  pthread_mutex_unlock(&e->mu);
  if (left == 0) {
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
  }
}

static int value_ready(uint32_t v, uint32_t value, unsigned cond) {
  switch (cond) {
    case WAIT_GEQ: return (int32_t)(v - value) >= 0;
    case WAIT_EQ: return v == value;
    case WAIT_AND: return (v & value) != 0;
    default: return ~(v | value) != 0;
  }
}

/* A device that lags the host, for tests (NCCL_RS_STUB_OP_DELAY_US=N): each operation waits a
 * pseudo-random 0..N µs before it runs, as a GPU's work runs long after the host issued it and
 * each stream at its own pace. Host code that reads a result, or frees or reuses memory,
 * before the stream has got there, without waiting for it, then sees it wrong. */
static void lag(void) {
  static int read_max = -1; /* (read once; threads racing to read it store the same) */
  int max_us = __atomic_load_n(&read_max, __ATOMIC_RELAXED);
  if (max_us < 0) {
    max_us = env_int("NCCL_RS_STUB_OP_DELAY_US", 0);
    if (max_us < 0) max_us = 0;
    __atomic_store_n(&read_max, max_us, __ATOMIC_RELAXED);
  }
  if (!max_us) return;
  static __thread unsigned state;
  if (!state) state = (unsigned)(uintptr_t)&state ^ (unsigned)getpid() * 2654435761u;
  state = state * 1103515245u + 12345u;
  long us = (long)((state >> 8) % ((unsigned)max_us + 1));
  struct timespec pause = {us / 1000000, (us % 1000000) * 1000};
  if (us) nanosleep(&pause, NULL);
}

static void run(struct op *op) {
  lag();
  switch (op->kind) {
    case OP_COPY: memmove(dev_view((uintptr_t)op->dst), dev_view((uintptr_t)op->src), op->n); break;
    case OP_SET: memset(dev_view((uintptr_t)op->dst), op->byte, op->n); break;
    case OP_RECORD: break; /* completed by the worker, with the stream's progress */
    case OP_WAIT_EVENT:
      pthread_mutex_lock(&op->ev->mu);
      while (op->ev->completed < op->seq) pthread_cond_wait(&op->ev->cv, &op->ev->mu);
      pthread_mutex_unlock(&op->ev->mu);
      event_unref(op->ev);
      break;
    case OP_WAIT_VALUE: {
      /* The writer may be the host, another stream or another process: poll, as the GPU does. */
      struct timespec pause = {0, 20000};
      const uint32_t *word = dev_view((uintptr_t)op->word);
      /* (Said once after 10 s: which word a hung stream waits on, for what, and what it holds.) */
      struct timespec t0;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      int said = 0;
      for (long polls = 1; !value_ready(__atomic_load_n(word, __ATOMIC_ACQUIRE), op->value, op->cond); polls++) {
        struct timespec t;
        if (!said && polls % 1024 == 0 && clock_gettime(CLOCK_MONOTONIC, &t) == 0 && t.tv_sec - t0.tv_sec >= 10 && (said = 1))
          fprintf(stderr, "cuda-stub: a stream has waited 10 s on the word at %p for %u (condition %u); it holds %u\n",
                  (void *)(uintptr_t)op->word, op->value, op->cond, __atomic_load_n(word, __ATOMIC_ACQUIRE));
        nanosleep(&pause, NULL);
      }
      break;
    }
    case OP_WRITE_VALUE: __atomic_store_n((uint32_t *)dev_view((uintptr_t)op->word), op->value, __ATOMIC_SEQ_CST); break;
    case OP_KERNEL:
      t_kernel_dev = op->dev;
      kernel_run(op->kernel, op->params, op->grid_y);
      t_kernel_dev = -1;
      break;
    case OP_HOST:
      t_in_callback = 1;
      op->fn(op->data);
      t_in_callback = 0;
      break;
  }
}

/* The event reaches record `seq`. Called with the stream's lock held, so that whoever sees the
 * event complete sees the stream's progress include it, and the other way round. */
static void complete_record(struct event *e, uint64_t seq) {
  pthread_mutex_lock(&e->mu);
  if (seq > e->completed) e->completed = seq;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  event_unref(e);
}

/* Operations enqueued on, and completed by, every stream of the process (for device_sync). */
static uint64_t g_ops_enqueued, g_ops_done;

void device_sync(const char *call) {
  static int on = -1;
  if (on < 0) on = env_int("NCCL_RS_STUB_FREE_SYNCS", 0) != 0;
  if (!on) return;
  const uint64_t target = __atomic_load_n(&g_ops_enqueued, __ATOMIC_ACQUIRE);
  struct timespec pause = {0, 1000000};
  for (int waited_ms = 0; __atomic_load_n(&g_ops_done, __ATOMIC_ACQUIRE) < target; waited_ms++) {
    if (waited_ms == 20000) {
      char name[32] = "?";
      pthread_getname_np(pthread_self(), name, sizeof name);
      fprintf(stderr, "cuda-stub: %s on thread %s waited 20 s for this process's earlier device work, which does not "
              "finish: a driver whose %s synchronizes would hang here\n", call, name, call);
      abort();
    }
    nanosleep(&pause, NULL);
  }
}

static void *worker(void *arg) {
  struct stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->destroying) pthread_cond_wait(&s->cv, &s->mu);
    struct op *op = s->head;
    if (!op) break; /* destroyed, and every operation ran */
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    run(op);
    pthread_mutex_lock(&s->mu);
    if (op->kind == OP_RECORD) complete_record(op->ev, op->seq);
    free(op);
    s->done++;
    __atomic_fetch_add(&g_ops_done, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  /* cuStreamDestroy: the resources go once the pending work has completed. */
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
  return NULL;
}

/* ---- shared hardware queues (NCCL_RS_STUB_CONNECTIONS=N) --------------------------------------
 * A GPU multiplexes streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues. Within one queue
 * commands are processed in the order they were issued, whatever their stream, and a command
 * that waits (for another stream's event, or on memory) holds up everything behind it. With
 * N > 0 the stub models that: stream i (in creation order) goes to queue i % N, one thread per
 * queue runs its commands in issue order. A launched kernel runs on its own (the queue moves
 * on), but the next command of the same stream waits for it, holding up the queue meanwhile.
 * Streams destroyed in this mode are not freed (a test double). Unset or 0: every stream is a
 * queue of its own. */
#define MAX_QUEUES 32

struct queue {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct op *head, *tail;
};

static struct queue g_queues[MAX_QUEUES];
static int g_nqueues;
static unsigned g_next_queue;
static pthread_once_t g_queues_once = PTHREAD_ONCE_INIT;

static void finish_op(struct stream *s, struct op *op) {
  pthread_mutex_lock(&s->mu);
  if (op->kind == OP_RECORD) complete_record(op->ev, op->seq);
  s->done++;
  __atomic_fetch_add(&g_ops_done, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  free(op);
}

static void *kernel_thread(void *arg) {
  struct op *op = arg;
  struct stream *s = op->owner;
  run(op);
  pthread_mutex_lock(&s->mu);
  s->kernels_running--;
  s->done++;
  __atomic_fetch_add(&g_ops_done, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  free(op);
  return NULL;
}

static void *queue_worker(void *arg) {
  struct queue *q = arg;
  for (;;) {
    pthread_mutex_lock(&q->mu);
    while (!q->head) pthread_cond_wait(&q->cv, &q->mu);
    struct op *op = q->head;
    q->head = op->next;
    if (!q->head) q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    struct stream *s = op->owner;
    pthread_mutex_lock(&s->mu);
    while (s->kernels_running) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    /* The gate kernel may run for long: it runs beside the queue. Others are short. */
    pthread_t t;
    if (op->kind == OP_KERNEL && kernel_is_gate(op->kernel)) {
      pthread_mutex_lock(&s->mu);
      s->kernels_running++;
      pthread_mutex_unlock(&s->mu);
      if (pthread_create(&t, NULL, kernel_thread, op) == 0) {
        pthread_detach(t);
        continue;
      }
      pthread_mutex_lock(&s->mu);
      s->kernels_running--;
      pthread_mutex_unlock(&s->mu);
    }
    run(op);
    finish_op(s, op);
  }
  return NULL;
}

static void queues_init(void) {
  g_nqueues = env_int("NCCL_RS_STUB_CONNECTIONS", 0);
  if (g_nqueues > MAX_QUEUES) g_nqueues = MAX_QUEUES;
  for (int i = 0; i < g_nqueues; i++) {
    pthread_mutex_init(&g_queues[i].mu, NULL);
    pthread_cond_init(&g_queues[i].cv, NULL);
    pthread_t t;
    if (pthread_create(&t, NULL, queue_worker, &g_queues[i]) != 0) {
      g_nqueues = i; /* fewer queues than asked; still a model */
      break;
    }
    pthread_detach(t);
  }
}

static struct stream *stream_new(void) {
  struct stream *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->magic = STREAM_MAGIC;
  s->ctx = t_current;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_once(&g_queues_once, queues_init);
  if (g_nqueues > 0) {
    s->q = &g_queues[__atomic_fetch_add(&g_next_queue, 1, __ATOMIC_RELAXED) % (unsigned)g_nqueues];
    return s;
  }
  pthread_t t;
  if (pthread_create(&t, NULL, worker, s) != 0) {
    free(s);
    return NULL;
  }
  pthread_detach(t);
  return s;
}

/* NULL, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2) are the current context's legacy
 * stream; anything else must be a live stream. */
static CUresult resolve(struct stream *h, struct stream **out) {
  if ((uintptr_t)h <= 2) {
    REQUIRE_CTX();
    pthread_mutex_lock(&g_lock);
    if (!t_current->legacy) t_current->legacy = stream_new();
    *out = t_current->legacy;
    pthread_mutex_unlock(&g_lock);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
  }
  REQUIRE_INIT();
  if (h->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  *out = h;
  return CUDA_SUCCESS;
}

static int capture_append(struct stream *s, const struct op *op);

/* Appends a copy of `op` to the stream `h`, or to the graph it captures. */
static CUresult enqueue(struct stream *h, const struct op *op) {
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  switch (capture_append(s, op)) {
    case 1: return CUDA_SUCCESS;
    case -1: return CUDA_ERROR_OUT_OF_MEMORY;
    default: break;
  }
  struct op *o = malloc(sizeof *o);
  if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
  *o = *op;
  o->next = NULL;
  o->owner = s;
  if (s->q) {
    /* Counted and queued under the queue's lock: issue order is queue order. */
    pthread_mutex_lock(&s->q->mu);
    pthread_mutex_lock(&s->mu);
    s->enqueued++;
    __atomic_fetch_add(&g_ops_enqueued, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->mu);
    if (s->q->tail) s->q->tail->next = o;
    else s->q->head = o;
    s->q->tail = o;
    pthread_cond_broadcast(&s->q->cv);
    pthread_mutex_unlock(&s->q->mu);
    return CUDA_SUCCESS;
  }
  pthread_mutex_lock(&s->mu);
  if (s->tail) s->tail->next = o;
  else s->head = o;
  s->tail = o;
  s->enqueued++;
  __atomic_fetch_add(&g_ops_enqueued, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(struct stream **ph, unsigned flags) {
  count_call(__func__);
  REQUIRE_CTX();
  if (!ph || (flags & ~(unsigned)STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  *ph = stream_new();
  if (*ph) (*ph)->blocking = !(flags & STREAM_NON_BLOCKING);
  return *ph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuStreamDestroy_v2(struct stream *h) {
  count_call(__func__);
  REQUIRE_INIT();
  if ((uintptr_t)h <= 2 || h->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&h->mu);
  h->magic = 0;
  h->destroying = 1;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(struct stream *h) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuStreamSynchronize");
  note_worker_call("cuStreamSynchronize");
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&s->mu);
  uint64_t target = s->enqueued;
  while (s->done < target) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return CUDA_SUCCESS;
}

/* ---- graph capture and graphs ----------------------------------------------------------------
 * Work enqueued on a stream between cuStreamBeginCapture_v2 and cuStreamEndCapture is recorded
 * into a graph instead of run: copies, memsets, stream memory operations, kernels and host
 * functions. Another stream joins the capture by waiting for an event recorded in it (as
 * PyTorch's NCCL stream does), and its work goes into the same graph: the stub's graphs are one
 * sequence, in issue order, which respects every dependency a capture can express. An event
 * recorded in a capture cannot be queried or waited for on the host (CUDA_ERROR_CAPTURED_EVENT);
 * the stub refuses waits for events recorded outside the capture, and copies to or from
 * pageable memory. cuGraphInstantiateWithFlags copies a graph into an executable graph;
 * cuGraphLaunch enqueues its work on a stream, then the release of the references that launch
 * holds. User objects (cuUserObjectCreate) are reference counted; graphs hold references
 * (cuGraphRetainUserObject), executable graphs and launches in flight hold their graph's; the
 * last release calls the destructor on a thread of its own, as the driver calls it from one of
 * its own.
 *
 * What a capture prohibits meanwhile is CUDA's (cuThreadExchangeStreamCaptureMode): a thread in
 * mode GLOBAL (every thread's default) may not make a potentially unsafe call while another
 * thread captures in mode GLOBAL, nor while it captures itself in a mode other than RELAXED; in
 * THREAD_LOCAL only its own captures count; in RELAXED none do. A prohibited call fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the captures that prohibited it: their
 * cuStreamEndCapture fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. The real driver does not
 * list its unsafe calls; the stub counts allocating and freeing memory, opening and closing IPC
 * and VMM mappings, loading modules, and queries and synchronisations (REFUSE_DURING_CAPTURE at
 * each). */
enum { CAPTURE_GLOBAL = 0, CAPTURE_THREAD_LOCAL = 1, CAPTURE_RELAXED = 2 };
enum { USER_OBJECT_NO_DESTRUCTOR_SYNC = 1, GRAPH_USER_OBJECT_MOVE = 1 };
#define MAX_CAPTURES 64
#define MAX_JOINED 16
#define MAX_HELD 16
#define GRAPH_MAGIC 0x47524150u
#define EXEC_MAGIC 0x47455845u
#define UOBJ_MAGIC 0x554f424au

struct uobj {
  uint32_t magic;
  void *ptr;
  void (*destroy)(void *);
  unsigned refs; /* under g_capture_lock */
};

/* References to user objects, held by a graph, an executable graph or a launch. */
struct held {
  int n;
  struct uobj *obj[MAX_HELD];
  unsigned count[MAX_HELD];
};

/* The work one stream (the capture's origin, or one that joined it) recorded. */
struct branch {
  struct op *head, *tail;
  uint32_t n;
};

struct graph {
  uint32_t magic; /* GRAPH_MAGIC or EXEC_MAGIC */
  struct branch branch[1 + MAX_JOINED]; /* 0: the origin's; j + 1: that of joined stream j */
  int nbranches;
  uint64_t ops; /* recorded so far: the last op's order */
  struct held held;
};

static __thread int t_capture_mode = CAPTURE_GLOBAL;
static struct capture {
  struct stream *s;
  pthread_t thread;
  int mode;
  int invalidated;
  uint64_t id;
  struct graph *g;
  struct stream *joined[MAX_JOINED]; /* streams that joined it through an event */
  int njoined;
} g_captures[MAX_CAPTURES];
static int g_ncaptures;
static uint64_t g_capture_ids;
static pthread_mutex_t g_capture_lock = PTHREAD_MUTEX_INITIALIZER;

int capture_refuses(const char *call) {
  if (t_capture_mode == CAPTURE_RELAXED) return 0;
  int refused = 0;
  pthread_mutex_lock(&g_capture_lock);
  for (int i = 0; i < g_ncaptures; i++) {
    struct capture *c = &g_captures[i];
    int mine = pthread_equal(c->thread, pthread_self());
    if ((mine && c->mode != CAPTURE_RELAXED) || (!mine && t_capture_mode == CAPTURE_GLOBAL && c->mode == CAPTURE_GLOBAL)) {
      c->invalidated = 1;
      refused = 1;
    }
  }
  pthread_mutex_unlock(&g_capture_lock);
  if (refused) {
    char thread[32] = "?";
    pthread_getname_np(pthread_self(), thread, sizeof thread);
    fprintf(stderr, "cuda-stub: %s from thread %s during a graph capture: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "
                    "the capture is invalidated\n", call, thread);
  }
  return refused;
}

/* The capture stream s began or joined, if any, and its branch there (g_capture_lock held). */
static struct capture *capture_branch(const struct stream *s, int *branch) {
  for (int i = 0; i < g_ncaptures; i++) {
    if (g_captures[i].s == s) {
      if (branch) *branch = 0;
      return &g_captures[i];
    }
    for (int j = 0; j < g_captures[i].njoined; j++) {
      if (g_captures[i].joined[j] == s) {
        if (branch) *branch = j + 1;
        return &g_captures[i];
      }
    }
  }
  return NULL;
}

static struct capture *capture_of(const struct stream *s) {
  return capture_branch(s, NULL);
}

/* Appends op to branch `i` of g (a new op gets the next place in g's issue order). */
static int branch_append(struct graph *g, int i, const struct op *op) {
  struct branch *b = &g->branch[i];
  struct op *o = malloc(sizeof *o);
  if (!o) return -1;
  *o = *op;
  o->next = NULL;
  if (!o->order) o->order = ++g->ops;
  if (b->tail) b->tail->next = o;
  else b->head = o;
  b->tail = o;
  b->n++;
  return 1;
}

/* Stream s waits for the point of capture `id` an event marks (op `at_pos` of branch
 * `at_branch`): it joins that capture (a branch of its own, from that point). */
static CUresult capture_join(struct stream *s, uint64_t id, int at_branch, uint32_t at_pos) {
  pthread_mutex_lock(&g_capture_lock);
  int b = 0;
  struct capture *c = NULL, *mine = capture_branch(s, &b);
  for (int i = 0; i < g_ncaptures; i++)
    if (g_captures[i].id == id) c = &g_captures[i];
  CUresult r = CUDA_SUCCESS;
  if (!c) {
    r = CUDA_ERROR_NOT_SUPPORTED; /* that capture ended: the stub does not model it */
  } else if (mine && mine != c) {
    r = CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
  } else if (!mine && c->njoined == MAX_JOINED) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    if (!mine) {
      c->joined[c->njoined++] = s;
      b = c->g->nbranches++;
    }
    struct op wait = {.kind = OP_WAIT_VALUE, .value = at_pos, .cond = 0 /* GEQ */, .branch = at_branch};
    if (b != at_branch && branch_append(c->g, b, &wait) < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_unlock(&g_capture_lock);
  return r;
}

/* Event e is recorded on stream s: if s captures, e marks the point its branch has reached. */
static int capture_mark(struct stream *s, struct event *e) {
  pthread_mutex_lock(&g_capture_lock);
  int b = 0;
  struct capture *c = capture_branch(s, &b);
  if (c) {
    e->captured = c->id;
    e->cap_branch = b;
    e->cap_pos = c->g->branch[b].n + 1;
  } else {
    e->captured = 0;
  }
  pthread_mutex_unlock(&g_capture_lock);
  return c != NULL;
}

/* 1: `op` was recorded into the graph s captures; 0: s is not capturing; -1: out of memory. */
static int capture_append(struct stream *s, const struct op *op) {
  pthread_mutex_lock(&g_capture_lock);
  int b = 0;
  struct capture *c = capture_branch(s, &b);
  int r = c ? branch_append(c->g, b, op) : 0;
  pthread_mutex_unlock(&g_capture_lock);
  return r;
}

/* Is stream h capturing? (Its validity is checked by the caller.) */
static int stream_capturing(struct stream *h) {
  struct stream *s;
  if (resolve(h, &s) != CUDA_SUCCESS) return 0;
  pthread_mutex_lock(&g_capture_lock);
  int yes = capture_of(s) != NULL;
  pthread_mutex_unlock(&g_capture_lock);
  return yes;
}

static void *destroy_thread(void *arg) {
  struct uobj *o = arg;
  int was = t_in_callback;
  t_in_callback = 1;
  o->destroy(o->ptr);
  t_in_callback = was;
  free(o);
  return NULL;
}

/* Takes `count` references of o (g_capture_lock held); the last one runs its destructor. */
static void uobj_release_locked(struct uobj *o, unsigned count) {
  if (count > o->refs) count = o->refs;
  o->refs -= count;
  if (o->refs) return;
  o->magic = 0;
  pthread_t t;
  if (pthread_create(&t, NULL, destroy_thread, o) == 0) {
    pthread_detach(t);
  } else {
    destroy_thread(o);
  }
}

static void held_release(struct held *h) {
  pthread_mutex_lock(&g_capture_lock);
  for (int i = 0; i < h->n; i++) uobj_release_locked(h->obj[i], h->count[i]);
  h->n = 0;
  pthread_mutex_unlock(&g_capture_lock);
}

/* A copy of h whose references are new ones (g_capture_lock held). */
static void held_copy_locked(struct held *to, const struct held *from) {
  *to = *from;
  for (int i = 0; i < from->n; i++) from->obj[i]->refs += from->count[i];
}

static void graph_free(struct graph *g) {
  held_release(&g->held);
  for (int b = 0; b < g->nbranches; b++) {
    for (struct op *o = g->branch[b].head, *next; o; o = next) {
      next = o->next;
      free(o);
    }
  }
  g->magic = 0;
  free(g);
}

/* NCCL_RS_STUB_CAPTURE_REFUSES=memops|hostfunc|userobject, for tests: a driver that cannot
 * capture stream memory operations or host functions (the call fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, as an unsupported
 * operation does), or cannot create user objects (CUDA_ERROR_OUT_OF_MEMORY). */
static int capture_refuses_kind(const char *kind) {
  const char *v = getenv("NCCL_RS_STUB_CAPTURE_REFUSES");
  return v && !strcmp(v, kind);
}

/* Stream h captures and the stub is told to refuse `kind` there: the capture is invalidated. */
static int capture_refuses_op(struct stream *h, const char *kind) {
  if (!capture_refuses_kind(kind)) return 0;
  struct stream *s;
  if (resolve(h, &s) != CUDA_SUCCESS) return 0;
  pthread_mutex_lock(&g_capture_lock);
  struct capture *c = capture_of(s);
  if (c) c->invalidated = 1;
  pthread_mutex_unlock(&g_capture_lock);
  return c != NULL;
}

EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
  count_call(__func__);
  if (!mode || *mode < CAPTURE_GLOBAL || *mode > CAPTURE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
  int old = t_capture_mode;
  t_capture_mode = *mode;
  *mode = old;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamBeginCapture_v2(struct stream *h, int mode) {
  count_call(__func__);
  if (mode < CAPTURE_GLOBAL || mode > CAPTURE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  struct graph *g = calloc(1, sizeof *g);
  if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
  g->magic = GRAPH_MAGIC;
  g->nbranches = 1;
  pthread_mutex_lock(&g_capture_lock);
  int busy = capture_of(s) || g_ncaptures == MAX_CAPTURES;
  if (!busy) {
    g_captures[g_ncaptures++] = (struct capture){.s = s, .thread = pthread_self(), .mode = mode, .id = ++g_capture_ids, .g = g};
  }
  pthread_mutex_unlock(&g_capture_lock);
  if (busy) free(g);
  return busy ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

EXPORT CUresult cuStreamEndCapture(struct stream *h, struct graph **graph) {
  count_call(__func__);
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  if (!graph) return CUDA_ERROR_INVALID_VALUE;
  *graph = NULL;
  pthread_mutex_lock(&g_capture_lock);
  struct capture *c = capture_of(s), done = {0};
  int joined = c && c->s != s;
  if (c && !joined) {
    done = *c;
    *c = g_captures[--g_ncaptures];
  }
  pthread_mutex_unlock(&g_capture_lock);
  if (joined) return CUDA_ERROR_STREAM_CAPTURE_UNMATCHED; /* ended where it began, only */
  if (!done.g) return CUDA_ERROR_INVALID_VALUE;
  if (done.invalidated) {
    graph_free(done.g);
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *graph = done.g;
  return CUDA_SUCCESS;
}

/* CU_STREAM_CAPTURE_STATUS_NONE 0, _ACTIVE 1, _INVALIDATED 2. */
EXPORT CUresult cuStreamGetCaptureInfo_v2(struct stream *h, int *status, uint64_t *id, struct graph **graph,
                                          const void **deps, size_t *ndeps) {
  count_call(__func__);
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_capture_lock);
  /* CUDA: asked of the legacy stream while a blocking stream captures, the answer is
   * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (the capture is not invalidated). */
  for (int i = 0; (uintptr_t)h <= 1 && i < g_ncaptures; i++) {
    if (g_captures[i].s->blocking) {
      pthread_mutex_unlock(&g_capture_lock);
      return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
  }
  struct capture *c = capture_of(s);
  *status = !c ? 0 : c->invalidated ? 2 : 1;
  if (id) *id = c ? c->id : 0;
  if (graph) *graph = c ? c->g : NULL;
  pthread_mutex_unlock(&g_capture_lock);
  if (deps) *deps = NULL;
  if (ndeps) *ndeps = 0;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphDestroy(struct graph *g) {
  count_call(__func__);
  if (!g || g->magic != GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  graph_free(g);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphInstantiateWithFlags(struct graph **exec, struct graph *g, unsigned long long flags) {
  count_call(__func__);
  if (!exec || !g || g->magic != GRAPH_MAGIC || flags) return CUDA_ERROR_INVALID_VALUE;
  struct graph *e = calloc(1, sizeof *e);
  if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
  e->magic = EXEC_MAGIC;
  e->nbranches = g->nbranches;
  for (int b = 0; b < g->nbranches; b++) {
    for (struct op *o = g->branch[b].head; o; o = o->next) {
      if (branch_append(e, b, o) < 0) {
        graph_free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
      }
    }
  }
  pthread_mutex_lock(&g_capture_lock);
  held_copy_locked(&e->held, &g->held);
  pthread_mutex_unlock(&g_capture_lock);
  *exec = e;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphExecDestroy(struct graph *e) {
  count_call(__func__);
  if (!e || e->magic != EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  graph_free(e);
  return CUDA_SUCCESS;
}

/* One launch in flight: the references it holds, and how far each branch got (its ops done,
 * + 1 once it started). */
struct launch {
  struct held held;
  uint32_t done[1 + MAX_JOINED];
};

static void release_launch(void *arg) {
  struct launch *l = arg;
  held_release(&l->held);
  free(l);
}

static void bump(void *word) {
  __atomic_fetch_add((uint32_t *)word, 1, __ATOMIC_SEQ_CST);
}

/* Branch 0 runs on the stream of the launch; the others on streams of their own, each from the
 * point of another branch it joined at. The launch ends (and releases what it holds) once
 * every branch is done. */
EXPORT CUresult cuGraphLaunch(struct graph *e, struct stream *h) {
  count_call(__func__);
  if (!e || e->magic != EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  if (stream_capturing(s)) return CUDA_ERROR_NOT_SUPPORTED; /* no child graphs */
  struct launch *l = calloc(1, sizeof *l);
  if (!l) return CUDA_ERROR_OUT_OF_MEMORY;
  struct stream *on[1 + MAX_JOINED] = {s};
  for (int b = 1; b < e->nbranches; b++) {
    if (!(on[b] = stream_new())) {
      for (int k = 1; k < b; k++) uncounted(cuStreamDestroy_v2(on[k]));
      free(l);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  pthread_mutex_lock(&g_capture_lock);
  held_copy_locked(&l->held, &e->held);
  pthread_mutex_unlock(&g_capture_lock);
  /* Issued in the capture's order, which respects every dependency it recorded: where streams
   * share hardware queues, no branch's wait sits ahead of the work it waits for. */
  struct op *next[1 + MAX_JOINED];
  for (int b = 0; b < e->nbranches && r == CUDA_SUCCESS; b++) {
    struct op step = {.kind = OP_HOST, .fn = bump, .data = &l->done[b]};
    r = enqueue(on[b], &step);
    next[b] = e->branch[b].head;
  }
  while (r == CUDA_SUCCESS) {
    int b = -1;
    for (int k = 0; k < e->nbranches; k++)
      if (next[k] && (b < 0 || next[k]->order < next[b]->order)) b = k;
    if (b < 0) break;
    struct op op = *next[b], step = {.kind = OP_HOST, .fn = bump, .data = &l->done[b]};
    next[b] = next[b]->next;
    if (op.kind == OP_WAIT_VALUE && !op.word) op.word = &l->done[op.branch];
    if ((r = enqueue(on[b], &op)) == CUDA_SUCCESS) r = enqueue(on[b], &step);
  }
  for (int b = 1; b < e->nbranches && r == CUDA_SUCCESS; b++) {
    struct op joined = {.kind = OP_WAIT_VALUE, .word = &l->done[b], .value = e->branch[b].n + 1, .cond = 0};
    r = enqueue(s, &joined);
  }
  struct op done = {.kind = OP_HOST, .fn = release_launch, .data = l};
  /* A launch half enqueued cannot be taken back: its memory stays (a test double). */
  if (r == CUDA_SUCCESS) r = enqueue(s, &done);
  for (int b = 1; b < e->nbranches; b++) uncounted(cuStreamDestroy_v2(on[b]));
  return r;
}

EXPORT CUresult cuLaunchHostFunc(struct stream *h, void (*fn)(void *), void *data) {
  count_call(__func__);
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  if (capture_refuses_op(h, "hostfunc")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  struct op op = {.kind = OP_HOST, .fn = fn, .data = data};
  return enqueue(h, &op);
}

EXPORT CUresult cuUserObjectCreate(struct uobj **out, void *ptr, void (*destroy)(void *), unsigned initial,
                                   unsigned flags) {
  count_call(__func__);
  if (!out || !destroy || !initial || flags != USER_OBJECT_NO_DESTRUCTOR_SYNC) return CUDA_ERROR_INVALID_VALUE;
  if (capture_refuses_kind("userobject")) return CUDA_ERROR_OUT_OF_MEMORY;
  struct uobj *o = calloc(1, sizeof *o);
  if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
  *o = (struct uobj){UOBJ_MAGIC, ptr, destroy, initial};
  *out = o;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuUserObjectRelease(struct uobj *o, unsigned count) {
  count_call(__func__);
  if (!o || o->magic != UOBJ_MAGIC || !count) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_capture_lock);
  uobj_release_locked(o, count);
  pthread_mutex_unlock(&g_capture_lock);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphRetainUserObject(struct graph *g, struct uobj *o, unsigned count, unsigned flags) {
  count_call(__func__);
  if (!g || g->magic != GRAPH_MAGIC || !o || o->magic != UOBJ_MAGIC || !count || (flags & ~GRAPH_USER_OBJECT_MOVE))
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_capture_lock);
  int i = 0;
  while (i < g->held.n && g->held.obj[i] != o) i++;
  CUresult r = CUDA_SUCCESS;
  if (i == MAX_HELD) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    if (i == g->held.n) {
      g->held.obj[g->held.n] = o;
      g->held.count[g->held.n++] = 0;
    }
    g->held.count[i] += count;
    if (!(flags & GRAPH_USER_OBJECT_MOVE)) o->refs += count;
  }
  pthread_mutex_unlock(&g_capture_lock);
  return r;
}

EXPORT CUresult cuStreamIsCapturing(struct stream *h, int *status) {
  count_call(__func__);
  return uncounted(cuStreamGetCaptureInfo_v2(h, status, NULL, NULL, NULL, NULL)); /* (h as given: the legacy stream's answer) */
}

/* The context a stream was created in (the default streams: the current context's). */
EXPORT CUresult cuStreamGetCtx(struct stream *h, struct ctx **pctx) {
  count_call(__func__);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  *pctx = (uintptr_t)h <= 2 || !s->ctx ? t_current : s->ctx;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamQuery(struct stream *h) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuStreamQuery");
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&s->mu);
  int idle = s->done == s->enqueued;
  pthread_mutex_unlock(&s->mu);
  return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* cuMemcpyAsync is asynchronous only between memory the driver knows, one end of it on the
 * device. With pageable host memory the driver "might be synchronous", and "for transfers from
 * any host memory to any host memory, the function is fully synchronous with respect to the
 * host" (CUDA: API synchronization behavior): the stub takes the strict reading, so code that
 * relies on such a copy being asynchronous fails (or hangs behind a held stream) here too.
 * From pageable memory, and between two host buffers (pinned or not), it waits for the stream
 * and copies at once; to pageable memory it returns when the copy has completed. */
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, struct stream *h) {
  count_call(__func__);
  note_worker_call("cuMemcpyAsync");
  if (n == 0) return resolve(h, &(struct stream *){NULL});
  if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
  /* CUDA: "the memory areas may not overlap" (a GPU copy of overlapping ones is undefined,
   * where this stand-in's memmove would hide it). */
  if (dst < src + n && src < dst + n) {
    fprintf(stderr, "cuda-stub: cuMemcpyAsync: source %#llx and destination %#llx of %zu bytes overlap\n",
            (unsigned long long)src, (unsigned long long)dst, n);
    return CUDA_ERROR_INVALID_VALUE;
  }
  enum mem_kind from = mem_lookup(src, n), to = mem_lookup(dst, n);
  int from_pageable = from == MEM_PAGEABLE, to_pageable = to == MEM_PAGEABLE;
  int host_to_host = (from_pageable || from == MEM_HOST_PINNED) && (to_pageable || to == MEM_HOST_PINNED);
  int capturing = stream_capturing(h);
  if ((from_pageable || to_pageable) && capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  CUresult r;
  if (from_pageable || (host_to_host && !capturing)) {
    if ((r = uncounted(cuStreamSynchronize(h))) != CUDA_SUCCESS) return r;
    memmove(dev_view(dst), dev_view(src), n);
    return CUDA_SUCCESS;
  }
  struct op op = {.kind = OP_COPY, .dst = (void *)(uintptr_t)dst, .src = (const void *)(uintptr_t)src, .n = n};
  if ((r = enqueue(h, &op)) != CUDA_SUCCESS) return r;
  return to_pageable ? uncounted(cuStreamSynchronize(h)) : CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char byte, size_t n, struct stream *h) {
  count_call(__func__);
  note_worker_call("cuMemsetD8Async");
  if (n == 0) return resolve(h, &(struct stream *){NULL});
  if (mem_lookup(dst, n) == MEM_PAGEABLE) return CUDA_ERROR_INVALID_VALUE;
  struct op op = {.kind = OP_SET, .dst = (void *)(uintptr_t)dst, .n = n, .byte = byte};
  return enqueue(h, &op);
}

/* The v2 stream memory operations: device-accessible memory (not managed), 4-aligned. */
static CUresult mem_op_target(CUdeviceptr addr) {
  if (env_int("NCCL_RS_STUB_DRIVER_VERSION", 12040) < V2_MEM_OPS_SINCE) return CUDA_ERROR_NOT_SUPPORTED;
  enum mem_kind k = mem_lookup(addr, 4);
  if (addr % 4 || k == MEM_PAGEABLE || k == MEM_MANAGED) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitValue32_v2(struct stream *h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  count_call(__func__);
  note_worker_call("cuStreamWaitValue32_v2");
  CUresult r = mem_op_target(addr);
  if (r != CUDA_SUCCESS) return r;
  unsigned cond = flags & ~(unsigned)WAIT_FLUSH;
  if (cond > WAIT_NOR) return CUDA_ERROR_INVALID_VALUE;
  /* FLUSH needs platform support the stub does not pretend to have. */
  if (flags & WAIT_FLUSH) return CUDA_ERROR_NOT_SUPPORTED;
  if (cond == WAIT_NOR && !env_int("NCCL_RS_STUB_WAIT_VALUE_NOR", 1)) return CUDA_ERROR_NOT_SUPPORTED;
  /* A driver that reports stream memory operations but refuses a wait when asked. */
  if (env_int("NCCL_RS_STUB_WAIT_VALUE_REFUSED", 0)) return CUDA_ERROR_NOT_SUPPORTED;
  if (capture_refuses_op(h, "memops")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  struct op op = {.kind = OP_WAIT_VALUE, .word = (uint32_t *)(uintptr_t)addr, .value = value, .cond = cond};
  return enqueue(h, &op);
}

EXPORT CUresult cuStreamWriteValue32_v2(struct stream *h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  count_call(__func__);
  note_worker_call("cuStreamWriteValue32_v2");
  CUresult r = mem_op_target(addr);
  if (r != CUDA_SUCCESS) return r;
  if (flags & ~(unsigned)WRITE_NO_MEMORY_BARRIER) return CUDA_ERROR_INVALID_VALUE;
  if (capture_refuses_op(h, "memops")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  struct op op = {.kind = OP_WRITE_VALUE, .word = (uint32_t *)(uintptr_t)addr, .value = value};
  return enqueue(h, &op);
}

/* ---- events --------------------------------------------------------------------------------- */

EXPORT CUresult cuEventCreate(struct event **pe, unsigned flags) {
  count_call(__func__);
  REQUIRE_CTX();
  if (!pe || (flags & ~(unsigned)EVENT_FLAGS_ALL)) return CUDA_ERROR_INVALID_VALUE;
  struct event *e = calloc(1, sizeof *e);
  if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
  e->magic = EVENT_MAGIC;
  e->ctx = t_current;
  e->refs = 1;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  *pe = e;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(struct event *e) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  e->magic = 0;
  event_unref(e); /* pending records and waits hold their own references */
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(struct event *e, struct stream *h) {
  count_call(__func__);
  note_worker_call("cuEventRecord");
  REQUIRE_INIT();
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  /* The driver records an event only on a stream of its own context (another device's
   * stream may wait for it, cuStreamWaitEvent). */
  if (s->ctx && e->ctx && s->ctx != e->ctx) {
    fprintf(stderr, "cuda-stub: cuEventRecord: an event of device %d on a stream of device %d\n", e->ctx->dev, s->ctx->dev);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  pthread_mutex_lock(&e->mu);
  if (capture_mark(s, e)) { /* a point of the graph, for other streams to join at */
    pthread_mutex_unlock(&e->mu);
    return CUDA_SUCCESS;
  }
  struct op op = {.kind = OP_RECORD, .ev = e, .seq = ++e->recorded};
  e->refs++;
  pthread_mutex_unlock(&e->mu);
  if ((r = enqueue(s, &op)) != CUDA_SUCCESS) event_unref(e);
  return r;
}

EXPORT CUresult cuEventQuery(struct event *e) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuEventQuery");
  note_worker_call("cuEventQuery");
  REQUIRE_INIT();
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&e->mu);
  if (e->captured) {
    pthread_mutex_unlock(&e->mu);
    return CUDA_ERROR_CAPTURED_EVENT;
  }
  int ready = e->completed >= e->recorded;
  pthread_mutex_unlock(&e->mu);
  return ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

EXPORT CUresult cuEventSynchronize(struct event *e) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuEventSynchronize");
  note_worker_call("cuEventSynchronize");
  REQUIRE_INIT();
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&e->mu);
  if (e->captured) {
    pthread_mutex_unlock(&e->mu);
    return CUDA_ERROR_CAPTURED_EVENT;
  }
  uint64_t target = e->recorded;
  while (e->completed < target) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
  return CUDA_SUCCESS;
}

/* Waits for the event's latest record at the time of the call; a never-recorded event is
 * complete, so the wait is a no-op. */
EXPORT CUresult cuStreamWaitEvent(struct stream *h, struct event *e, unsigned flags) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  struct stream *s;
  CUresult r = resolve(h, &s);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&e->mu);
  uint64_t in_capture = e->captured;
  int at_branch = e->cap_branch;
  uint32_t at_pos = e->cap_pos;
  pthread_mutex_unlock(&e->mu);
  if (in_capture) return capture_join(s, in_capture, at_branch, at_pos);
  if (stream_capturing(s)) return CUDA_ERROR_NOT_SUPPORTED;
  pthread_mutex_lock(&e->mu);
  struct op op = {.kind = OP_WAIT_EVENT, .ev = e, .seq = e->recorded};
  if (op.seq) e->refs++;
  pthread_mutex_unlock(&e->mu);
  if (!op.seq) return CUDA_SUCCESS;
  if ((r = enqueue(s, &op)) != CUDA_SUCCESS) event_unref(e);
  return r;
}

/* ---- modules and launches ------------------------------------------------------------------- */

struct module {
  uint32_t magic;
  char *ptx;
};

/* Loads PTX text; `log` (may be NULL) receives a compiler's complaint. A driver whose JIT
 * cannot compile the text (NCCL_RS_STUB_NO_MODULES: too old for its .version) or no longer
 * takes its target (NCCL_RS_STUB_PTX_TARGET_MIN=NN refuses `.target sm_MM` for MM < NN, as
 * CUDA 13's compilers refuse Volta) fails as a driver does, for tests. */
static CUresult load_module(struct module **pm, const void *image, char *log, size_t log_size) {
  REQUIRE_CTX();
  if (!pm || !image) return CUDA_ERROR_INVALID_VALUE;
  if (!strstr(image, ".version")) return CUDA_ERROR_INVALID_IMAGE; /* not PTX text */
  if (env_int("NCCL_RS_STUB_NO_MODULES", 0)) return CUDA_ERROR_INVALID_IMAGE;
  const char *target = strstr(image, "\n.target sm_");
  int min = env_int("NCCL_RS_STUB_PTX_TARGET_MIN", 0);
  if (target && atoi(target + strlen("\n.target sm_")) < min) {
    if (log && log_size > 0)
      snprintf(log, log_size, "ptxas fatal   : Value 'sm_%d' is not defined for option 'gpu-name'\n",
               atoi(target + strlen("\n.target sm_")));
    return CUDA_ERROR_INVALID_PTX;
  }
  struct module *m = calloc(1, sizeof *m);
  if (!m || !(m->ptx = strdup(image))) {
    free(m);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  m->magic = MODULE_MAGIC;
  *pm = m;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleLoadData(struct module **pm, const void *image) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuModuleLoadData");
  return load_module(pm, image, NULL, 0);
}

/* Of the JIT options, only the error log buffer (5) and its size (6) are heeded. */
EXPORT CUresult cuModuleLoadDataEx(struct module **pm, const void *image, unsigned n, int *options, void **values) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuModuleLoadDataEx");
  if (n && (!options || !values)) return CUDA_ERROR_INVALID_VALUE;
  char *log = NULL;
  size_t log_size = 0;
  for (unsigned i = 0; i < n; i++) {
    if (options[i] == 5) log = values[i];
    if (options[i] == 6) log_size = (size_t)(uintptr_t)values[i];
  }
  return load_module(pm, image, log, log_size);
}

EXPORT CUresult cuModuleUnload(struct module *m) {
  count_call(__func__);
  REFUSE_DURING_CAPTURE("cuModuleUnload");
  REQUIRE_INIT();
  if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  m->magic = 0;
  free(m->ptx);
  free(m);
  return CUDA_SUCCESS;
}

/* The kernel must be an entry of the module's PTX and one the stub implements. */
EXPORT CUresult cuModuleGetFunction(const struct kernel **pf, struct module *m, const char *name) {
  count_call(__func__);
  REQUIRE_INIT();
  if (!pf || !name) return CUDA_ERROR_INVALID_VALUE;
  if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  char entry[160];
  if ((size_t)snprintf(entry, sizeof entry, ".entry %s(", name) >= sizeof entry) return CUDA_ERROR_NOT_FOUND;
  const struct kernel *k = strstr(m->ptx, entry) ? kernel_find(name) : NULL;
  if (!k) return CUDA_ERROR_NOT_FOUND;
  *pf = k;
  return CUDA_SUCCESS;
}

/* A kernel may only touch memory the device can reach: an address the driver does not know is
 * reported at launch as CUDA_ERROR_ILLEGAL_ADDRESS (700). The real driver reports it later,
 * from the faulting kernel, and the context is lost; here the launch fails and nothing runs. */
EXPORT CUresult cuLaunchKernel(const struct kernel *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, struct stream *h, void **params, void **extra) {
  count_call(__func__);
  note_worker_call("cuLaunchKernel");
  REQUIRE_INIT();
  (void)shared;
  if (!kernel_valid(f)) return CUDA_ERROR_INVALID_HANDLE;
  /* A device whose reduction kernels fail to launch, for tests (the gate kernel still runs). */
  if (env_int("NCCL_RS_STUB_LAUNCH_FAILS", 0) && !kernel_is_gate(f)) return CUDA_ERROR_LAUNCH_FAILED;
  /* The limits of every GPU since compute capability 3.0. */
  if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024 || gx > 0x7fffffffu || gy > 65535 ||
      gz > 65535 || bz > 64)
    return CUDA_ERROR_INVALID_VALUE;
  if (extra) return CUDA_ERROR_NOT_SUPPORTED;
  if (!params) return CUDA_ERROR_INVALID_VALUE;
  struct stream *on;
  CUresult resolved = resolve(h, &on);
  if (resolved != CUDA_SUCCESS) return resolved;
  struct op op = {.kind = OP_KERNEL, .kernel = f, .dev = on->ctx ? on->ctx->dev : -1, .grid_y = gy};
  for (int i = 0; i < 4; i++) memcpy(&op.params[i], params[i], sizeof(uint64_t));
  size_t bytes = kernel_reach(f, op.params);
  for (int i = 0; i < kernel_pointers(f) && op.params[3]; i++)
    if (mem_lookup(op.params[i], bytes) == MEM_PAGEABLE || !device_reaches(op.dev, op.params[i])) return CUDA_ERROR_ILLEGAL_ADDRESS;
  return enqueue(h, &op);
}
