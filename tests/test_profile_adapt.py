"""Online adaptation on a scripted stream of PassStats (steady acceptance keeps the plan, drift re-plans), and
auto without a tree when the plan predicts none beats the target alone."""

import math

import pytest

from offspec.cli.bench import parse_setups, run_bench
from offspec.config import TreeConfig
from offspec.profile import adapt, planner
from offspec.profile.adapt import AdaptConfig, AdaptiveBudget
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.planner import PairCosts, PlannerConfig, draft_seconds
from offspec.types import PassStats

BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128)


def cpu_like_policy(extra=None) -> AdaptiveBudget:
    """Every tree token costs 10 ms on top of a 300 ms pass; acceptance saturates around 2 tokens."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.3), (129, 1.58)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.0)]))
    acceptance = AcceptanceCurve.of(BUDGETS, [2.0 * (1 - math.exp(-b / 6)) for b in BUDGETS])
    return AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=BUDGETS), AdaptConfig(), extra=extra)


def feed(policy: AdaptiveBudget, accepted_of_budget, passes: int) -> list[int]:
    """Run `passes` scripted passes; each accepts accepted_of_budget(budget) tokens. Returns the budgets used."""
    used = []
    for i in range(passes):
        tree = policy.next_tree(TreeConfig())
        used.append(tree.budget)
        accepted = accepted_of_budget(tree.budget, i)
        policy.observe(PassStats(tree_size=tree.budget, accepted=accepted, emitted=accepted + 1, draft_seconds=0.0,
                                 target_seconds=0.0, budget=tree.budget))
    return used


def test_steady_acceptance_keeps_the_plan():
    policy = cpu_like_policy()
    start = policy.plan.best.budget
    # accept what the profile predicts, on average (alternating around it)
    predicted = policy.acceptance(start)
    used = feed(policy, lambda b, i: math.floor(predicted) + (i % 2 if predicted % 1 >= 0.25 else 0), 40)
    assert set(used) == {start}
    assert policy.replans == [] or all(r.budget_to == start for r in policy.replans)


def test_drift_up_then_down_replans_and_is_visible():
    extra = {}
    policy = cpu_like_policy(extra)
    start = policy.plan.best.budget
    # code with long repeats: the pair accepts far more than calibrated (up to 6 tokens, bounded by the tree)
    used_up = feed(policy, lambda b, i: min(b, 6), 30)
    assert policy.replans, "a strong upward drift must re-plan"
    up = policy.plan.best.budget
    assert up > start and policy.scale > 1.5
    assert used_up[0] == start and used_up[-1] == up  # PassStats.budget shows the budget in force per pass
    assert extra["budget_adaptive"]["budget"] == up
    assert extra["budget_adaptive"]["replans"][0]["budget_from"] == start
    # then prose in another language: almost nothing is accepted
    feed(policy, lambda b, i: 1 if i % 10 == 0 else 0, 40)
    assert policy.plan.best.budget < up and policy.scale < 0.5
    assert extra["budget_adaptive"]["acceptance_scale"] == round(policy.scale, 4)
    assert len(policy.replans) >= 2


def test_noise_alone_does_not_replan():
    policy = cpu_like_policy()
    start = policy.plan.best.budget
    predicted = policy.acceptance(start)
    # a noisy stream with the predicted mean: 0 or 2*predicted rounded, alternating
    feed(policy, lambda b, i: (round(2 * predicted) if i % 2 else 0), 48)
    assert policy.plan.best.budget == start or abs(policy.scale - 1) <= 0.2 + 2 * policy.observed_scale()[1]


def test_less_acceptance_is_planned_as_a_per_token_drift():
    """Below the profile, the re-plan thins the curve (each drafted token kept with chance `keep` given the ones
    before it): the window's passes are predicted what they took, and a one-node chain keeps more of its share than
    the deeper trees the window measured (where one scale would take the same share of every budget)."""
    extra = {}
    policy = cpu_like_policy(extra)
    start = policy.plan.best.budget
    predicted = policy.acceptance(start)
    feed(policy, lambda b, i: i % 2, AdaptConfig().min_passes)  # half a token a pass where nearly 2 were due
    assert [r.reason for r in policy.replans] == ["acceptance"]
    assert policy.scale < 0.5 and 0.0 < policy.keep < 1.0
    assert policy.replans[0].keep == policy.keep
    assert extra["budget_adaptive"]["acceptance_keep"] == round(policy.keep, 4)
    taken = sum(w[0] for w in policy.window)
    in_force = sum(policy._expected_accepted(b, d, policy.curve_in_force()) for *_, b, d in policy.window)
    assert in_force == pytest.approx(taken, rel=1e-3)
    thinned = policy.curve_in_force()
    assert thinned(1) / policy.acceptance(1) > thinned(start) / policy.acceptance(start)
    assert predicted > 1.4 and policy.plan.best.budget < start


def test_stopping_trees_waits_for_a_full_window(monkeypatch):
    """Without trees the draft model's acceptance is never measured again, so a re-plan that stops speculating waits
    for `window` passes of evidence, searching no plan on the passes in between."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.1), (65, 0.12)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.03), (64, 0.03)]))
    acceptance = AcceptanceCurve.of((1, 2, 4, 8), [0.8, 1.4, 2.0, 2.4])
    config = AdaptConfig()
    policy = AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=(1, 2, 4, 8)), config, guard=None)
    assert policy.speculates
    searches = []
    monkeypatch.setattr(adapt, "plan", lambda *a, **k: searches.append(1) or planner.plan(*a, **k))
    feed(policy, lambda b, i: 0, config.window - 1)  # nothing accepted: the plan would stop, but not yet
    assert policy.speculates and policy.replans == [] and policy.use_tree()
    assert len(searches) == 1  # the candidate of the first judged pass (the min_passes-th), none after it
    feed(policy, lambda b, i: 0, 1)
    assert not policy.speculates and policy.replans[-1].reason == "acceptance" and policy.keep < 1.0
    assert not policy.use_tree()


