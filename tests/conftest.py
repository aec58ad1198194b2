"""Fixtures shared by every test directory; the helpers the tests use live in tests/helpers.

On the CPU, Triton kernels (the kernel path) run under Triton's interpreter. It must be chosen before
triton is first imported, which torch may do, hence before anything else here.
"""

from __future__ import annotations

import os

if os.environ.get("CBSERVE_TEST_DEVICE", "cpu").startswith("cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.models import FULL_ATTENTION_FAMILIES, tiny_model


@pytest.fixture(params=FULL_ATTENTION_FAMILIES)
def full_attention_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param)
