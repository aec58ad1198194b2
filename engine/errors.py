"""Errors the engine raises to its callers."""


class QueueFullError(RuntimeError):
    """`add_request` found `max_queue_size` requests already waiting; nothing was queued."""


class DuplicateRequestError(ValueError):
    """`add_request` was given the id of a request still in flight; nothing was queued. A ValueError, as
    transformers' continuous batching raises for it."""


class EngineBusyError(RuntimeError):
    """A call that needs an idle engine found requests in flight (queued or running); nothing was done."""


class WeightTransferError(RuntimeError):
    """A weight-update group could not be joined, or a transfer over it failed (engine.weights.transfer)."""


class WeightTransferTimeout(WeightTransferError, TimeoutError):
    """The trainer, or another member of its group, did not answer within the group's timeout."""


class UnsupportedModelError(ValueError):
    """The engine cannot serve this model exactly (engine.families): refused at load, before anything is
    built."""
