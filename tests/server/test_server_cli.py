"""`python -m server`'s command line before anything starts: a bad setting is one `python -m server: error:`
line (argparse's), not a traceback; the default gRPC port; the security flags."""

from __future__ import annotations

import pytest

from server import __main__ as server_main
from server.security import ServerSecurity

SERVER_CMD_ERROR = "python -m server: error: "


def error_line(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        server_main.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith(SERVER_CMD_ERROR)]
    return line[len(SERVER_CMD_ERROR):]


@pytest.mark.parametrize("argv, words", [
    (["--num-blocks", "10", "--kv-cache-bytes", "1000000"], "give one of them"),  # contradictory engine fields
    (["--token-budget", "100"], "multiple of 16"),
    (["--scheduling-policy", "fcfs", "--priority-max-wait-s", "-1"], "priority_max_wait_s"),
    (["--ssl-keyfile", __file__], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", __file__, "--ssl-keyfile", "/nonexistent/key.pem"], "no such file: /nonexistent/key.pem"),
    (["--ssl-ca-certs", __file__], "--ssl-ca-certs needs"),
])
def test_a_bad_setting_is_one_error_line(argv, words, capsys):
    assert words in error_line(argv, capsys)


def test_the_default_grpc_port_is_below_the_ephemeral_range():
    port = server_main.build_parser().parse_args([]).port
    assert port == 8033 and port < 32768  # Linux's ephemeral ports: 32768-60999


def test_security_flags_build_one_setting(monkeypatch, tmp_path):
    parser = server_main.build_parser()
    monkeypatch.delenv("SARATHI_API_KEY", raising=False)
    assert server_main.security_from_args(parser.parse_args([])) == ServerSecurity()
    monkeypatch.setenv("SARATHI_API_KEY", "from-env")
    assert server_main.security_from_args(parser.parse_args([])).api_key == "from-env"
    assert server_main.security_from_args(parser.parse_args(["--api-key", "flag"])).api_key == "flag"
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    security = server_main.security_from_args(parser.parse_args(["--ssl-certfile", str(cert), "--ssl-keyfile",
                                                                 str(key)]))
    assert security.tls and security.ssl_ca_certs is None
