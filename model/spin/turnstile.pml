/* One rank's turnstile (engine/protocol/turnstile.py) as Promela inlines over per-rank arrays.

   Included by ranks.pml (N ranks) and conformance.pml (N = 1). Each inline mirrors one method
   of `Turnstile`, checks in the same order and leaves the state unchanged on an error, so the
   conformance test can compare every reachable transition with the Python class.
   Encoding: epoch None = -1 (NO_EPOCH), boundary END = -1, permit UNBOUNDED = UNB. */

#define UNB 100            /* UNBOUNDED: above every boundary the models publish */
#define NOE (-1)           /* NO_EPOCH, and an epoch of None */
#define END (-1)

/* ProducerState */
#define IDLE 0
#define RUNNING 1
#define AT_PERMIT 2
#define FINISHED 3
/* RoundState */
#define RNONE 0
#define RPRE 1
#define RENQ 2
/* the TurnstileError subclasses, by name in conformance.py */
#define OK 0
#define ESTALE 1
#define EDUP 2
#define EMISSING 3
#define ENONMONO 4
#define EPERMIT 5
#define EPHASE 6
#define ESPAN 7

short ts_epoch[N];
short ts_last[N];
short ts_reached[N];
byte ts_permit[N];
byte ts_prod[N];
byte ts_round[N];
byte ts_span[N];
bit ts_has_tag[N];        /* round_tag is not None */
short ts_tag_e[N];
short ts_tag_b[N];

inline ts_init(r, k) {
  ts_epoch[r] = NOE; ts_last[r] = -1; ts_reached[r] = -1; ts_permit[r] = 0;
  ts_prod[r] = IDLE; ts_round[r] = RNONE; ts_span[r] = k; ts_has_tag[r] = 0;
  ts_tag_e[r] = 0; ts_tag_b[r] = 0
}

inline ts_retire(r) {
  ts_epoch[r] = NOE; ts_reached[r] = -1; ts_permit[r] = 0; ts_prod[r] = IDLE
}

/* begin(epoch, d_enqueued) */
inline ts_begin(r, e, denq, err) {
  if
  :: e < 0 -> err = EMISSING
  :: e >= 0 && e < ts_last[r] -> err = ESTALE
  :: e >= 0 && e == ts_last[r] -> err = EDUP
  :: e > ts_last[r] && ts_prod[r] != IDLE -> err = EPHASE
  :: e > ts_last[r] && ts_prod[r] == IDLE && ts_round[r] != RNONE -> err = EPHASE
  :: e > ts_last[r] && ts_prod[r] == IDLE && ts_round[r] == RNONE ->
       ts_epoch[r] = e; ts_last[r] = e; ts_reached[r] = -1;
       ts_permit[r] = (denq -> ts_span[r] : 0); ts_prod[r] = RUNNING; err = OK
  fi
}

/* _active(epoch): the event names the active epoch */
inline ts_active(r, e, err) {
  if
  :: (ts_epoch[r] == NOE || e > ts_epoch[r]) && e <= ts_last[r] -> err = ESTALE
  :: (ts_epoch[r] == NOE || e > ts_epoch[r]) && e > ts_last[r] -> err = EMISSING
  :: ts_epoch[r] != NOE && e < ts_epoch[r] -> err = ESTALE
  :: ts_epoch[r] != NOE && e == ts_epoch[r] -> err = OK
  fi
}

/* publish(epoch, boundary) -> may: 1 pass, 0 stop at the permit */
inline ts_publish(r, e, b, err, may) {
  ts_active(r, e, err);
  if
  :: err != OK -> skip
  :: err == OK && ts_prod[r] != RUNNING -> err = EPHASE
  :: err == OK && ts_prod[r] == RUNNING && b <= ts_reached[r] -> err = ENONMONO
  :: err == OK && ts_prod[r] == RUNNING && b > ts_reached[r] && b > ts_permit[r] -> err = EPERMIT
  :: err == OK && ts_prod[r] == RUNNING && b > ts_reached[r] && b <= ts_permit[r] ->
       ts_reached[r] = b;
       if
       :: b == ts_permit[r] -> ts_prod[r] = AT_PERMIT; may = 0
       :: b < ts_permit[r] -> may = 1
       fi
  fi
}

inline ts_may_pass(r, e, b, err, may) {
  ts_active(r, e, err);
  if
  :: err == OK -> may = (b < ts_permit[r])
  :: else -> skip
  fi
}

inline ts_finish(r, e, err) {
  ts_active(r, e, err);
  if
  :: err == OK && ts_prod[r] != RUNNING -> err = EPHASE
  :: err == OK && ts_prod[r] == RUNNING -> ts_prod[r] = FINISHED
  :: else -> skip
  fi
}

inline ts_cancel(r, e, err) {
  ts_active(r, e, err);
  if
  :: err == OK && ts_round[r] != RNONE -> err = EPHASE
  :: err == OK && ts_round[r] == RNONE -> ts_retire(r)
  :: else -> skip
  fi
}

/* tag(): has = 0 while P runs below its permit (the round waits for it) */
inline ts_tag(r, has, te, tb) {
  if
  :: ts_prod[r] == IDLE -> has = 1; te = NOE; tb = END
  :: ts_prod[r] == FINISHED -> has = 1; te = ts_epoch[r]; tb = END
  :: ts_prod[r] == AT_PERMIT -> has = 1; te = ts_epoch[r]; tb = ts_permit[r]
  :: ts_prod[r] == RUNNING -> has = 0; te = 0; tb = 0
  fi
}

/* pre_d(epoch, boundary): rendezvous 1 passed */
inline ts_pre_d(r, e, b, err, has, te, tb) {
  ts_tag(r, has, te, tb);
  if
  :: ts_round[r] != RNONE -> err = EPHASE
  :: ts_round[r] == RNONE && !has -> err = EMISSING
  :: ts_round[r] == RNONE && has && (e != te || b != tb) ->
       if
       :: e != NOE && ts_epoch[r] != NOE && e < ts_epoch[r] -> err = ESTALE
       :: else -> err = EMISSING
       fi
  :: ts_round[r] == RNONE && has && e == te && b == tb ->
       ts_round[r] = RPRE; ts_has_tag[r] = 1; ts_tag_e[r] = te; ts_tag_b[r] = tb; err = OK
  fi
}

inline ts_enqueued(r, err) {
  if
  :: ts_round[r] != RPRE -> err = EPHASE
  :: else -> ts_round[r] = RENQ; err = OK
  fi
}

/* ack(span=k): rendezvous 2 passed; p <- min(p + k, UNBOUNDED) */
inline ts_ack(r, k, err) {
  if
  :: ts_round[r] == RNONE -> err = EPHASE
  :: ts_round[r] != RNONE && k < 1 -> err = ESPAN
  :: ts_round[r] != RNONE && k >= 1 ->
       if
       :: ts_prod[r] == AT_PERMIT ->
            ts_permit[r] = (ts_permit[r] + k >= UNB -> UNB : ts_permit[r] + k); ts_prod[r] = RUNNING
       :: ts_prod[r] == FINISHED -> ts_retire(r)
       :: else -> skip
       fi;
       ts_round[r] = RNONE; ts_has_tag[r] = 0; ts_tag_e[r] = 0; ts_tag_b[r] = 0; err = OK
  fi
}

inline ts_set_span(r, k, err) {
  if
  :: k < 1 -> err = ESPAN
  :: else -> ts_span[r] = k; err = OK
  fi
}
