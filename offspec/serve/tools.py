"""Tool calls for `offspec serve`: the functions a request offers, shown to the model through its chat template, its
calls read back from the output as OpenAI's `tool_calls`, and the grammar that keeps them valid.

The model's own way of calling (`ToolFormat`) comes from its chat template:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call (Qwen2, Qwen2.5, Qwen3,
  Hermes; and any other template that shows the tools itself);
- llama3: the reply is one `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3, `<|python_tag|>` before it allowed);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
A template that does not show tools (Gemma, Phi-3, SmolLM2, Llama 2) gets them in the system message with the
hermes instructions, and the conversation's calls and results as text (`ToolPlan.messages`).

`tool_choice`: "none" shows the model no tools; "auto" lets it answer or call, a call's JSON held to the functions'
schemas (hermes, mistral) by a grammar that takes effect at the call's first token; "required" and a named function
force one call (several where `parallel_tool_calls`), through the same grammar from the first token. The grammar
masks the target's tokens at every position, so speculation stays on and lossless (offspec/spec/grammar.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from offspec.errors import OffspecError
from offspec.spec.grammar import JSON_OPTIONS


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: its function definitions ({"name", "description", "parameters"}), the choice
    ("auto", "none", "required" or "function": the one named `name`) and whether several calls may come at once."""

    functions: tuple[dict, ...]
    choice: str = "auto"
    name: Optional[str] = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["name"] for f in self.functions)

    def offered(self) -> list[dict]:
        """The functions as chat templates take them: OpenAI's {"type": "function", "function": {...}}."""
        return [{"type": "function", "function": f} for f in self.functions]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = ""

    def openai(self, index: Optional[int] = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Parsed:
    content: Optional[str]  # the text before the calls (None: none)
    calls: tuple[ToolCall, ...]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, args_key: str) -> Optional[ToolCall]:
    """A ToolCall from a decoded {"name": ..., args_key: {...}}, or None where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # already JSON text
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args, _call_id())
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), _call_id())


def _schema(request: ToolRequest, args_key: str) -> dict:
    """The JSON schema of one call: {"name": one of the functions (the named one only), args_key: its parameters}."""
    options = []
    for f in request.functions:
        if request.choice == "function" and f["name"] != request.name:
            continue
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def _lark_text(s: str) -> str:
    return json.dumps(s)


class ToolFormat:
    """How one family of chat templates calls tools: parse its output, and the grammar of its calls."""

    name = ""

    def parse(self, text: str, names: Sequence[str] = ()) -> Optional[Parsed]:
        """The calls in a whole reply (and the text before them); None where the reply holds no well-formed call.
        `names`: the functions offered."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a reply in progress is surely plain text (streamed at once; the rest waits for the end)."""
        raise NotImplementedError

    def grammar(self, request: ToolRequest) -> Optional[str]:
        """A Lark grammar (llguidance's dialect) for the reply, or None: unconstrained."""
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def __init__(self, special: Optional[tuple[int, int]] = None):
        self.special = special  # the token ids of <tool_call> and </tool_call> where they are special tokens

    def parse(self, text: str, names: Sequence[str] = ()) -> Optional[Parsed]:
        start = text.find(self.START)
        if start < 0:  # a small model may write the call as bare JSON, or in a ```json block
            call = _bare_call(text, names, "arguments")
            return Parsed(None, (call,)) if call is not None else None
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
        return Parsed(text[:start].strip() or None, tuple(calls)) if calls else None

    def content_end(self, text: str) -> int:
        if self.START not in text and _may_be_bare_call(text.lstrip()):
            return 0
        return _before_marker(text, self.START)

    def grammar(self, request: ToolRequest) -> Optional[str]:
        if self.special is not None:  # the markers are tokens of their own, which plain text never contains
            begin, end = (f"<[{i}]>" for i in self.special)
        else:
            begin, end = _lark_text(self.START), _lark_text(self.END)
        body = f'"\\n" %json {json.dumps(_schema(request, "arguments"))} "\\n" {end}'
        calls = 'call ("\\n" call)*' if request.parallel else "call"
        if request.choice in ("required", "function"):
            return f"start: {calls}\ncall: {begin} {body}\n"
        if self.special is not None:  # auto: text, then the calls (after them only the end of the reply)
            return f"start: TEXT? ({calls})?\ncall: {begin} {body}\nTEXT: /(.|\\n)+/\n"
        # auto, a marker of plain text: a lazy lexeme ends the text at the marker, and the call's grammar holds
        # from there (as llguidance's StructTag does)
        shape = "(head body)* TEXT" if request.parallel else "head body | TEXT"
        return f"start: {shape}\nhead[lazy]: TEXT {begin}\nbody: {body}\nTEXT: /(.|\\n)*/\n"


