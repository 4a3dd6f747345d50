"""Waiting on work that cannot be taken back (a worker thread, a call queued on the engine thread) from a coroutine
that may be cancelled meanwhile, once or many times: e.g. a request whose client left, then the server's shutdown."""

from __future__ import annotations

import asyncio
import functools


async def outlast(future: asyncio.Future) -> bool:
    """Wait until ``future`` is done, through any number of cancellations of the caller; True when the caller was
    cancelled meanwhile. The caller then records or undoes what ``future`` did (its lease, where its tensors are)
    and raises ``asyncio.CancelledError`` itself, so that the cancellation still ends it. ``future``'s result or
    error is left for the caller to read (``future.result()``)."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def in_thread(func, /, *args, **kwargs) -> asyncio.Future:
    """``func(*args, **kwargs)`` on the loop's default executor, as a plain future: unlike ``asyncio.to_thread``'s
    task, nothing cancels it (neither its caller's cancellation nor a shutdown's cancel-all), so what the thread does
    is always there to be read and undone."""
    return asyncio.get_running_loop().run_in_executor(None, functools.partial(func, *args, **kwargs))


async def to_thread_to_the_end(func, /, *args, **kwargs):
    """``func(*args, **kwargs)`` on a worker thread, seen to its end even when the caller is cancelled meanwhile (a
    lease released, a file removed: half done is worse than late); the cancellation then goes on, whatever the
    thread ended with."""
    future = in_thread(func, *args, **kwargs)
    if await outlast(future):
        retrieve(future)  # nobody is left to tell
        raise asyncio.CancelledError
    return future.result()


def retrieve(future: asyncio.Future) -> None:
    """Mark ``future``'s error as read, where nobody is left to be told it: asyncio would log "exception was never
    retrieved" (a done-callback, or after ``outlast``)."""
    if not future.cancelled():
        future.exception()
