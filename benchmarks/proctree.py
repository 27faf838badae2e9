"""Memory of a process and its descendants, read from /proc (the benchmarks' samplers share it).

A pipeline's decode workers are children of a forkserver, which the CLI never waits for, so
getrusage(RUSAGE_CHILDREN) misses them: the tree is walked through each process's parent pid.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """pid and every descendant of it alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # the process ended while we looked
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _status_kib(pid: int, keys: tuple[str, ...]) -> tuple[int, ...] | None:
    """These lines of the process's /proc status, KiB; None if it ended or is a zombie without them."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return tuple(int(status[k].split()[0]) for k in keys)
    except (OSError, KeyError, ValueError):
        return None


def tree_memory(pid: int, own: bool = False) -> tuple[int, int, int]:
    """(RSS summed over the tree, the highest VmHWM of a descendant, processes counted), KiB; with
    own=True the process alone. The sum counts shared pages once per process, so it overstates."""
    total, largest, alive = 0, 0, 0
    for member in [pid] if own else process_tree(pid):
        if (values := _status_kib(member, ("VmRSS", "VmHWM"))) is None:
            continue
        rss, hwm = values
        total += rss
        alive += 1
        if member != pid:
            largest = max(largest, hwm)
    return total, largest, alive


def tree_rss_kinds(pid: int) -> dict[str, int]:
    """The tree's RSS by kind, KiB, summed over its processes: anon (heaps, the processes' own),
    shmem (shared memory: a page is counted once per process that maps it) and file."""
    kinds = {"anon": 0, "shmem": 0, "file": 0}
    for member in process_tree(pid):
        if (values := _status_kib(member, tuple(f"Rss{kind.capitalize()}" for kind in kinds))) is None:
            continue
        for kind, kib in zip(kinds, values):
            kinds[kind] += kib
    return kinds


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each thread of the process has used ('main' or 'thread TID'); the process's
    whole tree summed under 'tree'. Read twice, the differences say which thread is the bottleneck."""
    tick = os.sysconf("SC_CLK_TCK")

    def seconds(stat: str) -> float:
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        out["main" if int(tid) == pid else f"thread {tid}"] = seconds(stat)
    tree = 0.0
    for member in process_tree(pid):
        try:
            tree += seconds(Path(f"/proc/{member}/stat").read_text())
        except OSError:
            continue
    out["tree"] = tree
    return out
