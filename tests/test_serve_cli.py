"""`offspec serve` as a user runs it (`python main.py serve ...`): start-up checks, greedy output equal to
`offspec generate`'s token for token, one log line per request, and Ctrl-C."""

import json
import signal
import socket

import openai
import pytest
from helpers.serving import cli_server
from test_cli import run

from offspec.cli.main import main


def one_error_line(capsys, *args) -> str:
    """`offspec serve ARGS` in this process (the entry point main.py calls): exit 2 and one `error:` line."""
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_public_host_needs_a_key_and_is_refused_before_loading(capsys):
    # the target does not exist: the host is refused before any model is looked at
    line = one_error_line(capsys, "--host", "0.0.0.0", "--target", "/nonexistent/model")
    assert "without an API key" in line and "--api-key" in line and "--insecure" in line
    line = one_error_line(capsys, "--host", "0.0.0.0", "--insecure", "--port", "0", "--target", "/nonexistent/model")
    assert "without an API key" not in line and "/nonexistent/model" in line  # past the host check, at loading


def test_a_port_in_use_and_a_bad_queue_size_are_one_line_errors(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = one_error_line(capsys, "--port", str(port), "--target", "/nonexistent/model")
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line
    assert "queue size" in one_error_line(capsys, "--queue-size", "-1", "--target", "/nonexistent/model")


@pytest.mark.slow
def test_the_cli_server_answers_like_generate_and_stops_on_ctrl_c(tiny_dirs):
    target, draft = (str(p) for p in tiny_dirs[("qwen2", 0)])
    common = ["--target", target, "--draft", draft, "--budget", "8"]
    generated = run("generate", *common, "--json", "--max-new-tokens", "12", "Hi")
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(generated.stdout)

    with cli_server(*common) as (proc, url, seen):
        assert any("warming up" in line for line in seen)  # the CLI's loading progress
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
        assert answer.choices[0].token_ids == expected["token_ids"]
        assert answer.choices[0].message.content == expected["text"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted; the server stopped" in err
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [entry["path"] for entry in logged] == ["/v1/models", "/v1/chat/completions"]
    assert logged[1]["id"] == answer.id and logged[1]["completion_tokens"] == len(expected["token_ids"])


def test_serve_help_lists_the_model_and_server_options():
    proc = run("serve", "--help")
    assert proc.returncode == 0
    for option in ("--target", "--budget", "--device-mem", "--host", "--port", "--api-key", "--insecure",
                   "--queue-size", "--model-name"):
        assert option in proc.stdout
