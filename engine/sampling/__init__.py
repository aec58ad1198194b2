"""Choosing the next token: sampling parameters and their bounds, penalties, structured output, and the
sampler that applies them to a step's logits."""
