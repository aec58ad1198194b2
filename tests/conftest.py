"""Fixtures shared by every test directory; the helpers the tests use live in tests/helpers.

On the CPU, Triton kernels (the kernel path) run under Triton's interpreter. It must be chosen before
triton is first imported, which torch may do, hence before anything else here.

Each run compiles into an inductor cache of its own (unless TORCHINDUCTOR_CACHE_DIR is set): two runs on
one machine writing the shared /tmp/torchinductor_<user> at once left a truncated file there ("file too
short"), and a later run that read it failed a compiled test. The folder goes when the run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile

if os.environ.get("CBSERVE_TEST_DEVICE", "cpu").startswith("cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cbserve-tests-inductor-")
    # Which run made it, so that only that run removes it (the servers it starts inherit both variables).
    os.environ["CBSERVE_TESTS_INDUCTOR_CACHE_OF"] = str(os.getpid())

import pytest
import torch

from tests.helpers.models import FULL_ATTENTION_FAMILIES, tiny_model


@pytest.fixture(params=FULL_ATTENTION_FAMILIES)
def full_attention_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param)


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("CBSERVE_TESTS_INDUCTOR_CACHE_OF") == str(os.getpid()):
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
