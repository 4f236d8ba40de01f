"""Returning freed heap memory to the OS after one-time work (weight casts, tracing)."""
from __future__ import annotations

import ctypes
import gc


def release_freed_memory() -> None:
    """Hands heap pages that one-time work freed back to the OS (glibc only; a no-op elsewhere).

    glibc keeps freed medium-sized blocks in its heap: after a cast of SD1.5's weights to
    bf16, or a torch.jit.trace of its UNet, the process would otherwise keep 0.1-0.2 GB of
    dead memory resident for good.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
