/*
 * p2p.c - ncclSend / ncclRecv.
 *
 *   p2p [--quick] [--only Ring|Pairs|Self|Many|Ungrouped]
 *
 * NCCL: sends and receives that must progress together are fused in one
 * ncclGroupStart/ncclGroupEnd; operations between the same two ranks are matched in the
 * order they were issued; a rank may send to and receive from itself inside a group.
 */
#include "common.h"

#include <string.h>
#include <strings.h>

typedef struct {
  int is_send;
  int peer;
  size_t count;
  ncclDataType_t dt;
  int seq; /* index of the message between this pair, to tell same-pair messages apart */
  gbuf_t buf;
  void* ptr;
} p2p_op_t;

typedef struct {
  p2p_op_t* ops;
  int n, cap;
} opset_t;

static ncclComm_t g_comms[MAX_LOCAL];
static uint32_t g_round;

static const ncclDataType_t DTS[] = {ncclInt8,     ncclInt32,      ncclFloat16, ncclFloat64,
                                     ncclBfloat16, ncclFloat8e5m2, ncclUint64,  ncclFloat32};
#define NUM_P2P_DTS ((int)(sizeof DTS / sizeof DTS[0]))

static int wanted(const char* name) { return !g_env.only || !strcasecmp(g_env.only, name); }

/* The data of message `seq` from src to dst: distinct for every pair, message and round. */
static uint32_t msg_salt(int src, int dst, int seq) {
  return hash3((uint32_t)dst, (uint32_t)seq, g_round) ^ (uint32_t)src;
}

static void add_op(opset_t* s, int me, int is_send, int peer, size_t count, ncclDataType_t dt, int seq) {
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 16;
    s->ops = realloc(s->ops, (size_t)s->cap * sizeof *s->ops);
  }
  p2p_op_t* op = &s->ops[s->n++];
  memset(op, 0, sizeof *op);
  op->is_send = is_send;
  op->peer = peer;
  op->count = count;
  op->dt = dt;
  op->seq = seq;
  size_t es = dt_info(dt)->size;
  op->ptr = gbuf_alloc(&op->buf, count * es);
  if (is_send)
    fill_bytes(op->ptr, es, me, 0, count, msg_salt(me, peer, seq));
  else
    gbuf_poison(&op->buf, g_round);
}

static void add_send(opset_t* s, int me, int peer, size_t count, ncclDataType_t dt, int seq) {
  add_op(s, me, 1, peer, count, dt, seq);
}

static void add_recv(opset_t* s, int me, int peer, size_t count, ncclDataType_t dt, int seq) {
  add_op(s, me, 0, peer, count, dt, seq);
}

/* Issues every local rank's operations, in the order they were added, inside one group
 * (or without a group when `grouped` is 0: one operation per process), then checks them. */
static void run(const char* name, opset_t* sets, int grouped) {
  test_step(name);
  if (grouped) CHECK(ncclGroupStart());
  for (int l = 0; l < g_env.local; l++) {
    for (int i = 0; i < sets[l].n; i++) {
      p2p_op_t* op = &sets[l].ops[i];
      ncclResult_t r = op->is_send
                           ? ncclSend(op->ptr, op->count, op->dt, op->peer, g_comms[l], TEST_STREAM)
                           : ncclRecv(op->ptr, op->count, op->dt, op->peer, g_comms[l], TEST_STREAM);
      if (r != ncclSuccess) {
        tlog("%s: rank %d %s #%d peer %d count %zu %s", name, g_env.first_rank + l,
             op->is_send ? "ncclSend" : "ncclRecv", i, op->peer, op->count, dt_info(op->dt)->name);
        test_check_fail(__FILE__, __LINE__, op->is_send ? "ncclSend" : "ncclRecv", r);
      }
    }
  }
  if (grouped) CHECK(ncclGroupEnd());
  for (int l = 0; l < g_env.local; l++) {
    int me = g_env.first_rank + l;
    for (int i = 0; i < sets[l].n; i++) {
      p2p_op_t* op = &sets[l].ops[i];
      char what[200];
      snprintf(what, sizeof what, "%s: rank %d %s #%d peer %d count %zu %s", name, me,
               op->is_send ? "send" : "recv", op->seq, op->peer, op->count, dt_info(op->dt)->name);
      size_t es = dt_info(op->dt)->size;
      /* A receive holds the sender's data; a send buffer is never modified. */
      if (op->is_send)
        check_bytes(what, op->ptr, es, me, 0, op->count, msg_salt(me, op->peer, op->seq));
      else
        check_bytes(what, op->ptr, es, op->peer, 0, op->count, msg_salt(op->peer, me, op->seq));
      check_guards(what, &op->buf);
      gbuf_free(&op->buf);
    }
    free(sets[l].ops);
    memset(&sets[l], 0, sizeof sets[l]);
  }
  g_round++; /* the next round's data differs from this one's */
}

static size_t big_count(void) { return (1u << 20) + 3; }

/* Every rank sends to the next and receives from the previous one. */
static void ring(void) {
  if (!wanted("Ring")) return;
  const int n = g_env.nranks;
  size_t counts[] = {0, 1, 7, big_count()};
  int ncounts = g_env.quick ? 3 : 4;
  double t0 = now_s();
  for (int d = 0; d < NUM_P2P_DTS; d++) {
    for (int c = 0; c < ncounts; c++) {
      if (c == 3 && d % 3 != 0) continue; /* large messages for a few datatypes only */
      opset_t sets[MAX_LOCAL];
      memset(sets, 0, sizeof sets);
      for (int l = 0; l < g_env.local; l++) {
        int me = g_env.first_rank + l;
        /* Half the ranks post the receive first. */
        if (me % 2) add_recv(&sets[l], me, (me + n - 1) % n, counts[c], DTS[d], 0);
        add_send(&sets[l], me, (me + 1) % n, counts[c], DTS[d], 0);
        if (!(me % 2)) add_recv(&sets[l], me, (me + n - 1) % n, counts[c], DTS[d], 0);
      }
      run("Ring", sets, 1);
    }
  }
  tlog("Ring: done in %.2f s", now_s() - t0);
}

