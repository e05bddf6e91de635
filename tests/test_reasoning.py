"""offspec.util.reasoning: which reasoning markers a chat template uses, and the streaming splitter, with exact
expectations; and the Generator's side of it (the format read from the tokenizer, its markers kept in the text)."""

from __future__ import annotations

import pytest
from helpers.tiny import make_tokenizer

from offspec.config import TreeConfig
from offspec.generator import Generator, template_reasoning
from offspec.types import ModelInfo
from offspec.util.reasoning import (HARMONY, THINK, ReasoningFormat, ReasoningSplitter, Split, held_from_start,
                                    reasoning_format, split_reasoning)

TH, TH_IN = ReasoningFormat(THINK), ReasoningFormat(THINK, inside=True)
HA, HA_IN = ReasoningFormat(HARMONY), ReasoningFormat(HARMONY, inside=True)

# the parts of real templates that matter here (Qwen3-0.6B's, QwQ-32B's, gpt-oss's, Qwen2.5's)
QWEN3 = ("{%- for message in messages %}{%- if message.role == 'assistant' and '</think>' in message.content %}"
         "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}{%- else %}"
         "{%- set content = message.content %}{%- endif %}"
         "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
         "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
         "{%- endif %}{%- endif %}")
QWQ = ("{%- for message in messages %}{%- set content = message.content.split('</think>')[-1] %}"
       "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
       "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
GPT_OSS = ("{%- for message in messages %}{{- '<|start|>' + message.role + '<|message|>' + message.content + "
           "'<|end|>' }}{%- endfor %}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
           "{#- assistant turns: <|channel|>analysis / <|channel|>final #}")
QWEN25 = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
          "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def pieces(fmt, *texts: str) -> list[tuple[str, str]]:
    """(reasoning, answer) of each fed piece, then of finish()."""
    splitter = ReasoningSplitter(fmt)
    out = [splitter.feed(t) for t in texts] + [splitter.finish()]
    return [(s.reasoning, s.answer) for s in out]


# --- the format, from the template ----------------------------------------------------------------------------------

@pytest.mark.parametrize("template, prompt, expected", [
    (QWEN3, "<|im_start|>assistant\n", TH),
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", TH),  # enable_thinking=False: an empty, closed block
    (QWQ, "<|im_start|>assistant\n<think>\n", TH_IN),  # the prompt opens the block: the output starts inside it
    (GPT_OSS, "<|start|>assistant", HA),
    (GPT_OSS, "<|start|>assistant<|channel|>analysis<|message|>", HA_IN),
    (GPT_OSS, "<|start|>assistant<|channel|>final<|message|>", HA),
    (QWEN25, "<|im_start|>assistant\n", None),  # no markers: no split at all
    (None, "", None), ("", "", None),
    ({"default": QWEN3, "tool_use": QWEN3}, "", TH),  # transformers' named templates
])
def test_the_format_comes_from_the_template_text(template, prompt, expected):
    assert reasoning_format(template, prompt) == expected


def test_the_generator_reads_the_format_and_its_generation_prompt_from_the_tokenizer():
    for template, expected in [(QWEN3, TH), (QWQ, TH_IN), (GPT_OSS, HA), (QWEN25, None)]:
        tok = make_tokenizer()
        tok.chat_template = template
        assert template_reasoning(tok) == expected
    tok = make_tokenizer()
    tok.chat_template = "{{ raise_exception('no chat') }}</think>"  # renders nothing: the markers are still known
    assert template_reasoning(tok) == TH


def generator_on(tokenizer) -> Generator:
    info = ModelInfo(target="t", draft="d", device="cpu", dtype="float32", max_context=64, default_budget=4)
    return Generator(None, tokenizer, set(), info, TreeConfig())  # decoding needs no engine


def test_harmony_markers_stay_in_decoded_text_where_they_are_special_tokens():
    tok = make_tokenizer()
    tok.add_tokens(["<|channel|>", "<|message|>", "<|start|>", "<|end|>"], special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>",
                                                      "<|user|>", "</s>")}
    reply = ([ids["<|channel|>"]] + tok.encode("analysis") + [ids["<|message|>"]] + tok.encode("Sum.")
             + [ids["<|end|>"], ids["<|start|>"]] + tok.encode("assistant") + [ids["<|channel|>"]]
             + tok.encode("final") + [ids["<|message|>"]] + tok.encode("4") + [ids["<|user|>"], ids["</s>"]])
    tok.chat_template = QWEN25
    plain = generator_on(tok)
    assert plain.reasoning is None and plain.decode(reply) == "analysisSum.assistantfinal4"  # as before
    tok.chat_template = GPT_OSS
    harmony = generator_on(tok)
    text = harmony.decode(reply)  # the other special tokens are still left out
    assert text == "<|channel|>analysis<|message|>Sum.<|end|><|start|>assistant<|channel|>final<|message|>4"
    assert split_reasoning(text, harmony.reasoning) == Split("Sum.", "4")
    assert harmony.decode(reply, special=True).endswith("4<|user|></s>")


