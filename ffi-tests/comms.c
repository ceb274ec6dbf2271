/*
 * comms.c - communicators made from communicators: ncclCommSplit (colors, keys, NOCOLOR),
 * ncclCommShrink (the last rank left out, blocking and not), ncclCommRevoke (calls refused,
 * shrink still works) and ncclCommGrow with ncclCommGetUniqueId (the last rank joins a
 * communicator of the others), with their bad arguments. Each new communicator is checked by
 * its size, its ranks and an exact all-reduce. Then two communicators driven at once by two
 * threads.
 *
 *   comms [--only split|split-nonblocking|shrink|shrink-nonblocking|revoke|grow|grow-nonblocking|threads]
 *   COMMS_TEST_ABSENT=split|split-nonblocking|split-dead|grow comms   (the last rank never makes the call; see absent())
 *   COMMS_TEST_SUSPENDED=FILE comms      (the last rank is suspended until FILE exists)
 *   COMMS_TEST_LATE=FILE comms           (the last rank issues its all-reduce once FILE exists;
 *                                         COMMS_TEST_CONNECTED=1: after a first all-reduce)
 *
 * Every process runs the same steps in the same order; a local rank that a step leaves out
 * simply does not call (as NCCL asks of an excluded rank).
 */
#include "common.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static int begin(const char* name) {
  if (g_env.only && strcasecmp(g_env.only, name)) return 0;
  test_step(name);
  tlog("step: %s", name);
  return 1;
}

/* Local rank l's communicator's size and rank must be n[l] and r[l] (skipped where comms[l]
 * is NULL). */
static void expect_shape(ncclComm_t* comms, const int* n, const int* r, const char* what) {
  for (int l = 0; l < g_env.local; l++) {
    if (!comms[l]) continue;
    int count = -1, rank = -1;
    CHECK(ncclCommCount(comms[l], &count));
    CHECK(ncclCommUserRank(comms[l], &rank));
    EXPECT(count == n[l] && rank == r[l], "%s, world rank %d: rank %d of %d, expected %d of %d", what,
           g_env.first_rank + l, rank, count, r[l], n[l]);
  }
}

/* One sum all-reduce of COUNT int32 on every local communicator that is not NULL (grouped):
 * local rank l gives v[l] * (j + 1) at j and must get want[l] * (j + 1). */
enum { COUNT = 4099 };
static void sum_check(ncclComm_t* comms, const int* v, const int* want, const char* what) {
  static int32_t send[MAX_LOCAL][COUNT], recv[MAX_LOCAL][COUNT];
  for (int l = 0; l < g_env.local; l++)
    for (int j = 0; j < COUNT; j++) send[l][j] = v[l] * (j + 1), recv[l][j] = -1;
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++)
    if (comms[l]) CHECK(ncclAllReduce(send[l], recv[l], COUNT, ncclInt32, ncclSum, comms[l], TEST_STREAM));
  /* (Nonblocking communicators: ncclInProgress, then done in the background.) */
  CHECK(finish_async(ncclGroupEnd(), comms, g_env.local));
  for (int l = 0; l < g_env.local; l++) {
    if (!comms[l]) continue;
    int bad = 0;
    for (int j = 0; j < COUNT; j++) bad += recv[l][j] != want[l] * (j + 1);
    EXPECT(bad == 0, "%s, world rank %d: %d of %d values wrong (first %d, expected %d)", what, g_env.first_rank + l,
           bad, COUNT, recv[l][0], want[l]);
  }
}

static void destroy_all(ncclComm_t* comms) {
  for (int l = 0; l < g_env.local; l++)
    if (comms[l]) CHECK(ncclCommDestroy(comms[l]));
}

/* A barrier on the world communicator: every rank, excluded ones too, gets here. */
static void world_barrier(ncclComm_t* world) {
  int n = g_env.nranks;
  EXPECT(allreduce_sum_int(world, 1) == n, "world barrier: not %d ranks", n);
}

/* What a split by parity with keys reversing the order (color rank % 2, key n - rank) gives
 * local rank l: its size and rank, its all-reduce term and sum (sum_check). */
