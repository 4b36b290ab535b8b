/* N ranks running the turnstile (controller.py + the P thread) over a one-slot device model.

   Per rank: a foreground (the planner's step loop: begin, round), a producer (the P thread:
   publish boundary i, stop at the permit, enqueue P's registered collective R_i), and a device
   (device.py's CpuDevice with slots=1: one op at a time, a collective holds the slot until every
   member of its group has started it, i.e. full residency). Which op a free slot starts is
   DISPATCH: FIFO (the oldest enqueued op: CpuDevice "fifo") or ANY (any lane head: "random",
   and a GPU, whose streams promise no order between them). Rank skew is the interleaving.

   Groups (topology.py, ATP = N/ADP): R_i on the whole world (P's model-wide AllReduce; with
   ATP1 the P all-to-all over the world EP group), D's ATP collective on the rank's replica
   (ATP>1) and D's DP collective on ranks of the same local index (ADP>1). With ATP2/ADP2 on
   4 ranks the world group intersects both DP groups: the crossed pair of docs/DISTRIBUTED.md.

   The plan (begin an epoch now?, D ready?, span K for auto) is rank-shared and chosen
   nondeterministically per iteration, as the broadcast StepPlan makes it; PER_RANK_READY lets
   each rank choose its D readiness (the rendezvous must then agree on it).

   Properties: no invalid end state (deadlock: all slots held by crossed collectives, or a round
   or a producer waiting forever); ORDER: D_j is enqueued after the same number of R's on every
   rank (trace.check_order for this shape); OVERTAKE: when any rank enqueues the D of a
   rendezvous round at global boundary g, no rank has issued R_g (the delayed ACK orders D's
   enqueue before the permit moves on); AGREE: the rendezvous see one (epoch, boundary) and the
   ACK one d_any; at the end every admitted epoch completed on every rank and the devices
   drained. Every loop is bounded (E epochs, B boundaries, DI D iterations), so no invalid end
   state plus the end assertions is bounded completion. */

#ifndef N
#define N 4
#endif
#ifndef ADP
#define ADP 2
#endif
#define ATP (N / ADP)
#ifndef E
#define E 2
#endif
#ifndef B
#define B 3
#endif
#ifndef DI
#define DI 2
#endif

#include "controller.pml"
#ifndef ORDERING
#define ORDERING FG
#endif
#ifndef ACTIVATION
#define ACTIVATION ON
#endif
#ifndef SPAN
#define SPAN 1             /* 1..4, or 0 = auto (K in 1..4 per round, rank-shared) */
#endif
#define FIFO 0
#define ANY 1
#ifndef DISPATCH
#define DISPATCH ANY
#endif
#ifndef DSYNC
#define DSYNC 0            /* 1: the D launch returns after D's collectives completed (CPU engine) */
#endif
#ifndef PSYNC
#define PSYNC 0            /* 1: P waits for each R to complete before its next boundary */
#endif
#ifndef PER_RANK_READY
#define PER_RANK_READY 0
#endif
#ifndef NO_PRE_D
#define NO_PRE_D 0         /* known-bad variant: rendezvous 1 removed */
#endif
#ifndef NO_POST_D
#define NO_POST_D 0        /* known-bad variant: rendezvous 2 (the ACK) removed */
#endif
#ifndef D_ATP
#define D_ATP 1            /* 0: leave out D's ATP collective (the harness's D: DP collectives only) */
#endif
#ifndef CHECK_ORDER
#define CHECK_ORDER 1      /* 0: ORDER and OVERTAKE off, so a bad variant runs on into its deadlock */
#endif

#include "turnstile.pml"

#define ORD EFF(ORDERING, ACTIVATION)
#define LP 0
#define LD 1
#define REG_LANE (ON_D_LANE(ORDERING, ACTIVATION) -> LD : LP)

#define IT (E * (B + 1) + DI + 1)   /* foreground iterations: at most B+1 rounds per epoch, one per D-only round */
#define LCAP (E * B + 2 * DI + 1)

