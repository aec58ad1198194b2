"""The SDKs' table of request bounds (sdk/sampling_bounds.json) is the server's, and each SDK has it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.sampling import params as sampling_params
from service import validation

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdk_table_holds_the_server_s_bounds() -> None:
    table = json.loads((ROOT / "sdk" / "sampling_bounds.json").read_text())
    server = {
        "min_max_new_tokens": 1,
        "max_top_logprobs": sampling_params.MAX_TOP_LOGPROBS,
        "max_abs_presence_frequency_penalty": sampling_params.MAX_ABS_PRESENCE_FREQUENCY_PENALTY,
        "max_abs_logit_bias": sampling_params.MAX_ABS_LOGIT_BIAS,
        "max_logit_bias_entries": validation.MAX_LOGIT_BIAS_ENTRIES,
        "max_stop_strings": validation.MAX_STOP_STRINGS,
        "max_stop_string_chars": validation.MAX_STOP_STRING_CHARS,
        "max_request_id_bytes": validation.MAX_REQUEST_ID_BYTES,
        "max_stop_token_ids": sampling_params.MAX_STOP_TOKEN_IDS,
        "max_prompt_logprobs": sampling_params.MAX_TOP_LOGPROBS,
        "max_structured_output_chars": sampling_params.MAX_STRUCTURED_OUTPUT_CHARS,
        "max_min_p": 1.0,
        "min_priority": validation.MIN_PRIORITY,
        "max_priority": validation.MAX_PRIORITY,
        "max_n": sampling_params.MAX_SEQUENCES_PER_REQUEST,
    }
    assert {name: value for name, value in table.items() if not name.startswith("_")} == server


def test_every_sdk_has_the_table_as_written() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_sdk_bounds.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr
