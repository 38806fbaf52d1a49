"""The `serve` app on a loopback port, in a thread of the test process: Server (needs openai and uvicorn)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dflash_cli.conversation import GenerationSettings
from dflash_cli.server.worker import EngineWorker

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from dflash_cli.server.app import ServerState, make_app  # noqa: E402 - needs starlette, skipped above

BLOCK = 4  # a fixed block (no adaptive choice from timings): the same steps as the direct engine run


class Server:
    """The app on a free 127.0.0.1 port, in a thread of this process; `stop()` shuts it down."""

    def __init__(self, runtime, *, max_queue: int = 16, api_key: str | None = None, max_tokens: int = 24):
        self.worker = EngineWorker(runtime, max_queue=max_queue).start()
        defaults = GenerationSettings(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, block_size=BLOCK)
        state = ServerState(self.worker, "tiny", api_key=api_key, defaults=defaults, max_tokens_cap=4096)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.02)

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)

    def idle(self) -> None:
        for _ in range(500):
            if self.worker.waiting == 0:
                return
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.worker.stop()
