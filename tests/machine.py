"""The machine facts a numeric or timing test's outcome may depend on, for its failure message."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def facts() -> str:
    """CPU model, usable cores, load, torch build and threads: one line."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"[machine: {model}; {cores} usable cores, load {load}; torch {torch.__version__} ({capability}), "
            f"{torch.get_num_threads()} threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}]")