/* An op is one byte: kind (P's R on the world, D's ATP or DP collective), lane, and id = the
   call's index on its process group, so two ranks' ops match exactly when gloo would match them. */
#define KP 1
#define KA 2
#define KD 3
#define OP(k, l, i) (((k) << 6) | ((l) << 5) | (i))
#define OPK(o) ((o) >> 6)
#define OPL(o) (((o) >> 5) & 1)
#define OPI(o) ((o) & 31)
#define MEMBER(o, r, g) (OPK(o) == KP || (OPK(o) == KA && (g) / ATP == (r) / ATP) || (OPK(o) == KD && (g) % ATP == (r) % ATP))

#if DISPATCH == FIFO
chan lane[N] = [LCAP] of { byte };       /* one queue: with one slot, oldest-first runs ops in enqueue order */
#define Q(r, l) lane[r]
#else
chan lane[2 * N] = [LCAP] of { byte };
#define Q(r, l) lane[2 * (r) + (l)]
#endif

byte slot[N];    /* the op holding the rank's only slot, 0 = free */
byte doneP[N];   /* calls completed per process group: P world, ATP, DP */
byte doneA[N];
byte doneD[N];
byte pend_p[N];  /* device.pending("p"): ops on the P lane not completed */
byte rP[N];      /* R's enqueued: the global boundary this rank's P has passed */
byte released[N];
bit fdone[N];
bit pdone[N];

/* ORDER: R's enqueued before D_j on the first rank that enqueued it */
bit dpos_set[DI];
byte dpos[DI];

/* the rank-shared plan of one iteration: chosen by the first rank that reaches it */
bit plan_set[IT];
bit plan_begin[IT];
bit plan_ready[IT];
byte plan_seen[IT];
/* span auto: K of the iteration's ACK, chosen by the first rank that acks it */
byte plan_k[IT];
byte plan_kseen[IT];

/* the two rendezvous: an all-gather, double-buffered by parity */
byte rdv_n[N];
short rdv_e[2 * N];
short rdv_b[2 * N];
bit rdv_ready[2 * N];
byte rdv_reads[2];

hidden byte err, may, has, par, g, o, allr, kk;
hidden short te, tb;

#define RDV_PASSED(q, m) ((q) >= N || rdv_n[q] >= (m))
#define ALL_RDV(m) (RDV_PASSED(0, m) && RDV_PASSED(1, m) && RDV_PASSED(2, m) && RDV_PASSED(3, m))

/* the global boundary a round is ordered at: (e, b) -> e*B + b, END -> after the epoch */
#define GLOBAL(r, e, b) ((e) == NOE -> (ts_last[r] + 1) * B : (e) * B + ((b) == END -> B : (b)))

/* The slot starts op `o`. A collective returns once every member of its group has started it;
   it then completes on all members in this same step (a member's later return could only
   delay its next pick, which stays a free choice). */
inline start(r) {
  printf("@ rank %d slot %d:%d lane %d\n", r, OPK(slot[r]), OPI(slot[r]), OPL(slot[r]));
  allr = 1;
  for (g : 0 .. N - 1) {
    if :: MEMBER(slot[r], r, g) && slot[g] != slot[r] -> allr = 0 :: else -> skip fi
  }
  if
  :: allr ->
     o = slot[r];
     for (g : 0 .. N - 1) {
       if
       :: MEMBER(o, r, g) ->
          if :: OPK(o) == KP -> doneP[g]++ :: OPK(o) == KA -> doneA[g]++ :: OPK(o) == KD -> doneD[g]++ fi;
          if :: OPL(o) == LP -> pend_p[g]-- :: else -> skip fi;
          printf("@ rank %d done %d:%d\n", g, OPK(o), OPI(o));
          slot[g] = 0
       :: else -> skip
       fi
     }
  :: else -> skip
  fi;
  allr = 0; g = 0; o = 0
}

