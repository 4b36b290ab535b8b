"""Exit codes of every pdrollout process, and the one rule that picks one (stdlib only).

A group fails as a whole: any rank's stall or death ends every rank on every node, and the exit
code says why, so a supervisor (the node launcher, the kubelet, the operator) can tell a protocol
stall from a lost peer from a configuration the engine cannot run:

  0  EXIT_OK         stopped on request
  1  EXIT_ERROR      anything else (a bug: the log has the traceback)
  2  EXIT_CONFIG     bad configuration: layout, topology, flags, model files
  3  EXIT_STALL      the watchdog saw no rank progress for its bound while work was outstanding
  4  EXIT_PEER_LOST  a rank died, stopped answering, or never joined
  5  EXIT_COMM       expert communication failed at run time (a buffer overflow, a pending dispatch)

A stall ends with the ranks exiting, so their peers then see closed connections: the stall report
wins over the lost peer it causes (`verdict`).
"""
from __future__ import annotations

import sys

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_STALL, EXIT_PEER_LOST, EXIT_COMM = 0, 1, 2, 3, 4, 5
NAMES = {EXIT_OK: "ok", EXIT_ERROR: "error", EXIT_CONFIG: "bad configuration", EXIT_STALL: "stall",
         EXIT_PEER_LOST: "peer lost", EXIT_COMM: "communication error"}
# When several ranks of a node exit with different codes, the node reports the most telling one.
PRIORITY = (EXIT_STALL, EXIT_PEER_LOST, EXIT_COMM, EXIT_CONFIG, EXIT_ERROR)
# by name: the config, topology and expert-comm errors live in modules this stdlib-only one must not import
CONFIG_ERRORS = ("ConfigError", "TopologyError", "LayoutError", "ExpertCommConfigError")
COMM_ERRORS = ("ExpertCommError",)   # its config subclass is matched first


class PeerLostError(RuntimeError):
    """A rank of the group died, stopped answering, or never joined."""


class GroupJoinTimeout(PeerLostError):
    """Peers did not arrive within the join bound."""


# What gloo and the TCPStore say when the process on the other end is gone.
_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                    "socket closed", "end of file", "timed out", "no route to host")


def name(code: int | None) -> str:
    return NAMES.get(code, "signal" if code is not None and code < 0 else f"exit {code}")


def say(text: str) -> None:
    """A line on stderr that never raises. The watchdog, the exit paths and the launcher watch speak
    right before they act: if whoever read this process's stderr is gone (a pipe with no reader, a
    closed file), a BrokenPipeError there ended the watchdog's thread before its verdict, and the
    engine then waited on a stopped peer forever."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):   # EPIPE/EIO, or stderr closed
        pass


def flush_quietly() -> None:
    """stdout and stderr flushed before an os._exit, never raising (see `say`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def lost_report(rank: int, code: int, err: BaseException) -> str:
    """What a failing rank tells its group (watchdog.report_lost) before it exits with `code`."""
    return f"rank {rank} failed ({name(code)}): {type(err).__name__}: {err}"


def last_words(rank: int, code: int, err: BaseException) -> str:
    """The one line a rank leaves on how it ended (its log's tail: an orphaned rank has no one else)."""
    first = str(err).splitlines()[0] if str(err) else ""
    return f"[rank {rank}] exit {code} ({name(code)}): {type(err).__name__}: {first}"


def is_connection_lost(exc: BaseException) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, EOFError)):
            return True
        text = str(exc).lower()
        if any(s in text for s in _CONNECTION_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_config_error(exc: BaseException) -> bool:
    return any(t.__name__ in CONFIG_ERRORS for t in type(exc).__mro__)


def is_comm_error(exc: BaseException) -> bool:
    return any(t.__name__ in COMM_ERRORS for t in type(exc).__mro__)


def exit_code(exc: BaseException | None, *, stall: bool = False, lost: bool = False) -> int:
    """The exit code for a process ending with `exc`; `stall`/`lost`: what the group's watchdog
    declared (the store's record, which every rank reads, or this rank's own view). An exception
    that already carries its group's verdict (`exc.exit_code`, set where the watchdog was at hand)
    keeps it."""
    if isinstance(getattr(exc, "exit_code", None), int):
        return exc.exit_code
    if stall or type(exc).__name__ == "StallError":
        return EXIT_STALL
    if lost or isinstance(exc, PeerLostError):
        return EXIT_PEER_LOST
    if exc is None:
        return EXIT_OK
    if is_config_error(exc):
        return EXIT_CONFIG
    if is_comm_error(exc):
        return EXIT_COMM
    if is_connection_lost(exc):
        return EXIT_PEER_LOST
    return EXIT_ERROR


def most_telling(codes: list[int | None]) -> int:
    """One code for a node whose ranks exited with `codes` (None: still running)."""
    for c in PRIORITY:
        if c in codes:
            return c
    if any(c is not None and c != EXIT_OK for c in codes):   # killed by a signal
        return EXIT_PEER_LOST
    return EXIT_OK
