"""Failures of a distributed run: collective errors named by the call they hit, and test hooks.

A collective or point-to-point message that never completes (a rank hung, or died without its
peers noticing) fails after the process-group timeout (``--collective-timeout``, passed to every
group the runtime creates); a peer that died closes its connections, which fails its partners'
pending operations at once. Either way the backend raises a bare error deep inside torch. `named`
turns it into a `PlannerError` that says which call of which step on which rank it hit, so the
log of a failed run points at the call, and the run exits with status 2 (under ``torchrun
--max-restarts`` the group then restarts and resumes from its last checkpoint).

Test hooks (off unless the variable is set; armed only in a group's first attempt, i.e. while
torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0 or unset, so a restarted group runs through):

- ``RUNTIME_TEST_KILL_AT=STEP:RANK``: rank RANK exits abruptly (``os._exit``, no cleanup, as a
  SIGKILL or a lost GPU would) at the start of the first train call it runs in step STEP, in the
  middle of the step.
- ``RUNTIME_TEST_KILL_AT=save:STEP:RANK``: rank RANK exits abruptly while the checkpoint of step
  STEP is being written, right after its own shard file.
- ``RUNTIME_TEST_HANG_AT=STEP:RANK``: rank RANK stops (sleeps) before the first call it runs in
  step STEP and never joins it, so its peers' collective timeout fires.
- ``RUNTIME_TEST_DISK_FULL_AT=STEP``: the manifest of checkpoint STEP is written to ``/dev/full``
  instead of its file, so the kernel answers with a real ENOSPC (a disk that filled up).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from plans.errors import PlannerError

KILL_ENV, HANG_ENV, FULL_ENV = "RUNTIME_TEST_KILL_AT", "RUNTIME_TEST_HANG_AT", "RUNTIME_TEST_DISK_FULL_AT"
FULL_DEVICE = "/dev/full"  # every write to it fails with ENOSPC
KILLED_EXIT = 137  # what a SIGKILLed process reports
HANG_S = 3600.0  # a hung rank sleeps until its launcher ends it
# What gloo's transport says when an operation timed out or its peer went away (it raises plain
# RuntimeErrors; NCCL's errors are DistBackendErrors).
_COMM_SIGNS = ("timed out", "connection closed", "connection reset", "broken pipe", "gloo/transport")


class SharedError(PlannerError):
    """A problem every rank of the run raises alike (rank 0 found it and sent it to all): each
    rank reports it, and they leave together, so the launcher stopping the group after the first
    exit does not silence the others."""


def is_comm_failure(err: BaseException) -> bool:
    """Whether `err` is a failed collective or message (a timeout or a lost peer), not a bug."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(sign in text for sign in _COMM_SIGNS)


@contextmanager
def named(what: str, *, rank: int, timeout_s: float) -> Iterator[None]:
    """Run a block of collectives; a failed one becomes a `PlannerError` naming `what` (e.g.
    "call 'actor_train' of step 3") and this rank. Other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as e:
        if not is_comm_failure(e):
            raise
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        timed_out = "timed out" in detail.lower() or "timeout" in detail.lower()
        why = f"a collective did not complete within {timeout_s:g} s" if timed_out else "a peer rank failed"
        raise PlannerError(f"{what} on rank {rank}: {why} ({detail})",
                           hint="another rank hung or died inside this call; see its log. If the call legitimately "
                           "takes longer, raise --collective-timeout" if timed_out else
                           "another rank died during this call; see its log (torchrun --max-restarts R with "
                           "--resume auto restarts the group from the last checkpoint)") from e


def _spec(name: str) -> tuple[str, int, int] | None:
    """(where, step, rank) of a hook variable: ``STEP:RANK`` (where "call") or ``save:STEP:RANK``."""
    text = os.environ.get(name)
    if not text:
        return None
    parts = text.split(":")
    where = parts.pop(0) if parts and parts[0] == "save" else "call"
    try:
        step, rank = (int(p) for p in parts)
    except ValueError:
        raise PlannerError(f"{name}={text!r} must be STEP:RANK or save:STEP:RANK") from None
    return where, step, rank


@dataclass
class FaultHooks:
    """The test hooks armed for this rank (see the module docstring); each fires once."""

    rank: int
    kill: tuple[str, int, int] | None = None
    hang: tuple[str, int, int] | None = None
    full_at: int | None = None
    fired: set[str] = field(default_factory=set)

    @classmethod
    def from_env(cls, rank: int) -> FaultHooks:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return cls(rank)
        full = os.environ.get(FULL_ENV)
        if full is not None and not full.isdigit():
            raise PlannerError(f"{FULL_ENV}={full!r} must be a step number")
        return cls(rank, kill=_spec(KILL_ENV), hang=_spec(HANG_ENV), full_at=int(full) if full else None)

    def _due(self, hook: tuple[str, int, int] | None, where: str, step: int) -> bool:
        return hook is not None and hook == (where, step, self.rank)

    def before_call(self, step: int, *, kind: str) -> None:
        """At the start of a call this rank runs in `step`."""
        if self._due(self.hang, "call", step) and "hang" not in self.fired:
            self.fired.add("hang")
            time.sleep(HANG_S)
        if kind == "train" and self._due(self.kill, "call", step) and "kill" not in self.fired:
            os._exit(KILLED_EXIT)

    def manifest_device(self, step: int) -> str | None:
        """The device the manifest of checkpoint `step` is written to instead of its file (None: its file)."""
        return FULL_DEVICE if self.full_at == step else None

    def while_saving(self, step: int) -> None:
        """After this rank wrote its shard file of checkpoint `step`, before the checkpoint is complete."""
        if self._due(self.kill, "save", step):
            os._exit(KILLED_EXIT)