static void parity_split_expects(int* cn, int* cr, int* v, int* want) {
  const int n = g_env.nranks;
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    cn[l] = 0, cr[l] = 0, v[l] = rank + 1, want[l] = 0;
    for (int r = 0; r < n; r++) {
      if (r % 2 != rank % 2) continue;
      cn[l]++;
      cr[l] += r > rank; /* larger old ranks have smaller keys: they come first */
      want[l] += r + 1;
    }
  }
}

/* Colors by parity, keys reversing the order; then NOCOLOR for rank 0. */
static void step_split(ncclComm_t* world) {
  const int n = g_env.nranks;
  ncclComm_t sub[MAX_LOCAL];
  int cn[MAX_LOCAL], cr[MAX_LOCAL], v[MAX_LOCAL], want[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CHECK(ncclCommSplit(world[l], rank % 2, n - rank, &sub[l], NULL));
  }
  CHECK(ncclGroupEnd());
  parity_split_expects(cn, cr, v, want);
  expect_shape(sub, cn, cr, "split by parity, keys reversed");
  sum_check(sub, v, want, "all-reduce on a split by parity");
  destroy_all(sub);

  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    sub[l] = (ncclComm_t)(uintptr_t)1; /* must become NULL */
    CHECK(ncclCommSplit(world[l], rank == 0 ? NCCL_SPLIT_NOCOLOR : 7, rank, &sub[l], NULL));
  }
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    if (rank == 0) EXPECT(sub[l] == NULL, "NCCL_SPLIT_NOCOLOR: newcomm %p, not NULL", (void*)sub[l]);
    cn[l] = n - 1, cr[l] = rank - 1, v[l] = rank, want[l] = n * (n - 1) / 2;
  }
  expect_shape(sub, cn, cr, "split with rank 0 NOCOLOR");
  if (n > 1) sum_check(sub, v, want, "all-reduce on a split without rank 0");
  destroy_all(sub);
}

/* After nonblocking parents' splits or grows (`r`: ncclInProgress, or what the group that ran
 * them returned): the parents polled done, then each child set (not the placeholder 1 the
 * caller put there) and polled ready. (A new rank's grow has no parent: its child is polled.) */
static void finish_children(ncclResult_t r, ncclComm_t* parents, ncclComm_t* children, const char* call) {
  CHECK(finish_async(r, parents, g_env.local));
  for (int l = 0; l < g_env.local; l++) {
    EXPECT(children[l] != NULL && children[l] != (ncclComm_t)(uintptr_t)1, "the %s's parent is done but newcomm is %p",
           call, (void*)children[l]);
    if (children[l] == (ncclComm_t)(uintptr_t)1) children[l] = NULL;
    if (children[l]) CHECK(wait_comm(children[l]));
  }
}

/* A nonblocking parent's split, as PyTorch makes one (one rank per thread): the call returns
 * ncclInProgress and sets newcomm to NULL; the parent says ncclInProgress until the split is
 * done, and by then newcomm holds the new communicator (NCCL's order: PyTorch polls the
 * parent, then waits for the handle). Rank 0 is 1.5 s late, so the others do poll. A thread
 * driving several ranks splits them in a group. Before, the call returned only once every
 * rank had made it, so a rank that never did left the others stuck in it, unable to abort
 * (COMMS_TEST_ABSENT=split-nonblocking). */
static void step_split_nonblocking(ncclComm_t* world) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t nb[MAX_LOCAL], sub[MAX_LOCAL];
  int cn[MAX_LOCAL], cr[MAX_LOCAL], v[MAX_LOCAL], want[MAX_LOCAL];
  CHECK(ncclGroupStart()); /* (the world is blocking: this split is done when the group is) */
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommSplit(world[l], 0, g_env.first_rank + l, &nb[l], &cfg));
  CHECK(ncclGroupEnd());
  const int grouped = g_env.local > 1;
  if (g_env.first_rank == 0) sleep_ms(1500); /* (a late rank, not a wait for anything) */
  if (grouped) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    sub[l] = (ncclComm_t)(uintptr_t)1; /* the call sets it to NULL */
    ncclResult_t r = ncclCommSplit(nb[l], rank % 2, g_env.nranks - rank, &sub[l], NULL);
    if (grouped) {
      CHECK(r);
      continue;
    }
    EXPECT(r == ncclInProgress, "a nonblocking parent's split returned %s, not ncclInProgress", result_name(r));
    /* (Rank 0, the last to call, may find it done already.) */
    if (rank != 0) EXPECT(sub[l] == NULL, "a nonblocking parent's split in progress left newcomm %p", (void*)sub[l]);
  }
  finish_children(grouped ? ncclGroupEnd() : ncclInProgress, nb, sub, "split");
  parity_split_expects(cn, cr, v, want);
  expect_shape(sub, cn, cr, "nonblocking split by parity");
  sum_check(sub, v, want, "all-reduce on a nonblocking split by parity");
  destroy_all(sub);
  destroy_all(nb);
}

