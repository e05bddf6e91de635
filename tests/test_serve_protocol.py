"""`offspec serve` request parsing: supported parameters, neutral values, and a 400 for everything else."""

import json

import pytest

from offspec.serve.protocol import APIError, parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat(json.dumps({"model": "m", "messages": USER, **fields}).encode(), default_max_tokens=100)


def completion(**fields):
    return parse_completion(json.dumps({"model": "m", "prompt": "abc", **fields}).encode())


def test_chat_defaults_follow_openai():
    req = chat()
    assert req.chat and req.prompt == USER and not req.stream
    assert req.options == dict(max_new_tokens=100, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=())


def test_chat_parameters_reach_the_generator():
    req = chat(max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n", n=1, stream=True,
               stream_options={"include_usage": True}, top_k=4, user="u1", return_token_ids=True)
    assert req.options == dict(max_new_tokens=7, temperature=0.0, top_p=0.5, top_k=4, seed=3, stop=("\n",))
    assert req.stream and req.include_usage and req.return_token_ids and req.user == "u1"
    assert chat(stop=["a", "b"]).options["stop"] == ("a", "b")
    assert chat(max_completion_tokens=9).options["max_new_tokens"] == 9
    assert chat(max_completion_tokens=9, max_tokens=9).options["max_new_tokens"] == 9