class Llama3(ToolFormat):
    name = "llama3"
    TAG = "<|python_tag|>"

    def parse(self, text: str, names: Sequence[str] = ()) -> Optional[Parsed]:
        body = text.strip()
        body = body[len(self.TAG):].strip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return None
        calls = []
        for part in _json_objects(body):
            call = _call(part, "parameters")
            if call is None:
                return None
            calls.append(call)
        return Parsed(None, tuple(calls)) if calls else None

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or self.TAG.startswith(head[: len(self.TAG)]):
            return 0  # it may be a call: wait for the end
        return len(text)

    def grammar(self, request: ToolRequest) -> Optional[str]:
        if request.choice not in ("required", "function"):
            return None  # a call is the whole reply: no marker to switch the grammar on
        one = f"%json {json.dumps(_schema(request, 'parameters'))}"
        return f"start: {one} (\"; \" {one})*\n" if request.parallel else f"start: {one}\n"


class Mistral(ToolFormat):
    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def __init__(self, special: Optional[int] = None):
        self.special = special  # the token id of [TOOL_CALLS] where it is a special token

    def parse(self, text: str, names: Sequence[str] = ()) -> Optional[Parsed]:
        start = text.find(self.MARK)
        if start < 0:
            return None
        try:
            items = json.loads(text[start + len(self.MARK):].strip())
        except json.JSONDecodeError:
            return None
        items = items if isinstance(items, list) else [items]
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return Parsed(text[:start].strip() or None, tuple(calls))

    def content_end(self, text: str) -> int:
        return _before_marker(text, self.MARK)

    def grammar(self, request: ToolRequest) -> Optional[str]:
        array = {"type": "array", "items": _schema(request, "arguments"), "minItems": 1,
                 **({} if request.parallel else {"maxItems": 1}), "x-guidance": JSON_OPTIONS}
        mark = f"<[{self.special}]>" if self.special is not None else _lark_text(self.MARK)
        calls = f"{mark} %json {json.dumps(array)}"
        if request.choice in ("required", "function"):
            return f"start: {calls}\n"
        if self.special is None:
            return None  # a plain-text marker in free text: parsed, not held
        return f"start: TEXT? calls?\ncalls: {calls}\nTEXT: /(.|\\n)+/\n"


_FENCE = re.compile(r"```(?:json)?[ \t]*\n?\s*")


def _may_be_bare_call(head: str) -> bool:
    """Whether a reply beginning with `head` (no leading whitespace) may still be a call written as bare JSON or
    in a ```json block."""
    if not head or head.startswith("{") or "```json".startswith(head):
        return True
    fence = _FENCE.match(head)
    return fence is not None and (fence.end() == len(head) or head[fence.end()] == "{")


def _bare_call(text: str, names: Sequence[str], args_key: str) -> Optional[ToolCall]:
    """A whole reply that is one {"name": <an offered function>, "arguments": {...}}, bare or in a ```json block."""
    body = text.strip()
    fence = _FENCE.match(body)
    if fence is not None and body.endswith("```"):
        body = body[fence.end() : -3].strip()
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or set(obj) - {"name", args_key}:
        return None
    return _call(obj, args_key)


