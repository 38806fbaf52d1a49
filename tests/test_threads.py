"""The CPU thread count: chosen from the cores other processes leave free (a busy core faked, and one made
busy for real by a spinning process), re-checked while generating, forced by --threads, and reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from click.testing import CliRunner
from conftest import drafter_config, save_random_drafter, target_config

from dflash_cli.engine.cpu.threads import (
    CpuTimes,
    ThreadGovernor,
    read_cpu_times,
    threads_for,
    usable_cpus,
)
from dflash_cli.ui.cli import cli


def test_a_core_counts_as_taken_from_forty_percent_of_its_time():
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.3) == 2
    assert threads_for(2, 0.5) == 1
    assert threads_for(2, 0.67) == 1  # a spinner sharing two cores with our two threads gets 2/3 of one
    assert threads_for(2, 2.0) == 1  # never none
    assert threads_for(8, 3.0) == 5


class FakeMachine:
    """CPU times as /proc/stat would give them for `cpus` CPUs of which `others` are kept busy by other
    processes and `own` by this one, advancing `seconds` per reading."""

    def __init__(self, cpus: int, seconds: float = 1.0):
        self.cpus, self.seconds = cpus, seconds
        self.others = self.own = 0.0
        self.busy = self.total = 0
        self.own_seconds = self.at = 0.0

    def read(self, cpus: list[int]) -> CpuTimes:
        ticks = 100 * self.seconds
        self.total += int(ticks * self.cpus)
        self.busy += int(ticks * min(self.cpus, self.others + self.own))
        self.own_seconds += self.own * self.seconds
        self.at += self.seconds
        return CpuTimes(self.busy, self.total, self.own_seconds, self.at)


def test_the_governor_follows_a_core_taken_and_freed_and_subtracts_its_own_work():
    machine, applied = FakeMachine(2), []
    governor = ThreadGovernor(cpus=[0, 1], read=machine.read, apply=applied.append)
    machine.own = 2.0  # our own two threads busy: not a reason to run fewer
    assert governor.check(force=True) == 2 and applied == [2]
    machine.own, machine.others = 1.33, 0.67  # a spinner arrives and takes a third of our time
    assert governor.check(force=True) == 1 and applied == [2, 1]
    machine.own, machine.others = 1.0, 1.0
    assert governor.check(force=True) == 1 and applied == [2, 1]  # set once, not again
    machine.others = 0.0  # it left
    assert governor.check(force=True) == 2 and applied == [2, 1, 2]
    assert governor.changes == 2 and "auto" in governor.describe()


def test_between_checks_nothing_is_read_and_a_window_too_short_to_tell_keeps_the_count():
    machine, reads = FakeMachine(2, seconds=0.01), []

    def read(cpus):
        reads.append(1)
        return machine.read(cpus)

    governor = ThreadGovernor(cpus=[0, 1], read=read, apply=lambda n: None, clock=lambda: machine.at)
    machine.others = 2.0
    governor.check()  # 10 ms of 2 CPUs is 2 ticks: too few to tell
    assert len(reads) == 1 and governor.threads == 2  # the reading at creation only: RECHECK_SECONDS not passed
    governor.check(force=True)
    assert len(reads) == 2 and governor.threads == 2 and governor.others_busy is None


def test_a_forced_count_is_set_in_the_calling_thread_and_never_changed():
    machine, applied = FakeMachine(2), []
    governor = ThreadGovernor(forced=3, cpus=[0, 1], read=machine.read, apply=lambda n: applied.append(
        (threading.get_ident(), n)))
    machine.others = 2.0
    assert governor.check(force=True) == 3
    worker = threading.Thread(target=governor.check)  # serve's worker: OpenMP keeps a count per thread
    worker.start()
    worker.join()
    assert [n for _, n in applied] == [3, 3] and len({t for t, _ in applied}) == 2
    assert governor.describe() == "3 (--threads)"


def test_proc_stat_is_read_for_the_usable_cpus_only(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 100 1000 0 0 0 0 0 0\n"
                    "cpu0 400 0 100 500 0 0 0 0 0 0\n"
                    "cpu1 500 0 0 500 20 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    times = read_cpu_times([1], stat)
    assert times is not None and times.total == 1020 and times.busy == 500  # idle and iowait are not busy
    assert read_cpu_times([0, 1], tmp_path / "missing") is None


@pytest.mark.skipif(len(usable_cpus()) < 2 or not os.path.exists("/proc/stat"),
                    reason="needs two usable CPUs and /proc/stat (Linux)")
def test_a_process_spinning_on_one_core_is_seen_and_a_thread_given_up():
    cpus = usable_cpus()[:2]
    governor = ThreadGovernor(cpus=cpus, apply=lambda n: None)
    if governor.measure(0.5) < 2:
        pytest.skip(f"other processes already keep {governor.others_busy:.1f} of these CPUs busy")
    spin = ("import os, time\nos.sched_setaffinity(0, {%d})\nend = time.time() + 20\n"
            "while time.time() < end: pass" % cpus[0])
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        governor.measure(0.3)  # it started and pinned itself
        assert governor.measure(0.6) == 1, governor.others_busy
        assert governor.others_busy is not None and governor.others_busy > 0.6
    finally:
        spinner.kill()
        spinner.wait()
    governor.measure(0.1)  # a window that starts after the spinner left
    assert governor.measure(0.6) == 2, governor.others_busy


def test_generate_runs_on_the_threads_asked_for_and_reports_them(tiny_target_dir, tmp_path):
    tiny_drafter_dir = save_random_drafter(tmp_path / "drafter", drafter_config(target_config("qwen3")), seed=2)
    before = torch.get_num_threads()
    try:
        ok = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--draft", str(tiny_drafter_dir),
                                      "--threads", "3", "--json", "-n", "12", "--no-chat-template", "hello"])
        assert ok.exit_code == 0, ok.stderr
        assert json.loads(ok.stdout)["threads"] == 3 and torch.get_num_threads() == 3
        ok = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "-v", "-n", "4", "--no-chat-template",
                                      "hello"], env={"DFLASH_THREADS": "2"})
        assert ok.exit_code == 0, ok.stderr
        assert "cpu threads:" in ok.stderr and torch.get_num_threads() == 2
        bad = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--threads", "0", "hi"])
        assert bad.exit_code == 2 and "--threads" in bad.stderr
    finally:
        torch.set_num_threads(before)