def test_text_parts_and_roles():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"}]
    req = parse_chat(json.dumps({"model": "m", "messages": messages}).encode(), default_max_tokens=5)
    assert req.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                          {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("fields", [
    dict(presence_penalty=0), dict(frequency_penalty=0.0), dict(logit_bias={}), dict(logprobs=False),
    dict(tools=[]), dict(tool_choice="none"), dict(response_format={"type": "text"}), dict(n=None),
    dict(parallel_tool_calls=True), dict(store=False), dict(presence_penalty=None), dict(seed=None),
])
def test_neutral_values_are_accepted(fields):
    assert chat(**fields).options["max_new_tokens"] == 100


@pytest.mark.parametrize("fields, param, fragment", [
    (dict(n=2), "n", "one choice per request"),
    (dict(top_logprobs=3), "top_logprobs", "needs 'logprobs': true"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "in 0..20"),
    (dict(logprobs=3), "logprobs", "valid boolean"),
    (dict(presence_penalty=0.5), "presence_penalty", "only 0 or 0.0 or null"),
    (dict(frequency_penalty=1), "frequency_penalty", "unsupported value"),
    (dict(logit_bias={"5": 10}), "logit_bias", "unsupported value"),
    (dict(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools", "letters, digits"),
    (dict(tools=[{"type": "function"}]), "tools", "tools[0] must be"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools", "JSON schema object"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools", "same name"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"), "tool_choice",
     "none, auto, required"),
    (dict(functions=[{"name": "f"}]), "functions", "send 'tools'"),
    (dict(response_format={"type": "xml"}), "response_format", "text, json_object or json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "needs"),
    (dict(response_format={"type": "json_object"}, tools=[{"type": "function", "function": {"name": "f"}}]),
     "response_format", "cannot be combined"),
    (dict(foo=1), "foo", "unrecognized request argument supplied: foo"),
    (dict(stop=""), "stop", "must not be empty"),
    (dict(stop=5), "stop", "a string or a list of strings"),
    (dict(stop=["a", 3]), "stop", "a string or a list of strings"),
    (dict(temperature=-1), None, "temperature must be a number >= 0"),
    (dict(temperature="hot"), "temperature", "valid number"),
    (dict(top_p=0), None, "top_p must be in (0, 1]"),
    (dict(top_k=-2), None, "top_k must be a whole number >= 0"),
    (dict(max_tokens=0), None, "max_new_tokens must be a positive whole number"),
    (dict(max_tokens=2.5), "max_tokens", "valid integer"),
    (dict(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "differ"),
    (dict(seed=2 ** 70), "seed", "integer within 64 bits"),
    (dict(stream="yes"), "stream", "valid boolean"),
    (dict(stream_options={"include_usage": True}), "stream_options", "only allowed with stream"),
    (dict(stream=True, stream_options={"include_obfuscation": True}), "stream_options", "include_usage"),
    (dict(messages=[]), "messages", "non-empty list"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages", "system, developer, user, assistant or tool"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages", "needs 'tool_call_id'"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages", "arguments as JSON text"),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages",
     "unsupported field(s) tool_call_id"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages", "only text parts"),
    (dict(messages=[{"role": "user", "content": "x", "name": "bob"}]), "messages", "unsupported field(s) name"),
    (dict(messages=[{"role": "assistant", "content": None}]), "messages", "string or a list of text parts"),
    (dict(messages="hi"), "messages", "valid array"),
    (dict(model=None), "model", "valid string"),
])
def test_unsupported_or_bad_chat_values_are_400_naming_the_parameter(fields, param, fragment):
    with pytest.raises(APIError) as caught:
        chat(**fields)
    error = caught.value
    assert error.status == 400
    assert fragment in error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": param,
                                      "code": None}}


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "missing required parameter: 'model'"),
    (b'{"model": "m"}', "missing required parameter: 'messages'"),
])
def test_malformed_bodies_are_400(body, fragment):
    with pytest.raises(APIError) as caught:
        parse_chat(body, default_max_tokens=10)
    assert caught.value.status == 400 and fragment in caught.value.message


def test_completion_prompts_and_defaults():
    req = completion()
    assert not req.chat and req.prompt == "abc"
    assert req.options["max_new_tokens"] == 16 and req.options["temperature"] == 1.0  # OpenAI's defaults
    assert completion(prompt=["xyz"]).prompt == "xyz"
    assert completion(prompt=[5, 6, 7]).prompt == [5, 6, 7]
    assert completion(prompt=[[5, 6]]).prompt == [5, 6]
    assert completion(echo=False, best_of=1, suffix="", logprobs=None).prompt == "abc"


@pytest.mark.parametrize("fields, param, fragment", [
    (dict(prompt=["a", "b"]), "prompt", "one prompt per request"),
    (dict(prompt=[]), "prompt", "one prompt per request"),
    (dict(prompt=5), "prompt", "one prompt per request"),
    (dict(prompt=[1, "a"]), "prompt", "one prompt per request"),
    (dict(echo=True), "echo", "not echoed"),
    (dict(best_of=3), "best_of", "one candidate"),
    (dict(suffix="x"), "suffix", "insertion"),
    (dict(logprobs=21), "logprobs", "in 0..20"),
    (dict(n=3), "n", "one choice"),
    (dict(messages=USER), "messages", "unrecognized request argument"),
])
def test_unsupported_completion_values_are_400(fields, param, fragment):
    with pytest.raises(APIError) as caught:
        completion(**fields)
    assert caught.value.status == 400 and caught.value.param == param and fragment in caught.value.message


def test_the_offspec_field_counts_a_mixtures_routed_experts_and_only_then():
    from offspec.serve.responses import speculation
    from offspec.types import GenerationResult, PassStats

    plain = PassStats(tree_size=4, accepted=2, emitted=3, draft_seconds=0.01, target_seconds=0.1, budget=4)
    routed = PassStats(tree_size=4, accepted=2, emitted=3, draft_seconds=0.01, target_seconds=0.1, budget=4,
                       experts_routed=96, expert_hits=80)
    field = speculation(GenerationResult("x", [1, 2, 3, 4, 5, 6], [routed, routed], 0.3, "eos"), 0.0)
    assert (field["experts_routed"], field["expert_hits"], field["experts_read"]) == (192, 160, 32)
    assert "experts_routed" not in speculation(GenerationResult("x", [1, 2, 3], [plain], 0.1, "eos"), 0.0)
