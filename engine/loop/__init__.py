"""The generation loop: the thread that owns the engine, its inbox of commands, the lock-step loops of
tensor parallelism, and the router that hands finished tokens back to callers."""
