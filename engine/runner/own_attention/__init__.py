"""Adapters for families whose attention is computed in the model's own code, not through transformers'
attention interface (Falcon, GPT-J, CodeGen, GPT-Neo).

The engine cannot put its paged attention in place of such a model's attention function, because there
is none to replace: the attention module's `forward` projects, rotates and attends in one piece. So each
family has a module here whose `forward` stands in for that attention module's: it computes queries, keys
and values with the module's own projections and its own rotary embedding, at the positions the engine
passes (never at the token's index in the packed input), then attends through the engine's paged
attention exactly as the attention-interface path does (`engine.runner.attention.paged_attention`).

`registry` installs the adapters on a model for the engine's lifetime and refuses, at load, the
combinations an adapted family cannot run with.
"""
