"""A tree that grows while the weights load (TreeConfig.grow_nodes): scripted streamers with exact expectations,
then a real streamed target whose reads are held back."""

import threading

import pytest
import torch
from helpers.fakes import BigramRunner

from offspec import OffspecError
from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.drafter import TreeDrafter
from offspec.spec.engine import SpeculativeEngine
from offspec.spec.sampling import TokenChooser

CHAIN = {t: {t + 1: 0.9} for t in range(15)}  # both models continue t with t + 1: every node of the chain accepted


class Polls:
    """A grow answer: True for the first `yes` asks, then False. Counts the asks."""

    def __init__(self, yes: int):
        self.yes, self.asked = yes, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked <= self.yes


@pytest.mark.parametrize("yes, nodes", [(0, 6), (1, 8), (2, 10), (3, 12), (9, 12)])
def test_each_yes_adds_one_step_of_beams_up_to_the_growth_cap(yes, nodes):
    config = TreeConfig(budget=6, max_beams=2, branch=3, max_depth=8, grow_nodes=6)
    polls = Polls(yes)
    tree = TreeDrafter(BigramRunner({})).propose([0], config, 0.0, grow=polls)
    assert tree.n - 1 == nodes  # 6 + 2 a yes, never past 6 + 6
    assert polls.asked == min(yes + 1, 3)  # asked again after each yes, not once the cap is reached


def test_without_grow_the_tree_has_its_budget_and_nothing_is_asked():
    config = TreeConfig(budget=6, max_beams=2, branch=3, max_depth=8, grow_nodes=6)
    assert TreeDrafter(BigramRunner({})).propose([0], config, 0.0).n - 1 == 6
    none = TreeConfig(budget=6, max_beams=2, branch=3, max_depth=8, grow_nodes=0)
    polls = Polls(5)
    assert TreeDrafter(BigramRunner({})).propose([0], none, 0.0, grow=polls).n - 1 == 6
    assert polls.asked == 0


def test_grow_nodes_defaults_to_the_budget_and_rejects_bad_values():
    assert TreeConfig(budget=48).growth == 48 and TreeConfig(budget=48, grow_nodes=0).growth == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(OffspecError, match="grow_nodes must be"):
            TreeConfig(grow_nodes=bad).validate()


class ScriptedIO:
    """A target's streamer whose next pass's first layer arrives after `held` asks of each pass."""

    def __init__(self, held: int):
        self.polls = Polls(held)

    def loading(self) -> bool:
        return self.polls()

    def counters(self) -> tuple[int, float]:
        self.polls.asked = 0  # read at the start and the end of each target pass: the next pass starts afresh
        return 0, 0.0


def _engine(io, max_budget=16):
    target = BigramRunner(CHAIN)
    target.io = io
    engine = SpeculativeEngine(target, TreeDrafter(BigramRunner(CHAIN)), max_context=64, max_budget=max_budget)
    engine.reset_to([9, 0])  # the root is 0
    return engine


def test_a_pass_gains_the_nodes_drafted_while_its_first_layer_loads_and_keeps_its_tokens():
    chooser = TokenChooser(SamplingConfig(temperature=0.0), torch.device("cpu"))
    config = TreeConfig(budget=4, max_beams=1, branch=2, max_depth=16, grow_nodes=8)
    held_tokens, held = _engine(ScriptedIO(held=3)).speculative_step(config, chooser)
    plain_tokens, plain = _engine(None).speculative_step(config, chooser)
    assert plain.tree_size == 4 and plain.grown_nodes == 0 and plain.accepted == 4
    assert held.tree_size == 7 and held.grown_nodes == 3 and held.budget == 4  # one node a yes (max_beams 1)
    assert held.accepted == 7 and held_tokens == list(range(1, 9))  # the chain: the grown nodes paid
    assert held_tokens[:5] == plain_tokens  # the same tokens as far as both go


def test_growth_stays_within_the_cache_room_and_a_loaded_layer_adds_nothing():
    chooser = TokenChooser(SamplingConfig(temperature=0.0), torch.device("cpu"))
    config = TreeConfig(budget=4, max_beams=1, branch=2, max_depth=16, grow_nodes=50)
    _, stats = _engine(ScriptedIO(held=100), max_budget=10).speculative_step(config, chooser)
    assert stats.tree_size == 10 and stats.grown_nodes == 6  # the target cache reserves 10 nodes
    _, stats = _engine(ScriptedIO(held=0)).speculative_step(config, chooser)
    assert stats.tree_size == 4 and stats.grown_nodes == 0


@pytest.mark.slow
def test_a_streamed_target_with_held_reads_grows_its_trees_and_keeps_the_target_greedy_output(tiny_dirs, tmp_path):
    import re

    import offspec
    from helpers.tiny import save_tiny_model

    target = save_tiny_model(tmp_path / "deep", arch="llama", seed=0, logit_scale=3.0, layers=6)
    draft = tiny_dirs[("llama", 0)][1]
    options = dict(dtype="float64", max_context=256, max_budget=64)
    with pytest.raises(OffspecError) as info:
        offspec.load(str(target), str(draft), device_mem="1KB", offload_dir=str(tmp_path), **options)
    budget = re.search(r"--device-mem (\S+)", str(info.value))[1]
    gen = offspec.load(str(target), str(draft), device_mem=budget, offload_dir=str(tmp_path), grow_nodes=16, **options)
    plain = offspec.load(str(target), str(draft), **options).generate("Hello there", max_new_tokens=24,
                                                                       speculate=False)
    streamer, drafter = gen.engine.target.io, gen.engine.drafter
    first = streamer._p.order[0].path  # the first streamed layer's packed file
    drafted, armed = threading.Event(), threading.Event()
    read, propose = streamer.reader.read, drafter.propose

    def held_read(path, *args, **kwargs):  # a filler thread: a pass's first layer is read once its tree is done
        if armed.is_set() and path == first:
            if not drafted.wait(30):
                raise RuntimeError("the first layer's read was never let go")  # surfaces in the pass: a failure
            drafted.clear()  # one tree, one read
        return read(path, *args, **kwargs)

    def held_propose(*args, **kwargs):  # the first layer is still loading for as long as the draft grows
        try:
            return propose(*args, **kwargs)
        finally:
            drafted.set()

    streamer.reader.read, drafter.propose = held_read, held_propose
    armed.set()  # the ring already holds the prefill's first layers; each pass's first layer is held from here on
    try:
        out = gen.generate("Hello there", max_new_tokens=24, budget=8, drafter="model")
    finally:
        armed.clear()
        drafted.set()
    assert out.token_ids == plain.token_ids
    assert len(out.passes) >= 2 and all(p.budget == 8 for p in out.passes)
    assert all(p.grown_nodes == 16 for p in out.passes), str([p.grown_nodes for p in out.passes])  # to the cap
    assert all(p.tree_size == p.budget + p.grown_nodes for p in out.passes)


def test_budget_auto_keeps_the_users_grow_nodes(tiny_dirs):
    import offspec

    target, draft = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(draft), grow_nodes=5, max_context=256, max_budget=64)  # budget auto
    assert gen.policy is not None and gen.tree is gen.policy.base_tree
    assert gen.tree.grow_nodes == 5 and all(p.base_tree.grow_nodes == 5 for p in gen.policies.values())
