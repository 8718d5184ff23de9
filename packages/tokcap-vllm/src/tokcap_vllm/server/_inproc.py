"""vLLM's OpenAI server with the gate, in a background thread of this process.

For tests, the demo and benchmarks: the caller keeps in-process access to the `Gate`
(ledgers, sink) while real HTTP clients talk to the server. `call` runs a coroutine on
the server's event loop (the gate is not thread-safe; touch it only there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..gate import Gate, require_vllm
from ._middleware import install_gate

_LAUNCHERS = "vllm.entrypoints.launchers"

__all__ = ["InProcessServer"]

T = TypeVar("T")


class InProcessServer:
    """Start with `start`, stop with `stop` (or use as a context manager)."""

    def __init__(
        self,
        model: str,
        *,
        gate: Gate | None = None,
        host: str = "127.0.0.1",
        vllm_args: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.gate = gate if gate is not None else Gate()
        self.host = host
        self.vllm_args = list(vllm_args)
        self.port = 0
        self.engine_client: Any = None
        """vLLM's engine client (``AsyncLLM``) once started: what `WeightSync` pushes into."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tokcap-vllm-server", daemon=True)

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def rollout_url(self, rollout_id: str) -> str:
        """The OpenAI base URL a harness uses for ``rollout_id``."""
        return f"{self.base_url}{self.gate.config.path_prefix}{rollout_id}/v1"

    def start(self, timeout: float = 600.0) -> InProcessServer:
        """Build the engine and serve; returns once the server accepts connections."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start building the engine in the server's thread and return at once (other
        start-up work can overlap); `wait_ready` waits for it."""
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()

    def wait_ready(self, timeout: float = 600.0) -> InProcessServer:
        """Wait until the launched server accepts connections (or failed to start)."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"vLLM server not ready after {timeout} s")
        if self._error is not None:
            raise RuntimeError("vLLM server failed to start") from self._error
        return self

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 120.0) -> T:
        """Run ``await fn(*args)`` on the server's loop and return its result."""
        assert self._loop is not None
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            _invoke(fn, args), self._loop
        )
        return future.result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the server to exit and wait for the engine to shut down."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported to start(); the thread must not die silently
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        init_app_state = require_vllm(_LAUNCHERS + ".api_server.app_state").init_app_state
        build_async_engine_client = require_vllm(
            _LAUNCHERS + ".api_server.entry"
        ).build_async_engine_client
        build_app = require_vllm(_LAUNCHERS + ".app").build_app
        make_arg_parser = require_vllm(_LAUNCHERS + ".cli_args").make_arg_parser
        parser_type = require_vllm("vllm.utils.argparse_utils").FlexibleArgumentParser
        import uvicorn

        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        parser = make_arg_parser(parser_type())
        args = parser.parse_args(
            [
                "--model",
                self.model,
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--middleware",
                "tokcap_vllm.GateMiddleware",
                *self.vllm_args,
            ]
        )
        install_gate(self.gate)
        async with build_async_engine_client(args) as engine:
            self.engine_client = engine
            supported = await engine.get_supported_tasks()
            app = build_app(args, supported, engine.model_config)
            await init_app_state(engine, app.state, args, supported)
            config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=30)
            self._server = uvicorn.Server(config)
            serve = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            while not self._server.started and not serve.done():
                await asyncio.sleep(0.05)
            self._ready.set()
            await serve
            await asyncio.sleep(
                0.2
            )  # let the lifespan task finish before the engine's blocking shutdown


async def _invoke(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await fn(*args)