/* The last rank is left out (it does not call); the others keep their order. Nonblocking
 * (a config with blocking 0): one rank per thread gets ncclInProgress and a communicator that
 * becomes ready (polled with ncclCommGetAsyncError); a thread driving several ranks shrinks
 * them in a group. */
static void step_shrink(ncclComm_t* world, int nonblocking) {
  const int n = g_env.nranks;
  if (n < 2) return;
  ncclComm_t sub[MAX_LOCAL] = {0};
  int cn[MAX_LOCAL], cr[MAX_LOCAL], v[MAX_LOCAL], want[MAX_LOCAL];
  int last = n - 1;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  const int grouped = !nonblocking || g_env.local > 1;
  if (grouped) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    cn[l] = n - 1, cr[l] = rank, v[l] = rank + 1, want[l] = n * (n - 1) / 2;
    if (rank == last) continue;
    ncclResult_t r = ncclCommShrink(world[l], &last, 1, &sub[l], nonblocking ? &cfg : NULL, NCCL_SHRINK_DEFAULT);
    if (!grouped) EXPECT(r == ncclInProgress, "a nonblocking shrink returned %s, not ncclInProgress", result_name(r));
    else CHECK(r);
  }
  if (grouped) CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local && nonblocking; l++) {
    ncclResult_t state = sub[l] ? wait_comm(sub[l]) : ncclSuccess;
    EXPECT(state == ncclSuccess, "the nonblocking shrink ended in %s", result_name(state));
  }
  expect_shape(sub, cn, cr, nonblocking ? "nonblocking shrink without the last rank" : "shrink without the last rank");
  sum_check(sub, v, want, "all-reduce on the shrunk communicator");
  destroy_all(sub);
  if (!nonblocking) {
    int me = g_env.first_rank, out_of_range = n;
    EXPECT(ncclCommShrink(world[0], &out_of_range, 1, &sub[0], NULL, 0) == ncclInvalidArgument,
           "shrink excluding rank %d of %d was not ncclInvalidArgument", n, n);
    EXPECT(ncclCommShrink(world[0], &me, 1, &sub[0], NULL, 0) == ncclInvalidArgument,
           "shrink excluding the calling rank was not ncclInvalidArgument");
  }
  world_barrier(world);
}

/* A revoked communicator refuses calls; shrinking it (nothing excluded) still works. */
static void step_revoke(ncclComm_t* world) {
  const int n = g_env.nranks;
  ncclComm_t dup[MAX_LOCAL], sub[MAX_LOCAL];
  int cn[MAX_LOCAL], cr[MAX_LOCAL], v[MAX_LOCAL], want[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommSplit(world[l], 0, g_env.first_rank + l, &dup[l], NULL));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    CHECK(ncclCommRevoke(dup[l], NCCL_REVOKE_DEFAULT));
    int32_t x = 1;
    ncclResult_t r = ncclAllReduce(&x, &x, 1, ncclInt32, ncclSum, dup[l], TEST_STREAM);
    EXPECT(r == ncclInvalidUsage, "all-reduce on a revoked communicator: %s, not ncclInvalidUsage", result_name(r));
  }
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommShrink(dup[l], NULL, 0, &sub[l], NULL, NCCL_SHRINK_DEFAULT));
  CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    cn[l] = n, cr[l] = rank, v[l] = 2 * rank, want[l] = n * (n - 1);
  }
  expect_shape(sub, cn, cr, "shrink of a revoked communicator");
  sum_check(sub, v, want, "all-reduce on the shrink of a revoked communicator");
  destroy_all(sub);
  destroy_all(dup);
}

static void grow_checked(ncclComm_t* small, ncclUniqueId* ids, const ncclUniqueId* id, ncclComm_t* grown);
static void grow_nonblocking(ncclComm_t* small, ncclUniqueId* ids, const ncclUniqueId* id, ncclComm_t* grown);

