"""Which exit code each error class of the engine ends a rank with (docs/DISTRIBUTED.md, "Failure
semantics"): a run-time expert-communication failure has its own code, apart from a configuration the
engine cannot run; a node and the operator name it."""
from __future__ import annotations

import pytest

from pdrollout.engine.model.loader import CheckpointError
from pdrollout.engine.protocol.config import ConfigError
from pdrollout.engine.protocol.exits import (EXIT_COMM, EXIT_CONFIG, EXIT_ERROR, EXIT_PEER_LOST, EXIT_STALL,
                                             GroupJoinTimeout, PeerLostError, exit_code, most_telling, name)
from pdrollout.engine.protocol.layout import LayoutError
from pdrollout.engine.protocol.topology import TopologyError
from pdrollout.engine.protocol.turnstile import TurnstileError
from pdrollout.engine.runtime import expert_comm
from pdrollout.engine.runtime.deepep_comm import DeepEPExpertComm
from pdrollout.engine.runtime.steplog import StepLogError
from pdrollout.engine.runtime.watchdog import StallError
from pdrollout.operator import group

# the table of docs/DISTRIBUTED.md
CODES = {ConfigError: EXIT_CONFIG, TopologyError: EXIT_CONFIG, LayoutError: EXIT_CONFIG,
         expert_comm.ExpertCommConfigError: EXIT_CONFIG, expert_comm.ExpertCommError: EXIT_COMM,
         expert_comm.PendingDispatchError: EXIT_COMM, expert_comm.PermitMissingError: EXIT_COMM,
         PeerLostError: EXIT_PEER_LOST, GroupJoinTimeout: EXIT_PEER_LOST, ConnectionResetError: EXIT_PEER_LOST,
         StepLogError: EXIT_ERROR, TurnstileError: EXIT_ERROR, CheckpointError: EXIT_ERROR}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@pytest.mark.parametrize("cls", list(CODES), ids=lambda c: c.__name__)
def test_each_error_class_ends_with_its_code(cls):
    assert exit_code(cls("x")) == CODES[cls], f"{cls.__name__}: exit {exit_code(cls('x'))}"


def test_every_expert_comm_error_is_a_communication_error_but_its_config_kind():
    classes = [expert_comm.ExpertCommError, *_subclasses(expert_comm.ExpertCommError)]
    assert len(classes) >= 4
    for cls in classes:
        want = EXIT_CONFIG if issubclass(cls, expert_comm.ExpertCommConfigError) else EXIT_COMM
        assert exit_code(cls("x")) == want, cls.__name__
    assert exit_code(StallError("x", {}, 1.0)) == EXIT_STALL
    # the group's verdict wins over this rank's own class
    assert exit_code(expert_comm.ExpertCommError("x"), stall=True) == EXIT_STALL
    assert exit_code(expert_comm.ExpertCommError("x"), lost=True) == EXIT_PEER_LOST


def test_deep_ep_that_cannot_be_built_here_is_bad_configuration():
    # raised before deep_ep is imported, so it runs on CPU: a layout stock DeepEP cannot serve
    with pytest.raises(expert_comm.ExpertCommConfigError, match="two RDMA DeepEP Buffers") as e:
        DeepEPExpertComm([[0, 1]], 0, num_experts=8, hidden=16, max_tokens=4, topk=2, nodes=2)
    assert exit_code(e.value) == EXIT_CONFIG


def test_node_and_operator_name_the_communication_code():
    assert name(EXIT_COMM) == "communication error"
    assert most_telling([0, EXIT_CONFIG, EXIT_COMM]) == EXIT_COMM            # 3 over 4 over 5 over 2 over 1
    assert most_telling([EXIT_COMM, EXIT_PEER_LOST]) == EXIT_PEER_LOST
    assert most_telling([EXIT_COMM, EXIT_STALL]) == EXIT_STALL
    pod = {"metadata": {"name": "r-0"}, "status": {"containerStatuses": [
        {"name": "engine", "restartCount": 1, "lastState": {"terminated": {"exitCode": EXIT_COMM}}}]}}
    assert group.pod_failure(pod) == f"container engine of pod r-0 restarted (1x: exit {EXIT_COMM} (communication error))"
