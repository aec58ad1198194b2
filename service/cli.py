"""`cbserve serve` (run the server) and `cbserve generate` (stream a completion through the SDK).

A mistake the user can fix (a missing model folder, a port in use, no server at --target, an answer cut off)
ends in one `cbserve: error:` line saying what to do in terms of the CLI's flags, with exit status 1 (2 for
a bad flag); a traceback, and gRPC's own log lines, come only with `--debug` (a traceback also from a bug).
`serve` checks what it can before it opens its ports (flags, the model folder, the embedded model's package,
the ports); the model then loads with the ports open and health NOT_SERVING, and a load that fails shuts
the servers down before the error is reported.

Only the standard library loads at import, so `--help` and `generate` start at once: the server's stack
(torch, transformers, the engine) is imported inside the serve path, the SDK inside `generate`.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib.metadata
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from service.default_model import CHAT_MAX_NEW_TOKENS, DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from cbserve_client import CbserveError

    from engine import ContinuousBatchingConfig
    from service.tls import ServerTls

# The engine's defaults that --help names (tests/service/test_cli_errors.py checks them against the engine's
# ContinuousBatchingConfig, which this module does not import: it would import torch).
ENGINE_DEFAULTS: dict[str, Any] = {
    "page_size": 256,
    "max_queue_size": 0,
    "scheduler_type": "fifo",
    "default_compile_level": 0,
    "logprobs_mode": "raw_logprobs",
}
# The precisions of --dtype (service.model_loading.DTYPES, checked by the same test).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# The engine fields set by a flag of the same name (--page-size sets page_size).
ENGINE_KNOBS = (
    "page_size",
    "num_blocks",
    "kv_cache_memory",
    "max_batch_tokens",
    "max_requests_per_batch",
    "max_queue_size",
    "max_blocks_per_request",
)
# How `cbserve serve`'s stop line names the signal that stopped it.
STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT (Ctrl-C)"}
# The request fields that `generate` sets, as the server's refusals name them (service.validation): at the
# start of a refusal, the prompt as text or as a chat message; anywhere, --max-new-tokens and each --stop.
REFUSED_FIELD = re.compile(r"^(?:text|messages)\b|sampling\.max_new_tokens|sampling\.stop(?:\[(\d+)\]|\b)")
# How gRPC's load balancing fails a call it had no connection for; then "; last error: " and why.
NO_CONNECTION = ("failed to connect to all addresses", "connections to all backends failing")

logger = logging.getLogger(__name__)


class CommandError(Exception):
    """A failure the user can fix: `main` prints the message as one line and exits with status 1."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, with a flag error told in one line (the error, then where the help is) instead of the
    whole usage, which for `serve` runs to a dozen lines."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _VersionAction(argparse.Action):
    """`--version`: the version pip installed, from the package's metadata, looked up only when asked (it
    reads the installed distributions, which every other command would pay for)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        try:
            version = importlib.metadata.version("cbserve")
        except importlib.metadata.PackageNotFoundError:
            parser.error("--version: cbserve is not installed as a package (`pip install -e .`)")
        print(f"cbserve {version}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="cbserve", description="Continuous-batching LLM inference over gRPC")
    parser.add_argument("--version", action=_VersionAction, help="print cbserve's version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    common = _ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        help="on an error, show the Python traceback too, not only the one-line message; and let gRPC log as "
        "$GRPC_VERBOSITY says (without it, `generate` silences gRPC's own log lines)",
    )

    serve = commands.add_parser(
        "serve",
        parents=[common],
        help="serve a model",
        description="Serve a model: generation, health and reflection on --port, the admin API on "
        "--admin-port. Runs until SIGTERM or SIGINT, then drains.",
    )
    serve.set_defaults(command_parser=serve)  # run_serve reports flag errors through it
    serve.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="folder of a transformers causal LM and its tokenizer, as save_pretrained writes it, or a "
        "GGUF file (served from its own quantized blocks unless --quantization none) "
        f"(default: the embedded {DEFAULT_MODEL_NAME})",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address both ports listen on (default 127.0.0.1: this machine only; 0.0.0.0: all interfaces)",
    )
    serve.add_argument(
        "--port",
        type=int,
        default=50051,
        help="port of generation, health and reflection (default 50051; 0 picks a free port)",
    )
    serve.add_argument(
        "--admin-port",
        type=int,
        default=50052,
        help="port of the admin API: pause, stop, start, status, weight updates (default 50052)",
    )
    serve.add_argument(
        "--reuse-port",
        action="store_true",
        help="share --port and --admin-port with other servers started with this flag (SO_REUSEPORT: the "
        "kernel splits the connections among them); default: refuse a port already in use",
    )
    serve.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="time in-flight requests get to finish on SIGTERM or SIGINT before they fail (default 30)",
    )
    serve.add_argument(
        "--max-pause-lease",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="longest hold of one admin Pause call (default 300)",
    )
    serve.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="file whose first line is the admin bearer token (default: $CBSERVE_ADMIN_TOKEN; with neither, "
        "every admin call is refused)",
    )
    tls = serve.add_argument_group("TLS (both ports; default: plaintext)")
    tls.add_argument("--tls-cert", metavar="PEM", help="certificate chain of the server (needs --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    tls.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="CA bundle: clients must present a certificate it signed (mutual TLS; default: no client "
        "certificate asked)",
    )
    serve.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="OTLP/gRPC collector for request traces (default $OTEL_EXPORTER_OTLP_ENDPOINT; none: no export)",
    )
    serve.add_argument(
        "--device", default="auto", help="cpu, cuda or cuda:N (default auto: the GPU when there is one)"
    )
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPE_NAMES),
        help="weights and KV cache precision (default auto: bfloat16 on a GPU or an AMX CPU, else float32)",
    )
    serve.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel size: run N ranks, each holding 1/N of every layer (N must divide the "
        "model's KV heads); rank 0 serves, the others follow it (default 1)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default 0: off)",
    )
    serve.add_argument(
        "--control-port",
        type=int,
        metavar="PORT",
        help="serve the admin operations as vLLM's HTTP routes (/pause, /update_weights, ...; the admin "
        "token required, plaintext: not with --tls-cert) at http://HOST:PORT (default: off; "
        "docs/control-http.md)",
    )
    engine = serve.add_argument_group(
        "engine", "Defaults are the engine's (engine.ContinuousBatchingConfig), sized for the device."
    )
    engine.add_argument(
        "--page-size",
        type=int,
        metavar="TOKENS",
        help=f"tokens per KV-cache page, at least 4 (default {ENGINE_DEFAULTS['page_size']})",
    )
    engine.add_argument(
        "--num-blocks",
        type=int,
        metavar="N",
        help="KV-cache blocks (default: sized from free memory: device memory on a GPU; RAM on the CPU, "
        "at most 4 GiB)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=float,
        metavar="GIB",
        help="most GiB the KV cache may take when sized from free memory (default: no cap on a GPU, 4 GiB "
        "on the CPU; not with --num-blocks)",
    )
    engine.add_argument(
        "--max-batch-tokens",
        type=int,
        metavar="N",
        help="most tokens, prefill and decode together, in one forward pass (default: sized from free "
        "memory)",
    )
    engine.add_argument(
        "--max-requests-per-batch",
        type=int,
        metavar="N",
        help="most requests in one batch (default: inferred, at most 1024)",
    )
    engine.add_argument(
        "--max-queue-size",
        type=int,
        metavar="N",
        help="most requests waiting to be scheduled; more are refused with RESOURCE_EXHAUSTED "
        f"(default {ENGINE_DEFAULTS['max_queue_size']}: no bound)",
    )
    engine.add_argument(
        "--scheduler-type",
        choices=("fifo", "prefill_first", "priority"),
        help="fifo: arrival order, decode steps first; prefill_first: waiting prefills first, for a lower "
        "time to first token; priority: fifo by each request's priority (smaller first), the lowest "
        f"preempted first (default {ENGINE_DEFAULTS['scheduler_type']})",
    )
    engine.add_argument(
        "--logprobs-mode",
        choices=("raw_logprobs", "processed_logprobs"),
        help="what a request's logprobs are of when it does not say (vLLM's --logprobs-mode): "
        "raw_logprobs, log_softmax of the model's logits; processed_logprobs, of the distribution each "
        "token was drawn from, after logit bias, penalties, temperature, top-k, top-p and min-p "
        f"(default {ENGINE_DEFAULTS['logprobs_mode']})",
    )
    engine.add_argument(
        "--compile-level",
        type=int,
        choices=range(4),
        help="torch.compile preset of the forward, 0 (off) to 3 (see default_compile_level; "
        f"default {ENGINE_DEFAULTS['default_compile_level']})",
    )
    engine.add_argument(
        "--max-blocks-per-request",
        type=int,
        metavar="N",
        help="attention kernel for steps whose requests hold up to N KV blocks; 0 gathers keys instead "
        "(default: on the CPU, cbserve's C kernel for every step; on CUDA, off)",
    )
    engine.add_argument(
        "--cuda-graphs",
        action="store_true",
        help=(
            "replay CUDA graphs (CUDA only, one model rank): of decode steps, captured before serving, and "
            "of steps with prefill chunks when --max-blocks-per-request is set, captured on first use "
            "(default: off)"
        ),
    )
    engine.add_argument(
        "--async-batching",
        action="store_true",
        help="prepare each step while the previous one runs on the GPU (use_async_batching; default: off)",
    )
    engine.add_argument(
        "--no-pack-cpu-weights",
        action="store_true",
        help="on the CPU, run linear layers on the model's own weights instead of copies packed once "
        "(float32 for the engine's kernel, bf16 for oneDNN): slower steps, but the weight memory is not "
        "held twice (pack_cpu_weights; default: packed)",
    )
    engine.add_argument(
        "--lazy-kv-cache",
        action="store_true",
        help="on the CPU, back the KV cache's pages at their first write instead of at start and wake-up: "
        "memory grows with use, and new requests pay a page fault per 4 KiB they write "
        "(populate_kv_cache; default: backed at start)",
    )
    engine.add_argument(
        "--quantization",
        choices=("none", "int8", "int4", "fp8", "fp8_tensor"),
        help="on the CPU, serve the linear layers from 8-bit or 4-bit weights (a scale per 32; int4 also a "
        "min), quantized at load; with int4 the embedded model serves its GGUF file's own blocks (Q4_1, "
        "and Q8_0 for its output layer); on an H100/H200-class GPU, fp8 weights with a scale per channel "
        "and fp8 inputs (fp8_tensor: one scale each, for compute capability 8.9), or int4 through tinygemm "
        "(quantization; default: none, the model's own weights)",
    )
    engine.add_argument(
        "--no-quantize-activations",
        action="store_true",
        help="with --quantization, multiply a few rows' float32 inputs by the dequantized weights instead of "
        "quantizing them to int8 (exact up to summation order, slower to decode; quantize_activations; "
        "default: int8 inputs at up to 4 rows)",
    )
    engine.add_argument(
        "--batch-invariant",
        action="store_true",
        help="give each request the same tokens and logprobs, bit for bit, whatever else is batched with it, "
        "and the bits a trainer computes under engine.trainer_exact; slower (batch_invariant; default: off)",
    )

    generate = commands.add_parser(
        "generate",
        parents=[common],
        help="stream a completion from a running server",
        description="Stream a completion from a running `cbserve serve` to stdout. Exits 1, saying why on "
        "stderr, when the answer did not come whole.",
    )
    generate.add_argument("prompt", help="the question (sent as a chat message), or the text to continue")
    generate.add_argument(
        "--target",
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="the server's generation port, its --port (default 127.0.0.1:50051)",
    )
    generate.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        default=CHAT_MAX_NEW_TOKENS,
        help=f"most tokens to generate; an answer cut at N is followed by a notice on stderr (default "
        f"{CHAT_MAX_NEW_TOKENS}: a few paragraphs; the prompt and N together must fit the model's context)",
    )
    generate.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the output before TEXT (repeat for several; default: none)",
    )
    generate.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text to continue, not as a chat message (default: a chat message "
        "when the model has a chat template)",
    )
    generate.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA that signed the server's certificate (turns TLS on; default: plaintext)",
    )
    generate.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a mutual-TLS server")
    generate.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    return parser


def engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine config from the flags given; the others keep the engine's defaults."""
    from engine import ContinuousBatchingConfig

    values = {
        name: getattr(args, name)
        for name in (*ENGINE_KNOBS, "scheduler_type", "logprobs_mode", "quantization")
        if getattr(args, name) is not None
    }
    if args.compile_level is not None:
        values["default_compile_level"] = args.compile_level
    if args.cuda_graphs:
        values["use_cuda_graph"] = True
    if args.async_batching:
        values["use_async_batching"] = True
    if args.no_pack_cpu_weights:
        values["pack_cpu_weights"] = False
    # The server backs its cache at start, as vLLM does: its first requests then write no fresh page.
    values["populate_kv_cache"] = not args.lazy_kv_cache
    if args.no_quantize_activations:
        values["quantize_activations"] = False
    if args.batch_invariant:
        values["batch_invariant"] = True
    return ContinuousBatchingConfig(**values)


