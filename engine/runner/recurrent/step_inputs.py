"""What a step's recurrent layers read besides the packed tokens: each request's state slot, whether its
state carries on from an earlier step, and the gather indices of a short convolution over the step.

A step packs every request's new tokens into one sequence, and a request's prompt may arrive over several
steps (chunked prefill). A short convolution of kernel K at row t reads the K - 1 inputs before it *in its
own request*: rows of the same request in this step, and before the request's first row here, the state
its slot holds (the last K - 1 inputs of its earlier steps; zeros for a request starting at position 0).
So every layer gathers from one source, the slots' states then the step's rows::

    source:  | state of request 0 (K-1 rows) | state of request 1 | ... | packed row 0 | row 1 | ... |

`tap_index[t, j]` is the source row of row t's j-th tap (oldest first), `new_state_index[r, i]` the
source row of request r's i-th state input after the step. Both are built once per step for every layer,
and no layer loops over requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from engine.runner.attention import PagedAttentionMetadata
from engine.system.device_copies import to_device


@dataclass(frozen=True)
class StateSegment:
    """One request's rows in a step: packed rows `row .. row + num_tokens - 1`, its state `slot`, and
    whether the state carries on from earlier steps (False at position 0: it starts from zeros)."""

    row: int
    num_tokens: int
    slot: int
    continues: bool


@dataclass(frozen=True)
class StateStepInputs:
    """A step's state slots and convolution indices (see the module docstring); R requests, T rows."""

    slots: torch.Tensor  # [R] the state slot of each request
    continues: torch.Tensor  # [R, 1, 1] True where the request's state carries on, False where it starts
    tap_index: torch.Tensor  # [T, K] rows of the source each packed row's taps read
    new_state_index: torch.Tensor  # [R, K - 1] rows of the source that are each request's new state


@dataclass(kw_only=True)
class StatefulStepMetadata(PagedAttentionMetadata):
    """The step's metadata for a model with recurrent layers: its attention's, and its states'. It reaches
    the engine's recurrent forwards (engine.runner.recurrent) as `paged_metadata`, as attention's does."""

    state_inputs: StateStepInputs


def with_state_inputs(
    metadata: PagedAttentionMetadata, state_inputs: StateStepInputs
) -> StatefulStepMetadata:
    """`metadata` with the step's state inputs beside it."""
    attention = {field.name: getattr(metadata, field.name) for field in fields(metadata)}
    return StatefulStepMetadata(**attention, state_inputs=state_inputs)


def build_state_inputs(
    segments: Sequence[StateSegment],
    num_rows: int,
    kernel_size: int,
    device: torch.device,
) -> StateStepInputs:
    """The indices of a step whose `segments` (in packed-row order) own all its `num_rows` rows."""
    num_requests = len(segments)
    state_len = kernel_size - 1
    if sum(segment.num_tokens for segment in segments) != num_rows:
        raise RuntimeError(
            f"a step of {num_rows} rows whose requests own "
            f"{sum(segment.num_tokens for segment in segments)}: recurrent layers need every row owned "
            "(no padding tokens)"
        )
    first_rows = to_device([segment.row for segment in segments], torch.long, device)
    lengths = to_device([segment.num_tokens for segment in segments], torch.long, device)
    request_of_row = torch.repeat_interleave(
        torch.arange(num_requests, device=device), lengths, output_size=num_rows
    )
    rows = torch.arange(num_rows, device=device)
    taps = torch.arange(kernel_size, device=device)
    # Row t's tap j reads the input `state_len - j` rows before t, in its request: a row of this step when
    # that falls at or after the request's first row, else its state's row `state_len + offset`.
    offset = (rows - first_rows[request_of_row]).unsqueeze(1) - state_len + taps  # [T, K]
    states_end = num_requests * state_len
    tap_index = torch.where(
        offset >= 0,
        states_end + rows.unsqueeze(1) - state_len + taps,
        request_of_row.unsqueeze(1) * state_len + state_len + offset,
    )
    # The request's new state is the last `state_len` inputs of its state followed by its rows.
    position = lengths.unsqueeze(1) + torch.arange(state_len, device=device)  # [R, K - 1] in that sequence
    requests = torch.arange(num_requests, device=device).unsqueeze(1)
    new_state_index = torch.where(
        position < state_len,
        requests * state_len + position,
        states_end + first_rows.unsqueeze(1) + position - state_len,
    )
    return StateStepInputs(
        slots=to_device([segment.slot for segment in segments], torch.long, device),
        continues=to_device([segment.continues for segment in segments], torch.bool, device).view(-1, 1, 1),
        tap_index=tap_index,
        new_state_index=new_state_index,
    )