def test_autoregressive_passes_are_ignored():
    policy = cpu_like_policy()
    policy.observe(PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0, target_seconds=0.3, budget=0))
    assert policy.passes == 0


def slow_draft_policy(extra=None) -> AdaptiveBudget:
    """A draft step costs as much as two target passes: no tree can beat the target alone."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.3), (129, 1.58)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.6)]))
    acceptance = AcceptanceCurve.of(BUDGETS, [2.0 * (1 - math.exp(-b / 6)) for b in BUDGETS])
    return AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=BUDGETS), AdaptConfig(), extra=extra)


def test_auto_decodes_without_a_tree_when_no_tree_pays_off(tiny_pair, tmp_path):
    assert cpu_like_policy().speculates  # the cheap draft: trees pay
    extra: dict = {}
    policy = slow_draft_policy(extra)
    assert not policy.speculates and extra["budget_adaptive"]["speculate"] is False
    assert policy.plan.summary()["speculate"] is False
    assert any("decodes with the target alone" in note for note in policy.plan.notes)

    saved_tree, saved_policy = tiny_pair.tree, tiny_pair.policy
    try:
        tiny_pair.policy, tiny_pair.tree = policy, policy.base_tree  # what load(budget="auto") sets up
        plain = tiny_pair.generate("Hello", max_new_tokens=12, speculate=False)
        auto = tiny_pair.generate("Hello", max_new_tokens=12)
        assert auto.token_ids == plain.token_ids
        assert all(p.tree_size == 0 and p.budget == 0 for p in auto.passes) and policy.passes == 0
        fixed = tiny_pair.generate("Hello", max_new_tokens=12, budget=4)  # an explicit budget still speculates
        assert fixed.token_ids == plain.token_ids and all(p.budget == 4 for p in fixed.passes)
        report = run_bench(tiny_pair, ["Hello"], parse_setups("ar,auto", TreeConfig()), max_new_tokens=8,
                           temperature=0.0, out_dir=tmp_path)
        assert report["setups"]["auto"]["budgets"] == [0] and report["setups"]["auto"]["greedy_mismatches"] == 0
        assert "| auto (budget none) | 1 | 1.00 |" in (tmp_path / "bench.md").read_text()
    finally:
        tiny_pair.tree, tiny_pair.policy = saved_tree, saved_policy


def test_a_suffix_plan_runs_gated_passes_even_when_it_speculates():
    """A pass costs the same for 1 or 64 tokens (streamed weights): the suffix plan has a tree, and still each
    pass proposes up to confident_budget candidates as one chain deep, cut by the pass's own cost model."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.3), (129, 0.31)]), target_head=0.0, draft_step=None,
                      suffix_seconds=0.0)
    acceptance = AcceptanceCurve.of(BUDGETS, [min(b, 0.4) for b in BUDGETS])  # flat past one node
    planner = PlannerConfig(budgets=BUDGETS, drafter="suffix", max_budget=64)
    gated = AdaptiveBudget(costs, acceptance, planner, AdaptConfig(), gate_suffix=True)
    assert gated.speculates and gated.plan.best.drafter == "suffix" and gated.gated and gated.use_tree()
    tree = gated.next_tree(TreeConfig(confident_budget=48))
    assert tree.budget == tree.confident_budget == tree.max_depth == 48 and tree.drafter == "suffix"
    assert tree.pass_cost is not None and tree.pass_cost.base == 0.3
    plain = AdaptiveBudget(costs, acceptance, planner, AdaptConfig(), gate_suffix=False)  # a fixed policy
    assert not plain.gated and plain.next_tree(TreeConfig(confident_budget=48)).budget == plain.plan.best.budget