def check_model_folder(path: str) -> None:
    """Raises CommandError unless `path` is a folder with a transformers config or a GGUF file (nothing is
    loaded)."""
    folder = Path(path)
    if not folder.exists():
        raise CommandError(f"--model {path}: no such {'file' if folder.suffix == '.gguf' else 'folder'}")
    if folder.is_file() and folder.suffix == ".gguf":
        return
    if not folder.is_dir():
        raise CommandError(
            f"--model {path}: not a folder; pass the folder that holds the model's config.json, or a "
            ".gguf file"
        )
    if not (folder / "config.json").is_file():
        raise CommandError(
            f"--model {path}: the folder holds no transformers model config (config.json); pass a folder "
            "written by save_pretrained"
        )


def _one_line(error: BaseException, limit: int = 300) -> str:
    """The first line of `error`'s message, at most `limit` characters (some of transformers' messages
    list every model type it knows)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_serve(args: argparse.Namespace, argv: list[str]) -> int:
    """`cbserve serve`: the checks that need no model, then the N ranks of `--tp N`, a follower rank under
    torchrun, or the server (`serve`)."""
    from service.default_model import DefaultModelUnavailable, check_default_model_available
    from service.tls import TlsConfigError, load_server_tls

    parser: argparse.ArgumentParser = args.command_parser
    try:
        # Read before anything starts, so a bad TLS flag fails at once, naming the flag.
        tls = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    except TlsConfigError as exc:
        parser.error(str(exc))
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.control_port is not None and args.tls_cert:
        parser.error("--control-port serves plaintext HTTP: it cannot be combined with --tls-cert")
    ports = {"--port": args.port, "--admin-port": args.admin_port, "--metrics-port": args.metrics_port}
    ports["--control-port"] = args.control_port
    taken = [flag for flag, port in ports.items() if port and list(ports.values()).count(port) > 1]
    if taken:
        parser.error(f"{' and '.join(taken)} name the same port; give each its own")
    if args.model is not None:
        check_model_folder(args.model)
    else:
        try:
            check_default_model_available()
        except DefaultModelUnavailable as exc:
            raise CommandError(str(exc)) from exc
    admin_token = _admin_token(args.admin_token_file)

    from engine import torchrun_rank, torchrun_world_size
    from service.default_model import ensure_default_model
    from service.tensor_parallel import follow

    try:
        config = engine_config(args)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        parser.error(f"--{field.replace('_', '-')}: {exc}" if field in ENGINE_KNOBS else str(exc))
    if args.tp > 1 and torchrun_world_size() == 1:
        return launch_tensor_parallel(parser, args, argv)
    if torchrun_rank() > 0:
        return follow(args.model or ensure_default_model(), config, args.dtype)
    asyncio.run(serve(args, config, admin_token, tls))
    return 0


def _admin_token(token_file: str | None) -> str | None:
    from service.auth import load_admin_token

    try:
        return load_admin_token(token_file)
    except OSError as exc:
        raise CommandError(f"--admin-token-file {token_file}: {exc.strerror or exc}") from exc


async def serve(
    args: argparse.Namespace, config: ContinuousBatchingConfig, admin_token: str | None, tls: ServerTls | None
) -> None:
    """Opens the ports at once (health NOT_SERVING while the model loads), serves until SIGTERM or SIGINT,
    then drains and logs a line saying which signal stopped it and how long it served. Whatever fails once
    the servers exist, they are shut down before the error goes up, so the process ends without asyncio's
    complaints about servers never stopped."""
    from service.default_model import ensure_default_model
    from service.model_loading import load_host
    from service.ports import PortError
    from service.server import CbserveServer, ServerOptions

    options = ServerOptions(
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        grace_period_s=args.grace_period,
        max_pause_lease_s=args.max_pause_lease,
        admin_token=admin_token,
        tls=tls,
        otlp_endpoint=args.otlp_endpoint,
        metrics_port=args.metrics_port,
        reuse_port=args.reuse_port,
        control_port=args.control_port,
    )
    try:
        server = CbserveServer(options)
    except PortError as exc:
        raise CommandError(str(exc)) from exc
    loop = asyncio.get_running_loop()
    stop_signal: asyncio.Future[signal.Signals] = loop.create_future()

    def stop_on(signum: signal.Signals) -> None:
        if not stop_signal.done():  # a second signal during the drain changes nothing
            stop_signal.set_result(signum)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop_on, signum)
    # `kill -USR1 <pid>` writes every thread's Python stack to the log, for a server that seems stuck; it
    # interrupts nothing (written from the C signal handler, not on the event loop).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    model = args.model or DEFAULT_MODEL_NAME
    serving_since: float | None = None
    try:
        try:
            await server.start()
        except PortError as exc:
            raise CommandError(str(exc)) from exc
        # The first start on the embedded model converts it once (~80 s), in load's worker thread, while
        # health reports NOT_SERVING.
        loading = asyncio.ensure_future(
            server.load(
                lambda: load_host(
                    args.model or ensure_default_model(), config, device=args.device, dtype=args.dtype
                )
            )
        )
        either: list[asyncio.Future[Any]] = [loading, stop_signal]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            failure = loading.exception()
            if failure is not None:
                raise CommandError(
                    f"could not load the model {model}: {_one_line(failure)} (--debug shows the traceback)"
                ) from failure
            serving_since = time.monotonic()
            logger.info("serving %s", model)
            await stop_signal
        else:
            loading.cancel()
    finally:
        await server.shutdown()
    why = STOP_SIGNALS[stop_signal.result()]
    if serving_since is None:
        logger.info("stopped on %s while loading %s", why, model)
    else:
        served = _duration(time.monotonic() - serving_since)
        logger.info("stopped on %s after serving %s for %s", why, model, served)


def _duration(seconds: float) -> str:
    """`seconds` as a person reads it: 42 s, 7 min 05 s, 3 h 12 min."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, seconds_left = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds_left:02d} s"
    hours, minutes_left = divmod(minutes, 60)
    return f"{hours} h {minutes_left:02d} min"


