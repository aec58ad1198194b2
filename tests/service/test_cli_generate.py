"""How long `cbserve generate`'s answer runs, and what it says when the length limit cut it: a chat answer's
length by default (not transformers' 20 tokens), and a notice on stderr naming --max-new-tokens when the
answer stopped there (the output is what was asked for, so the exit status stays 0)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.default_model import CHAT_MAX_NEW_TOKENS
from tests.helpers.cli import run_cli
from tests.helpers.models import fresh_tiny_model
from tests.helpers.servers import ByteTokenizer, RunningServer, loaded_server


@pytest.fixture(scope="module")
def endless_server() -> Iterator[RunningServer]:
    """The tiny llama without an EOS id, whose generation config sets no length: an answer runs to the
    request's max_new_tokens, else to transformers' default of 20."""
    model = fresh_tiny_model("llama")
    model.generation_config.eos_token_id = None
    running = loaded_server(model, tokenizer=ByteTokenizer())
    try:
        yield running
    finally:
        running.close()


def test_an_answer_runs_to_a_chat_answers_length_by_default_and_says_it_stopped_there(
    endless_server: RunningServer,
) -> None:
    result = run_cli("generate", "Hello", "--raw", "--target", endless_server.target)
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        f"cbserve: the answer stopped at --max-new-tokens {CHAT_MAX_NEW_TOKENS}; pass a larger "
        "--max-new-tokens for a longer answer\n"
    ), result.stderr
    # UTF-8 takes at most 4 of the byte tokenizer's tokens per character.
    assert len(result.stdout) >= CHAT_MAX_NEW_TOKENS // 4, f"the answer is too short: {result.stdout!r}"


def test_an_answer_cut_at_the_given_max_new_tokens_names_the_flag_and_its_value(
    endless_server: RunningServer,
) -> None:
    result = run_cli("generate", "Hello", "--raw", "--max-new-tokens", "5", "--target", endless_server.target)
    assert result.returncode == 0, result.stderr
    assert "stopped at --max-new-tokens 5;" in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_the_help_states_the_default_length() -> None:
    result = run_cli("generate", "--help")
    assert f"default {CHAT_MAX_NEW_TOKENS}" in " ".join(result.stdout.split()), result.stdout
