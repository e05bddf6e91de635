"""Tool calls, JSON-schema output and log-probabilities through `offspec serve` (offspec/serve/tools.py): the formats'
parsers and grammars with exact expectations, the request fields, and a live server on tiny random models through
the real `openai` client (their chat template shows no tools: the hermes instructions go into the system message).
"""

import json

import jsonschema
import openai
import pytest
from helpers.serving import live_server
from helpers.tiny import BASE_VOCAB, make_tokenizer, save_tiny_model

import offspec
from offspec.serve.protocol import APIError, parse_chat
from offspec.serve.tools import Hermes, Llama3, Mistral, ToolRequest, ToolStream, plan, tool_format
from offspec.spec.grammar import TokenGrammar, grammar_tokenizer, lark_grammar

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 4}},
                                           "required": ["tz"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"level": {"enum": ["low", "high"]},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                    "maxItems": 2},
                                           "where": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                                   "maximum": 99}},
                                                     "required": ["x"], "additionalProperties": False}},
          "required": ["level", "tags", "where"], "additionalProperties": False}


# --- the formats ------------------------------------------------------------------------------------------------

def test_hermes_reads_calls_and_the_text_before_them():
    parsed = Hermes().parse("Let me check." + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert len({c.id for c in parsed.calls}) == 2 and all(c.id.startswith("call_") for c in parsed.calls)
    assert Hermes().parse("no call here") is None
    assert Hermes().parse("<tool_call>\n{not json}\n</tool_call>") is None
    # a call written as bare JSON or in a ```json block (small models do): only of an offered function
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```'
    assert Hermes().parse(fenced, ["get_weather"]).calls[0].arguments == '{"city": "Rome"}'
    assert Hermes().parse(fenced, ["other"]) is None
    assert Hermes().parse('{"name": "get_weather", "arguments": {}, "extra": 1}', ["get_weather"]) is None


def test_hermes_streams_text_until_a_call_may_begin():
    fmt = Hermes()
    assert fmt.content_end("Hello <tool") == len("Hello ")
    assert fmt.content_end("Hello" + CALL) == len("Hello")
    assert fmt.content_end("Plain text.") == len("Plain text.")
    assert fmt.content_end("```js") == 0 and fmt.content_end('```json\n{"na') == 0  # may be a bare call
    assert fmt.content_end("```python\nx = 1") == len("```python\nx = 1")


def test_llama3_and_mistral_formats():
    call = Llama3().parse('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert call.content is None and call.calls[0].name == "get_time" and call.calls[0].arguments == '{"tz": "UTC"}'
    two = Llama3().parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in two.calls] == ["a", "b"]
    assert Llama3().parse("The time is noon.") is None
    assert Llama3().content_end("The time") == len("The time") and Llama3().content_end(' {"na') == 0
    mistral = Mistral().parse('Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "CET"}}]')
    assert mistral.content == "Sure." and mistral.calls[0].arguments == '{"tz": "CET"}'
    assert Mistral().parse("[TOOL_CALLS][{bad") is None


class _Tokenizer:
    def __init__(self, template, added=None):
        self.chat_template, self._added = template, added or {}

    def get_added_vocab(self):
        return self._added


def test_the_format_comes_from_the_chat_template():
    qwen = _Tokenizer("{% if tools %}...<tool_call>...{% endif %}", {"<tool_call>": 7, "</tool_call>": 8})
    fmt, shows = tool_format(qwen)
    assert isinstance(fmt, Hermes) and fmt.special == (7, 8) and shows
    assert isinstance(tool_format(_Tokenizer("{{ tools }} <|python_tag|> ipython"))[0], Llama3)
    mistral, shows = tool_format(_Tokenizer("{% for t in tools %}[TOOL_CALLS]{% endfor %}", {"[TOOL_CALLS]": 5}))
    assert isinstance(mistral, Mistral) and mistral.special == 5
    plain, shows = tool_format(_Tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert isinstance(plain, Hermes) and plain.special is None and not shows


def test_a_template_without_tools_gets_them_as_text():
    request = ToolRequest((WEATHER,))
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    p = plan(request, history, make_tokenizer())
    assert p.template_tools is None and p.messages[0]["role"] == "system"
    assert p.messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in p.messages[0]["content"]
    assert p.messages[2] == {"role": "assistant", "content": CALL}
    assert p.messages[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    shown = plan(request, history, _Tokenizer("{{ tools }}<tool_call>", {"<tool_call>": 7, "</tool_call>": 8}))
    assert shown.template_tools == [{"type": "function", "function": WEATHER}]
    assert shown.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}  # a dict
    assert plan(ToolRequest((WEATHER,), "none"), history[:2], make_tokenizer()).grammar is None


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.mark.parametrize("special", [None, (3, 4)])
def test_the_call_grammars(tok, special):
    """Which replies each tool_choice allows (the byte tokenizer; its <|user|> and <|assistant|> tokens stand in
    for special <tool_call> markers)."""
    ll = grammar_tokenizer(tok, BASE_VOCAB, [tok.eos_token_id])
    fmt = Hermes(special)
    begin, end = ("<|user|>", "<|assistant|>") if special else ("<tool_call>", "</tool_call>")
    one = CALL.replace("<tool_call>", begin).replace("</tool_call>", end)
    other = one.replace('"get_weather", "arguments": {"city": "Paris", "unit": "c"}',
                        '"get_time", "arguments": {"tz": "UTC"}')

    def allows(choice, text, parallel=True, name=None):
        g = TokenGrammar(ll, lark_grammar(fmt.grammar(ToolRequest((WEATHER, TIME), choice, name, parallel))),
                         BASE_VOCAB)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for t in ids:
            if not g.allowed()[t]:
                return False
            g.advance(t)
        return bool(g.allowed()[tok.eos_token_id])  # the reply may end here

    assert allows("auto", "It is sunny.") and allows("auto", one) and allows("auto", "Checking." + one)
    assert allows("auto", one + "\n" + other) and not allows("auto", one + "\n" + other, parallel=False)
    assert not allows("auto", one.replace('"unit": "c"', '"unit": "k"'))  # a call's JSON follows the schema
    assert not allows("required", "It is sunny.") and allows("required", one)
    assert allows("function", other, name="get_time") and not allows("function", one, name="get_time")


def test_tool_stream_sends_text_at_once_and_calls_at_the_end():
    stream = ToolStream(Hermes(), ["get_weather"])
    sent = "".join(stream.feed(piece) for piece in ["Let me ", "check. <tool", CALL[5:]])
    assert sent == "Let me check. "
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    broken = ToolStream(Hermes(), ["get_weather"])
    broken.feed("<tool_call>\n{oops")
    assert broken.finish() == ("<tool_call>\n{oops", ())  # no well-formed call: the reply is text


# --- the request fields -------------------------------------------------------------------------------------------

def chat(**fields):
    return parse_chat(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode(),
                      default_max_tokens=100)


def test_tool_fields_become_a_tool_request():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
               parallel_tool_calls=False)
    assert req.tools == ToolRequest((WEATHER, TIME), "function", "get_time", False)
    assert chat(tools=TOOLS).tools.choice == "auto" and chat().tools is None
    assert chat(response_format={"type": "json_object"}).options["json_schema"] is True
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert chat(response_format=fmt).options["json_schema"] == SCHEMA
    assert chat(logprobs=True, top_logprobs=5).options["logprobs"] == 5
    assert chat(logprobs=True).options["logprobs"] == 0 and "logprobs" not in chat(logprobs=False).options
    messages = [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "ok"}]}]
    req = parse_chat(json.dumps({"model": "m", "messages": messages}).encode(), default_max_tokens=5)
    assert req.prompt[0] == {"role": "system", "content": "x"}
    assert req.prompt[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert req.prompt[3] == {"role": "tool", "content": "ok", "tool_call_id": "c"}
    bad = [messages[1], {**messages[2], "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(APIError, match="arguments is not valid JSON"):
        parse_chat(json.dumps({"model": "m", "messages": bad}).encode(), default_max_tokens=5)


# --- a live server ------------------------------------------------------------------------------------------------

OPTIONS = dict(dtype="float64", max_context=2048, max_budget=64, budget=8)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")  # room for the tool instructions: one token per byte
    target = save_tiny_model(root / "target", arch="llama", seed=0, logit_scale=3.0, max_pos=2048)
    draft = save_tiny_model(root / "draft", arch="llama", seed=0, logit_scale=3.0, noise=0.02, max_pos=2048)
    generator = offspec.load(str(target), str(draft), **OPTIONS)
    with live_server(generator) as live:
        yield generator, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(served, **kwargs):
    generator, client = served
    kwargs = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0, "max_tokens": 120,
              **kwargs}
    return client.chat.completions.create(model=generator.info.target, **kwargs)


def test_required_and_named_tool_choices_give_calls_that_follow_the_schemas(served):
    for choice, names in (("required", {"get_weather", "get_time"}), (
            {"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        answer = ask(served, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert answer.choices[0].finish_reason == "tool_calls", answer
        calls = answer.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name in names and calls[0].type == "function"
        schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]["parameters"]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
        streamed = list(ask(served, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, stream=True))
        deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, calls[0].function.name, calls[0].function.arguments)]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_goes_back_through_the_template(served):
    call = ask(served, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    messages = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C, cloudy"}]
    answer = ask(served, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=20)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > 60  # the call and the result are in the prompt


def test_json_schema_replies_validate_greedy_and_sampled(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    generator, _ = served
    greedy = ask(served, response_format=fmt, extra_body={"return_token_ids": True})
    alone = generator.generate([{"role": "user", "content": "Weather in Paris?"}], max_new_tokens=120,
                               speculate=False, json_schema=SCHEMA)
    assert greedy.choices[0].token_ids == alone.token_ids and greedy.offspec["tokens_per_pass"] > 1
    for seed in range(20):
        answer = ask(served, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200)
        assert answer.choices[0].finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    streamed = ask(served, response_format={"type": "json_object"}, stream=True, max_tokens=40)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).startswith("{")


def test_a_bad_schema_is_a_400(served):
    with pytest.raises(openai.BadRequestError, match="JSON schema|grammar"):
        ask(served, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}})


def test_logprobs_on_both_endpoints_equal_the_target_alones(served):
    generator, client = served
    messages = [{"role": "user", "content": "Hello"}]
    alone = generator.generate(messages, max_new_tokens=12, speculate=False, logprobs=3)
    answer = ask(served, messages=messages, max_tokens=12, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert [c.logprob for c in content] == [lp.logprob for lp in alone.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[v for _, v in lp.top] for lp in alone.logprobs]
    assert [bytes(c.bytes) for c in content] == [generator.token_bytes(t) for t in alone.token_ids]
    streamed = ask(served, messages=messages, max_tokens=12, logprobs=True, stream=True)
    assert [c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == [lp.logprob for lp in alone.logprobs]
    raw = generator.generate("Hello", raw=True, max_new_tokens=8, speculate=False, logprobs=2)
    text = client.completions.create(model=generator.info.target, prompt="Hello", max_tokens=8, temperature=0,
                                     logprobs=2)
    lp = text.choices[0].logprobs
    assert lp.token_logprobs == [x.logprob for x in raw.logprobs] and len(lp.top_logprobs[0]) <= 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