proctype Device(byte r) {
end:
  do
  :: d_step { slot[r] == 0 && nempty(Q(r, LP)) -> Q(r, LP)?slot[r]; start(r) }
#if DISPATCH == ANY
  :: d_step { slot[r] == 0 && nempty(Q(r, LD)) -> Q(r, LD)?slot[r]; start(r) }
#endif
  od
}

inline enqueue(r, qk, qi, ql) {
  printf("@ rank %d enqueue %d:%d lane %d\n", r, qk, qi, ql);
  Q(r, ql)!OP(qk, ql, qi);
  if :: ql == LP -> pend_p[r]++ :: else -> skip fi
}

/* arrive at a rendezvous with (epoch, boundary, ready) */
inline arrive(r, re, rb, rrd) {
  par = rdv_n[r] % 2; rdv_e[par * N + r] = re; rdv_b[par * N + r] = rb; rdv_ready[par * N + r] = rrd;
  rdv_n[r]++; par = 0
}

/* pass it (every rank arrived): read everyone's; ack = 1 checks the post-D ACK */
inline pass(r, re, rb, rrd, rany, ack) {
  par = (rdv_n[r] - 1) % 2; rany = 0; allr = 1;
  for (g : 0 .. N - 1) {
    assert(rdv_e[par * N + g] == re && rdv_b[par * N + g] == rb);   /* AGREE */
    rany = rany || rdv_ready[par * N + g];
    allr = allr && rdv_ready[par * N + g]
  }
  assert(!ack || (rany == rrd && allr == rrd));   /* every rank enqueued D iff the pre-D agreement said so */
  rdv_reads[par]++;
  if   /* the last reader clears the buffer: stale values would only split states */
  :: rdv_reads[par] == N ->
       for (g : 0 .. N - 1) { rdv_e[par * N + g] = 0; rdv_b[par * N + g] = 0; rdv_ready[par * N + g] = 0 }
       rdv_reads[par] = 0
  :: else -> skip
  fi;
  par = 0; g = 0; allr = 0
}

/* enqueue_d: this rank's D iteration j (idle-shaped when not ready: the same collectives) */
inline enqueue_d(r, j, withrdv, e0, b0) {
#if CHECK_ORDER
  if
  :: dpos_set[j] -> assert(dpos[j] == rP[r])                 /* ORDER */
  :: else -> dpos_set[j] = 1; dpos[j] = rP[r]
  fi;
  if   /* OVERTAKE: no rank has passed the permit this round is ordered at */
  :: withrdv -> for (g : 0 .. N - 1) { assert(rP[g] <= GLOBAL(r, e0, b0)) }; g = 0
  :: else -> skip
  fi;
#endif
  if :: ATP > 1 && D_ATP -> enqueue(r, KA, j, LD) :: else -> skip fi;
  if :: ADP > 1 -> enqueue(r, KD, j, LD) :: else -> skip fi
}

/* Steps that touch only what the same thread reads next (publish with a pass, pre_d, enqueued,
   ack) are merged with the visible step next to them: other threads cannot tell the order. */
proctype Producer(byte r) {
  byte e = 0, i = 0;
  do
  :: e == E -> break
  :: e < E ->
     released[r] > e;   /* begin(e) handed the epoch to the P thread */
     do
     :: i == B -> d_step { ts_finish(r, e, err); assert(err == OK); err = 0; i = 0 }; break
     :: i < B ->
        atomic {
          ts_publish(r, e, i, err, may); assert(err == OK); err = 0; may = 0;
          ts_permit[r] > i;   /* boundary(): wait while i == p */
          enqueue(r, KP, e * B + i, REG_LANE); rP[r]++
        }
#if PSYNC
        doneP[r] > e * B + i;
#endif
        i++
     od;
     e++
  od;
  pdone[r] = 1
}