def test_a_hybrid_plan_times_the_model_only_in_the_passes_that_ran_it():
    """A hybrid pass grows the model's tree unless the suffix match is confident: the draft time of a pass that ran
    the model is the model's whole tree time, not the plan's average over passes (model_share), and a confident
    pass's few microseconds say nothing about the model. Draft times that match the model keep the plan."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.07), (2, 0.075), (3, 0.08), (9, 0.1)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.02), (2, 0.021), (8, 0.03)]), suffix_seconds=0.0003)
    acceptance = AcceptanceCurve.of((1, 2, 4, 8), [0.8, 1.4, 2.2, 3.0], model_share=0.3)
    policy = AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=(1, 2, 4, 8), drafter="hybrid"), AdaptConfig(),
                            guard=None, gate_suffix=True)
    assert policy.speculates and policy.plan.best.drafter == "hybrid"
    for i in range(60):
        tree = policy.next_tree(TreeConfig())  # the tree in force (acceptance re-plans move it: 1 of 3 accepted)
        model = draft_seconds(costs, acceptance, tree.budget, tree.max_beams, tree.max_depth, "model")
        ran_model = i % 3 == 0  # the other passes were confident copies
        policy.observe(PassStats(tree_size=tree.budget, accepted=1, emitted=2, budget=tree.budget,
                                 draft_seconds=model if ran_model else 0.0002,
                                 target_seconds=costs.target_pass(tree.budget + 1),
                                 drafter="hybrid" if ran_model else "suffix"))
    assert policy.draft_time_scale == 1.0 and not [r for r in policy.replans if r.reason == "timing"]
    assert policy.plan.best.drafter == "hybrid" and policy.speculates


def test_a_hybrid_plan_lets_each_pass_choose_and_keeps_suffix_passes_out_of_the_curve():
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.07), (2, 0.075), (3, 0.08), (9, 0.1)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.02), (2, 0.021), (8, 0.03)]), suffix_seconds=0.0003)
    acceptance = AcceptanceCurve.of((1, 2, 4, 8), [0.8, 1.4, 2.2, 3.0], model_share=0.3)
    policy = AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=(1, 2, 4, 8), drafter="hybrid"), AdaptConfig(),
                            gate_suffix=True)
    assert policy.choosing and policy.use_tree()
    tree = policy.next_tree(TreeConfig(confident_budget=16))
    best = policy.plan.best
    assert tree.drafter == "hybrid" and tree.pass_cost is not None
    assert tree.model_expectation == (best.accepted, draft_seconds(costs, acceptance, best.budget, best.max_beams,
                                                                   best.max_depth, "model"))
    for _ in range(30):  # suffix passes that took nothing: the suffix drafter's business, not the model's curve
        policy.next_tree(TreeConfig(confident_budget=16))
        policy.observe(PassStats(tree_size=3, accepted=0, emitted=1, draft_seconds=0.0003, target_seconds=0.08,
                                 budget=tree.budget, drafter="suffix"))
    assert policy.passes == 0 and policy.scale == 1.0 and policy.gated_passes == 30
    fixed = AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=(1, 2, 4, 8), drafter="hybrid"), AdaptConfig())
    assert not fixed.choosing and fixed.next_tree(TreeConfig()).model_expectation is None


def test_a_hybrid_pass_with_the_model_expects_the_drafts_average_catch_up():
    """Passes that took the suffix candidates alone leave tokens the draft has not seen; the model's next pass
    catches up on them first. The choice weighs that debt as the recent model passes paid it on average."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.07), (2, 0.075), (3, 0.08), (9, 0.1)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.02), (2, 0.021), (8, 0.05)]), suffix_seconds=0.0003)
    acceptance = AcceptanceCurve.of((1, 2, 4, 8), [0.8, 1.4, 2.2, 3.0], model_share=0.3)
    policy = AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=(1, 2, 4, 8), drafter="hybrid"), AdaptConfig(),
                            guard=None, gate_suffix=True)
    best = policy.plan.best
    model = draft_seconds(costs, acceptance, best.budget, best.max_beams, best.max_depth, "model")
    assert policy.next_tree(TreeConfig()).model_expectation == (best.accepted, model)
    # the first model pass catches up on the prompt (no debt of the passes), then two suffix passes commit 6 tokens
    # the next one takes with its own 2; a pass of the model drafter alone owes nothing
    for caught_up, drafter, emitted in ((150, "hybrid", 2), (0, "suffix", 5), (0, "suffix", 1), (8, "hybrid", 2),
                                        (30, "model", 2), (0, "suffix", 3)):
        policy.next_tree(TreeConfig())
        policy.observe(PassStats(tree_size=best.budget, accepted=emitted - 1, emitted=emitted, budget=best.budget,
                                 draft_seconds=0.0, target_seconds=0.0, drafter=drafter, caught_up=caught_up))
    assert list(policy.catch_ups) == [2, 8]
    debt = (0.0 + (costs.draft_step(8) - costs.draft_step(2))) / 2  # 0.0145 s: the two hybrid passes' mean
    accepted, draft = policy.next_tree(TreeConfig()).model_expectation
    assert accepted == best.accepted and math.isclose(draft, model + debt)


