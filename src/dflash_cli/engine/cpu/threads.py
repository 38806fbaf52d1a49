"""How many threads a CPU generation runs on, chosen from the cores the rest of the machine leaves free and
re-checked while it runs.

Every C layer and torch op splits its work among the threads and waits for all of them at the end (an
OpenMP barrier), so one thread that the scheduler takes off its core for another process stalls the whole
step until it is back: with one core of two busy, two threads decoded 19x slower than idle and one thread
1.6x (benchmarks/README.md, "Threads on a busy machine"). So the count follows the machine: the cores this
process may run on, less what other processes used over the last window, read from /proc/stat (the whole
machine's busy time) less this process's own CPU time. The window since the last check is at least
RECHECK_SECONDS of generation, or the idle time between two replies of a chat. `--threads N` forces a count.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

RECHECK_SECONDS = 0.5
# others' busy cores above which one thread fewer is run: a core that is more than 40% taken stalls a
# thread on it more often than a thread more gains
BUSY_THRESHOLD = 0.4


_torch_threads: list[int] = []


def most_threads() -> int:
    """torch's thread count before the first governor changed it: its default of one per physical core
    (hyperthreads share one), or what the program embedding us set with torch.set_num_threads."""
    if not _torch_threads:
        _torch_threads.append(torch.get_num_threads())
    return _torch_threads[0]


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's or taskset's share of the machine)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuTimes:
    """Busy and total time of some CPUs, in the kernel's ticks, and this process's CPU seconds, at one instant."""

    busy: int
    total: int
    own_seconds: float
    at: float

    def others_busy(self, since: CpuTimes, cpus: int) -> float | None:
        """Cores' worth of busy time of every other process between `since` and now; None when too little
        time passed to tell (the kernel counts in ticks of 10 ms)."""
        total = self.total - since.total
        if total < 4 * cpus:  # under about 40 ms of each CPU's time
            return None
        machine = cpus * (self.busy - since.busy) / total  # busy cores, this process included
        own = (self.own_seconds - since.own_seconds) / max(self.at - since.at, 1e-9)
        return max(0.0, machine - own)


def read_cpu_times(cpus: list[int], stat: Path = Path("/proc/stat")) -> CpuTimes | None:
    """The busy and total ticks of `cpus` from /proc/stat (None where there is none: not Linux)."""
    own, at = time.process_time(), time.perf_counter()
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            ticks = [int(v) for v in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    if total == 0:
        return None
    return CpuTimes(busy, total, own, at)


def threads_for(cpus: int, others_busy: float) -> int:
    """Threads for `cpus` usable CPUs when other processes keep `others_busy` cores busy: one per core they
    leave free, a core counted as taken from BUSY_THRESHOLD of its time; never fewer than one."""
    return max(1, min(cpus, int(cpus - others_busy + BUSY_THRESHOLD)))


class ThreadGovernor:
    """Sets torch's (and so the C kernels') thread count for the generations of the thread that calls
    `check`. `forced`: a count from --threads, set once and kept. `read` reads the CPU times, `clock` tells the
    time they are stamped with (tests fake both)."""

    def __init__(self, forced: int | None = None, cpus: list[int] | None = None,
                 read: Callable[[list[int]], CpuTimes | None] = read_cpu_times,
                 apply: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.perf_counter):
        self.cpus = cpus if cpus is not None else usable_cpus()
        self.most = min(len(self.cpus), most_threads()) if cpus is None else len(self.cpus)
        self.forced = forced
        self._read, self._apply, self._clock = read, apply, clock
        self.threads = forced or self.most
        self.others_busy: float | None = None
        self.changes = 0
        self._last = None if forced else read(self.cpus)
        self._applied: tuple[int, int] | None = None  # (the thread it was set in, the count)

    def check(self, *, force: bool = False) -> int:
        """Re-reads the machine when RECHECK_SECONDS have passed since the last reading (or `force`), sets the
        thread count it calls for, and returns it. Cheap otherwise: call it before every step."""
        if self.forced is None and self._last is not None and (
                force or self._clock() - self._last.at >= RECHECK_SECONDS):
            now = self._read(self.cpus)
            busy = now.others_busy(self._last, len(self.cpus)) if now is not None else None
            if busy is not None and now is not None:
                self.others_busy, self._last = busy, now
                chosen = min(self.most, threads_for(len(self.cpus), busy))
                if chosen != self.threads:
                    self.threads = chosen
                    self.changes += 1
        here = (threading.get_ident(), self.threads)  # OpenMP keeps the count per calling thread
        if self._applied != here:
            self._apply(self.threads)
            self._applied = here
        return self.threads

    def measure(self, seconds: float = 0.3) -> int:
        """The count auto would choose after watching the machine for `seconds` (doctor's reading)."""
        time.sleep(seconds)
        return self.check(force=True)

    def describe(self) -> str:
        if self.forced is not None:
            return f"{self.threads} (--threads)"
        seen = f"; others kept {self.others_busy:.1f} busy" if self.others_busy is not None else ""
        return f"{self.threads} of {len(self.cpus)} CPUs (auto{seen})"