/* The last rank joins a communicator of the others: rank 0 (the coordinator) asks for the id
 * and hands it to the new rank over the world communicator; the existing ranks keep their
 * numbers, the new one takes the last. Nonblocking (every communicator with blocking 0, one
 * rank per thread): each call returns ncclInProgress; an existing rank polls its parent, then
 * finds newcomm set; the new rank, with no parent to poll, gets newcomm at once and polls it,
 * as after a nonblocking init. A thread driving several ranks grows them in a group. */
static void step_grow(ncclComm_t* world, int nonblocking) {
  const int n = g_env.nranks, last = n - 1;
  if (n < 2) return;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclConfig_t* conf = nonblocking ? &cfg : NULL;
  ncclComm_t small[MAX_LOCAL], grown[MAX_LOCAL] = {0};
  int cn[MAX_LOCAL], cr[MAX_LOCAL], v[MAX_LOCAL], want[MAX_LOCAL];
  CHECK(ncclGroupStart()); /* (the world is blocking: this split is done when the group is) */
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    CHECK(ncclCommSplit(world[l], rank == last ? NCCL_SPLIT_NOCOLOR : 0, rank, &small[l], conf));
  }
  CHECK(ncclGroupEnd());
  ncclUniqueId id, ids[MAX_LOCAL];
  memset(&id, 0, sizeof id);
  EXPECT(ncclCommGetUniqueId(NULL, &id) == ncclInvalidArgument, "ncclCommGetUniqueId(NULL) not ncclInvalidArgument");
  if (small[0]) EXPECT(ncclCommGetUniqueId(small[0], NULL) == ncclInvalidArgument, "uniqueId NULL accepted");
  if (g_env.first_rank == 0) CHECK(ncclCommGetUniqueId(small[0], &id));
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    ids[l] = id;
    CHECK(ncclBroadcast(&ids[l], &ids[l], sizeof id, ncclUint8, 0, world[l], TEST_STREAM));
  }
  CHECK(ncclGroupEnd());

  if (nonblocking) {
    grow_nonblocking(small, ids, &id, grown);
  } else {
    grow_checked(small, ids, &id, grown);
  }
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    cn[l] = n, cr[l] = rank, v[l] = rank + 1, want[l] = n * (n + 1) / 2;
  }
  expect_shape(grown, cn, cr, nonblocking ? "grown by the last rank, nonblocking" : "grown by the last rank");
  sum_check(grown, v, want, "all-reduce on the grown communicator");
  destroy_all(grown);
  destroy_all(small);
}

/* The grow, after the bad arguments (each refused where it is made, no rank waiting for
 * another) and a grow that no existing rank passes the id to. */
static void grow_checked(ncclComm_t* small, ncclUniqueId* ids, const ncclUniqueId* id, ncclComm_t* grown) {
  const int n = g_env.nranks, last = n - 1;
  ncclComm_t bad = NULL;
  for (int l = 0; l < g_env.local; l++) {
    if (small[l]) {
      EXPECT(ncclCommGrow(small[l], n - 1, NULL, -1, &bad, NULL) == ncclInvalidArgument,
             "growing %d ranks to %d was not ncclInvalidArgument", n - 1, n - 1);
      EXPECT(ncclCommGrow(small[l], n, NULL, 0, &bad, NULL) == ncclInvalidArgument,
             "an existing rank passing rank 0, not -1, was not ncclInvalidArgument");
      EXPECT(ncclCommGrow(small[l], n, NULL, -1, NULL, NULL) == ncclInvalidArgument, "newcomm NULL accepted");
    } else {
      EXPECT(ncclCommGrow(NULL, n, NULL, last, &bad, NULL) == ncclInvalidArgument,
             "a new rank without the id was not ncclInvalidArgument");
      EXPECT(ncclCommGrow(NULL, n, &ids[l], n, &bad, NULL) == ncclInvalidArgument,
             "a new rank %d of %d was not ncclInvalidArgument", n, n);
    }
  }
  /* No existing rank passes the id: every one of them is told, none hangs. */
  ncclResult_t r = ncclSuccess;
  int existing = 0;
  for (int l = 0; l < g_env.local; l++) existing += small[l] != NULL;
  if (existing) {
    CHECK(ncclGroupStart());
    for (int l = 0; l < g_env.local; l++)
      if (small[l]) CHECK(ncclCommGrow(small[l], n, NULL, -1, &bad, NULL));
    r = ncclGroupEnd();
    EXPECT(r == ncclInvalidUsage, "a grow without the coordinator's id: %s, not ncclInvalidUsage (%s)",
           result_name(r), ncclGetLastError(NULL));
  }

  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    if (small[l]) CHECK(ncclCommGrow(small[l], n, rank == 0 ? id : NULL, -1, &grown[l], NULL));
    else CHECK(ncclCommGrow(NULL, n, &ids[l], last, &grown[l], NULL));
  }
  CHECK(ncclGroupEnd());
}

