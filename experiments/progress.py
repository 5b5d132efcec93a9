"""Progress lines of a command's long steps that are not a Keras `fit` (which shows its own bar)."""

import contextlib
import sys
import time


@contextlib.contextmanager
def phase(tag, what, file=None):
    """Print `[tag] what ...` before a step and `[tag] what: 12.3 s` after it, flushed, to `file` (stdout)."""
    file = file or sys.stdout
    print(f"[{tag}] {what} ...", file=file, flush=True)
    start = time.perf_counter()
    yield
    print(f"[{tag}] {what}: {time.perf_counter() - start:.1f} s", file=file, flush=True)
