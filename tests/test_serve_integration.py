"""Tier 3: `offspec serve` on the real default pair (installed by `offspec setup`), through the `openai` client.

Only CLI flags are used (no paths or weight formats): the test holds whatever `offspec setup` prepared.
"""

import json
import signal
import subprocess
import sys

import openai
import pytest
from helpers.serving import cli_server
from test_cli import ROOT

PROMPT = "Write a Python function that checks whether a string is a palindrome."
OPTIONS = ["--budget", "8", "--max-context", "1024", "--max-budget", "64"]


@pytest.mark.integration
def test_default_pair_greedy_through_the_server_equals_generate_token_for_token():
    generated = subprocess.run([sys.executable, str(ROOT / "main.py"), "generate", *OPTIONS, "--json",
                                "--max-new-tokens", "48", PROMPT], capture_output=True, text=True, timeout=1800)
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(generated.stdout)
    assert len(expected["token_ids"]) == 48

    with cli_server(*OPTIONS, timeout=900) as (proc, url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPT}]
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                                extra_body={"return_token_ids": True})
        assert answer.choices[0].token_ids == expected["token_ids"]
        assert answer.choices[0].message.content == expected["text"]
        assert answer.offspec["tokens_per_pass"] > 1.0 and answer.offspec["budget"] == 8

        streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected["text"]

        turn = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                           {"role": "user", "content": "Now make it ignore case."}]
        second = client.chat.completions.create(model=model, messages=turn, max_tokens=16, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 20  # the first turn's KV cache, reused

        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err
