"""How much host memory a piece of code really takes: this process's anonymous RSS, peak.

    with AnonPeak() as peak:
        model = load(...)
    print(peak.delta_bytes)      # the highest anonymous RSS seen, minus the one at the start

Anonymous memory (`RssAnon` in /proc/self/status) is what a pod's memory limit cannot
reclaim: heap and tensors. File pages that a memory-mapped safetensors file brings in are
page cache, which the kernel drops under pressure, so they are not counted. A thread
samples every `interval_s`; a peak shorter than that can be missed, so the figure is a
lower bound of the true peak by at most one sampling interval's allocations (tests load
tensors much larger than what one interval allocates). Linux only; elsewhere 0.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

STATUS = Path("/proc/self/status")


def anon_rss_bytes() -> int:
    """This process's anonymous resident memory now (0 where /proc is missing)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class AnonPeak:
    """The peak of `anon_rss_bytes` while the block runs, sampled by a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, anon_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> AnonPeak:
        self.start_bytes = self.peak_bytes = anon_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, anon_rss_bytes())
