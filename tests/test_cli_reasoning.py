"""`offspec generate` and a reasoning model (the scripted generator, its `reasoning` standing for the format of the
model's chat template): `--json` has the reasoning as its own field, the streamed answer alone goes to stdout."""

import json

import pytest

import offspec
from offspec.cli.main import main
from offspec.util.reasoning import THINK, ReasoningFormat
from tui.fake import FakeGenerator

THOUGHT, ANSWER = "Two and two.", "It is 4."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


@pytest.fixture
def loads(monkeypatch):
    """`offspec.load` gives this generator."""
    def use(generator):
        monkeypatch.setattr(offspec, "load", lambda progress=None, **options: generator)
        return generator

    return use


def run_json(capsys, *args) -> dict:
    assert main(["generate", "--target", "/x", "--json", *args, "2+2?"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_has_the_reasoning_apart(loads, capsys):
    loads(FakeGenerator(reply=REPLY, reasoning=ReasoningFormat(THINK)))
    out = run_json(capsys)
    assert (out["text"], out["reasoning"]) == (ANSWER, THOUGHT)
    assert list(out)[:2] == ["text", "reasoning"] and out["stop_reason"] == "eos" and out["passes"] >= 1
    loads(FakeGenerator(reply=f"{THOUGHT}\n</think>\n\n{ANSWER}", reasoning=ReasoningFormat(THINK, inside=True)))
    assert (lambda o: (o["text"], o["reasoning"]))(run_json(capsys)) == (ANSWER, THOUGHT)


def test_generate_json_of_a_model_without_markers_is_untouched(loads, capsys):
    loads(FakeGenerator(reply=REPLY))
    out = run_json(capsys)
    assert out["text"] == REPLY and out["reasoning"] is None


def test_generate_streams_the_answer_to_stdout_and_the_reasoning_to_stderr(loads, capsys):
    loads(FakeGenerator(reply=REPLY, tokens_per_pass=1, reasoning=ReasoningFormat(THINK)))
    assert main(["generate", "--target", "/x", "2+2?"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ANSWER + "\n"
    assert captured.err.startswith(THOUGHT + "\n[")  # then the statistics line
