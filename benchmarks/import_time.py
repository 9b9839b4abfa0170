"""How long `import lmdock` adds to a bare Python start: median of N runs of each, in fresh processes.

    python benchmarks/import_time.py [N]

Prints the medians and the difference; the target (issue 15) is under 50 ms on a quiet machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def median_ms(code: str, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    median_ms("import lmdock", 1)  # warm the file cache
    bare = median_ms("pass", n)
    full = median_ms("import lmdock", n)
    print(f"bare python: {bare:.0f} ms   import lmdock: {full:.0f} ms   lmdock adds: {full - bare:.0f} ms (median of {n})")


if __name__ == "__main__":
    main()
