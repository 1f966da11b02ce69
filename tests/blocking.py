"""``within``: a call that may block for ever (the open of a named pipe waits for a writer), run so that the test
fails in seconds instead of hanging, as the code before a fix would have made it hang."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any


def within(seconds: float, call: Callable[[], Any], fifo: str | os.PathLike | None = None) -> Any:
    """``call()``'s result, or the exception it raised; an ``AssertionError`` when it has not returned after
    ``seconds``. A reader blocked in the open of ``fifo`` is let go first (a writer opens it), so that no thread
    stays blocked after the test."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive() and fifo is not None:
        with contextlib.suppress(OSError):  # no reader waiting on it: nothing to let go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not thread.is_alive() or "error" in box, f"still reading after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]