#if ORDERING == ISO && ACTIVATION != OFF
/* isolation-only: no turnstile; P runs unbounded on its own lane while D is enqueued at once */
proctype Foreground(byte r) {
  byte e = 0, k = 0, j = 0;
  do
  :: e == E -> break
  :: e < E ->
     d_step { ts_begin(r, e, 0, err); assert(err == OK); ts_permit[r] = UNB; released[r] = e + 1; err = 0 }
     do
     :: k == (DI + E - 1) / E -> break
     :: k < (DI + E - 1) / E -> d_step { enqueue_d(r, j, 0, e, END); j++; k++ }
#if DSYNC
        (doneA[r] >= j || ATP == 1 || !D_ATP) && (doneD[r] >= j || ADP == 1);
#endif
     od;
     ts_prod[r] == FINISHED;
     d_step { ts_cancel(r, e, err); assert(err == OK); err = 0; k = 0 }   /* retire(e) */
     e++
  od;
  fdone[r] = 1
}
#else
proctype Foreground(byte r) {
  byte it = 0, e_next = 0, d_left = DI, j = 0, k = 0;
  bit ready = 0, any = 0, rdv = 0, go = 0, acked = 1;
  short e0, b0;
  /* Two steps per round. (1) the previous round's ACK and ack(), the next plan and begin(), the
     wait for a tag, the completion fence, rendezvous 1's arrival; (2) rendezvous 1 passed,
     pre_d, the D launch, enqueued, rendezvous 2's arrival. A wait inside a step splits it. */
  do
  :: atomic {
       if   /* the ACK of the previous round */
       :: !acked && rdv && !NO_POST_D && ALL_RDV(rdv_n[r]) -> pass(r, e0, b0, any, ready, 1)
       :: !acked && !(rdv && !NO_POST_D) -> skip
       :: acked -> skip
       fi;
       if
       :: !acked ->
#if SPAN == 0
          /* auto: K in 1..4 (auto_span's range), rank-shared. From permit p every K >= B - p
             lets P run to its end, so only K <= B - p are told apart (larger ones would only
             leave permit values no boundary reaches). */
          if
          :: ORD == FG && ts_prod[r] == AT_PERMIT ->
             if
             :: plan_k[it] == 0 ->
                if
                :: plan_k[it] = 1
                :: B - ts_permit[r] >= 2 -> plan_k[it] = 2
                :: B - ts_permit[r] >= 3 -> plan_k[it] = 3
                :: B - ts_permit[r] >= 4 -> plan_k[it] = 4
                fi
             :: else -> skip
             fi;
             k = plan_k[it];
             plan_kseen[it]++;
             if :: plan_kseen[it] == N -> plan_k[it] = 0; plan_kseen[it] = 0 :: else -> skip fi
          :: else -> k = 1
          fi;
#endif
          kk = GRANT(ORDERING, ACTIVATION, k); ts_ack(r, kk, err); assert(err == OK); err = 0; kk = 0;
          printf("@ rank %d ack %d %d any %d k %d permit %d\n", r, e0, b0, any, k, ts_permit[r]);
          d_left = d_left - any; it++; ready = 0; any = 0; rdv = 0; k = 0; e0 = 0; b0 = 0; acked = 1
       :: else -> skip
       fi;
       if
       :: e_next == E && ts_prod[r] == IDLE && d_left == 0 -> fdone[r] = 1; goto done
       :: else -> skip
       fi;
       /* the plan of iteration `it`: whether an epoch begins, whether D is ready, the span */
       if
       :: !plan_set[it] ->
            if
            :: ts_prod[r] == IDLE && e_next < E && d_left == 0 -> plan_begin[it] = 1
            :: ts_prod[r] == IDLE && e_next < E && d_left > 0 -> if :: plan_begin[it] = 1 :: plan_begin[it] = 0 fi
            :: else -> plan_begin[it] = 0
            fi;
            if
            :: d_left == 0 -> plan_ready[it] = 0
            :: d_left > 0 && ts_prod[r] == IDLE && !plan_begin[it] -> plan_ready[it] = 1   /* a D-only round does work */
            :: else -> if :: plan_ready[it] = 1 :: plan_ready[it] = 0 fi
            fi;
            plan_set[it] = 1
       :: else -> skip
       fi;
       go = plan_begin[it]; ready = plan_ready[it];
#if SPAN != 0
       k = SPAN;
#endif
#if PER_RANK_READY
       if   /* each rank its own readiness while an epoch runs: the rendezvous agrees on d_any */
       :: d_left > 0 && (ts_prod[r] != IDLE || go) -> if :: ready = 1 :: ready = 0 fi
       :: else -> skip
       fi;
#endif
       plan_seen[it]++;
       if
       :: plan_seen[it] == N -> plan_set[it] = 0; plan_begin[it] = 0; plan_ready[it] = 0; plan_seen[it] = 0
       :: else -> skip
       fi;
       if
       :: go ->   /* begin(e, d_active = D left): UNBOUNDED when this epoch is not multiplexed */
          ts_begin(r, e_next, 0, err); assert(err == OK); err = 0;
          if :: BEGIN_UNBOUNDED(ORDERING, ACTIVATION, d_left > 0) -> ts_permit[r] = UNB :: else -> skip fi;
          printf("@ rank %d begin %d d_active %d permit %d\n", r, e_next, d_left > 0, ts_permit[r]);
          e_next++; released[r] = e_next; go = 0
       :: else -> skip
       fi;
       /* round(): wait for P at its permit, finished, or no epoch; the completion fence of
          global-complete and normal; rendezvous 1 (none under auto outside P/D coexistence) */
       ts_prod[r] != RUNNING;
       ts_tag(r, has, e0, b0); has = 0;
       if
       :: FENCE(ORDERING, ACTIVATION, e0, b0) -> pend_p[r] == 0
       :: else -> skip
       fi;
       rdv = NEEDS_RDV(ORDERING, ACTIVATION, e0, b0);
       printf("@ rank %d round %d %d ready %d rendezvous %d\n", r, e0, b0, ready, rdv);
       if :: rdv && !NO_PRE_D -> arrive(r, e0, b0, ready) :: else -> skip fi
     }
     atomic {
       if
       :: rdv && !NO_PRE_D && ALL_RDV(rdv_n[r]) -> pass(r, e0, b0, ready, any, 0)
       :: !(rdv && !NO_PRE_D) -> any = ready
       fi;
       ts_pre_d(r, e0, b0, err, has, te, tb); assert(err == OK); err = 0; has = 0; te = 0; tb = 0;
       if
       :: any -> enqueue_d(r, j, rdv, e0, b0); j++
#if DSYNC
          (doneA[r] >= j || ATP == 1 || !D_ATP) && (doneD[r] >= j || ADP == 1);
#endif
          ts_enqueued(r, err); assert(err == OK); err = 0
       :: else -> skip
       fi;
       if :: rdv && !NO_POST_D -> arrive(r, e0, b0, any) :: else -> skip fi;
       acked = 0
     }
  od;
done:
  skip
}
#endif

init {
  byte r;
  atomic {
    for (r : 0 .. N - 1) { ts_init(r, (SPAN == 0 -> 1 : SPAN)) }
    for (r : 0 .. N - 1) { run Device(r); run Producer(r); run Foreground(r) }
    r = 0
  }
  /* bounded completion: every rank finished its rounds and epochs, every device drains */
  for (r : 0 .. N - 1) { fdone[r] && pdone[r] }
  r = 0;
#if DISPATCH == ANY
  for (r : 0 .. N - 1) { empty(Q(r, LP)) && empty(Q(r, LD)) && slot[r] == 0 }
#else
  for (r : 0 .. N - 1) { empty(Q(r, LP)) && slot[r] == 0 }
#endif
  r = 0;
  d_step {
    for (r : 0 .. N - 1) {
      assert(ts_prod[r] == IDLE && ts_last[r] == E - 1 && ts_round[r] == RNONE);
      assert(doneP[r] == E * B && rP[r] == E * B && pend_p[r] == 0);
      assert(ATP == 1 || !D_ATP || doneA[r] == doneA[0]);
      assert(ADP == 1 || doneD[r] == doneD[0])
    }
    r = 0
  }
}
