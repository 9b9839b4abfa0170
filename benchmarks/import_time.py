"""How long `import lmdock` adds to a bare Python start: median of N runs of each, in fresh processes.

    python benchmarks/import_time.py [N]

Prints the medians and the difference, of wall time and of CPU time (user + sys of the child, which a
busy machine disturbs less); the target (issue 15) is under 50 ms.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time


def median_ms(code: str, n: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``python -c code``."""
    wall, cpu = [], []
    for _ in range(n):
        c0 = os.times()
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        wall.append((time.perf_counter() - t0) * 1000)
        c1 = os.times()
        cpu.append((c1.children_user - c0.children_user + c1.children_system - c0.children_system) * 1000)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    median_ms("import lmdock", 1)  # warm the file cache
    bare = median_ms("pass", n)
    full = median_ms("import lmdock", n)
    for i, what in enumerate(("wall", "CPU")):
        print(f"{what}: bare python {bare[i]:.0f} ms, import lmdock {full[i]:.0f} ms, lmdock adds {full[i] - bare[i]:.0f} ms (median of {n})")


if __name__ == "__main__":
    main()
