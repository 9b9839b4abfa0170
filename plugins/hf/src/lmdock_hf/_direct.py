"""Reading whole files with ``O_DIRECT``, several requests outstanding (no torch here).

The offload engine reads each streamed layer with this, and ``benchmarks/offload.py`` measures the
disk's bandwidth with the same code (it must not import torch), so the batch-1 bound it reports is
the bound of the reader the engine really has.  A file is split into ``threads`` aligned parts, each
read by its own thread in ``request``-byte ``preadv`` calls into the same page-aligned buffer.  On
this project's benchmark VM (virtio disk, ext4) 4 threads of 4 MiB requests read a 1 GB layout at a
median 1.12 GB/s against 1.05 GB/s for one thread reading each file in one request (8 alternating
passes, every pair in the same order); 2 or 8 threads were no better than 4 (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096
THREADS = 4
REQUEST = 4 << 20


class ShortFile(OSError):
    """The file ended before the bytes asked for."""


def _read_range(fd: int, view: memoryview, lo: int, hi: int, request: int) -> int:
    done = lo
    while done < hi:
        n = os.preadv(fd, [view[done : min(hi, done + request)]], done)
        if n <= 0:
            raise ShortFile(f"read {done} of {hi} bytes")
        done += n
    return done - lo


class DirectReader:
    """Reads a file's first ``len(view)`` bytes into ``view`` (page-aligned, e.g. an ``mmap``).

    ``O_DIRECT`` where the filesystem takes it; elsewhere normal reads, then ``POSIX_FADV_DONTNEED``
    so the page cache does not keep the file.  ``direct`` says which the last read used."""

    def __init__(self, threads: int = THREADS, request: int = REQUEST) -> None:
        self.threads = max(1, threads)
        self.request = request
        self.direct = hasattr(os, "O_DIRECT")
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="lmdock-hf-read") if self.threads > 1 else None

    def read(self, path: str, view: memoryview) -> int:
        size = len(view)
        if self.direct:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct = False
            else:
                try:
                    return self._parallel(fd, view, size)
                except ShortFile:
                    raise
                except OSError:
                    self.direct = False  # the filesystem took the open but not the read
                finally:
                    os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            done = _read_range(fd, view, 0, size, max(size, 1))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return done
        finally:
            os.close(fd)

    def _parallel(self, fd: int, view: memoryview, size: int) -> int:
        part = -(-size // self.threads // ALIGN) * ALIGN
        ranges = [(lo, min(size, lo + part)) for lo in range(0, size, max(part, ALIGN))]
        if self._pool is None or len(ranges) == 1:
            return _read_range(fd, view, 0, size, self.request)
        futures = [self._pool.submit(_read_range, fd, view, lo, hi, self.request) for lo, hi in ranges[1:]]
        done, error = 0, None
        try:
            done += _read_range(fd, view, *ranges[0], self.request)
        except OSError as exc:
            error = exc
        for f in futures:  # every part finishes before the caller may close fd or reuse the buffer
            try:
                done += f.result()
            except OSError as exc:
                error = error or exc
        if error is not None:
            raise error
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
