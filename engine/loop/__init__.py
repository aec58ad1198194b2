"""The generation loop: the thread that owns the engine, its inbox of commands and each iteration's
decision; what the commands change, composed into it (the admission ledger, the served weights and sleep,
the listeners); the lock-step loops of tensor parallelism and the agreement between their ranks; and the
router that hands finished tokens back to callers."""
