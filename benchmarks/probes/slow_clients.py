"""Slow-body clients against a running HTTP server: `python -m benchmarks.probes.slow_clients [--connections 3000]
[--interval 5] [--body-timeout 30] [--model tiny-llama]`.

Starts `python -m server` (HTTP only, `--body-timeout`), opens `--connections` connections that each send a
request head announcing a body and then one byte of it every `--interval` seconds, and, while they are all open,
sends one normal completion request. Prints how long the server took to close the slow connections (from each
one's head; all should close within the body deadline plus the lingering close's idle second), how many got
the 408, the normal request's status and latency, and the server's resident memory (VmRSS) before, with all
connections open, and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time

HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n{")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _slow_client(port: int, interval: float, out: list[tuple[float, bool]], opened: asyncio.Event,
                       n_open: list[int], target: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEAD)
    start = time.monotonic()
    n_open[0] += 1
    if n_open[0] == target:
        opened.set()
    got = b""

    async def dribble() -> None:
        while True:
            await asyncio.sleep(interval)
            writer.write(b" ")
            await writer.drain()

    sender = asyncio.ensure_future(dribble())
    try:
        while chunk := await reader.read(65536):
            got += chunk
    except OSError:
        pass
    finally:
        sender.cancel()
        out.append((time.monotonic() - start, got.startswith(b"HTTP/1.1 408")))
        writer.close()


async def _normal_request(port: int) -> tuple[int, float]:
    body = json.dumps({"prompt": [3, 4, 5], "max_tokens": 8, "ignore_eos": True}).encode()
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1]), time.monotonic() - start


async def _probe(args: argparse.Namespace, port: int, pid: int) -> None:
    rss_before = _rss_mib(pid)
    closed: list[tuple[float, bool]] = []
    opened, n_open = asyncio.Event(), [0]
    t0 = time.monotonic()
    clients = [asyncio.ensure_future(_slow_client(port, args.interval, closed, opened, n_open, args.connections))
               for _ in range(args.connections)]
    await asyncio.wait_for(opened.wait(), args.body_timeout)
    print(f"{args.connections} slow connections open after {time.monotonic() - t0:.1f} s")
    await asyncio.sleep(1.0)
    rss_open = _rss_mib(pid)
    status, latency = await _normal_request(port)
    print(f"normal request meanwhile: HTTP {status} in {latency * 1000:.0f} ms "
          f"({len(closed)} slow connections closed so far)")
    await asyncio.wait(clients, timeout=args.body_timeout + 30)
    waits = sorted(t for t, _ in closed)
    print(f"closed by the server: {len(closed)}/{args.connections}, with a 408: {sum(ok for _, ok in closed)}; "
          f"head to close: min {waits[0]:.1f} s, median {waits[len(waits) // 2]:.1f} s, max {waits[-1]:.1f} s "
          f"(--body-timeout {args.body_timeout:g})")
    await asyncio.sleep(1.0)
    print(f"server RSS: {rss_before:.0f} MiB before, {rss_open:.0f} MiB with all open "
          f"(+{rss_open - rss_before:.0f}), {_rss_mib(pid):.0f} MiB after")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=3000)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between two bytes of a slow body")
    p.add_argument("--body-timeout", type=float, default=30.0, help="the server's --body-timeout")
    p.add_argument("--model", default="tiny-llama")
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 256
    if soft < need:  # this process and the server it starts each hold one descriptor per connection
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    cmd = [sys.executable, "-m", "server", "--model", args.model, "--no-grpc", "--http-port", "0", "--host",
           "127.0.0.1", "--body-timeout", str(args.body_timeout), "--max-model-len", "256",
           "--no-background-compile", "--log-level", "WARNING"]  # no compiles growing the RSS meanwhile
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if "HTTP API on" in line:
                port = int(line.split("HTTP API on", 1)[1].split()[0].removesuffix("/v1").rsplit(":", 1)[1])
                break
        else:
            print("the server did not start", file=sys.stderr)
            return 1
        asyncio.run(_probe(args, port, server.pid))
    finally:
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
