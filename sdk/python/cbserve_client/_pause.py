"""A hold on the engine's pause, as an object: :class:`PauseLease`, from :meth:`AdminClient.pause`."""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

import grpc

from cbserve_client._channel import Closeable
from cbserve_client._types import PauseInfo

__all__ = ["PauseLease"]


class PauseLease(Closeable):
    """One hold on the engine's pause: the engine stays paused while the lease is held.

    The hold ends when :meth:`release` is called (or a ``with`` block around the lease exits, or the
    lease is dropped, or its client closed), when the server's lease expires, or when the connection
    breaks, so a crashed client cannot freeze the server; :attr:`held` and :meth:`wait` tell when.
    Pauses nest: the engine resumes when its last holder lets go. The attributes describe the hold as
    the engine paused::

        lease = admin.pause(lease_s=60)
        try:
            print(lease.lease_expires_at)
            admin.update_weights(state_dict)
        finally:
            lease.release()

    Attributes:
        info: the server's first message, the engine paused (:class:`PauseInfo`).
        holders: the holds on the pause when the engine paused, this one included.
        lease_expires_at: when the server drops this hold unless it is released first (UTC; None if
            the server sent none).
        weight_version: the version of the weights served when the engine paused.
        cancelled_requests: with mode "abort", the requests the pause cancelled.
    """

    def __init__(self, call: Any, info: PauseInfo) -> None:
        self.info = info
        self.holders: int = info.holders
        self.lease_expires_at: datetime.datetime | None = info.lease_expires_at
        self.weight_version: int = info.weight_version
        self.cancelled_requests: int = info.cancelled_requests
        self._call = call
        self._ended = threading.Event()
        # The watcher holds the call and the event, not the lease, so that a dropped lease is collected
        # (and releases its hold in __del__) while the watcher still waits on the stream.
        self._watcher = threading.Thread(
            target=_watch, args=(call, self._ended), name="cbserve-pause-lease", daemon=True
        )
        self._watcher.start()

    @property
    def held(self) -> bool:
        """True while this lease holds the engine paused: False once released, or once the server
        ended the hold (the lease expired, the connection broke)."""
        return not self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the hold ends, however it ends, or ``timeout`` seconds pass; returns
        whether it ended."""
        return self._ended.wait(timeout)

    def release(self) -> None:
        """Ends the hold: cancels the Pause call, and the server resumes the engine (if this was its
        last holder) as soon as it sees the call end. Returns once the call has ended on this side;
        idempotent."""
        self._call.cancel()
        self._watcher.join()

    def close(self) -> None:
        """The same as :meth:`release` (``with`` support)."""
        self.release()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()

    def __repr__(self) -> str:
        return (
            f"PauseLease(holders={self.holders}, lease_expires_at={self.lease_expires_at}, "
            f"weight_version={self.weight_version}, held={self.held})"
        )


def _watch(call: Any, ended: threading.Event) -> None:
    """Reads the Pause stream until the hold ends: the server's last message (paused = False: the
    lease expired), the call's end, a cancel or a broken connection."""
    try:
        for message in call:
            if not message.paused:
                break
    except grpc.RpcError:
        pass
    finally:
        ended.set()
