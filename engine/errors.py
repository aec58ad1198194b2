"""Errors the engine raises to its callers."""


class QueueFullError(RuntimeError):
    """`add_request` found `max_queue_size` requests already waiting; nothing was queued."""
