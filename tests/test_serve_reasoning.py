"""`offspec serve` and a reasoning model: `reasoning_content` beside `content` (whole and streamed), the request's
`reasoning_format`, reasoning sent back in assistant messages, tool calls read from the answer alone; against the
scripted generator (its `reasoning` stands for the format of the model's chat template), through the `openai`
client."""

import json

import openai
import pytest
from helpers.serving import live_server

from offspec.errors import OffspecError
from offspec.serve import ServeConfig
from offspec.serve.protocol import APIError, parse_chat, parse_completion
from offspec.serve.reply import ReplyStream, whole_reply
from offspec.serve.responses import Shape
from offspec.serve.tools import Hermes, ToolStream
from offspec.types import GenerationResult, TextDelta
from offspec.util.reasoning import THINK, ReasoningFormat, Split
from tui.fake import FakeGenerator

USER = [{"role": "user", "content": "2+2?"}]
THOUGHT, ANSWER = "The user asks for a sum.", "It is 4."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
FAKE = "fake-target"


def chat(**fields):
    return parse_chat(json.dumps({"model": "m", "messages": USER, **fields}).encode(), default_max_tokens=100)


# --- the request -----------------------------------------------------------------------------------------------------

def test_reasoning_format_is_llama_cpps():
    assert chat().reasoning_format is None  # the server's default
    assert chat(reasoning_format="none").reasoning_format == "none"
    assert chat(reasoning_format="deepseek").reasoning_format == "deepseek"
    assert chat(reasoning_format="auto").reasoning_format == "deepseek"
    assert chat(reasoning_format=None).reasoning_format is None


@pytest.mark.parametrize("value, fragment", [("deepseek-legacy", "unsupported value for 'reasoning_format'"),
                                             (1, "valid string")])
def test_other_reasoning_formats_are_refused(value, fragment):
    with pytest.raises(APIError) as info:
        chat(reasoning_format=value)
    assert info.value.status == 400 and info.value.param == "reasoning_format" and fragment in info.value.message


def test_completions_take_no_reasoning_format():
    with pytest.raises(APIError) as info:
        parse_completion(json.dumps({"model": "m", "prompt": "x", "reasoning_format": "none"}).encode())
    assert "unrecognized request argument supplied: reasoning_format" in info.value.message


def test_an_assistant_message_may_carry_its_reasoning_back():
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                {"role": "user", "content": "Sure?"}]
    req = parse_chat(json.dumps({"model": "m", "messages": messages}).encode(), default_max_tokens=5)
    assert req.prompt[1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    messages[1]["reasoning_content"] = ["no"]
    with pytest.raises(APIError, match="reasoning_content must be a string"):
        parse_chat(json.dumps({"model": "m", "messages": messages}).encode(), default_max_tokens=5)
    messages[0]["reasoning_content"] = "x"  # a user's message has none
    with pytest.raises(APIError, match="unsupported field"):
        parse_chat(json.dumps({"model": "m", "messages": messages}).encode(), default_max_tokens=5)


def test_the_servers_default_is_checked():
    assert ServeConfig().reasoning_format == "deepseek" and ServeConfig(reasoning_format="none").validate()
    with pytest.raises(OffspecError, match="reasoning format must be deepseek or none"):
        ServeConfig(reasoning_format="raw").validate()


# --- the answer ------------------------------------------------------------------------------------------------------

RESULT = GenerationResult(text=REPLY, token_ids=[1, 2], passes=[], seconds=0.1, stop_reason="eos")


def test_a_whole_answer_has_reasoning_content_beside_content():
    message = Shape(True, "m").whole(RESULT, 0.0, split=Split(THOUGHT, ANSWER))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    plain = Shape(True, "m").whole(RESULT, 0.0)["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": REPLY}  # no split: no field, the text as it was
    assert "reasoning_content" not in Shape(True, "m").whole(RESULT, 0.0, split=Split("", ANSWER))["choices"][0][
        "message"]


def test_stream_chunks_of_reasoning_carry_no_content():
    shape = Shape(True, "m")
    assert shape.text_chunk(None, reasoning=THOUGHT)["choices"][0]["delta"] == {"reasoning_content": THOUGHT}
    assert shape.text_chunk("x", reasoning="y")["choices"][0]["delta"] == {"content": "x", "reasoning_content": "y"}
    assert shape.text_chunk("x")["choices"][0]["delta"] == {"content": "x"}


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_are_read_from_the_answer_only():
    text = f"<think>\nShould I write {CALL}? Yes.\n</think>\n\nChecking. {CALL}"
    split, parsed = whole_reply(text, ReasoningFormat(THINK), Hermes(), ["get_weather"])
    assert split.reasoning == f"Should I write {CALL}? Yes." and parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]

    stream = ReplyStream(ReasoningFormat(THINK), ToolStream(Hermes(), ["get_weather"]), lambda ids: "".join(ids))
    cuts = [0, 5, 9, 30, 60, len(text) - 40, len(text) - 3, len(text)]
    got = [stream.feed(TextDelta("", tuple(text[a:b]))) for a, b in zip(cuts, cuts[1:])]
    (rest, calls) = stream.finish()
    assert "".join(s.reasoning for s in got) + rest.reasoning == split.reasoning
    assert "".join(s.answer for s in got) + rest.answer == "Checking. "  # the text before the call, as it came
    assert [c.name for c in calls] == ["get_weather"]


