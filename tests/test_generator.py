"""Generation loop and API on tiny random models: stops, streaming, multi-turn reuse, bad input."""

import threading

import pytest

import offspec
from offspec import GenerationResult, OffspecError, TextDelta


def test_stream_yields_deltas_then_result_and_texts_agree(tiny_pair):
    events = list(tiny_pair.stream("Hello", max_new_tokens=24, budget=8))  # a fixed tree: every pass has one
    assert isinstance(events[-1], GenerationResult)
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert deltas and all(isinstance(d.text, str) for d in deltas)
    assert "".join(d.text for d in deltas) == events[-1].text
    per_pass = [d for d in deltas if d.stats is not None]
    assert len(per_pass) == events[-1].n_passes
    assert per_pass[-1].stats.tree is not None  # the UI's tree panel gets the tree of each pass
    result = events[-1]
    assert result.stop_reason in ("max_tokens", "eos")
    assert sum(p.emitted for p in result.passes) == len(result.token_ids)
    assert all(p.emitted <= p.accepted + 1 for p in result.passes)


def test_max_new_tokens_is_exact(tiny_pair):
    res = tiny_pair.generate("Hello", max_new_tokens=7, budget=64)
    assert len(res.token_ids) == 7 or res.stop_reason == "eos"


def test_stop_string_cuts_the_text(tiny_pair):
    full = tiny_pair.generate("Hello", max_new_tokens=40)
    assert len(full.text) > 6
    stop = full.text[3:5]
    first = full.text.find(stop)
    res = tiny_pair.generate("Hello", max_new_tokens=40, stop=[stop])
    assert res.stop_reason == "stop"
    assert res.text == full.text[:first]
    assert stop not in "".join(e.text for e in tiny_pair.stream("Hello", max_new_tokens=40, stop=[stop])
                               if isinstance(e, TextDelta))


def test_eos_stops_generation(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 1)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=256)
    plain = gen.generate("x", max_new_tokens=60, speculate=False)
    # force an EOS: make the token the model would emit at step 3 an end-of-sequence token
    gen.eos_ids = gen.eos_ids | {plain.token_ids[3]}
    res = gen.generate("x", max_new_tokens=60)
    cut = plain.token_ids.index(plain.token_ids[3])
    assert res.stop_reason == "eos"
    assert res.token_ids == plain.token_ids[:cut]


def test_multi_turn_reuses_the_shared_prefix_and_matches_a_fresh_run(tiny_dirs):
    target, draft = tiny_dirs[("llama", 1)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=256)
    messages = [{"role": "user", "content": "hi"}]
    first = gen.generate(messages, max_new_tokens=12)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    second = gen.generate(messages, max_new_tokens=12)
    assert second.reused_prompt_tokens >= len(gen.encode(messages[:1]))
    fresh = offspec.load(str(target), str(draft), dtype="float64", max_context=256)
    again = fresh.generate(messages, max_new_tokens=12)
    assert again.reused_prompt_tokens == 0
    assert again.token_ids == second.token_ids


def test_context_limit_stops_with_a_reason(tiny_dirs):
    target, draft = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=40, max_budget=64)
    res = gen.generate("Hello", max_new_tokens=100, budget=16)
    assert res.stop_reason == "context"
    assert res.prompt_tokens + len(res.token_ids) == 40
    with pytest.raises(OffspecError, match="context limit"):
        gen.generate("x" * 60)


def test_cancel_stops_between_passes(tiny_pair):
    cancel = threading.Event()
    events = []
    for event in tiny_pair.stream("Hello", max_new_tokens=100, budget=2, cancel=cancel):
        events.append(event)
        cancel.set()
    assert events[-1].stop_reason == "cancelled"
    assert 1 <= events[-1].n_passes <= 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget must be a positive integer"),
    (dict(budget=-3), "budget must be a positive integer"),
    (dict(budget=100000), "above max_budget"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_generation_options_are_clear_errors(tiny_pair, kwargs, message):
    with pytest.raises(OffspecError, match=message):
        tiny_pair.generate("Hello", **kwargs)


def test_bad_load_options_are_clear_errors(tiny_dirs):
    target, draft = tiny_dirs[("llama", 0)]
    with pytest.raises(OffspecError, match="budget must be a positive integer"):
        offspec.load(str(target), str(draft), budget=0)
    with pytest.raises(OffspecError, match="unknown option"):
        offspec.load(str(target), str(draft), bugdet=3)
    with pytest.raises(OffspecError):
        offspec.load(str(target) + "-missing", str(draft))


def test_the_prompts_prefill_is_timed_apart_from_the_decode(tiny_pair, monkeypatch):
    """A clock that moves only where the test says: 5 s in the prefill, 1 s a pass."""
    import offspec.generator as generator_module

    now = [100.0]
    monkeypatch.setattr(generator_module.time, "perf_counter", lambda: now[0])
    engine = tiny_pair.engine
    engine.forget()  # the fixture is shared: start cold
    reset_to, step = engine.reset_to, engine.autoregressive_step

    def slow_reset(tokens):
        now[0] += 5.0
        return reset_to(tokens)

    def slow_step(chooser):
        now[0] += 1.0
        return step(chooser)

    monkeypatch.setattr(engine, "reset_to", slow_reset)
    monkeypatch.setattr(engine, "autoregressive_step", slow_step)
    result = tiny_pair.generate("Hello there", max_new_tokens=8, speculate=False)
    assert len(result.token_ids) == result.n_passes == 8
    assert result.prefill_seconds == 5.0 and result.seconds == 13.0
    assert result.tokens_per_second == 8 / 13.0 and result.decode_tokens_per_second == 1.0
    assert result.prefill_tokens == result.prompt_tokens - 1  # a cold cache: all but the last prompt token
    again = tiny_pair.generate("Hello there", max_new_tokens=8, speculate=False)
    assert again.reused_prompt_tokens == again.prompt_tokens - 1 and again.prefill_tokens == 0
    summary = result.summary()
    assert summary["prefill_seconds"] == 5.0 and summary["decode_tokens_per_second"] == 1.0
