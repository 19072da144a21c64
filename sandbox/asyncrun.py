"""Supervised runs awaited from asyncio: a thread of their own, killed when the task is cancelled."""

from __future__ import annotations

import _thread
import asyncio
from collections.abc import Callable
from typing import TypeVar

from .supervisor import Cancel, unthreaded

T = TypeVar("T")


async def in_thread(work: Callable[[Cancel], T]) -> T:
    """work(cancel) in a thread of its own; the loop never blocks. Cancelling the awaiting task
    cancels `cancel` (each run given it is killed, its whole tree) and waits for that before
    the CancelledError goes on (a second cancel too). A thread per call, not an executor's: its few workers would
    cap how many runs go at once (and an SDK reading its input through the same pool would
    stall behind them), and asyncio.run() would wait for them on the way out."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    cancel = Cancel()

    def settle(result: T | None, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        result, error = None, None
        unthreaded.daemon = True  # (not joined at exit: the supervisor's exit hook ends its run)
        try:
            result = work(cancel)
        except BaseException as e:  # noqa: BLE001 - raised in the task
            error = e
        finally:
            cancel.close()
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for it
            pass

    try:
        # Not threading.Thread().start(): it waits for the new thread to take the GIL, up to a
        # switch interval (5 ms) while other runs' threads are busy, and it waits on the loop.
        _thread.start_new_thread(target, ())
    except BaseException:
        cancel.close()
        raise
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        cancel.cancel()
        while not done.done():  # the sandbox is gone before the cancellation goes on
            try:
                await asyncio.shield(done)  # (shielded: a second cancel must not end the wait)
            except BaseException:  # noqa: BLE001 - a further cancel, or the run's outcome: not wanted now
                pass
        raise