def test_without_tools_a_stream_reads_the_generators_text():
    stream = ReplyStream(ReasoningFormat(THINK))
    got = [stream.feed(TextDelta(t, ())) for t in ("<think>\nA", "b</think>", "\n\nC")]
    assert [(s.reasoning, s.answer) for s in got] == [("A", ""), ("b", ""), ("", "C")]
    assert stream.finish() == (Split("", ""), ())


# --- through a live server -------------------------------------------------------------------------------------------

def reasoning_of(obj):
    return (obj.model_extra or {}).get("reasoning_content")


@pytest.fixture(scope="module")
def served():
    fake = FakeGenerator(reply=lambda m: REPLY if m[-1]["content"] != "raw" else "no <think> here",
                         tokens_per_pass=2, reasoning=ReasoningFormat(THINK))
    with live_server(fake) as live:
        yield fake, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_chat_answers_have_reasoning_content(served):
    fake, client = served
    message = client.chat.completions.create(model=FAKE, messages=USER).choices[0].message
    assert (message.content, reasoning_of(message)) == (ANSWER, THOUGHT)
    chunks = list(client.chat.completions.create(model=FAKE, messages=USER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    first = next(d for d in deltas if reasoning_of(d))
    assert first.content is None  # a chunk of reasoning is not an empty answer
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert client.models.list().data[0].offspec["reasoning"] == "think"


def test_reasoning_format_none_leaves_the_text_as_it_was(served):
    fake, client = served
    message = client.chat.completions.create(model=FAKE, messages=USER, extra_body={"reasoning_format": "none"})
    assert message.choices[0].message.content == REPLY and reasoning_of(message.choices[0].message) is None
    chunks = client.chat.completions.create(model=FAKE, messages=USER, stream=True,
                                            extra_body={"reasoning_format": "none"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY


def test_a_reply_without_reasoning_and_reasoning_sent_back(served):
    fake, client = served
    message = client.chat.completions.create(model=FAKE, messages=[{"role": "user", "content": "raw"}])
    assert message.choices[0].message.content == "no <think> here"
    assert "reasoning_content" not in message.choices[0].message.model_extra
    history = USER + [{"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                      {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model=FAKE, messages=history)
    assert fake.calls[-1]["prompt"][1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}


def test_a_server_started_with_none_splits_only_what_asks():
    fake = FakeGenerator(reply=REPLY, reasoning=ReasoningFormat(THINK))
    with live_server(fake, ServeConfig(reasoning_format="none")) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.chat.completions.create(model=FAKE, messages=USER).choices[0].message.content == REPLY
        asked = client.chat.completions.create(model=FAKE, messages=USER, extra_body={"reasoning_format": "auto"})
        assert (asked.choices[0].message.content, reasoning_of(asked.choices[0].message)) == (ANSWER, THOUGHT)


def test_a_model_without_markers_answers_as_ever():
    fake = FakeGenerator(reply=REPLY)  # reasoning None: its template has no markers
    with live_server(fake) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        message = client.chat.completions.create(model=FAKE, messages=USER).choices[0].message
        assert message.content == REPLY and "reasoning_content" not in message.model_extra
        assert client.models.list().data[0].offspec["reasoning"] is None


class SchemaFake(FakeGenerator):
    """The scripted generator taking `json_schema` (its reply is the scripted text whatever the schema)."""

    def stream(self, prompt, *, json_schema=None, **options):
        return super().stream(prompt, **options)


def test_output_held_to_a_schema_is_not_inside_a_block_its_prompt_opened():
    fake = SchemaFake(reply='{"sum": 4}', reasoning=ReasoningFormat(THINK, inside=True))  # as QwQ's template
    with live_server(fake) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        held = client.chat.completions.create(model=FAKE, messages=USER, response_format={"type": "json_object"})
        assert held.choices[0].message.content == '{"sum": 4}' and reasoning_of(held.choices[0].message) is None
        free = client.chat.completions.create(model=FAKE, messages=USER).choices[0].message
        assert (free.content, reasoning_of(free)) == ("", '{"sum": 4}')  # unclosed: all of it is reasoning


def test_offspec_serve_takes_the_default_reasoning_format():
    from offspec.cli.serve import serve_parser

    assert serve_parser().parse_args([]).reasoning_format == "deepseek"
    assert serve_parser().parse_args(["--reasoning-format", "none"]).reasoning_format == "none"
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--reasoning-format", "raw"])
