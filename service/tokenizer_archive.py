"""The served model's tokenizer as one zip archive, so a gateway tokenizes without a copy of the model.

A gateway (SMG) asks `GetTokenizer` for the files transformers' `save_pretrained` writes (tokenizer.json,
tokenizer_config.json with the chat template, special tokens) plus the model's config.json and
generation_config.json, whose EOS ids it stops on. The archive is built once, from the tokenizer object
the server loaded (so it is the one the server itself uses), and kept.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import zipfile
from pathlib import Path
from typing import Any

# What a gRPC message of the archive carries at most.
CHUNK_BYTES = 64 * 1024


def build_tokenizer_archive(tokenizer: Any, model_config: Any, generation_config: Any) -> tuple[bytes, str]:
    """The archive's bytes and their SHA-256 hex digest."""
    with tempfile.TemporaryDirectory(prefix="cbserve-tokenizer-") as folder:
        directory = Path(folder)
        tokenizer.save_pretrained(directory)
        if model_config is not None:
            model_config.to_json_file(directory / "config.json")
        if generation_config is not None:
            generation_config.to_json_file(directory / "generation_config.json")
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(directory.iterdir()):
                if path.is_file():
                    archive.write(path, path.name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def archive_chunks(data: bytes) -> list[bytes]:
    return [data[start : start + CHUNK_BYTES] for start in range(0, len(data), CHUNK_BYTES)] or [b""]
