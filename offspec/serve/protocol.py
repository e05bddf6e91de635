"""The OpenAI request bodies `offspec serve` accepts, and OpenAI's error shape.

`parse_chat` / `parse_completion` turn a request body into a `GenerationRequest` (what the engine runs) or
raise `APIError` (a 400 with OpenAI's error JSON). Every request field is either supported, accepted only at
the value that changes nothing (`presence_penalty: 0`, `echo: false`, ...), or refused with a 400 that
names it: nothing is silently ignored. Tools, `response_format`, log-probabilities and `reasoning_format`: see
offspec/serve/tools.py and docs/serve.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from offspec.config import MAX_TOP_LOGPROBS, GenerationConfig, SamplingConfig
from offspec.errors import OffspecError

from .config import REASONING_FORMATS
from .tools import ToolRequest

OPENAI_TEMPERATURE = 1.0  # OpenAI's default when a request gives none (offspec's own CLI default is greedy)
OPENAI_COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class APIError(Exception):
    """An HTTP error answered with OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One parsed request: what the engine runs and how the answer is shaped."""

    model: str
    chat: bool  # /v1/chat/completions (messages through the chat template) or /v1/completions (raw prompt)
    prompt: Any  # chat: [{"role", "content"}, ...]; completions: the raw text, or a list of token ids
    options: dict = field(default_factory=dict)  # Generator.stream keywords (max_new_tokens, temperature, ...)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with `usage`
    return_token_ids: bool = False  # an extension (as vLLM's): the completion's token ids in the choice
    user: Optional[str] = None  # OpenAI's end-user id; written to the request's log line
    tools: Optional[ToolRequest] = None  # the functions the model may call (chat), and how
    reasoning_format: Optional[str] = None  # chat: one of REASONING_FORMATS; None: the server's default


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: Optional[bool] = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # extras are checked against _NEUTRAL below

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # not OpenAI's: the extension vLLM and llama.cpp also accept
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    stop: Union[str, list[str], None] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[_StreamOptions] = None
    user: Optional[str] = None
    return_token_ids: Optional[bool] = None


class _ChatBody(_Common):
    messages: list[Any]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    reasoning_format: Optional[str] = None  # llama.cpp's extension: "deepseek" (or "auto"), or "none"


class _CompletionBody(_Common):
    prompt: Any
    logprobs: Optional[int] = None  # the likeliest tokens' log-probabilities at each token: this many (0-20)
    response_format: Optional[dict] = None  # an extension (as vLLM's): the text follows a JSON schema


# OpenAI fields accepted only at a value that changes nothing (and null, always such a value)
_NEUTRAL_COMMON: dict[str, tuple] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
    "service_tier": ("auto", "default"), "store": (False,), "metadata": ({},),
}
_NEUTRAL_CHAT = {**_NEUTRAL_COMMON, "functions": ([],), "function_call": ("none",)}
_NEUTRAL_COMPLETION = {**_NEUTRAL_COMMON, "echo": (False,), "best_of": (1,), "suffix": ("",)}
_HINTS = {  # what offspec serve would need for the refused values
    "functions": "the deprecated functions API is not supported; send 'tools'",
    "function_call": "the deprecated functions API is not supported; send 'tools' and 'tool_choice'",
    "echo": "the prompt is not echoed", "best_of": "one candidate is generated", "suffix": "insertion is not supported",
}
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EXPECTED = {"stop": "a string or a list of strings", "seed": "an integer within 64 bits",
             "stream_options": 'an object like {"include_usage": true}'}


def _param(loc: tuple) -> str:
    return str(loc[0]) if loc else "body"


def _validate(cls: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON ({error['msg']})") from None
        if error["type"] == "model_type":
            raise APIError(400, "the request body must be a JSON object") from None
        param = _param(error["loc"])
        if error["type"] == "missing":
            raise APIError(400, f"missing required parameter: '{param}'", param=param) from None
        expected = _EXPECTED.get(param)
        message = f"expected {expected}" if expected else error["msg"]
        raise APIError(400, f"invalid value for '{param}': {message}", param=param) from None


def _check_extras(parsed: BaseModel, neutral: dict[str, tuple]) -> None:
    for name, value in (parsed.model_extra or {}).items():
        if name not in neutral:
            raise APIError(400, f"unrecognized request argument supplied: {name}", param=name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral[name]):
            allowed = " or ".join(json.dumps(v) for v in neutral[name] + (None,))
            hint = _HINTS.get(name, "offspec serve does not implement it")
            raise APIError(400, f"unsupported value for '{name}': {json.dumps(value)} ({hint}; only {allowed} "
                                f"is accepted)", param=name)


def _options(body: _Common, max_tokens: Optional[int], default_max_tokens: int) -> dict:
    """Generator.stream keywords, validated by the same configs as the CLI and the Python API."""
    if body.n not in (None, 1):
        raise APIError(400, f"unsupported value for 'n': {body.n} (offspec serve generates one choice per "
                            f"request; send n=1 or leave it out)", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "invalid value for 'stop': stop strings must not be empty", param="stop")
    options = dict(max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                   temperature=OPENAI_TEMPERATURE if body.temperature is None else body.temperature,
                   top_p=1.0 if body.top_p is None else body.top_p,
                   top_k=0 if body.top_k is None else body.top_k, seed=body.seed, stop=tuple(stop))
    try:
        SamplingConfig(temperature=options["temperature"], top_p=options["top_p"], top_k=options["top_k"],
                       seed=options["seed"]).validate()
        GenerationConfig(max_new_tokens=options["max_new_tokens"], stop=options["stop"]).validate()
    except OffspecError as exc:
        raise APIError(400, str(exc)) from None
    return options


def _request(body: _Common, *, chat: bool, prompt: Any, max_tokens: Optional[int],
             default_max_tokens: int, extra: Optional[dict] = None, tools: Optional[ToolRequest] = None,
             reasoning_format: Optional[str] = None) -> GenerationRequest:
    options = {**_options(body, max_tokens, default_max_tokens), **(extra or {})}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
    return GenerationRequest(model=body.model, chat=chat, prompt=prompt, options=options, stream=bool(body.stream),
                             include_usage=include_usage, return_token_ids=bool(body.return_token_ids),
                             user=body.user, tools=tools, reasoning_format=reasoning_format)


def _text(where: str, content: Any) -> str:
    """A message's content: a string, or a list of text parts (joined by newlines)."""
    if isinstance(content, list):  # content parts: only text
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}.content: only text parts are supported, got {kind!r}",
                               param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="messages")
    return content


