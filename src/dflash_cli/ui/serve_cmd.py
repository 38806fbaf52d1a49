"""`dflash-cli serve`: the loaded pair behind an OpenAI-compatible HTTP API (server/app.py)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, NoReturn

import click

from dflash_cli.ui.common import guarded
from dflash_cli.ui.options import command_options, common_options, model_options, sampling_options

INSTALL = "pip install 'dflash-cli[serve]' (starlette, uvicorn and pydantic)"


@click.command("serve")
@model_options
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--api-key", envvar="DFLASH_SERVE_API_KEY", show_envvar=True, metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every request but /health and /metrics.")
@click.option("--max-queue", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests that may wait while one decodes; past it the server answers 503.")
@common_options
def serve(host, port, api_key, max_queue, **values):
    """Serve the model over an OpenAI-compatible API, with DFlash statistics in every response.

    POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models, /health and /metrics.
    The sampling options are the defaults a request can override. Requests are decoded one at a time.

    \b
    Examples:
      dflash-cli serve -m demo
      OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python my_script.py
      dflash-cli generate --engine http://127.0.0.1:8000/v1 "hello"
    """
    from dflash_cli.ui.render import Output

    command = command_options(values)
    guarded(lambda: Output(command.output.color),
            lambda out: run_serve(out, command, host=host, port=port, api_key=api_key, max_queue=max_queue),
            command.output.debug)


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket (so the port is known, also with --port 0, before the server starts)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise click.BadParameter(f"cannot resolve {host!r} ({e.strerror})", param_hint="--host") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(out: Any, command: Any, *, host: str, port: int, api_key: str | None, max_queue: int) -> NoReturn:
    """`serve`'s body (`command`: ui.options.CommandOptions; its sampling settings are the requests' defaults)."""
    try:
        import uvicorn

        from dflash_cli.server.app import ServerState, make_app
    except ImportError as e:
        raise click.ClickException(f"serve needs {e.name}: {INSTALL}") from None
    from dflash_cli.server.worker import EngineWorker
    from dflash_cli.ui.opening import open_model

    if not is_loopback(host) and not api_key:
        out.warn(f"listening on {host} without --api-key: anyone who can reach this port can use the model")
    sock = listening_socket(host, port)  # before loading: a taken port fails in a second
    settings = command.settings
    runtime = open_model(out, command.model, quiet=False, settings=settings)
    worker = EngineWorker(runtime, max_queue=max_queue).start()
    model = command.model.model
    state = ServerState(worker, model, api_key=api_key, defaults=settings, max_tokens_cap=1 << 20,
                        system=command.system)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    out.info(f"serving {model} on http://{shown}:{port}/v1 (OpenAI API; Ctrl-C stops)")
    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            worker.abort()  # open replies end at their next step, with a last chunk and [DONE]
            super().handle_exit(sig, frame)

    # the grace period covers one engine step (a long prefill included), after which every reply has ended
    server = Server(uvicorn.Config(make_app(state), log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=60))
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
        runtime.close()  # the round costs learnt, for the next start
    # uvicorn stops only on SIGINT/SIGTERM and then re-raises the signal, which reaches guarded as a
    # KeyboardInterrupt (130, 143); a SIGINT this process inherited as ignored (a job a script started with
    # `&`) is re-raised to no effect and comes back here: the same stop all the same
    raise KeyboardInterrupt