def generate(args: argparse.Namespace) -> int:
    """`cbserve generate`: streams the answer to stdout. An answer that did not come whole (the request
    failed or was cancelled, or the connection broke) is followed by a CommandError saying so; one cut at
    --max-new-tokens, by a notice on stderr naming the flag."""
    if not args.debug:
        # The C core reads this once, when grpc is imported. It logs what the CLI's own message says better
        # (a lost connection, the admin port's missing health service) in lines of its own before it.
        os.environ["GRPC_VERBOSITY"] = "NONE"
    from cbserve_client import CbserveError, Chunk, Client

    from service.tls import TlsConfigError, client_credentials

    sampling: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.stop:
        sampling["stop"] = args.stop
    use_tls = args.tls_ca is not None or args.tls_cert is not None
    try:
        credentials = client_credentials(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    except TlsConfigError as exc:
        raise CommandError(str(exc)) from exc
    last: Chunk | None = None
    printed = False
    try:
        with Client(args.target, credentials=credentials) as client:
            # An instruction-tuned model answers a question only through its chat template.
            chat = not args.raw and client.model_info().has_chat_template
            prompt: str | list[dict[str, str]] = (
                [{"role": "user", "content": args.prompt}] if chat else args.prompt
            )
            for chunk in client.stream(prompt, **sampling):
                last = chunk
                if chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    printed = True
    except CbserveError as exc:
        if printed:
            sys.stdout.write("\n")
        raise CommandError(_call_failure(exc, args, started=last is not None)) from exc
    sys.stdout.write("\n")
    if last is None or last.finish_reason is None:
        raise CommandError("the output was cut off: the stream ended before the request finished")
    if last.finish_reason == "error":
        raise CommandError(
            f"the output was cut off: the server failed the request: {last.error or 'no reason given'}"
        )
    if last.finish_reason == "cancelled":
        why = last.error or "by an admin Pause in ABORT mode, or a Cancel from another client"
        raise CommandError(f"the output was cut off: the request was cancelled on the server ({why})")
    if last.finish_reason == "length":
        # The server refuses a --max-new-tokens past the model's context, so "length" is always this limit.
        print(
            f"cbserve: the answer stopped at --max-new-tokens {args.max_new_tokens}; pass a larger "
            "--max-new-tokens for a longer answer",
            file=sys.stderr,
        )
    return 0


def _call_failure(error: CbserveError, args: argparse.Namespace, started: bool) -> str:
    """What went wrong with the call to --target, and what to try, in the CLI's terms."""
    import grpc

    target = args.target
    if started:
        return f"the output was cut off: the call to {target} broke: {error}"
    if error.code == grpc.StatusCode.UNAVAILABLE:
        unreached = _unreached(error, target, tls=args.tls_ca is not None or args.tls_cert is not None)
        if unreached is not None:
            return unreached
    if error.code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{target} does not serve cbserve's GenerationService: is it the admin port? --target takes the "
            "server's --port (50051 by default)"
        )
    return f"the request to {target} was refused: {_in_flag_terms(error.details, args.stop or [])}"


