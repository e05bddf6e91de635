"""A busy machine (issue 15, item 9): the OpenMP wait policy, threads sized to the free cores, `auto`
re-planning when pass times drift from the profile, and the measured guard against the target alone.

All scripted (fake CPU samples, scripted PassStats): the real effect is measured by a benchmark command
(`offspec bench` beside a load, docs/benchmarks.md), not by a timed test."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offspec.config import TreeConfig
from offspec.profile.adapt import AdaptConfig, AdaptiveBudget
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.guard import GuardConfig, SpeedGuard
from offspec.profile.planner import PairCosts, PlannerConfig, draft_seconds, plan
from offspec.types import PassStats
from offspec.util.threads import CpuSample, ThreadGovernor, read_cpu

ROOT = Path(__file__).parent.parent
BUDGETS = (1, 2, 4, 8, 16, 32, 64)


# -- the OpenMP wait policy --------------------------------------------------------------------


def python(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_offspec_first_sets_a_passive_wait_policy_unless_the_user_chose():
    code = "import offspec, os, offspec.util.threads as t; print(os.environ.get('OMP_WAIT_POLICY'), t.openmp_env_applied())"
    assert python(code) == "PASSIVE True"
    assert python(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE True"  # the user's choice stands
    spin = "import offspec, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert python(spin) == "20000"  # a short spin before sleeping, with the passive policy only
    assert python(spin, OMP_WAIT_POLICY="ACTIVE") == "None"
    assert python(spin, GOMP_SPINCOUNT="5") == "5"
    late = "import torch, offspec, os, offspec.util.threads as t; print(os.environ.get('OMP_WAIT_POLICY'), t.openmp_env_applied())"
    assert python(late) == "None False"  # torch's pool already started: offspec says so instead of pretending
    # the CLI entry imports offspec before torch
    assert python("import main, os; print(os.environ.get('OMP_WAIT_POLICY'))") == "PASSIVE"


# -- threads sized to the free cores ------------------------------------------------------------


class FakeCpu:
    """CPU time accounting of a 2-core machine: `others` cores busy with other processes, `own` with us."""

    def __init__(self):
        self.wall = self.busy = self.own_time = 0.0
        self.others, self.own = 0.0, 1.0
        self.reads = 0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.busy += seconds * min(2.0, self.others + self.own)
        self.own_time += seconds * self.own

    def read(self, cpus) -> CpuSample:
        self.reads += 1
        return CpuSample(self.wall, self.busy, self.own_time)

    def clock(self) -> float:
        return self.wall


def test_governor_sizes_threads_to_the_cores_other_processes_leave():
    cpu, threads = FakeCpu(), [2]
    gov = ThreadGovernor(max_threads=2, cpus=[0, 1], read=cpu.read, clock=cpu.clock,
                         set_threads=lambda n: threads.__setitem__(0, n), get_threads=lambda: threads[0])
    cpu.advance(5.0)
    assert gov.update(force=True) is False and threads == [2]  # quiet machine: both cores
    cpu.others = 1.0  # a CPU hog starts on one core
    for _ in range(3):
        cpu.advance(1.0)
        reads = cpu.reads
        assert gov.update() is False and cpu.reads == reads  # sampled at most every interval (2 s): not read
        cpu.advance(1.5)
        gov.update()
    assert threads == [1] and gov.others == pytest.approx(1.0, abs=0.2)
    assert gov.changes[-1]["threads"] == 1
    cpu.others = 0.0  # it ends
    for _ in range(4):
        cpu.advance(2.5)
        gov.update()
    assert threads == [2]
    cpu.others = 2.0  # everything busy: never below one thread
    for _ in range(4):
        cpu.advance(2.5)
        gov.update()
    assert threads == [1]


def test_a_childs_cpu_time_counts_as_our_own():
    # the first load compiles the kernels in a child process: the governor must not take that for a CPU hog
    cpus = list(range(os.cpu_count() or 1))
    before = read_cpu(cpus)
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"],
                   check=True, timeout=60)
    after = read_cpu(cpus)
    assert after.own - before.own >= 0.45  # the child's half second of CPU, counted once it was waited for


def test_governor_never_goes_above_the_configured_threads():
    cpu, threads = FakeCpu(), [1]
    gov = ThreadGovernor(max_threads=1, cpus=[0, 1], read=cpu.read, clock=cpu.clock,
                         set_threads=lambda n: threads.__setitem__(0, n), get_threads=lambda: threads[0])
    cpu.advance(10)
    gov.update(force=True)
    assert threads == [1] and gov.wanted() == 1  # e.g. OMP_NUM_THREADS=1 is a ceiling


def test_threads_option_is_checked_before_loading():
    import offspec
    from offspec.api import check_options

    for bad in (0, -2, 1.5, "two"):
        with pytest.raises(offspec.OffspecError, match="threads must be a positive whole number"):
            check_options(target="/nonexistent", threads=bad)


# -- auto re-plans when pass times drift from the profile ---------------------------------------


def costs() -> PairCosts:
    """A target pass of 0.3 s (+10 ms a token), a draft step of 20-60 ms."""
    return PairCosts(target_pass=CostCurve.of([(1, 0.3), (65, 0.94)]), target_head=0.002,
                     draft_step=CostCurve.of([(1, 0.02), (64, 0.06)]))


def acceptance() -> AcceptanceCurve:
    return AcceptanceCurve.of(BUDGETS, [3.0 * (1 - math.exp(-b / 6)) for b in BUDGETS])


def policy(guard=None, **adapt) -> AdaptiveBudget:
    return AdaptiveBudget(costs(), acceptance(), PlannerConfig(budgets=BUDGETS), AdaptConfig(**adapt), guard=guard)


def run_passes(p: AdaptiveBudget, n: int, draft_factor: float, target_factor: float,
               plain_seconds: float = None) -> list[int]:
    """n passes that accept what the curve predicts and take the predicted times x the factors.
    Returns the budget of each pass (0: without a tree)."""
    used = []
    c, acc = costs(), acceptance()
    for _ in range(n):
        if not p.use_tree():
            seconds = plain_seconds if plain_seconds is not None else c.autoregressive_seconds() * target_factor
            p.observe(PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0.0, target_seconds=seconds,
                                budget=0))
            used.append(0)
            continue
        tree = p.next_tree(TreeConfig())
        accepted = round(min(acc(tree.budget, tree.max_depth), tree.budget))
        draft = draft_seconds(c, acc, tree.budget, tree.max_beams, tree.max_depth) * draft_factor
        target = (c.target_pass(tree.budget + 1) + (1 + accepted) * c.target_head) * target_factor
        p.observe(PassStats(tree_size=tree.budget, accepted=accepted, emitted=accepted + 1, draft_seconds=draft,
                            target_seconds=target, budget=tree.budget))
        used.append(tree.budget)
    return used


def test_times_as_predicted_keep_the_plan():
    p = policy()
    start = p.plan.best.budget
    assert p.plan.speculates and start > 1
    assert set(run_passes(p, 40, 1.0, 1.0)) == {start}
    assert not [r for r in p.replans if r.reason == "timing"]
    assert p.summary()["draft_time_scale"] == 1.0


def test_a_slower_draft_replans_with_its_measured_scale():
    """Issue 15's busy machine made draft steps 12x slower: the plan must follow and drop the tree."""
    p = policy()
    assert p.plan.speculates
    used = run_passes(p, 40, draft_factor=10.0, target_factor=1.0)
    timing = [r for r in p.replans if r.reason == "timing"]
    assert timing, "a draft 10x slower than profiled must re-plan"
    assert p.draft_time_scale == pytest.approx(10.0, rel=0.05) and p.target_time_scale == pytest.approx(1.0, rel=0.05)
    expected = plan(costs().scaled(draft=10.0), acceptance(), PlannerConfig(budgets=BUDGETS))
    assert p.plan.best == expected.best and not expected.speculates  # a draft that dear: the target alone
    assert used[-5:] == [0] * 5
    assert p.summary()["replans"][-1]["reason"] == "timing"
    assert p.summary()["draft_time_scale"] == pytest.approx(10.0, rel=0.05)