def test_a_prompts_catch_up_past_the_timed_draft_steps_is_not_taken_for_a_slower_draft():
    """The first model pass of a conversation catches up on its prompt (150 tokens): its time is extrapolated past
    the draft steps timed (up to 8 here) and says nothing about the draft's speed; a short catch-up still does."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.07), (2, 0.075), (3, 0.08), (9, 0.1)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.02), (2, 0.021), (8, 0.05)]))
    acceptance = AcceptanceCurve.of((1, 2, 4, 8), [0.8, 1.4, 2.2, 3.0])

    def run(caught_up: int) -> AdaptiveBudget:
        policy = AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=(1, 2, 4, 8)), AdaptConfig(), guard=None)
        for _ in range(20):
            best = policy.plan.best  # (an acceptance re-plan may change it)
            tree = policy.next_tree(TreeConfig())
            modelled = draft_seconds(costs, acceptance, tree.budget, best.max_beams, best.max_depth, "model")
            modelled += costs.draft_step(caught_up) - costs.draft_step(2)  # every pass: a new conversation
            draft = modelled * 3.0  # the catch-ups take 3x their modelled time
            policy.observe(PassStats(tree_size=tree.budget, accepted=1, emitted=2, budget=tree.budget,
                                     draft_seconds=draft, target_seconds=costs.target_pass(tree.budget + 1),
                                     drafter="model", caught_up=caught_up))
        return policy

    assert run(150).draft_time_scale == 1.0  # past the 8 nodes timed: not counted
    assert run(6).draft_time_scale == pytest.approx(3.0)  # within them: a slower draft, re-timed
