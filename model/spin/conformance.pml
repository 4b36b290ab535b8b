/* Every reachable transition of one rank's turnstile automaton, printed for the conformance test.

   Built with -DPRINTF, pan runs the printf of each transition it explores; a state is expanded
   once, so the output is each reachable (state, event) pair with its result. Events and their
   arguments range over small domains (epochs -1..EMAX, boundaries END..BMAX, spans 0..4, UNB,
   and None = the current span); the initial span is 1..4. Line format, all integers:
     T <state> <event> <arg1> <arg2> <err> <may> <state'>
   state = epoch last reached permit producer round span has_tag tag_e tag_b
   First, controller.pml's decisions for every setting, one line each:
     C <ordering> <activation> <d_active> <epoch> <boundary> <k> <begin unbounded> <rendezvous> <fence> <grant> <d lane> */

#define N 1
#include "turnstile.pml"
#include "controller.pml"

#ifndef EMAX
#define EMAX 2
#endif
#ifndef BMAX
#define BMAX 3
#endif

/* event codes (conformance.py names them) */
#define V_BEGIN 0
#define V_PUBLISH 1
#define V_MAY_PASS 2
#define V_FINISH 3
#define V_CANCEL 4
#define V_PRE_D 5
#define V_ENQUEUED 6
#define V_ACK 7
#define V_SET_SPAN 8
#define V_TAG 9

hidden byte err, may, has;
hidden short te, tb;
hidden byte kk;

#define ST ts_epoch[0], ts_last[0], ts_reached[0], ts_permit[0], ts_prod[0], ts_round[0], ts_span[0], ts_has_tag[0], ts_tag_e[0], ts_tag_b[0]

/* one event: choose its arguments, print the state before, apply, print the result and the
   state after, and reset the choice so it does not split states */
#define EVENT(SEL, CODE, ARG1, ARG2, APPLY) \
  atomic { \
    SEL; \
    printf("T %d %d %d %d %d %d %d %d %d %d", ST); err = OK; may = 0; APPLY; \
    printf(" %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n", CODE, ARG1, ARG2, err, may, ST); \
    err = 0; may = 0; has = 0; te = 0; tb = 0; kk = 0; e = 0; b = 0; k = 0 }

init {
  short e, b;
  byte k;
  byte o, a, dact;
  d_step {
    for (o : FG .. ISO) {
      for (a : ON .. AUTO) {
        for (dact : 0 .. 1) {
          for (k : 1 .. 4) {
            for (e : -1 .. 0) {
              for (b : -1 .. 2) {
                if
                :: e == NOE && b != END -> skip   /* no epoch: only (NO_EPOCH, END) */
                :: else ->
                   printf("C %d %d %d %d %d %d %d %d %d %d %d\n", o, a, dact, e, b, k,
                          BEGIN_UNBOUNDED(o, a, dact), NEEDS_RDV(o, a, e, b), FENCE(o, a, e, b),
                          GRANT(o, a, k), ON_D_LANE(o, a))
                fi
              }
            }
          }
        }
      }
    }
    o = 0; a = 0; dact = 0; e = 0; b = 0; k = 0
  }
  select(k : 1 .. 4);
  ts_init(0, k);
  k = 0;
  do
  :: EVENT(select(e : -1 .. EMAX); select(k : 0 .. 1), V_BEGIN, e, k, ts_begin(0, e, k, err))
  :: EVENT(select(e : -1 .. EMAX); select(b : -1 .. BMAX), V_PUBLISH, e, b, ts_publish(0, e, b, err, may))
  :: EVENT(select(e : -1 .. EMAX); select(b : -1 .. BMAX), V_MAY_PASS, e, b, ts_may_pass(0, e, b, err, may))
  :: EVENT(select(e : -1 .. EMAX), V_FINISH, e, 0, ts_finish(0, e, err))
  :: EVENT(select(e : -1 .. EMAX), V_CANCEL, e, 0, ts_cancel(0, e, err))
  :: EVENT(select(e : -1 .. EMAX); select(b : -1 .. BMAX), V_PRE_D, e, b, ts_pre_d(0, e, b, err, has, te, tb))
  :: EVENT(skip, V_ENQUEUED, 0, 0, ts_enqueued(0, err))
  /* ack(span): 0 is invalid, 255 stands for None (the current span), UNB for UNBOUNDED */
  :: EVENT(if :: k = 0 :: k = 1 :: k = 2 :: k = 3 :: k = 4 :: k = UNB :: k = 255 fi,
           V_ACK, k, 0, kk = (k == 255 -> ts_span[0] : k); ts_ack(0, kk, err))
  :: EVENT(select(k : 0 .. 4), V_SET_SPAN, k, 0, ts_set_span(0, k, err))
  /* tag(): may = 1 with (epoch, boundary) in the argument columns, may = 0 for None */
  :: EVENT(skip, V_TAG, te, tb, ts_tag(0, has, te, tb); may = has)
  od
}