_MESSAGE_FIELDS = {"system": {"role", "content"}, "developer": {"role", "content"}, "user": {"role", "content"},
                   "assistant": {"role", "content", "tool_calls", "reasoning_content"},
                   "tool": {"role", "content", "tool_call_id", "name"}}


def _message(i: int, message: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{where} must be an object with 'role' and 'content'", param="messages")
    role = message.get("role")
    if role not in _MESSAGE_FIELDS:
        raise APIError(400, f"{where}.role must be system, developer, user, assistant or tool, got {role!r}",
                       param="messages")
    extra = {k for k, v in message.items() if v is not None} - _MESSAGE_FIELDS[role]
    if extra:
        raise APIError(400, f"{where}: unsupported field(s) {', '.join(sorted(extra))} for a {role} message "
                            f"(offspec serve takes {', '.join(sorted(_MESSAGE_FIELDS[role]))})", param="messages")
    out = {"role": "system" if role == "developer" else role}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _history_calls(where, message["tool_calls"])
        out["content"] = _text(where, message["content"]) if message.get("content") is not None else ""
    else:
        out["content"] = _text(where, message.get("content"))
    if role == "assistant" and message.get("reasoning_content") is not None:  # an answer sent back as it came
        if not isinstance(message["reasoning_content"], str):
            raise APIError(400, f"{where}.reasoning_content must be a string", param="messages")
        out["reasoning_content"] = message["reasoning_content"]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise APIError(400, f"{where}: a tool message needs 'tool_call_id', the id of the call it answers",
                           param="messages")
        out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def _history_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's earlier tool calls, as OpenAI gives them (arguments as JSON text)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise APIError(400, f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                                f"{{\"name\", \"arguments\"}}}} with arguments as JSON text", param="messages")
        try:
            json.loads(f["arguments"])
        except json.JSONDecodeError:
            raise APIError(400, f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                           param="messages") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": f["name"], "arguments": f["arguments"]}})
    return out


def _tools(body: _ChatBody) -> Optional[ToolRequest]:
    """The request's tools and tool_choice, checked; None where it offers none."""
    functions = []
    for i, tool in enumerate(body.tools or []):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not FUNCTION_NAME.match(f["name"]):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                f"\"description\", \"parameters\"}}}} with a name of letters, digits, _ and - "
                                f"(at most 64)", param="tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: two functions have the same name", param="tools")
    choice, name = body.tool_choice if body.tool_choice is not None else ("auto" if functions else "none"), None
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(names) or 'none'})",
                           param="tool_choice")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ...}}}}, got {json.dumps(choice)}", param="tool_choice")
    if choice in ("required", "function") and not functions:
        raise APIError(400, f"tool_choice {choice!r} needs 'tools'", param="tool_choice")
    if not functions:
        return None
    return ToolRequest(tuple(functions), choice, name, body.parallel_tool_calls is not False)