def test_think_markers_that_are_plain_added_tokens_change_nothing():
    tok = make_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3
    gen = generator_on(tok)
    assert gen.reasoning == TH and gen._hidden is None  # decoding is exactly as it was
    ids = tok.encode("<think>\nhm\n</think>\n\nok")
    assert gen.decode(ids) == tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"


# --- think ----------------------------------------------------------------------------------------------------------

def test_think_block_then_answer():
    assert split_reasoning("<think>\nLet me add.\n2+2=4.\n</think>\n\nIt is **4**.", TH) == \
        Split("Let me add.\n2+2=4.", "It is **4**.")


def test_think_markers_split_across_pieces():
    assert pieces(TH, "<thi", "nk>\nLet me", " add.\n</th", "ink>", "\n\nIt is", " 4.") == [
        ("", ""), ("Let me", ""), (" add.", ""), ("", ""), ("", "It is"), ("", " 4."), ("", "")]
    # a `<` that begins no marker is given out with the next piece
    assert pieces(TH, "<think>a <", "b> c</think>d") == [("a", ""), (" <b> c", "d"), ("", "")]


def test_trailing_whitespace_of_the_reasoning_waits_and_is_dropped():
    assert pieces(TH, "<think>\n\nab  ", "\n", "cd \n", "</think>\n", "\nx") == [
        ("ab", ""), ("", ""), ("  \ncd", ""), ("", ""), ("", "x"), ("", "")]


def test_a_block_never_closed_is_all_reasoning():
    assert pieces(TH, "<think>\nStill thinking", " when max_tokens cut it \n") == [
        ("Still thinking", ""), (" when max_tokens cut it", ""), ("", "")]
    assert pieces(TH, "<think>\nhalf a marker </thi") == [("half a marker", ""), (" </thi", "")]


def test_only_a_block_at_the_start_is_reasoning():
    assert split_reasoning("The tag <think> opens a block.", TH) == Split("", "The tag <think> opens a block.")
    assert split_reasoning("\n\n<think>x</think>y", TH) == Split("x", "y")  # leading whitespace before it is fine
    assert split_reasoning("  answer", TH) == Split("", "  answer")  # no block: the answer untouched
    assert pieces(TH, "<th", "e end") == [("", ""), ("", "<the end"), ("", "")]
    assert pieces(TH, "<thi") == [("", ""), ("", "<thi")]
    assert split_reasoning("<think>\n\n</think>\n\nHi", TH) == Split("", "Hi")  # an empty block: no reasoning
    assert split_reasoning("<think>a</think>b<think>c</think>", TH) == Split("a", "b<think>c</think>")


