"""The memory of every process of a server under test: the API process, the engine process, the compile
workers (walked through /proc, so workers started and killed during a request are seen while they live)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field


def _children_of() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children, out, stack = _children_of(), [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, ()))
    return out


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def role(pid: int, root: int) -> str:
    """'api' (the server's own process), 'compile worker', or 'engine' (any other python process below it)."""
    if pid == root:
        return "api"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return "compile worker" if "grammar/compile/worker.py" in cmdline else "engine"


@dataclass
class TreeWatch:
    """Samples the RSS of every process of the tree every `interval_s` until `stop()`: per pid its role, first
    and peak RSS (MiB)."""

    root: int
    interval_s: float = 0.02
    first: dict[int, float] = field(default_factory=dict)
    peak: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="tree-watch", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for pid in descendants(self.root):
            rss = rss_mb(pid)
            if rss is None:
                continue
            if pid not in self.roles:
                self.roles[pid] = role(pid, self.root)
                self.first[pid] = rss
            self.peak[pid] = max(self.peak.get(pid, 0.0), rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def stop(self) -> "TreeWatch":
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        return self

    def growth(self, kind: str) -> float:
        """The largest peak - first RSS among the processes of `kind` ('api', 'engine')."""
        return max((self.peak[p] - self.first[p] for p, r in self.roles.items() if r == kind), default=0.0)

    def largest(self, kind: str) -> float:
        return max((self.peak[p] for p, r in self.roles.items() if r == kind), default=0.0)

    def summary(self) -> str:
        return ", ".join(f"{r} {p}: {self.first[p]:.0f}->{self.peak[p]:.0f} MiB" for p, r in sorted(self.roles.items()))