def _response_format(value: Optional[dict]) -> dict:
    """Generator options for `response_format`: {"json_schema": ...} or nothing (plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                "{...}}}", param="response_format")
        return {"json_schema": schema}
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {json.dumps(kind)}",
                   param="response_format")


def _reasoning_format(value: Optional[str]) -> Optional[str]:
    """A request's reasoning_format (llama.cpp's names; "auto" is "deepseek"), checked."""
    if value == "auto":
        return "deepseek"
    if value is not None and value not in REASONING_FORMATS:
        raise APIError(400, f"unsupported value for 'reasoning_format': {json.dumps(value)} (offspec serve gives a "
                            f"model's reasoning apart in reasoning_content, deepseek or auto, or leaves it in the "
                            f"content, none)", param="reasoning_format")
    return value


def _top(value: Optional[int], param: str) -> None:
    if value is not None and (not 0 <= value <= MAX_TOP_LOGPROBS):
        raise APIError(400, f"invalid value for '{param}': it must be in 0..{MAX_TOP_LOGPROBS}", param=param)


def parse_chat(body: bytes, *, default_max_tokens: int) -> GenerationRequest:
    """A /v1/chat/completions body. Without max_tokens the reply may run to the end of the context."""
    parsed = _validate(_ChatBody, body)
    _check_extras(parsed, _NEUTRAL_CHAT)
    if not isinstance(parsed.messages, list) or not parsed.messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    messages = [_message(i, m) for i, m in enumerate(parsed.messages)]
    given = {parsed.max_tokens, parsed.max_completion_tokens} - {None}  # OpenAI's old and new name
    if len(given) > 1:
        raise APIError(400, "'max_tokens' and 'max_completion_tokens' differ; send one of them",
                       param="max_completion_tokens")
    max_tokens = given.pop() if given else None
    tools = _tools(parsed)
    extra = _response_format(parsed.response_format)
    if extra and tools is not None and tools.choice != "none":
        raise APIError(400, "response_format and tools cannot be combined (offspec serve holds the reply to one "
                            "grammar); send tool_choice none, or leave one out", param="response_format")
    _top(parsed.top_logprobs, "top_logprobs")
    if parsed.top_logprobs and not parsed.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if parsed.logprobs:
        extra["logprobs"] = parsed.top_logprobs or 0
    return _request(parsed, chat=True, prompt=messages, max_tokens=max_tokens, default_max_tokens=default_max_tokens,
                    extra=extra, tools=tools, reasoning_format=_reasoning_format(parsed.reasoning_format))


def parse_completion(body: bytes) -> GenerationRequest:
    """A /v1/completions body: one prompt (text, or token ids), sent as it is (no chat template)."""
    parsed = _validate(_CompletionBody, body)
    _check_extras(parsed, _NEUTRAL_COMPLETION)
    prompt = parsed.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids):
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a list holding one of them "
                            "(offspec serve runs one prompt per request)", param="prompt")
    extra = _response_format(parsed.response_format)
    _top(parsed.logprobs, "logprobs")
    if parsed.logprobs is not None:
        extra["logprobs"] = parsed.logprobs
    return _request(parsed, chat=False, prompt=prompt, max_tokens=parsed.max_tokens,
                    default_max_tokens=OPENAI_COMPLETION_MAX_TOKENS, extra=extra)
