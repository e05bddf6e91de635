"""Exploration by `budget="auto"`: a plan without a tree whose best tree comes close probes it now and then, learns
the pair's acceptance from the probes, and turns to trees when they pay (scripted passes, exact expectations)."""

from offspec.config import TreeConfig
from offspec.profile.adapt import AdaptConfig, AdaptiveBudget
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.guard import GuardConfig
from offspec.profile.planner import PairCosts, PlannerConfig, draft_seconds
from offspec.types import PassStats

BUDGETS = (1, 2, 4, 8)


def costs() -> PairCosts:
    """A 100 ms target pass (+10 ms a token), a draft step of 30 ms for a node, 120 ms for 4 tokens (a catch-up):
    a 2-node chain runs at 0.94x the target alone at the prior acceptance (1.0 of 2), 1.13x at 1.4 times it."""
    return PairCosts(target_pass=CostCurve.of([(1, 0.10), (2, 0.11), (3, 0.12), (5, 0.14), (9, 0.18)]),
                     target_head=0.0, draft_step=CostCurve.of([(1, 0.03), (2, 0.033), (4, 0.12), (8, 0.2)]))


def acceptance(**kw) -> AcceptanceCurve:
    return AcceptanceCurve.of(BUDGETS, [0.6, 1.0, 1.3, 1.5], **kw)


def policy(drafter: str = "model", **adapt) -> AdaptiveBudget:
    curve = acceptance(model_share=1.0) if drafter == "hybrid" else acceptance()
    return AdaptiveBudget(costs(), curve, PlannerConfig(budgets=BUDGETS, drafter=drafter), AdaptConfig(**adapt),
                          guard=GuardConfig(), gate_suffix=drafter != "model")


def run(p: AdaptiveBudget, passes: int, accepted_of_budget, slow: float = 1.0,
        catch_up: bool = False) -> list[tuple[int, str]]:
    """Scripted passes at the modelled times (probes `slow` times dearer); returns (budget, drafter) per pass
    (budget 0: the target alone). `catch_up`: a model pass first runs the draft over the tokens committed since
    it last ran (PassStats.caught_up), and takes that time too."""
    c, curve = costs(), p.acceptance
    out = []
    lag = 0  # tokens committed since the draft last ran
    for _ in range(passes):
        if not p.use_tree():
            p.observe(PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0.0,
                                target_seconds=c.autoregressive_seconds(), budget=0))
            out.append((0, "none"))
            lag += 1
            continue
        probe = p._probe is not None
        tree = p.next_tree(TreeConfig())
        drafter = "suffix" if tree.drafter == "suffix" else tree.drafter
        accepted = 0 if drafter == "suffix" else accepted_of_budget(tree.budget)
        size = 0 if drafter == "suffix" else tree.budget  # a gated pass whose candidates did not pay
        draft = draft_seconds(c, curve, tree.budget, tree.max_beams, tree.max_depth, "model") if size else 0.0
        caught_up = 0
        if size and catch_up:
            caught_up = lag + 1  # those tokens and the last pass's own
            draft += c.draft_step(caught_up) - c.draft_step(2)
            lag = 0
        target = c.target_pass(size + 1)
        factor = slow if probe else 1.0
        p.observe(PassStats(tree_size=size, accepted=accepted, emitted=accepted + 1, draft_seconds=draft * factor,
                            target_seconds=target * factor, budget=tree.budget, drafter=drafter,
                            caught_up=caught_up))
        lag += 0 if size else accepted + 1
        out.append((tree.budget if size else 0, drafter))
    return out


def test_a_plan_without_trees_probes_its_best_tree_and_turns_to_trees_when_the_pair_accepts_more():
    p = policy()
    assert not p.plan.speculates and p.plan.best.budget == 2
    point = p.exploration_point()
    assert point is not None and point.budget == 2
    used = run(p, 80, lambda b: b)  # code: every 2-node chain is taken whole (the prior says 1.0 of 2)
    trees = [i for i, (b, _) in enumerate(used) if b]
    assert trees[:3] == [3, 7, 11] and all(used[i][0] == 2 for i in trees[:3])  # one pass in explore_every = 4
    assert [r.reason for r in p.replans][:1] == ["acceptance"] and p.plan.speculates and p.scale > 1.4
    assert p.exploration_point() is None  # trees are the plan now: nothing to explore
    assert sum(1 for b, _ in used[-20:] if b) >= 18  # the plan's trees (the guard's plain probes aside)
    summary = p.summary()
    assert summary["explore"]["probes"] == p.probes >= 8 and summary["speculate"] is True


def test_when_the_prior_holds_exploration_backs_off():
    p = policy()
    used = run(p, 300, lambda b: 1 if b >= 2 else 0)  # exactly the prior at 2 nodes
    assert not p.plan.speculates
    trees = [i for i, (b, _) in enumerate(used) if b]
    gaps = [b - a for a, b in zip(trees, trees[1:])]
    assert gaps[:7] == [4] * 7 and gaps[7:15] == [8] * 8 and gaps[15] == 16  # doubling each 8 probes
    assert len(trees) == p.probes < 30


def test_probes_dearer_than_predicted_back_off_at_once():
    p = policy(time_tolerance=100.0)  # the timing windows never re-plan here: the probes' own back-off alone
    used = run(p, 60, lambda b: b, slow=3.0)
    trees = [i for i, (b, _) in enumerate(used) if b]
    assert [b - a for a, b in zip(trees, trees[1:])][:3] == [8, 16, 32]


def test_a_probes_catch_up_is_its_price_not_a_slow_prediction():
    """A probe follows passes without the model, so the draft first catches up on their tokens (4 here: its draft
    time doubles); that does not make the probe slower than predicted."""
    p = policy()
    used = run(p, 40, lambda b: 1 if b >= 2 else 0, catch_up=True)  # the prior: no turn to trees
    trees = [i for i, (b, _) in enumerate(used) if b]
    assert [b - a for a, b in zip(trees, trees[1:])][:7] == [4] * 7


def test_nothing_is_probed_where_no_tree_comes_close_or_exploration_is_off():
    far = AdaptiveBudget(costs().scaled(draft=4.0), acceptance(), PlannerConfig(budgets=BUDGETS), AdaptConfig(),
                         guard=GuardConfig())
    assert not far.plan.speculates and far.exploration_point() is None
    assert all(b == 0 for b, _ in run(far, 40, lambda b: b)) and far.probes == 0
    off = policy(explore_every=0)
    assert off.exploration_point() is None
    assert all(b == 0 for b, _ in run(off, 40, lambda b: b)) and off.probes == 0


def test_a_gated_hybrid_does_not_explore():
    """The hybrid's plan without a tree gates suffix candidates every pass; those are its alternative to the target
    alone (a copy of given code makes them worth more), so it grows no probe and never catches the draft up."""
    p = policy("hybrid")
    assert p.gated and not p.plan.speculates and p.exploration_point() is None
    assert {d for _, d in run(p, 40, lambda b: b)} == {"suffix"} and p.probes == 0
