/* controller.py's per-ordering decisions, as functions of (ordering, activation): ranks.pml
   runs them with its compile-time settings, conformance.pml prints them for every setting
   and the conformance test compares each with TurnstileController. */

/* Ordering */
#define FG 0
#define GE 1
#define GC 2
#define NORMAL 3
#define ISO 4
/* Activation */
#define ON 0
#define OFF 1
#define AUTO 2

/* _multiplexing_order(): activation off runs the normal ordering */
#define EFF(o, a) ((a) == OFF -> NORMAL : (o))
#define MUXES(o) ((o) == FG || (o) == GE || (o) == GC)
/* registered_lane 'd': R goes behind D on the D lane */
#define ON_D_LANE(o, a) (EFF(o, a) == FG || EFF(o, a) == GE)
/* begin(e, d_active): P runs unbounded when the epoch is not multiplexed */
#define BEGIN_UNBOUNDED(o, a, dact) (!MUXES(EFF(o, a)) || ((a) == AUTO && !(dact)))
/* round() at tag (e, b): a rendezvous unless auto outside P/D coexistence or at END */
#define NEEDS_RDV(o, a, e, b) (MUXES(EFF(o, a)) && ((a) != AUTO || ((e) != NOE && (b) != END)))
/* the P completion fence before the END round of an epoch */
#define FENCE(o, a, e, b) ((b) == END && (e) != NOE && (EFF(o, a) == GC || EFF(o, a) == NORMAL))
/* the permit increment at the ACK */
#define GRANT(o, a, k) (EFF(o, a) == FG -> (k) : UNB)
