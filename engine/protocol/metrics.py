"""Names of the engine's Prometheus metrics that other components read (the operator's status,
the bench's before/after scrapes): one place, so a rename cannot leave a reader behind.
The server (server/metrics.py) defines every metric; these are the shared ones."""
from __future__ import annotations

PREFIX = "pdrollout:"

TTFT = PREFIX + "time_to_first_token_seconds"                 # histogram
# gauge: the exact p99 of the last TTFT_WINDOW first tokens (the histogram's buckets are too wide to
# interpolate a p99 a client would recognise)
TTFT_RECENT_P99 = PREFIX + "time_to_first_token_recent_p99_seconds"
TTFT_WINDOW = 1024
DECODE_WAIT = PREFIX + "decode_wait_seconds"                  # histogram
DECODE_STEP = PREFIX + "decode_step_seconds"                  # histogram: steps with decode rows, no prefill
DECODE_STEP_BESIDE_P = PREFIX + "decode_step_beside_p_seconds"  # histogram: those of them with a P epoch in flight
P_EPOCH = PREFIX + "p_epoch_seconds"                          # histogram: a P epoch beside D, planned -> done
P_EPOCH_ENQUEUE = PREFIX + "p_epoch_enqueue_seconds"          # histogram: its forward's issuing
P_EPOCH_CPU = PREFIX + "p_epoch_cpu_seconds"                  # histogram: its thread's CPU time in that
TURNSTILE_WAIT = PREFIX + "turnstile_wait_seconds"            # histogram
RENDEZVOUS = PREFIX + "turnstile_rendezvous_seconds"          # histogram
ROUNDS = PREFIX + "turnstile_rounds"                          # counter
STALLS = PREFIX + "stalls"                                    # counter
JIT_COMPILES = PREFIX + "jit_compiles"                        # counter: Triton compiles in served steps
ROLLOUT_MAKESPAN = PREFIX + "rollout_makespan_seconds"        # gauge
ROLLOUTS_FINISHED = PREFIX + "rollouts_finished"              # counter
SPEC_VERIFY = PREFIX + "spec_verify"                          # counter: decode rows under speculation
SPEC_PROPOSED = PREFIX + "spec_proposed_drafts"               # counter
SPEC_ACCEPTED = PREFIX + "spec_accepted_drafts"               # counter


def total(counter: str) -> str:
    """The exposition name of a counter's value."""
    return counter + "_total"