static void grow_nonblocking(ncclComm_t* small, ncclUniqueId* ids, const ncclUniqueId* id, ncclComm_t* grown) {
  const int n = g_env.nranks, last = n - 1;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  const int grouped = g_env.local > 1;
  if (grouped) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    int rank = g_env.first_rank + l;
    grown[l] = (ncclComm_t)(uintptr_t)1; /* the call sets it */
    ncclResult_t r = small[l] ? ncclCommGrow(small[l], n, rank == 0 ? id : NULL, -1, &grown[l], &cfg)
                              : ncclCommGrow(NULL, n, &ids[l], last, &grown[l], &cfg);
    if (grouped) {
      CHECK(r);
      continue;
    }
    EXPECT(r == ncclInProgress, "a nonblocking grow (rank %d) returned %s, not ncclInProgress", rank,
           result_name(r));
    if (!small[l])
      EXPECT(grown[l] != NULL && grown[l] != (ncclComm_t)(uintptr_t)1,
             "a new rank's nonblocking grow in progress left newcomm %p, not a communicator to poll",
             (void*)grown[l]);
  }
  finish_children(grouped ? ncclGroupEnd() : ncclInProgress, small, grown, "grow");
}

/* Two communicators driven at once by two threads of every process, as frameworks run a
 * data-parallel and a tensor-parallel group: one thread all-reduces on the world, the other
 * all-gathers on a copy of it (a split), each checked every time. */
enum { ROUNDS = 40, GATHER = 1000 };
typedef struct {
  ncclComm_t* comms;
  int gather;
  int bad;
} driver_t;

static void* drive(void* arg) {
  driver_t* d = arg;
  const int n = g_env.nranks;
  static int32_t ar_send[2][MAX_LOCAL][COUNT], ar_recv[2][MAX_LOCAL][COUNT];
  int32_t (*send)[COUNT] = ar_send[d->gather], (*recv)[COUNT] = ar_recv[d->gather];
  int32_t* gathered[MAX_LOCAL];
  for (int l = 0; l < g_env.local; l++) gathered[l] = TEST_ALLOC(sizeof(int32_t) * GATHER * (size_t)n);
  for (int round = 0; round < ROUNDS; round++) {
    for (int l = 0; l < g_env.local; l++)
      for (int j = 0; j < COUNT; j++) send[l][j] = (g_env.first_rank + l + 1) * (j + round + 1);
    if (ncclGroupStart() != ncclSuccess) d->bad++;
    for (int l = 0; l < g_env.local; l++) {
      ncclResult_t r = d->gather ? ncclAllGather(send[l], gathered[l], GATHER, ncclInt32, d->comms[l], TEST_STREAM)
                                 : ncclAllReduce(send[l], recv[l], COUNT, ncclInt32, ncclSum, d->comms[l], TEST_STREAM);
      d->bad += r != ncclSuccess;
    }
    if (ncclGroupEnd() != ncclSuccess) d->bad++;
    for (int l = 0; l < g_env.local; l++) {
      if (d->gather) {
        for (int r = 0; r < n; r++)
          for (int j = 0; j < GATHER; j++) d->bad += gathered[l][r * GATHER + j] != (r + 1) * (j + round + 1);
      } else {
        for (int j = 0; j < COUNT; j++) d->bad += recv[l][j] != n * (n + 1) / 2 * (j + round + 1);
      }
    }
  }
  for (int l = 0; l < g_env.local; l++) free(gathered[l]);
  return NULL;
}

