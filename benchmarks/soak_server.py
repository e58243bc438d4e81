"""The server the soak (benchmarks/soak.py) drives, seen from outside: `LocalServer` starts `python -m server` as a
child process; `read_traits` says what it offers the traffic (`ServerTraits`); `ServerProbe` reads what any
running server exposes.

`ServerProbe.snapshot()`: requests in flight and KV blocks in use from gRPC `GetStats` (read between engine
iterations, so exact), or, for a server without gRPC, from the `/metrics` gauges (`sarathi:num_requests_running`,
`sarathi:num_requests_waiting`, `sarathi:kv_cache_usage_perc`); the server's resident memory from `/metrics`'
`process_resident_memory_bytes` (prometheus_client's process collector, which `ServerMetrics` registers).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import API_KEY_ENV, ClientSecurity, grpc_aio_channel

REPO_ROOT = Path(__file__).resolve().parents[1]
_GRPC_LINE = re.compile(r"sarathi server listening on (\S+):(\d+)")
_HTTP_LINE = re.compile(r"sarathi HTTP API on (http://\S+):(\d+)/v1")


@dataclass(frozen=True)
class ServerSnapshot:
    """The server's state at one moment."""

    engine_requests: int  # sequences running or waiting in the engine
    server_requests: int | None  # requests the server has in flight (gRPC GetStats only)
    kv_blocks_in_use: int | None  # of num_total_blocks (gRPC GetStats only)
    kv_usage: float  # fraction of the KV blocks in use, 0..1
    rss_bytes: int | None  # the server process's resident memory (None: not exposed)

    @property
    def idle(self) -> bool:
        """Nothing in flight and no KV block in use."""
        return (self.engine_requests == 0 and not self.server_requests and not self.kv_blocks_in_use
                and self.kv_usage == 0)

    def to_json(self) -> dict[str, Any]:
        return {"engine_requests": self.engine_requests, "server_requests": self.server_requests,
                "kv_blocks_in_use": self.kv_blocks_in_use, "kv_usage": self.kv_usage, "rss_bytes": self.rss_bytes}


@dataclass(frozen=True)
class ServerTraits:
    """What the traffic may use of this server."""

    routes: tuple[str, ...]  # "grpc", "http"
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool
    has_chat_template: bool


async def read_traits(routes: tuple[str, ...], http: Any, stub: Any) -> ServerTraits:
    """What the server offers: from its /v1/models card (`http`: an httpx2.AsyncClient on it) or GetModelInfo
    (`stub`); one chat request says whether the model has a chat template."""
    if http is not None:
        info = (await http.get("/v1/models")).raise_for_status().json()["data"][0]["sarathi"]
    else:
        m = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        info = {"vocab_size": m.vocab_size, "max_model_len": m.max_model_len, "has_tokenizer": m.has_tokenizer}
    chat = False
    if http is not None and info["has_tokenizer"]:  # one chat request says whether the model has a template
        probe = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 1})
        chat = probe.status_code == 200
    return ServerTraits(routes, int(info["vocab_size"]), int(info["max_model_len"]), bool(info["has_tokenizer"]), chat)


class ServerProbe:
    """Reads a running server's state: gRPC `GetStats` at `grpc_target` (None: the /metrics gauges) and
    /metrics at `metrics_url` (None: no memory figure)."""

    def __init__(self, grpc_target: str | None, metrics_url: str | None,
                 security: ClientSecurity = ClientSecurity()) -> None:
        import httpx2

        self.metrics_url = metrics_url
        self._http = httpx2.AsyncClient(timeout=30)
        self._channel = grpc_aio_channel(grpc_target, security) if grpc_target is not None else None
        self._stub = pb_grpc.GenerationStub(self._channel) if self._channel is not None else None

    async def close(self) -> None:
        await self._http.aclose()
        if self._channel is not None:
            await self._channel.close()

    async def _metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        if self.metrics_url is None:
            return {}
        text = (await self._http.get(self.metrics_url)).raise_for_status().text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    async def snapshot(self) -> ServerSnapshot:
        metrics = await self._metrics()
        rss = metrics.get("process_resident_memory_bytes")
        rss_bytes = int(rss) if rss is not None else None
        if self._stub is not None:
            s = await self._stub.GetStats(pb.GetStatsRequest(), timeout=30)
            return ServerSnapshot(engine_requests=s.num_running + s.num_waiting, server_requests=s.num_active_requests,
                                  kv_blocks_in_use=s.num_total_blocks - s.num_free_blocks, kv_usage=s.kv_cache_usage,
                                  rss_bytes=rss_bytes)
        if "sarathi:num_requests_running" not in metrics:
            raise RuntimeError(f"no gRPC target and no sarathi metrics at {self.metrics_url}: cannot see the "
                               "server's requests")
        engine = metrics["sarathi:num_requests_running"] + metrics["sarathi:num_requests_waiting"]
        return ServerSnapshot(engine_requests=int(engine), server_requests=None, kv_blocks_in_use=None,
                              kv_usage=metrics["sarathi:kv_cache_usage_perc"], rss_bytes=rss_bytes)


class LocalServer:
    """`python -m server --model MODEL` in a child process: gRPC and HTTP on free ports of 127.0.0.1, every
    executable compiled before it serves (`--no-background-compile`: start-up compiles are not taken for
    growth), then `server_args` (engine flags, `--max-waiting-requests`, ...; later flags win). Its output goes
    to `log_path`. A context manager: entered once it serves; on exit it gets SIGTERM and drains
    (`exit_status`: its exit status, None if it had to be killed)."""

    def __init__(self, model: str, server_args: Sequence[str], log_path: Path, start_timeout_s: float = 900.0,
                 api_key: str | None = None) -> None:
        self.command = [sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1", "--port", "0",
                        "--http-port", "0", "--no-background-compile", *server_args]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.api_key = api_key  # handed over in the environment, not on the command line (`ps` shows that)
        self.grpc_target = ""
        self.http_target = ""
        self.exit_status: int | None = None
        self._proc: subprocess.Popen | None = None

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> LocalServer:
        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}  # the child serves this checkout's code
        env.pop(API_KEY_ENV, None)
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            self._proc = subprocess.Popen(self.command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while not (self.grpc_target and self.http_target):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self._proc.returncode}) before serving:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the server did not serve within {self.start_timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)
            text = self.log_path.read_text(errors="replace")
            if (m := _GRPC_LINE.search(text)) is not None:
                self.grpc_target = f"{m.group(1)}:{m.group(2)}"
            if (m := _HTTP_LINE.search(text)) is not None:
                self.http_target = f"{m.group(1)}:{m.group(2)}"
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self.exit_status = None if proc is None else proc.returncode
            return
        proc.send_signal(signal.SIGTERM)
        try:
            self.exit_status = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self.exit_status = None
