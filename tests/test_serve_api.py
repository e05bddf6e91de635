"""`offspec serve` on tiny random models, through the real `openai` client against a live server on 127.0.0.1.

The reference is a second generator loaded from the same directories: greedy (and seeded) output through
the server equals the Python API's token for token (float64 keeps batched == sequential exactly).
"""

import json
import logging

import httpx
import openai
import pytest
from helpers.serving import live_server

import offspec
from offspec.serve import ServeConfig

OPTIONS = dict(dtype="float64", max_context=256, max_budget=64, budget=8)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    target, draft = tiny_dirs[("llama", 0)]
    return str(target), str(draft)


@pytest.fixture(scope="module")
def served(pair):
    generator = offspec.load(*pair, **OPTIONS)
    with live_server(generator) as live:
        yield generator, live.url


@pytest.fixture(scope="module")
def reference(pair):
    return offspec.load(*pair, **OPTIONS)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_id(served):
    return served[0].info.target


def test_models_and_health(served, client):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id(served)]
    assert models[0].offspec["budget"] == 8 and models[0].offspec["max_context"] == 256
    assert client.models.retrieve(model_id(served)).id == model_id(served)
    health = httpx.get(served[1] + "/health").json()
    assert health["status"] == "ok" and health["queue"]["running"] == 0


def test_greedy_chat_equals_the_python_api_token_for_token(served, client, reference):
    expected = reference.generate(HELLO, max_new_tokens=24)
    whole = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=24, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == expected.token_ids
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == len(reference.encode(HELLO))
    assert whole.choices[0].finish_reason == ("length" if expected.stop_reason == "max_tokens" else "stop")

    chunks = list(client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=24,
                                                 temperature=0, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].token_ids == expected.token_ids


def test_stream_ends_with_finish_reason_speculation_and_usage(served, client):
    chunks = list(client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    usage_chunk, last = chunks[-1], chunks[-2]
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens > 0
    assert (usage_chunk.usage.completion_tokens == 16) == (last.choices[0].finish_reason == "length")
    stats = last.offspec
    assert stats["passes"] >= 1 and stats["budget"] == 8
    assert stats["tokens_per_pass"] == pytest.approx(usage_chunk.usage.completion_tokens / stats["passes"], abs=1e-3)
    assert stats["draft_seconds"] > 0 and stats["target_seconds"] > 0 and stats["tokens_per_second"] > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_send_the_raw_prompt(served, client, reference):
    prompt = "def add(a, b):"
    expected = reference.generate(reference.tokenize(prompt), max_new_tokens=12)
    whole = client.completions.create(model=model_id(served), prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert whole.usage.prompt_tokens == len(reference.tokenize(prompt)) != len(reference.encode(prompt))
    assert whole.choices[0].token_ids == expected.token_ids and whole.choices[0].text == expected.text
    streamed = client.completions.create(model=model_id(served), prompt=prompt, max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    ids = client.completions.create(model=model_id(served), prompt=reference.tokenize(prompt), max_tokens=12,
                                    temperature=0)
    assert ids.choices[0].text == expected.text


def test_stop_strings_cut_the_text(served, client):
    full = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=40,
                                          temperature=0).choices[0].message.content
    assert len(full) > 6
    stop = full[3:5]
    cut = full[:full.find(stop)]
    whole = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=40, temperature=0,
                                           stop=[stop, "never-there"])
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    assert whole.offspec["stop_reason"] == "stop"
    streamed = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=40, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut


def test_max_tokens_is_exact(served, client):
    for n in (1, 5):
        whole = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=n, temperature=0)
        assert whole.usage.completion_tokens == n and whole.choices[0].finish_reason == "length"
    newer = client.chat.completions.create(model=model_id(served), messages=HELLO, max_completion_tokens=3,
                                           temperature=0)
    assert newer.usage.completion_tokens == 3


def test_a_fixed_seed_reproduces_and_matches_the_python_api(served, client, reference):
    expected = reference.generate(HELLO, max_new_tokens=24, temperature=1.0, seed=11)
    runs = [client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=24, seed=11,
                                           extra_body={"return_token_ids": True}).choices[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] == expected.token_ids


def test_the_next_turn_reuses_the_cached_prefix(served, client, reference):
    first = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=8, temperature=0)
    turn = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model=model_id(served), messages=turn, max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert second.usage.prompt_tokens == len(reference.encode(turn))
    assert second.usage.prompt_tokens_details.cached_tokens >= len(reference.encode(HELLO))
    assert second.choices[0].token_ids == reference.generate(turn, max_new_tokens=8).token_ids


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=2), "n"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(presence_penalty=1.0), "presence_penalty"),
    (dict(extra_body={"foo": 1}), "foo"),
    (dict(temperature=-0.5), None),
])
def test_bad_parameters_are_400_in_openai_shape(served, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=4, **kwargs)
    error = caught.value
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
    assert set(error.response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_over_the_context_is_400_and_the_server_goes_on(served, client):
    with pytest.raises(openai.BadRequestError, match="context limit"):
        client.chat.completions.create(model=model_id(served), messages=[{"role": "user", "content": "x" * 300}],
                                       max_tokens=4, stream=True)
    assert client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=2).usage.completion_tokens


def test_unknown_model_and_path_are_404_in_openai_shape(served, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    assert caught.value.code == "model_not_found" and model_id(served) in caught.value.message
    response = httpx.post(served[1] + "/v1/embeddings", json={"model": model_id(served), "input": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_an_api_key_is_required_when_set(pair, served):
    generator = served[0]  # the same engine, idle between the module server's requests
    with live_server(generator, ServeConfig(api_key="s3cret")) as live:
        url = live.url
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        assert good.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=2)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(url + "/v1/models").status_code == 401  # no Authorization header at all
        assert httpx.get(url + "/health").status_code == 200  # health checks need no key


def test_one_structured_log_line_per_request(served, client, caplog):
    caplog.set_level(logging.INFO, logger="offspec.serve")
    whole = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=6, temperature=0)
    list(client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=6, temperature=0,
                                        stream=True))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id(served), messages=HELLO, n=3)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "offspec.serve"]
    assert len(lines) == 3
    assert lines[0]["id"] == whole.id and lines[0]["status"] == 200 and lines[0]["stream"] is False
    for line in lines[:2]:
        assert line["completion_tokens"] == 6 and line["passes"] >= 1 and line["tokens_per_second"] > 0
        assert line["tokens_per_pass"] == pytest.approx(6 / line["passes"], abs=1e-3)
    assert lines[1]["stream"] is True and lines[1]["id"].startswith("chatcmpl-")
    assert lines[2]["status"] == 400 and "'n'" in lines[2]["error"]


def test_a_client_that_disconnects_mid_stream_leaves_the_engine_sound(served, client, reference, caplog):
    caplog.set_level(logging.INFO, logger="offspec.serve")
    stream = client.chat.completions.create(model=model_id(served), messages=[{"role": "user", "content": "Tell"}],
                                            max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    after = client.chat.completions.create(model=model_id(served), messages=HELLO, max_tokens=12, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert after.choices[0].token_ids == reference.generate(HELLO, max_new_tokens=12).token_ids
    first = json.loads(caplog.records[0].getMessage())
    assert first["status"] in (200, 499)  # 499: the log line of a stream its client left