def test_a_moderately_slower_draft_lowers_the_prediction_but_keeps_trees():
    p = policy()
    before = p.plan.best.tokens_per_second
    run_passes(p, 40, draft_factor=2.0, target_factor=1.0)
    expected = plan(costs().scaled(draft=2.0), acceptance(), PlannerConfig(budgets=BUDGETS))
    assert p.plan.best == expected.best and p.plan.speculates
    assert p.plan.best.tokens_per_second < before


def test_without_trees_the_target_alone_still_drives_timing():
    """When the plan says no tree, passes time the target alone; a faster machine brings trees back."""
    slow = policy()
    slow.draft_time_scale = slow.target_time_scale = 1.0
    slow.costs = costs().scaled(draft=30.0)  # profiled on a machine where drafting was hopeless
    slow.plan = plan(slow.costs, acceptance(), PlannerConfig(budgets=BUDGETS))
    assert not slow.plan.speculates
    used = run_passes(slow, 30, draft_factor=30.0 / 30.0, target_factor=0.2)  # everything 5x faster now
    assert slow.target_time_scale == pytest.approx(0.2, rel=0.05)
    assert slow.draft_time_scale == pytest.approx(0.2, rel=0.05)  # assumed to follow the target
    assert [r.reason for r in slow.replans] == ["timing"]
    assert used[0] == 0


