"""Where `cbserve serve` puts the model and in what precision (--device, --dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.engine_host import load_pretrained, resolve_placement
from tests.conftest import tiny_model


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_a_gpu() -> None:
    assert resolve_placement("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert resolve_placement("cuda:1", "auto") == (torch.device("cuda", 1), torch.bfloat16)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_placement("auto", "auto")[0].type == expected_device


def test_an_explicit_dtype_is_loaded_as_asked(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path / "model")
    model, tokenizer = load_pretrained(str(tmp_path / "model"), device="cpu", dtype="bfloat16")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert tokenizer is None  # the folder has no tokenizer: token-id prompts only


def test_an_unknown_dtype_names_the_choices() -> None:
    choices = r"\['auto', 'float32', 'bfloat16', 'float16'\]"
    with pytest.raises(ValueError, match=rf"dtype must be one of {choices}, got 'int4'"):
        resolve_placement("cpu", "int4")