def test_output_that_starts_inside_the_block():
    assert pieces(TH_IN, "Let me see.", "\n</think>\n\nFour.") == [("Let me see.", ""), ("", "Four."), ("", "")]
    assert pieces(TH_IN, "<thi", "nk>\nsure\n</think>ok") == [("", ""), ("sure", "ok"), ("", "")]  # repeated: dropped
    assert split_reasoning("never closed", TH_IN) == Split("never closed", "")
    assert split_reasoning("", TH_IN) == Split("", "")


def test_held_from_start_outputs_are_not_inside_a_block():
    json_text = '{"name": "Ada"}'
    assert split_reasoning(json_text, TH_IN) == Split(json_text, "")  # read as if the prompt's block were open
    assert held_from_start(TH_IN) == TH and held_from_start(HA_IN) == HA
    assert held_from_start(TH) is TH and held_from_start(None) is None
    assert split_reasoning(json_text, held_from_start(TH_IN)) == Split("", json_text)


# --- harmony --------------------------------------------------------------------------------------------------------

ANALYSIS_FINAL = "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>4."


def test_harmony_analysis_is_the_reasoning_final_the_answer():
    assert split_reasoning(ANALYSIS_FINAL, HA) == Split("Simple sum.", "4.")
    assert split_reasoning(ANALYSIS_FINAL + "<|return|>", HA) == Split("Simple sum.", "4.")


def test_harmony_markers_split_across_pieces():
    assert pieces(HA, "<|chan", "nel|>analysis<|mess", "age|>Simple", " sum.<|e", "nd|><|start|>assis",
                  "tant<|channel|>final<|message|>4", ".") == [
        ("", ""), ("", ""), ("Simple", ""), (" sum.", ""), ("", ""), ("", "4"), ("", "."), ("", "")]


def test_harmony_preamble_joins_the_answer_and_two_analyses_join_the_reasoning():
    text = ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
            "<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.")
    assert split_reasoning(text, HA) == Split("First.\n\nSecond.", "Checking.\n\nDone.")


def test_a_harmony_tool_call_stays_in_the_answer_verbatim():
    call = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"P"}'
    text = "<|channel|>analysis<|message|>Need the weather.<|end|>" + call + "<|call|>"
    assert split_reasoning(text, HA) == Split("Need the weather.", call + "<|call|>")


def test_harmony_output_cut_short_and_output_without_channels():
    assert split_reasoning("<|channel|>analysis<|message|>cut sh", HA) == Split("cut sh", "")
    assert split_reasoning("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", HA) == Split("a", "")
    assert split_reasoning("Plain text, no channels.", HA) == Split("", "Plain text, no channels.")
    assert split_reasoning("Thinking.<|end|><|start|>assistant<|channel|>final<|message|>ok", HA_IN) == \
        Split("Thinking.", "ok")


# --- no format, and any cut of the text -----------------------------------------------------------------------------

def test_no_format_passes_everything_through_as_it_comes():
    assert pieces(None, "<think>", "x</think>", "y") == [("", "<think>"), ("", "x</think>"), ("", "y"), ("", "")]


@pytest.mark.parametrize("fmt, text", [
    (TH, "<think>\nLet me add.\n  2+2=4. \n</think>\n\nIt is <b>4</b>.\n"),
    (TH_IN, "<think> again\n</think>\nanswer </think>"),
    (TH, " <thx"),
    (HA, ANALYSIS_FINAL + "<|end|><|start|>assistant<|channel|>commentary to=f<|message|>{}<|call|>"),
    (HA, "<|start|>assistant<|channel|>final<|message|>Hi<|end|>trailing"),
    (None, "a<think>b"),
])
def test_any_cut_into_pieces_gives_the_whole_texts_split(fmt, text):
    whole = split_reasoning(text, fmt)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            got = pieces(fmt, text[:i], text[i:j], text[j:])
            assert Split("".join(r for r, _ in got), "".join(a for _, a in got)) == whole, (i, j)
    assert pieces(fmt, *text) and Split(*map("".join, zip(*pieces(fmt, *text)))) == whole  # character by character
