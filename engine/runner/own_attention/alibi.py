"""ALiBi's slopes, one per attention head, as each family computes them (Bloom, MPT, Falcon's ALiBi
variant); the paged kernels add slope * (key position - query position) to each score
(engine.runner.attention's `alibi_slopes`).

The models add slope * key position instead (MPT: relative to the last key); the two differ by a constant
per query, which a softmax does not see. The slopes here are computed with the same float32 operations as
the models', so they have the same bits.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.cache
def geometric_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """Bloom's and Falcon's slopes [num_heads], float32: b^i for i = 1 .. n, with b = 2^(-8 / n) and n the
    largest power of two <= num_heads; the heads past n take every other slope of 2n heads (odd i, from
    b = 2^(-4 / n)). Cached: callers read it, never write."""
    power_of_two = 2 ** math.floor(math.log2(num_heads))

    def slopes_of(count: int, first_exponent: int, num_slopes: int, step: int) -> torch.Tensor:
        base = torch.tensor(2.0 ** (-8.0 / count), dtype=torch.float32, device=device)
        last = first_exponent + step * num_slopes
        return torch.pow(base, torch.arange(first_exponent, last, step, dtype=torch.int32, device=device))

    slopes = slopes_of(power_of_two, 1, power_of_two, 1)
    if power_of_two == num_heads:
        return slopes
    return torch.cat([slopes, slopes_of(2 * power_of_two, 1, num_heads - power_of_two, 2)])


@functools.cache
def mpt_slopes(num_heads: int, alibi_bias_max: int, device: torch.device) -> torch.Tensor:
    """MPT's slopes [num_heads], float32: 2^(-alibi_bias_max * i / n) for i = 1 .. n over the smallest power
    of two n >= num_heads; when that is more than num_heads, the odd-numbered slopes first, then the
    even-numbered, the first num_heads of them. Cached: callers read it, never write."""
    power_of_two = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, power_of_two + 1, dtype=torch.int64, device=device).float()
    slopes = 1.0 / torch.pow(2, exponents * (alibi_bias_max / power_of_two))
    if power_of_two != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes
