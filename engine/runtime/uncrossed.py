"""A pd step on several ranks where no registered collective of P meets D's groups (ATP1): P's
epoch runs on its thread beside D's steps with no permits and no rendezvous (docs/DISTRIBUTED.md,
"When the turnstile runs").

At ATP1 P has no model-wide AllReduce, and its expert all-to-alls run on P's own communicator, D's
on D's: the two paths never wait on a common collective, so nothing needs ordering as long as a P
collective and a D collective can run at once (two device slots on CPU; co-resident NCCL kernels
on CUDA). A one-slot CPU device keeps the turnstile (member.py).

The end of an epoch must land at the same step on every rank, but each rank's P thread finishes on
its own time: every step's report says whether this rank's P is done (`p_ready`), rank 0 gathers
the reports anyway, and once all said so it plans the next step with `p_collect`; that step hands
back P's logits on every rank. A step with no D row waits for P (a drain, or D all finished).
"""
from __future__ import annotations

from ..protocol.plan import StepPlan
from ..protocol.turnstile import Ordering
from .pd_step import TurnstileStep


def uncrossed(topo, cuda: bool, slots: int) -> bool:
    """Whether P and D can go beside each other with no turnstile on this topology and device."""
    return topo.atp == 1 and (cuda or slots >= 2)


class BesideStep(TurnstileStep):
    """TurnstileStep's P thread and warm-ups; its rounds only under isolation-only (a diagnostic)."""

    def run(self, plan: StepPlan):
        """(D logits, P logits, D replayed a graph, the plan whose P the P logits are), as
        TurnstileStep.run."""
        w, ctl = self.w, self.w.group.ctl
        if self.flight is None and ctl.ordering is Ordering.ISOLATION_ONLY:
            return super().run(plan)
        w.group.col.p_lane = "p"   # nothing of P is ordered behind D
        self.skew_applied = []
        if self.flight is None:
            if plan.p_flight is not None:
                raise RuntimeError(f"step {plan.step}: rank 0 continues P epoch {plan.p_flight}, none is in flight here")
            if not plan.p_any:
                d, graph = self._d(plan)
                return self.d_done(d), None, graph, None
            self._pq.put((plan, None))
            if not (ctl.ordering.multiplexes and w.control.activation != "off"):   # P first, then D
                p = self.wait_p()
                d, graph = self._d(plan)
                return self.d_done(d), p, graph, plan
            self.flight = (plan, plan.step, 0.0)
            collect = not (plan.p_span and plan.d_any)
        else:
            epoch = self.flight[1]
            if plan.p_any or plan.p_flight != epoch:
                raise RuntimeError(f"step {plan.step}: P epoch {epoch} is in flight, the plan says "
                                   f"p_flight={plan.p_flight} with{'' if plan.p_any else 'out'} P rows")
            collect = plan.p_collect or not plan.d_any
        d, graph = self._d(plan)
        if not collect:
            self.p_ready = not self._p_done.empty()
            return self.d_done(d), None, graph, None
        p = self.wait_p()
        started, self.flight, self.p_ready = self.flight[0], None, False
        return self.d_done(d), p, graph, started

    def _d(self, plan: StepPlan):
        """This step's D on every rank when any replica has D rows (its collectives need them all)."""
        if not plan.d_any:
            return None, False
        out: dict = {}
        self._enqueue_d(plan, out)
        return out["d"], out["graph"]