static void step_threads(ncclComm_t* world) {
  ncclComm_t dup[MAX_LOCAL];
  CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) CHECK(ncclCommSplit(world[l], 0, g_env.first_rank + l, &dup[l], NULL));
  CHECK(ncclGroupEnd());
  driver_t a = {world, 0, 0}, b = {dup, 1, 0};
  pthread_t ta, tb;
  TEST_THREAD(&ta, drive, &a);
  TEST_THREAD(&tb, drive, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  EXPECT(a.bad == 0, "%d failed calls or wrong values in the all-reduce thread", a.bad);
  EXPECT(b.bad == 0, "%d failed calls or wrong values in the all-gather thread", b.bad);
  destroy_all(dup);
}

/* COMMS_TEST_ABSENT=split-nonblocking (one rank per process, NCCL_INIT_TIMEOUT_S unset): the
 * fault-tolerance pattern NCCL documents (issue, poll with a deadline, abort) on a split whose
 * last rank never makes the call. The others' call returns ncclInProgress; their parent stays
 * in progress for the 2 s they poll; ncclCommAbort on it then returns at once and newcomm
 * stays NULL. The last rank keeps its parent until they are done. */
static int absent_nonblocking(ncclComm_t* world) {
  const int last = g_env.nranks - 1, rank = g_env.first_rank;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t parent = NULL, sub = NULL;
  CHECK(ncclCommSplit(world[0], 0, rank, &parent, &cfg));
  if (rank != last) {
    ncclResult_t r = ncclCommSplit(parent, 0, rank, &sub, NULL);
    EXPECT(r == ncclInProgress, "split without rank %d returned %s, not ncclInProgress", last, result_name(r));
    ncclResult_t state = ncclInProgress;
    for (double until = now_s() + 2; now_s() < until && state == ncclInProgress; sleep_ms(10))
      CHECK(ncclCommGetAsyncError(parent, &state));
    EXPECT(state == ncclInProgress, "the parent of a split without rank %d is %s, not in progress", last,
           result_name(state));
    double t0 = now_s();
    CHECK(ncclCommAbort(parent));
    tlog("ABSENT: split-nonblocking polled 2 s, then aborted in %.2f s", now_s() - t0);
    EXPECT(now_s() - t0 < 5, "ncclCommAbort took %.1f s", now_s() - t0);
    EXPECT(sub == NULL, "an aborted split left newcomm %p", (void*)sub);
  }
  world_barrier(world);
  if (rank == last) CHECK(ncclCommDestroy(parent));
  destroy_comms(world);
  return test_finish();
}

/* COMMS_TEST_ABSENT=split|grow (one rank per process): the last rank never makes the call
 * (it waits for the others on the world communicator). The others must name it: at WARN once
 * half of NCCL_INIT_TIMEOUT_S has gone, and in the ncclTimeout they get at the end. */
static int absent(ncclComm_t* world) {
  const char* what = getenv("COMMS_TEST_ABSENT");
  const int n = g_env.nranks, last = n - 1, rank = g_env.first_rank;
  ncclComm_t sub = NULL;
  ncclResult_t r = ncclSuccess;
  world_barrier(world); /* connected now: the last barrier must not connect under a short timeout */
  if (!strcmp(what, "split-nonblocking")) return absent_nonblocking(world);
  if (!strcmp(what, "split-dead")) {
    /* The last rank's process ends without making the call: the others are told it is gone,
     * within seconds, with no NCCL_INIT_TIMEOUT_S (before, they waited for it for ever). */
    if (rank == last) _exit(0);
    double t0 = now_s();
    r = ncclCommSplit(world[0], 0, rank, &sub, NULL);
    const char* why = ncclGetLastError(NULL);
    char want[48];
    snprintf(want, sizeof want, "rank %d", last);
    tlog("ABSENT: split-dead returned %s after %.1f s: %s", result_name(r), now_s() - t0, why);
    EXPECT(r == ncclRemoteError, "split with rank %d's process gone: %s, not ncclRemoteError", last, result_name(r));
    EXPECT(why && strstr(why, want), "the error does not name rank %d: %s", last, why ? why : "(null)");
    /* (A rank that passes parts on to it finds it gone when it sends; rank 0, which waits for
     * its part, is the one that waited for ever.) */
    if (rank == 0)
      EXPECT(why && strstr(why, "is gone (its process exited)"), "rank 0 is not told rank %d is gone: %s", last,
             why ? why : "(null)");
    EXPECT(sub == NULL, "a failed split left newcomm %p", (void*)sub);
    CHECK(ncclCommAbort(world[0]));
    return test_finish();
  }
  if (!strcmp(what, "split")) {
    if (rank != last) r = ncclCommSplit(world[0], 0, rank, &sub, NULL);
  } else {
    ncclComm_t small = NULL;
    CHECK(ncclCommSplit(world[0], rank == last ? NCCL_SPLIT_NOCOLOR : 0, rank, &small, NULL));
    ncclUniqueId id;
    if (rank == 0) CHECK(ncclCommGetUniqueId(small, &id));
    if (rank != last) r = ncclCommGrow(small, n, rank == 0 ? &id : NULL, -1, &sub, NULL);
    if (small) CHECK(ncclCommDestroy(small));
  }
  if (rank != last) {
    const char* why = ncclGetLastError(NULL);
    char want[32];
    snprintf(want, sizeof want, "rank %d", last);
    tlog("ABSENT: %s returned %s: %s", what, result_name(r), why);
    EXPECT(r == ncclTimeout, "%s without rank %d: %s, not ncclTimeout", what, last, result_name(r));
    EXPECT(why && strstr(why, want), "the error does not name rank %d: %s", last, why ? why : "(null)");
  }
  world_barrier(world);
  destroy_comms(world);
  return test_finish();
}

