"""The runtime as an operating-system process: signals, an orphaned rank, threads, the machine.

- **Interrupts.** SIGINT and SIGTERM (Ctrl-C, ``kill``, torchrun stopping its workers) raise
  `Interrupted` in the main thread; the command line turns it into one line on rank 0 and exit
  status 128 + the signal, instead of a traceback on every rank. Files are never left half
  written (every writer is atomic, `plans.io`; a checkpoint being saved is only a ``.tmp``
  directory until its manifest is in place).
- **An orphaned rank.** If the launcher (the torchrun agent) dies, its workers would linger,
  blocked in collectives. `watch_parent` notices the parent is gone within a second, interrupts
  the rank as SIGTERM would, and ends the process a few seconds later if it is stuck in a
  collective that does not return.
- **Threads.** A CPU process uses as many threads as the CPUs it may really run on: its affinity
  and its cgroup's CPU quota (torch counts the host's cores, so in a container limited to 2 CPUs
  of 64 it would start 64 threads and run several times slower).
- **The machine.** A plan for GPUs started where there are none, or with more ranks per node than
  the node has GPUs, is refused before anything is allocated (`device_problem`); so is a
  ``--reference`` run whose models cannot fit in this machine's memory (`memory_problem`).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from plans.hardware import GIB
from plans.plan import Plan
from plans.sharding import parameters

PARENT_POLL_S = 0.5
ORPHAN_GRACE_S = 5.0  # after the interrupt, how long an orphaned rank may take to stop on its own
FP32_BYTES = 4
ADAM_STATE_COPIES = 3  # a gradient and two moments per trainable parameter, in fp32


class Interrupted(BaseException):
    """The process received SIGINT or SIGTERM (or its launcher died); raised in the main thread.

    A BaseException, so that no ``except Exception`` on the way out swallows it."""

    def __init__(self, signum: int, *, reason: str = "") -> None:
        super().__init__(signum)
        self.signum = signum
        self.reason = reason or signal.Signals(signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class Interrupts:
    """Raises `Interrupted` on SIGINT/SIGTERM; remembers the first one (a run interrupted while a
    collective failed reports the interrupt, not the collective)."""

    received: Interrupted | None = None
    reason: str = ""
    step: int = 0  # the step running, for the message

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.received is not None:  # a second signal while unwinding: the first is being handled
            return
        self.received = Interrupted(signum, reason=self.reason)
        raise self.received


def watch_parent(interrupts: Interrupts) -> None:
    """Start a daemon thread that interrupts this process (as SIGTERM) when its parent, the
    launcher, dies, and ends it `ORPHAN_GRACE_S` later if it has not stopped by then."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        interrupts.reason = f"its launcher (pid {parent}) died"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by its cgroup's CPU quota (v2 or v1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    quota: float | None = None
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            quota = int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        try:
            q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
            p = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
            quota = q / p if q > 0 and p > 0 else None
        except (OSError, ValueError):
            quota = None
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cpu_threads(*, local_ranks: int) -> int | None:
    """Threads for each of `local_ranks` CPU processes sharing this machine, or None when
    OMP_NUM_THREADS already says (the user's choice, or torchrun's)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, usable_cpus() // max(1, local_ranks))


def device_problem(plan: Plan, *, cuda_devices: int, local_ranks: int, reference: bool) -> str | None:
    """Why this machine cannot run `plan` as launched (None when it can): a GPU plan with no GPU,
    or more ranks on this node than it has GPUs."""
    if plan.cluster.gpu == "cpu" or reference:
        return None
    if cuda_devices == 0:
        return (f"plan {plan.name!r} is for {plan.cluster.world_size} {plan.cluster.gpu} GPUs "
                f"({plan.cluster.short()}), but this machine has no CUDA GPU; its ranks would run on the CPU with "
                "the memory of GPUs")
    if local_ranks > cuda_devices:
        return f"this launch starts {local_ranks} ranks on this node, which has {cuda_devices} CUDA GPU(s)"
    return None


def reference_bytes(plan: Plan) -> int:
    """Memory the single-process reference holds: every model whole in fp32, and a gradient and
    Adam's two moments for each trainable one (activations come on top)."""
    total = 0
    for decl in plan.models.values():
        numel = sum(math.prod(p.shape) for p in parameters(decl.spec, head=decl.head))
        total += numel * FP32_BYTES * (1 + (ADAM_STATE_COPIES if decl.trainable else 0))
    return total


def available_memory_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, capped by its cgroup's limit (None when
    unknown)."""
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit_text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit_text != "max" and avail is not None:
            avail = min(avail, int(limit_text) - used)
    except (OSError, ValueError):
        pass
    return avail


def memory_problem(plan: Plan) -> str | None:
    """Why the reference of `plan` cannot fit in this machine's memory (None when it may)."""
    need, have = reference_bytes(plan), available_memory_bytes()
    if have is None or need <= have:
        return None
    return (f"the single-process reference of plan {plan.name!r} holds {need / GIB:.1f} GiB of weights and optimizer "
            f"state, but this machine has {have / GIB:.1f} GiB available")