/* The count and datatype of the message from src to dst in a round of pairs(): both ends
 * compute the same, every pair differs, and some counts are zero. */
static size_t pair_count(int src, int dst, int round) {
  return (size_t)((src * 3 + dst * 5 + round) % 9) * (round ? 37 : 1);
}

static ncclDataType_t pair_dt(int src, int dst, int round) { return DTS[(src + dst + round) % NUM_P2P_DTS]; }

static void pair_send(opset_t* s, int me, int peer, int round) {
  add_send(s, me, peer, pair_count(me, peer, round), pair_dt(me, peer, round), 0);
}

static void pair_recv(opset_t* s, int me, int peer, int round) {
  add_recv(s, me, peer, pair_count(peer, me, round), pair_dt(peer, me, round), 0);
}

/* Each rank exchanges with every rank (itself included), in an order that differs by rank:
 * all sends then all receives, receives first in reverse, interleaved, or rotated. */
static void pairs(void) {
  if (!wanted("Pairs")) return;
  const int n = g_env.nranks;
  double t0 = now_s();
  for (int round = 0; round < 2; round++) {
    opset_t sets[MAX_LOCAL];
    memset(sets, 0, sizeof sets);
    for (int l = 0; l < g_env.local; l++) {
      int me = g_env.first_rank + l;
      opset_t* s = &sets[l];
      switch ((me + round) % 4) {
        case 0:
          for (int p = 0; p < n; p++) pair_send(s, me, p, round);
          for (int p = 0; p < n; p++) pair_recv(s, me, p, round);
          break;
        case 1:
          for (int p = n - 1; p >= 0; p--) pair_recv(s, me, p, round);
          for (int p = n - 1; p >= 0; p--) pair_send(s, me, p, round);
          break;
        case 2:
          for (int p = 0; p < n; p++) {
            pair_send(s, me, p, round);
            pair_recv(s, me, p, round);
          }
          break;
        default:
          for (int i = 0; i < n; i++) {
            pair_recv(s, me, (me + i) % n, round);
            pair_send(s, me, (me + n - i) % n, round);
          }
          break;
      }
    }
    run("Pairs", sets, 1);
  }
  tlog("Pairs: done in %.2f s", now_s() - t0);
}

/* Send to and receive from oneself in one group, receive posted first. */
static void self(void) {
  if (!wanted("Self")) return;
  size_t counts[] = {0, 7, big_count()};
  int ncounts = g_env.quick ? 2 : 3;
  for (int c = 0; c < ncounts; c++) {
    opset_t sets[MAX_LOCAL];
    memset(sets, 0, sizeof sets);
    for (int l = 0; l < g_env.local; l++) {
      int me = g_env.first_rank + l;
      add_recv(&sets[l], me, me, counts[c], ncclFloat32, 0);
      add_send(&sets[l], me, me, counts[c], ncclFloat32, 0);
    }
    run("Self", sets, 1);
  }
  tlog("Self: done");
}

/* 64 sends to the next rank and 64 receives from the previous one in one group, with
 * different counts (zero included) and datatypes: matched in issue order. */
static void many(void) {
  if (!wanted("Many")) return;
  const int n = g_env.nranks, nmsg = 64;
  opset_t sets[MAX_LOCAL];
  memset(sets, 0, sizeof sets);
  for (int l = 0; l < g_env.local; l++) {
    int me = g_env.first_rank + l, next = (me + 1) % n, prev = (me + n - 1) % n;
    for (int pass = 0; pass < 2; pass++) {
      int sends = (pass == 0) == (me % 2 == 0);
      for (int k = 0; k < nmsg; k++) {
        size_t count = (size_t)(k * 5 % 13) * (size_t)(k % 7 + 1);
        ncclDataType_t dt = DTS[k % NUM_P2P_DTS];
        if (sends)
          add_send(&sets[l], me, next, count, dt, k);
        else
          add_recv(&sets[l], me, prev, count, dt, k);
      }
    }
  }
  run("Many", sets, 1);
  tlog("Many: done");
}

/* Outside a group: a single send meets a single receive in another process. */
static void ungrouped(void) {
  if (!wanted("Ungrouped") || g_env.local != 1 || g_env.nranks < 2) return;
  const int me = g_env.first_rank, n = g_env.nranks;
  for (int dir = 0; dir < 2; dir++) {
    opset_t sets[1];
    memset(sets, 0, sizeof sets);
    /* Pairs (0,1), (2,3), ...; in the second pass the odd rank sends. */
    int partner = me % 2 ? me - 1 : me + 1;
    if (partner < n) {
      int sender = (me % 2 == dir);
      if (sender)
        add_send(&sets[0], me, partner, 1000 + (size_t)dir, ncclInt32, 0);
      else
        add_recv(&sets[0], me, partner, 1000 + (size_t)dir, ncclInt32, 0);
    }
    run("Ungrouped", sets, 0);
  }
  tlog("Ungrouped: done");
}

int main(int argc, char** argv) {
  test_init(argc, argv);
  make_comms("", g_comms);
  ring();
  pairs();
  self();
  many();
  ungrouped();
  destroy_comms(g_comms);
  return test_finish();
}