def _unreached(error: CbserveError, target: str, tls: bool) -> str | None:
    """The message for a call that reached no server, from gRPC's own error (which the SDK keeps as the
    cause of the one it reworded for its callers); None when a server answered (loading or draining)."""
    details = getattr(error.__cause__, "details", None)
    grpc_text = details() if callable(details) else error.details
    if grpc_text.startswith("errors resolving"):
        return f"--target {target}: no such host ({grpc_text.rsplit(': ', 1)[-1].strip(' []')})"
    if not grpc_text.startswith(NO_CONNECTION):
        return None
    last = grpc_text.partition("last error: ")[2]
    # "UNKNOWN: ipv4:127.0.0.1:50099: Failed to connect to remote host: Connection refused": the status
    # code and the address say nothing the message does not.
    reason = re.sub(r"^[A-Z_]+: (?:ipv[46]:\S+: )?", "", last)
    if "handshake failed" in reason.lower():
        reason = "the TLS handshake failed"
    else:
        reason = reason.rsplit(": ", 1)[-1]
    security = (
        "--tls-ca must be the CA that signed its certificate, and a plaintext server takes no --tls-ca"
        if tls
        else "A server with --tls-cert needs --tls-ca"
    )
    return (
        f"nothing answers at --target {target} ({reason}): is `cbserve serve` running there, on that --port "
        f"(50051 by default)? {security}"
    )


