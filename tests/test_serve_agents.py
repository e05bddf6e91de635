"""Tier 3: what agents and editors send `offspec serve` on the real default pair (after `offspec setup`), through the
real `openai` client: a tool call and its follow-up, replies held to a JSON schema (sampled and greedy, streamed and
not), and log-probabilities equal to the target alone's.
"""

import json

import jsonschema
import openai
import pytest
from helpers.serving import live_server

import offspec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"], "additionalProperties": False}}}
# an agent's own instructions (a small model needs them to answer after a tool's result rather than call again)
SYSTEM = ("You are a helpful assistant with tools. When a <tool_response> answers your call, use it to answer the "
          "user in a sentence; do not call the tool again.")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["developer", "designer", "manager"]},
    "skills": {"type": "array", "items": {"enum": ["python", "rust", "design", "sql"]}, "minItems": 1, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "role", "skills", "address"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
INVENT = [{"role": "user", "content": "Invent a person who works in a software company, as JSON."}]


@pytest.fixture(scope="module")
def served():
    generator = offspec.load(budget=16, max_context=2048)
    with live_server(generator) as live:
        yield generator, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=900)


def ask(served, **kwargs):
    generator, client = served
    return client.chat.completions.create(model=generator.info.target, **{"temperature": 0, "max_tokens": 120,
                                                                            **kwargs})


@pytest.mark.integration
def test_a_tool_call_and_its_follow_up(served):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}]
    answer = ask(served, messages=messages, tools=[WEATHER])
    assert answer.choices[0].finish_reason == "tool_calls", answer
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments["city"] == "Paris"
    streamed = list(ask(served, messages=messages, tools=[WEATHER], stream=True))
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", call.function.arguments)]

    follow = messages + [answer.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"city": "Paris", "temperature_celsius": 18, "sky": "cloudy"})}]
    reply = ask(served, messages=follow, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.tool_calls is None, reply
    assert "18" in reply.choices[0].message.content


@pytest.mark.integration
def test_schema_replies_validate_and_greedy_equals_the_target_alone(served):
    generator, _ = served
    for seed in range(20):
        answer = ask(served, messages=INVENT, response_format=PERSON_FORMAT, temperature=0.8, seed=seed,
                     max_tokens=120)
        assert answer.choices[0].finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    greedy = ask(served, messages=INVENT, response_format=PERSON_FORMAT, extra_body={"return_token_ids": True})
    alone = generator.generate(INVENT, max_new_tokens=120, speculate=False, json_schema=PERSON)
    assert greedy.choices[0].token_ids == alone.token_ids
    assert greedy.offspec["tokens_per_pass"] > 1.5  # the tree pays under the schema too
    streamed = ask(served, messages=INVENT, response_format=PERSON_FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == alone.text


@pytest.mark.integration
def test_top_logprobs_equal_the_target_alones(served):
    generator, _ = served
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    alone = generator.generate(messages, max_new_tokens=24, speculate=False, logprobs=5)
    answer = ask(served, messages=messages, max_tokens=24, logprobs=True, top_logprobs=5)
    content = answer.choices[0].logprobs.content
    assert len(content) == len(alone.token_ids) == 24
    for got, want in zip(content, alone.logprobs):
        assert bytes(got.bytes) == generator.token_bytes(want.token)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [bytes(t.bytes) for t in got.top_logprobs] == [generator.token_bytes(t) for t, _ in want.top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-4)
