"""`cbserve serve` (run the server) and `cbserve generate` (stream a completion through the SDK)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from engine import ContinuousBatchingConfig, check_tensor_parallel_size, torchrun_rank, torchrun_world_size
from service.auth import load_admin_token
from service.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from service.engine_host import DTYPES, EngineHost
from service.server import CbserveServer, ServerOptions
from service.tensor_parallel import follow, launch, strip_tp_flag
from service.tls import ServerTls, TlsConfigError, client_credentials, load_server_tls


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbserve", description="Continuous-batching LLM inference over gRPC"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model")
    serve.add_argument(
        "--model",
        default=None,
        help=f"folder of a causal LM and its tokenizer (default: the embedded {DEFAULT_MODEL_NAME})",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--admin-port", type=int, default=50052)
    serve.add_argument(
        "--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    serve.add_argument(
        "--max-pause-lease", type=float, default=300.0, help="longest hold of one Pause call (s)"
    )
    serve.add_argument(
        "--admin-token-file", help="file holding the admin bearer token (else $CBSERVE_ADMIN_TOKEN)"
    )
    tls = serve.add_argument_group("TLS (both ports; plaintext when not given)")
    tls.add_argument("--tls-cert", help="PEM certificate chain of the server (needs --tls-key)")
    tls.add_argument("--tls-key", help="PEM private key of --tls-cert")
    tls.add_argument(
        "--tls-client-ca",
        help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)",
    )
    serve.add_argument(
        "--otlp-endpoint",
        help="OTLP/gRPC collector for request traces (default $OTEL_EXPORTER_OTLP_ENDPOINT; none: no export)",
    )
    serve.add_argument(
        "--device", default="auto", help="cpu, cuda or cuda:N (default auto: the GPU when there is one)"
    )
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="weights and KV cache precision (default auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    serve.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: run N ranks, each holding 1/N of every layer (N must divide the "
        "model's KV heads); rank 0 serves, the others follow it",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default 0: off)",
    )
    engine = serve.add_argument_group("engine")
    engine.add_argument("--page-size", type=int)
    engine.add_argument("--num-blocks", type=int)
    engine.add_argument("--max-batch-tokens", type=int)
    engine.add_argument("--max-requests-per-batch", type=int)
    engine.add_argument("--max-queue-size", type=int)
    engine.add_argument("--scheduler-type", choices=("fifo", "prefill_first"))
    engine.add_argument(
        "--compile-level",
        type=int,
        choices=range(4),
        help="torch.compile preset of the forward, 0 (off) to 3 (see default_compile_level)",
    )
    engine.add_argument(
        "--max-blocks-per-request",
        type=int,
        help="turn on the attention kernel (Triton, CUDA only) for requests holding up to N KV blocks",
    )
    engine.add_argument(
        "--cuda-graphs",
        action="store_true",
        help=(
            "replay CUDA graphs (CUDA only, one model rank): of decode steps, captured before serving, and "
            "of steps with prefill chunks when --max-blocks-per-request is set, captured on first use"
        ),
    )
    engine.add_argument(
        "--async-batching",
        action="store_true",
        help="prepare each step while the previous one runs on the GPU (use_async_batching)",
    )

    generate = commands.add_parser("generate", help="stream a completion from a running server")
    generate.add_argument("prompt")
    generate.add_argument("--target", default="127.0.0.1:50051")
    generate.add_argument("--max-new-tokens", type=int)
    generate.add_argument(
        "--stop", action="append", metavar="TEXT", help="end the output before TEXT (repeat for several)"
    )
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, not as a chat message"
    )
    generate.add_argument("--tls-ca", help="PEM CA that signed the server's certificate (turns TLS on)")
    generate.add_argument("--tls-cert", help="PEM client certificate, for a mutual-TLS server")
    generate.add_argument("--tls-key", help="PEM private key of --tls-cert")
    return parser


def engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine config from the flags given; the others keep the engine's defaults."""
    knobs = (
        "page_size",
        "num_blocks",
        "max_batch_tokens",
        "max_requests_per_batch",
        "max_queue_size",
        "max_blocks_per_request",
    )
    values = {
        name: getattr(args, name) for name in (*knobs, "scheduler_type") if getattr(args, name) is not None
    }
    if args.compile_level is not None:
        values["default_compile_level"] = args.compile_level
    if args.cuda_graphs:
        values["use_cuda_graph"] = True
    if args.async_batching:
        values["use_async_batching"] = True
    return ContinuousBatchingConfig(**values)


async def serve(args: argparse.Namespace, tls: ServerTls | None = None) -> None:
    options = ServerOptions(
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        grace_period_s=args.grace_period,
        max_pause_lease_s=args.max_pause_lease,
        admin_token=load_admin_token(args.admin_token_file),
        tls=tls,
        otlp_endpoint=args.otlp_endpoint,
        metrics_port=args.metrics_port,
    )
    server = CbserveServer(options)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await server.start()
    config = engine_config(args)
    # The first start on the embedded model converts it once (~80 s), in load's worker thread, while
    # health reports NOT_SERVING.
    loading = asyncio.ensure_future(
        server.load(
            lambda: EngineHost.from_path(
                args.model or ensure_default_model(), config, device=args.device, dtype=args.dtype
            )
        )
    )
    await asyncio.wait([loading, asyncio.ensure_future(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        loading.result()
        logging.getLogger(__name__).info("serving %s", args.model or DEFAULT_MODEL_NAME)
        await stopping.wait()
    await server.shutdown()


def generate(args: argparse.Namespace) -> None:
    from cbserve_client import Client

    sampling: dict[str, Any] = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    if args.stop:
        sampling["stop"] = args.stop
    use_tls = args.tls_ca is not None or args.tls_cert is not None
    credentials = client_credentials(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    with Client(args.target, credentials=credentials) as client:
        # An instruction-tuned model answers a question only through its chat template.
        chat = not args.raw and client.model_info().has_chat_template
        prompt: str | list[dict[str, str]] = (
            [{"role": "user", "content": args.prompt}] if chat else args.prompt
        )
        for chunk in client.stream(prompt, **sampling):
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    sys.stdout.write("\n")


def launch_tensor_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """`cbserve serve --tp N`: checks N against the model, then runs the N ranks (service.tensor_parallel)."""
    from transformers import AutoConfig

    model_path = args.model or ensure_default_model()
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
            # Read before anything starts, so a bad TLS flag fails at once, naming the flag.
            tls = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
            if args.tp < 1:
                parser.error(f"--tp must be >= 1, got {args.tp}")
            if args.tp > 1 and torchrun_world_size() == 1:
                return launch_tensor_parallel(parser, args, list(sys.argv[1:] if argv is None else argv))
            if torchrun_rank() > 0:
                return follow(args.model or ensure_default_model(), engine_config(args), args.dtype)
            asyncio.run(serve(args, tls))
        else:
            generate(args)
    except TlsConfigError as exc:
        parser.error(str(exc))
    return 0