def _in_flag_terms(details: str, stops: list[str]) -> str:
    """A refusal's text with the request fields the CLI set named as the user gave them: --max-new-tokens
    for sampling.max_new_tokens, --stop 'TEXT' for sampling.stop[i], the prompt for text and messages."""

    def flag(field: re.Match[str]) -> str:
        if field[0] == "sampling.max_new_tokens":
            return "--max-new-tokens"
        if field[0].startswith("sampling.stop"):
            index = field[1]
            return f"--stop {stops[int(index)]!r}" if index and int(index) < len(stops) else "--stop"
        return "the prompt"

    return REFUSED_FIELD.sub(flag, details) or "no reason given"


def launch_tensor_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """`cbserve serve --tp N`: checks N against the model, then runs the N ranks (service.tensor_parallel)."""
    from transformers import AutoConfig

    from engine import check_tensor_parallel_size
    from service.default_model import ensure_default_model
    from service.model_loading import is_gguf_file
    from service.tensor_parallel import launch, strip_tp_flag

    model_path = args.model or ensure_default_model()
    if is_gguf_file(model_path):
        parser.error(f"--tp {args.tp}: a GGUF file is served on one process (its blocks do not shard)")
    try:
        check_tensor_parallel_size(AutoConfig.from_pretrained(model_path), args.tp)
    except ValueError as exc:
        parser.error(f"--tp {args.tp}: {exc}")
    serve_argv = strip_tp_flag(argv)
    serve_argv.remove("serve")
    # Every rank loads the same folder: resolved here once, so no rank converts the embedded model.
    return launch([*serve_argv, "--model", model_path], args.tp)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return run_serve(args, list(sys.argv[1:] if argv is None else argv))
        return generate(args)
    except KeyboardInterrupt:
        return 130
    except CommandError as error:
        if args.debug:
            raise
        print(f"cbserve: error: {error}", file=sys.stderr, flush=True)
        return 1