/* Wait (60 s at most) until the harness makes FILE. */
static void wait_for_release(const char* file) {
  EXPECT(wait_for_file(file, 60), "never released (%s)", file);
}

/* COMMS_TEST_SUSPENDED=FILE (one rank per process): the last rank suspends the world
 * communicator until FILE exists (the harness makes it once rank 0 has said, at WARN, that it
 * waits on a suspended rank), then resumes and joins the all-reduce the others issued. */
static int suspended(ncclComm_t* world) {
  const char* release = getenv("COMMS_TEST_SUSPENDED");
  const int n = g_env.nranks, rank = g_env.first_rank;
  world_barrier(world); /* connected before anyone waits */
  if (rank == n - 1) {
    CHECK(ncclCommSuspend(world[0], 0));
    tlog("SUSPENDED");
    wait_for_release(release);
    CHECK(ncclCommResume(world[0]));
  }
  int v[MAX_LOCAL] = {rank + 1}, want[MAX_LOCAL] = {n * (n + 1) / 2};
  sum_check(world, v, want, "all-reduce with a rank suspended until it is released");
  destroy_comms(world);
  return test_finish();
}

/* COMMS_TEST_LATE=FILE (one rank per process): the last rank issues the all-reduce the others
 * issued only once FILE exists (the harness makes it once rank 0 has said, at WARN, that it
 * waits on a rank that has not issued the call). With COMMS_TEST_CONNECTED=1 the ranks are
 * connected first; otherwise the all-reduce is the communicator's first and waits for the late
 * rank's connection. */
static int late(ncclComm_t* world) {
  const int n = g_env.nranks, rank = g_env.first_rank;
  if (getenv("COMMS_TEST_CONNECTED")) world_barrier(world);
  if (rank == n - 1) wait_for_release(getenv("COMMS_TEST_LATE"));
  int v[MAX_LOCAL] = {rank + 1}, want[MAX_LOCAL] = {n * (n + 1) / 2};
  sum_check(world, v, want, "all-reduce with a rank that issues it late");
  destroy_comms(world);
  return test_finish();
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  ncclComm_t world[MAX_LOCAL];
  make_comms("", world);
  if (getenv("COMMS_TEST_ABSENT")) return absent(world);
  if (getenv("COMMS_TEST_SUSPENDED")) return suspended(world);
  if (getenv("COMMS_TEST_LATE")) return late(world);
  if (begin("split")) step_split(world);
  if (begin("split-nonblocking")) step_split_nonblocking(world);
  if (begin("shrink")) step_shrink(world, 0);
  if (begin("shrink-nonblocking")) step_shrink(world, 1);
  if (begin("revoke")) step_revoke(world);
  if (begin("grow")) step_grow(world, 0);
  if (begin("grow-nonblocking")) step_grow(world, 1);
  if (begin("threads")) step_threads(world);
  destroy_comms(world);
  return test_finish();
}
