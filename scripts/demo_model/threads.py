"""Pick torch's intra-op thread count from what other processes leave free.

On a small shared machine, two torch threads are fast while the second core is idle, but several
times slower than one thread when another process keeps that core busy (each parallel region
waits for the descheduled thread). :class:`ThreadGovernor` measures, from ``/proc/stat``, how much
CPU other processes used over the last interval and uses all threads only when they left enough
free.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _system_ticks() -> tuple[int, int]:
    """Return (busy, total) jiffies over all CPUs since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def _own_ticks() -> int:
    """Return user + system jiffies of this process (all threads)."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class ThreadGovernor:
    """Switch between ``max_threads`` and one thread depending on other processes' CPU use.

    Args:
        max_threads: Threads to use while the machine is otherwise idle.
        interval: Seconds between measurements.
        busy_cores: Other processes' load (in cores) above which one thread is used.
    """

    def __init__(self, max_threads: int, interval: float = 10.0, busy_cores: float = 0.4) -> None:
        self.max_threads = max_threads
        self.interval = interval
        self.busy_cores = busy_cores
        self.cpus = os.cpu_count() or 1
        self.switches = 0
        self.enabled = Path("/proc/stat").exists() and max_threads > 1
        self._last = (time.monotonic(), *_system_ticks(), _own_ticks()) if self.enabled else None
        torch.set_num_threads(max_threads)

    def update(self) -> int:
        """Measure if the interval has passed, set the thread count, and return it."""
        if not self.enabled or self._last is None:
            return torch.get_num_threads()
        now = time.monotonic()
        if now - self._last[0] < self.interval:
            return torch.get_num_threads()
        (busy, total), own = _system_ticks(), _own_ticks()
        _, busy0, total0, own0 = self._last
        self._last = (now, busy, total, own)
        others = max(0, (busy - busy0) - (own - own0)) / max(1, total - total0) * self.cpus
        wanted = 1 if others > self.busy_cores else self.max_threads
        if wanted != torch.get_num_threads():
            self.switches += 1
            logger.info("other processes use %.1f cores: %d torch thread(s)", others, wanted)
            torch.set_num_threads(wanted)
        return wanted