def test_guard_turns_trees_off_when_the_target_alone_is_measured_faster_and_probes_back():
    p = policy(guard=GuardConfig())
    assert p.plan.speculates
    c = costs()
    # the plan says trees, but on this machine the target alone takes 0.05 s while trees take their planned time
    used = run_passes(p, 60, 1.0, 1.0, plain_seconds=0.05)
    guard = p.guard
    assert not guard.trees_on and guard.switches[0]["trees"] is False
    assert used[:4] == [p.plan.best.budget] * 4 and used[4] == 0  # the first plain probe comes early
    tail = used[-30:]
    assert tail.count(0) >= 28  # now mostly without a tree, with rare tree probes
    assert guard.tree_every > GuardConfig().tree_every  # losing probes back off
    # the target alone slows down (e.g. the other process ends and trees pay again): a probe wins, trees return
    used = run_passes(p, 200, 1.0, 1.0, plain_seconds=c.autoregressive_seconds() * 3)
    assert guard.trees_on and guard.switches[-1]["trees"] is True
    assert used[-10:].count(p.plan.best.budget) >= 9


def test_guard_leaves_trees_on_when_they_are_faster():
    g = SpeedGuard(GuardConfig())
    plain = 0
    for i in range(100):
        if g.wants_tree():
            g.observe_tree(seconds=1.0, expected_tokens=3.0)  # 3 tokens/s
        else:
            g.observe_plain(seconds=0.5)  # 2 tokens/s
            plain += 1
    assert g.trees_on and not g.switches
    assert 4 <= plain <= 100 // GuardConfig().plain_every + 2  # a plain probe now and then, not more


def test_generator_resets_timing_when_the_thread_count_changes(tiny_pair):
    """The generator asks the governor between passes; a change makes the policy forget old pass times."""
    calls = []

    class Governor:
        def __init__(self):
            self.n = 0

        def update(self):
            self.n += 1
            return self.n == 2  # the thread count changes before the second pass

        def summary(self):
            return {"threads": 1}

    class Policy:
        base_tree = tiny_pair.tree
        speculates = True

        def use_tree(self):
            return False

        def next_tree(self, base):
            return base

        def observe(self, stats):
            calls.append("observe")

        def reset_timing(self):
            calls.append("reset")

    saved = tiny_pair.threads, tiny_pair.policy
    try:
        tiny_pair.threads, tiny_pair.policy = Governor(), Policy()
        result = tiny_pair.generate("Hi", max_new_tokens=4)
    finally:
        tiny_pair.threads, tiny_pair.policy = saved
        tiny_pair.info.extra.pop("threads", None)
    assert result.n_passes == 4 and calls == ["observe", "reset", "observe", "observe", "observe"]


def test_guard_of_a_suffix_capable_policy_weighs_the_tree_against_gated_suffix_passes():
    """Hybrid (gate_suffix): the passes without the planned tree are gated suffix passes, counted by the tokens
    they emit. A tree that beats the target alone but loses to copying is turned off for gated passes, not plain
    ones; the model drafter's policy (no gate) still compares with the target alone."""
    c = costs()
    for gate in (True, False):
        p = AdaptiveBudget(c, acceptance(), PlannerConfig(budgets=BUDGETS), AdaptConfig(), guard=GuardConfig(),
                           gate_suffix=gate)
        assert p.plan.speculates and not p.gated
        planned = p.plan.best.budget
        kinds = []
        for _ in range(60):
            if not p.use_tree():
                kinds.append("plain")  # the target alone: as fast per token as the trees here (same tokens/s)
                p.observe(PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0.0, target_seconds=0.3,
                                    budget=0))
                continue
            tree = p.next_tree(TreeConfig(confident_budget=32))
            if tree.drafter == "suffix":  # a gated pass: no draft step; copying takes 5 tokens in a 0.32 s pass
                kinds.append("gated")
                assert tree.budget == 32 and tree.pass_cost is not None
                p.observe(PassStats(tree_size=6, accepted=5, emitted=6, draft_seconds=0.001, target_seconds=0.32,
                                    budget=32, drafter="suffix"))
                continue
            kinds.append("tree")
            expected = 1 + min(acceptance()(tree.budget, tree.max_depth), tree.budget)
            seconds = expected * 0.3  # as fast per token as the target alone
            p.observe(PassStats(tree_size=tree.budget, accepted=round(expected - 1), emitted=round(expected),
                                draft_seconds=seconds / 2, target_seconds=seconds / 2, budget=tree.budget))
        if gate:
            assert "plain" not in kinds and kinds[:4] == ["tree"] * 4 and kinds[4] == "gated"
            assert not p.guard.trees_on and kinds[-20:].count("gated") >= 18
            assert p.summary()["gated_suffix"] is True and p.gated_passes >= 40
        else:
            assert "gated" not in kinds and p.guard.trees_on  # the target alone does not beat the tree
            assert p.plan.best.budget == planned