def _before_marker(text: str, marker: str) -> int:
    """The length of `text` before `marker` (or before a tail that may be its beginning)."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


def _json_objects(text: str) -> list:
    """The JSON values in `text`, separated by whitespace or ';' (Llama 3's parallel calls); [] if any is not."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\n;":
            i += 1
        if i == len(text):
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        values.append(value)
    return values


# --- a model's format, and the prompt ------------------------------------------------------------------------------

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _special_id(tokenizer, text: str) -> Optional[int]:
    """The id of `text` where the tokenizer has it as one added token, else None."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return added.get(text)


def tool_format(tokenizer) -> tuple[ToolFormat, bool]:
    """(the model's tool format, whether its chat template shows tools itself)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    shows = "tools" in template
    if "[TOOL_CALLS]" in template:
        return Mistral(_special_id(tokenizer, Mistral.MARK)), shows
    if Llama3.TAG in template or ("ipython" in template and "parameters" in template):
        return Llama3(), shows
    begin, end = _special_id(tokenizer, Hermes.START), _special_id(tokenizer, Hermes.END)
    return Hermes((begin, end) if begin is not None and end is not None else None), shows


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools runs: its messages, the tools for the template, the grammar, the output's format."""

    messages: list
    template_tools: Optional[list]  # None: the template is not given tools (they are in the messages, or none)
    grammar: Optional[str]
    format: ToolFormat


def plan(request: Optional[ToolRequest], messages: Sequence[dict], tokenizer) -> ToolPlan:
    """How `messages` run with `request`'s tools on a model with `tokenizer`."""
    fmt, shows = tool_format(tokenizer)
    messages = [_template_message(m) for m in messages]
    if request is None or request.choice == "none":
        tools = None
    elif shows:
        tools = request.offered()
    else:  # the template shows no tools: the hermes instructions in the system message, calls and results as text
        tools = None
        messages = _as_text(messages, request)
    if tools is None and not shows and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = _as_text(messages, None)  # earlier calls and results, as text the template can render
    grammar = fmt.grammar(request) if request is not None and request.choice != "none" else None
    return ToolPlan(messages, tools, grammar, fmt)


def _template_message(message: dict) -> dict:
    """A message as chat templates take it: an assistant's call arguments decoded (templates write them with
    `tojson`), an assistant's missing content empty."""
    out = dict(message)
    if out.get("tool_calls"):
        calls = []
        for c in out["tool_calls"]:
            f = c["function"]
            args = f.get("arguments") or "{}"
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    raise OffspecError(f"the arguments of tool call {c.get('id', f['name'])!r} are not valid JSON") \
                        from None
            calls.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
        out["tool_calls"] = calls
        out["content"] = out.get("content") or ""
    return out


def _as_text(messages: list[dict], request: Optional[ToolRequest]) -> list[dict]:
    """The conversation for a template without tools: the hermes instructions (when `request` offers tools) in the
    system message, each assistant call as a <tool_call> block, each tool result as a user turn."""
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            out.append({"role": "assistant", "content": f"{m['content']}\n{text}".strip()})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].endswith("</tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if request is not None:
        tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in request.offered())
        instructions = HERMES_SYSTEM.format(tools=tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


class ToolStream:
    """A reply with tools, streamed: its plain text as soon as it cannot be a call's beginning, its calls at the end.
    It reads the reply's text in pieces (decoded with special tokens kept: the markers of some formats are special
    tokens; a reasoning model's answer alone, its reasoning split off first: offspec/serve/reply.py)."""

    def __init__(self, fmt: ToolFormat, names: Sequence[str]):
        self.format, self.names = fmt, names
        self.text = ""
        self.sent = 0  # characters of the text sent as content

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.text += text
        end = self.format.content_end(self.text)
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(the content not sent yet, the calls) once the reply is whole; a reply with no well-formed call is
        content to the end."""
        parsed = self.format.parse(self.text, self.names)
        if parsed is None:
            return self.text[self.sent :], ()
        return self.text[self.sent : max(self.sent, self.format.content_end(self.text))].rstrip(), parsed.calls
