"""`offspec bench` on tiny random models: every set-up, the prompt formats, and the greedy-equality check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offspec import OffspecError
from offspec.cli import bench, bench_machine
from offspec.cli.bench import bench_max_budget, markdown_table, parse_setups, run_bench
from offspec.config import TreeConfig
from offspec.util.prompts import read_prompts

ROOT = Path(__file__).parent.parent


def test_prompt_file_formats(tmp_path):
    mt = tmp_path / "mt.jsonl"
    mt.write_text('{"question_id": 1, "turns": ["first?", "second?"]}\n\n{"turns": ["again"]}\n')
    assert read_prompts(mt) == ["first?", "again"]
    pj = tmp_path / "p.jsonl"
    pj.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert read_prompts(pj, n=2) == ["a", "b"]
    txt = tmp_path / "p.txt"
    txt.write_text("one prompt\n\nanother prompt\n")
    assert read_prompts(txt) == ["one prompt", "another prompt"]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": broken}\n', r":2: not valid JSON"),
    ('{"prompt": "ok"}\n{"text": "x"}\n', r":2: expected"),
    ("\n\n", "holds no prompts"),
])
def test_bad_prompt_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(OffspecError, match=message):
        read_prompts(path)


def test_missing_prompt_file_and_bad_setups(tmp_path):
    with pytest.raises(OffspecError, match="not found"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(OffspecError, match="unknown set-up"):
        parse_setups("ar,fast", TreeConfig())
    names = [s.name for s in parse_setups("64,chain5,ar,hf,auto", TreeConfig())]
    assert names[0] == "ar" and set(names) == {"ar", "tree64", "chain5", "hf-assisted", "auto"}


def test_drafter_setups_are_named_by_their_drafter():
    setups = {s.name: s for s in parse_setups("ar,model:8,suffix:16,hybrid:16,suffix:auto,8", TreeConfig())}
    assert set(setups) == {"ar", "model8", "suffix16", "hybrid16", "suffix-auto", "tree8"}
    assert setups["suffix16"].tree.drafter == "suffix" and setups["suffix16"].tree.budget == 16
    assert setups["suffix-auto"].tree is None and setups["suffix-auto"].drafter == "suffix"
    assert setups["tree8"].tree.drafter is None  # the generator's own drafter
    with pytest.raises(OffspecError, match="unknown set-up"):
        parse_setups("magic:8", TreeConfig())
    with pytest.raises(OffspecError, match="unknown set-up"):
        parse_setups("suffix:0", TreeConfig())


def test_auto_plans_up_to_the_load_default_and_fixed_budgets_reserve_only_their_largest():
    base = TreeConfig()
    assert bench_max_budget(parse_setups("ar,auto", base), 64) is None  # offspec.load's default, as chat has it
    assert bench_max_budget(parse_setups("ar,16,model:auto", base), 64) is None
    assert bench_max_budget(parse_setups("ar,16,suffix:256,chain8", base), 64) == 256
    assert bench_max_budget(parse_setups("ar,16", base), 64) == 64  # the generator's own default tree fits


def test_the_code_editing_prompt_set_ships_twenty_prompts_with_their_code():
    prompts = read_prompts(ROOT / "offspec" / "data" / "code_edits.jsonl")
    assert len(prompts) == 20 and all("```" in p for p in prompts)
    assert any(p.startswith("Rename the variable x to count") for p in prompts)


def test_drafter_setups_run_lossless_in_fresh_sessions(tiny_pair, tmp_path):
    prompts = ["ab ab ab ab", "ab ab ab ab"]  # the same prompt twice: the second must not copy the first's output
    setups = parse_setups("ar,model:8,suffix:8,hybrid:8,suffix:auto", TreeConfig())
    report = run_bench(tiny_pair, prompts, setups, max_new_tokens=24, temperature=0.0, out_dir=tmp_path)
    for name in ("model8", "suffix8", "hybrid8", "suffix-auto"):
        assert report["setups"][name]["greedy_mismatches"] == 0, name
    assert set(report["setups"]["suffix8"]["drafters"]) == {"suffix"}
    assert set(report["setups"]["model8"]["drafters"]) == {"model"}
    first, second = report["setups"]["suffix8"]["runs"]
    assert first["passes"] == second["passes"]  # no index over earlier generations in a benchmark
    # nor a cached prompt: a set-up after another on the same prompt would skip its prefill and look faster
    assert all(run["reused_prompt_tokens"] == 0 for s in report["setups"].values() for run in s["runs"])
    assert tiny_pair.engine.drafter.suffix.history is None
    tiny_pair.engine.drafter.use_history(True)
    table = (tmp_path / "bench.md").read_text()
    assert "| suffix8 | 2 |" in table and "suffix 100%" in table and "suffix-auto (budget" in table


def test_a_session_bench_gives_each_setup_its_own_replies_to_the_earlier_prompts(tiny_pair, tmp_path, monkeypatch):
    prompts = ["ab ab ab ab", "ab ab ab ab", "cd cd"]
    setups = parse_setups("ar,suffix:8", TreeConfig())
    drafter, given = tiny_pair.engine.drafter, []
    real = drafter.remember
    monkeypatch.setattr(drafter, "remember", lambda replies: (given.append([list(r) for r in replies]), real(replies)))
    report = run_bench(tiny_pair, prompts, setups, max_new_tokens=24, temperature=0.0, out_dir=tmp_path, session=True)
    ar, suffix = ([r["token_ids"] for r in report["setups"][name]["runs"]] for name in ("ar", "suffix8"))
    assert report["session"] is True and report["setups"]["suffix8"]["greedy_mismatches"] == 0
    # prompt by prompt, ar then suffix8: each run gets its own set-up's replies to the prompts before it, never
    # one to its own prompt
    assert given == [[], [], [ar[0]], [suffix[0]], ar[:2], suffix[:2]]
    first, second, _ = report["setups"]["suffix8"]["runs"]
    assert second["passes"] < first["passes"]  # the same prompt again: its reply is copied from the session
    assert all(run["reused_prompt_tokens"] == 0 for s in report["setups"].values() for run in s["runs"])
    monkeypatch.setattr(drafter, "remember", real)
    with pytest.raises(OffspecError, match="used session True, this run False"):  # --resume keeps the setting
        run_bench(tiny_pair, prompts, setups, max_new_tokens=24, temperature=0.0, out_dir=tmp_path, resume=True)
    drafter.use_history(True)


def test_every_setup_runs_and_greedy_runs_match(tiny_pair, tmp_path):
    prompts = ["Hello", "def f(x):"]
    setups = parse_setups("ar,hf,chain4,8,64,auto", TreeConfig())
    report = run_bench(tiny_pair, prompts, setups, max_new_tokens=16, temperature=0.0, out_dir=tmp_path)
    assert set(report["setups"]) == {"ar", "hf-assisted", "chain4", "tree8", "tree64", "auto"}
    for name, s in report["setups"].items():
        assert s["prompts"] == 2 and s["tokens"] > 0 and s["passes"] > 0
        if name not in ("ar", "hf-assisted"):
            assert s["greedy_mismatches"] == 0, name
    # transformers' assisted generation attends with SDPA, not offspec's exact kernel: compared, reported apart
    assert "greedy_mismatches" not in report["setups"]["hf-assisted"]
    assert 0 <= report["setups"]["hf-assisted"]["outputs_unlike_ar"] <= 2
    assert report["setups"]["ar"]["tokens_per_pass"] == 1.0
    assert report["setups"]["tree64"]["budgets"] == [64]
    assert report["setups"]["tree64"]["tokens_per_pass"] > 1.0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["environment"]["target"] and len(saved["setups"]["tree8"]["runs"]) == 2
    assert saved["environment"]["torch_threads"] >= 1
    for name, s in report["setups"].items():  # each run's prefill is timed apart, but transformers' (not split)
        if name == "hf-assisted":
            assert s["decode_tokens_per_second"] is None
        else:
            assert s["decode_tokens_per_second"] > s["tokens_per_second"] > 0, name
            assert all(0 < r["prefill_seconds"] < r["seconds"] for r in s["runs"]), name
    table = (tmp_path / "bench.md").read_text()
    assert "| tree64 | 2 |" in table and "greedy mismatches" in table and "tokens/s after the prompt" in table
    assert "| hf-assisted | 2 | " in table and table.split("| hf-assisted | 2 | ")[1].split(" | ")[2] == "-"
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_the_rate_after_the_prompt_leaves_each_prefill_out():
    runs = [{"tokens": 10, "seconds": 3.0, "prefill_seconds": 1.0}, {"tokens": 20, "seconds": 4.0, "prefill_seconds": 0.0}]
    assert bench._decode_rate(runs) == 30 / 6.0
    assert bench._decode_rate([*runs, {"tokens": 5, "seconds": 1.0}]) is None  # a run that did not split its time
    assert bench._decode_rate([]) is None


def test_the_memory_speed_is_probed_before_each_prompt_and_a_moved_speed_is_said(tiny_pair, tmp_path, monkeypatch):
    speeds = iter([30e9, 60e9])  # this VM's two memory speeds (docs/benchmarks.md)
    probed = []

    def probe(device, nbytes):
        probed.append((device.type, nbytes))
        return next(speeds)

    monkeypatch.setattr(bench_machine, "memory_bandwidth", probe)
    report = run_bench(tiny_pair, ["Hello", "Hi"], parse_setups("ar,8", TreeConfig()), max_new_tokens=4,
                       temperature=0.0, out_dir=tmp_path)
    assert probed == [("cpu", bench_machine.MEMORY_PROBE_BYTES)] * 2  # once a prompt, not once a set-up
    assert [(c["at_prompt"], c["copy_bytes_per_s"]) for c in report["memory_checks"]] == [(0, 30e9), (1, 60e9)]
    assert json.loads((tmp_path / "bench.json").read_text())["memory_checks"] == report["memory_checks"]
    table = (tmp_path / "bench.md").read_text()
    assert "Memory copy bandwidth before each prompt: 30.0-60.0 GB/s over 2 prompts, 2.00x apart: " in table
    steady = {**report, "memory_checks": [{"copy_bytes_per_s": 34e9}, {"copy_bytes_per_s": 36e9}]}
    assert "34.0-36.0 GB/s over 2 prompts." in markdown_table(steady)  # within 1.15x: nothing said to have moved
    assert "Memory copy" not in markdown_table({**report, "memory_checks": []})


def test_an_injected_mismatch_is_reported(tiny_pair, tmp_path, monkeypatch):
    real_generate = tiny_pair.generate

    def corrupt(prompt, **kwargs):
        result = real_generate(prompt, **kwargs)
        if kwargs.get("speculate"):
            result.token_ids[-1] += 1  # a lossy "speed-up"
        return result

    monkeypatch.setattr(tiny_pair, "generate", corrupt)
    report = run_bench(tiny_pair, ["Hello", "Hi"], parse_setups("ar,16", TreeConfig()), max_new_tokens=8,
                       temperature=0.0, out_dir=tmp_path)
    assert report["setups"]["tree16"]["greedy_mismatches"] == 2
    assert "| tree16 | 2 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow
def test_bench_cli_writes_table_json_and_plot(tiny_dirs, tmp_path):
    target, draft = tiny_dirs[("llama", 0)]
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\nWrite code\nThird one\n")
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "bench", "--target", str(target), "--draft",
                           str(draft), "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "8",
                           "--budgets", "ar,8", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| tree8 | 2 |" in proc.stdout
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (tmp_path / "out" / name).exists()


def test_resume_keeps_measured_prompts_and_runs_the_rest(tiny_pair, tmp_path, monkeypatch):
    setups = parse_setups("ar,8", TreeConfig())
    run_bench(tiny_pair, ["Hello", "Hi"], setups, max_new_tokens=8, temperature=0.0, out_dir=tmp_path)
    first = json.loads((tmp_path / "bench.json").read_text())
    ran: list[str] = []
    real_generate = tiny_pair.generate

    def counting(prompt, **kwargs):
        ran.append(prompt)
        return real_generate(prompt, **kwargs)

    monkeypatch.setattr(tiny_pair, "generate", counting)
    resumed: list[int] = []
    report = run_bench(tiny_pair, ["Hello", "Hi", "def f(x):"], setups, max_new_tokens=8, temperature=0.0,
                       out_dir=tmp_path, resume=True, on_resumed=resumed.append)
    assert ran == ["def f(x):", "def f(x):"] and resumed == [2]  # only the new prompt, by both set-ups
    assert [r["prompt"] for r in report["setups"]["tree8"]["runs"]] == [0, 1, 2]
    assert report["setups"]["ar"]["runs"][:2] == first["setups"]["ar"]["runs"]
    assert report["setups"]["tree8"]["prompts"] == 3 and report["setups"]["tree8"]["greedy_mismatches"] == 0
    assert report["environment"] == first["environment"] and report["resumed"][0]["at_prompt"] == 2
    assert report["resumed"][0]["prompts_matched_by_index_only"] == 0
    assert "| tree8 | 3 |" in (tmp_path / "bench.md").read_text()

    # A prompt that not every set-up finished runs again; different prompts or settings are refused.
    saved = json.loads((tmp_path / "bench.json").read_text())
    del saved["setups"]["tree8"]["runs"][2]
    (tmp_path / "bench.json").write_text(json.dumps(saved))
    ran.clear()
    run_bench(tiny_pair, ["Hello", "Hi", "def f(x):"], setups, max_new_tokens=8, temperature=0.0,
              out_dir=tmp_path, resume=True)
    assert ran == ["def f(x):", "def f(x):"]
    with pytest.raises(OffspecError, match="prompt 1 is not prompt 1"):
        run_bench(tiny_pair, ["Hello", "Other", "def f(x):"], setups, max_new_tokens=8, temperature=0.0,
                  out_dir=tmp_path, resume=True)
    with pytest.raises(OffspecError, match="holds 3 measured prompts, more than the 2 asked for; pass --n 3"):
        run_bench(tiny_pair, ["Hello", "Hi"], setups, max_new_tokens=8, temperature=0.0, out_dir=tmp_path,
                  resume=True)
    with pytest.raises(OffspecError, match="max_new_tokens 8, this run 16"):
        run_bench(tiny_pair, ["Hello"], setups, max_new_tokens=16, temperature=0.0, out_dir=tmp_path, resume=True)
    with pytest.raises(OffspecError, match="measured set-ups ar,tree8, not ar,tree16"):
        run_bench(tiny_pair, ["Hello"], parse_setups("ar,16", TreeConfig()), max_new_tokens=8, temperature=0.0,
                  out_dir=tmp_path, resume=True)
    (tmp_path / "bench.json").write_text("{not json")
    with pytest.raises(OffspecError, match="not a bench report"):
        run_bench(tiny_pair, ["Hello"], setups, max_new_tokens=8, temperature=0.0, out_dir=tmp_path, resume=True)


def test_resume_compares_the_thread_setting_not_the_governed_count(tiny_pair, tmp_path, monkeypatch):
    """Under the thread governor the count follows the machine's load (CI moved it from 2 to 1 between two runs);
    a resume checks the setting ("auto, at most N"), and a changed fixed count is still refused."""
    setups = parse_setups("ar", TreeConfig())
    run_bench(tiny_pair, ["Hello"], setups, max_new_tokens=4, temperature=0.0, out_dir=tmp_path)
    saved = json.loads((tmp_path / "bench.json").read_text())
    governed = {"threads": {"max_threads": 2, "threads": 2}}
    saved["environment"]["extra"] = {**(saved["environment"].get("extra") or {}), **governed}
    saved["environment"]["torch_threads"] = 2
    (tmp_path / "bench.json").write_text(json.dumps(saved))
    monkeypatch.setitem(tiny_pair.info.extra, "threads", {"max_threads": 2, "threads": 1})
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    run_bench(tiny_pair, ["Hello", "Hi"], setups, max_new_tokens=4, temperature=0.0, out_dir=tmp_path, resume=True)

    monkeypatch.delitem(tiny_pair.info.extra, "threads")
    saved = json.loads((tmp_path / "bench.json").read_text())
    saved["environment"]["extra"].pop("threads")
    (tmp_path / "bench.json").write_text(json.dumps(saved))
    with pytest.raises(OffspecError, match="measured with threads 2, this run has 1"):
        run_bench(tiny_pair, ["Hello"], setups, max_new_tokens=4, temperature=0.0, out_dir=tmp_path, resume=True)


def test_a_json_schema_bench_holds_every_setup_but_the_free_ones(tiny_pair, tmp_path):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "integer", "maximum": 9,
                                                                                 "minimum": 0}},
              "required": ["a", "b"], "additionalProperties": False}
    setups = parse_setups("ar,suffix:8,free:ar,free:suffix:8", TreeConfig())
    assert [s.name for s in setups] == ["ar", "free-ar", "suffix8", "free-suffix8"]
    report = run_bench(tiny_pair, ["Hello", "ab ab"], setups, max_new_tokens=40, temperature=0.0, out_dir=tmp_path,
                       json_schema=schema)
    held, free = report["setups"]["suffix8"], report["setups"]["free-suffix8"]
    assert held["greedy_mismatches"] == 0 and free["greedy_mismatches"] == 0  # each against its own ar
    assert held["json_parses"] == 2 and "json_parses" not in free
    assert report["setups"]["ar"]["runs"][0]["token_ids"] != report["setups"]["free-ar"]["runs"][0]["token_ids"]
    assert report["json_schema"] is not None
    with pytest.raises(OffspecError, match="json_schema"):  # a resumed run must hold the same schema
        run_bench(tiny_pair, ["Hello", "ab ab"], setups, max_new_tokens=40, temperature=0.0, out_dir=tmp_path,
                  resume=True)


def test_the_json_prompt_set_ships_ten_prompts_and_their_schema():
    prompts = read_prompts(ROOT / "offspec" / "data" / "json_prompts.jsonl")
    schema = json.loads((ROOT / "offspec" / "data" / "json_schema.json").read_text())
    assert len(prompts) == 10 and all(json.dumps(schema) in p for p in prompts)
    text = json.dumps(schema)  # nested objects, enums and arrays
    assert text.count('"properties"') >= 3 and '"enum"' in text and '"items"' in text


def test_no_memory_copy_is_probed_beside_a_streamed_target(tiny_pair, monkeypatch):
    """A streamed target's passes wait for the disk, and the copy's 256 MB lies outside the budget its placement
    fitted: it killed `bench --device-mem 1GB` inside a 1000M cgroup (issue 63)."""
    probed = []
    monkeypatch.setattr(bench_machine, "memory_bandwidth", lambda device, nbytes: probed.append(nbytes) or 1e9)
    monkeypatch.setitem(tiny_pair.info.extra, "placement", {"layers": {"device": 1, "ram": 0, "ssd": 3}})
    report = {}
    bench_machine.memory_check(tiny_pair, report, 0)
    assert probed == [] and "memory_checks" not in report
    monkeypatch.setitem(tiny_pair.info.extra, "placement", {"layers": {"device": 4, "ram": 0, "ssd": 0}})
    bench_machine.memory_check(tiny_pair, report, 0)
    assert probed == [bench_machine.MEMORY_PROBE_BYTES] and len(report["memory_checks"]) == 1
