"""``learn_online=True``: the EAGLE head keeps learning from served text; the text never changes.

Greedy output equals transformers' ``generate`` (float32) over several requests while learned heads
swap in between them (driven step by step, and with the background thread); the learner changes
the head's weights and raises acceptance on a repeated domain; a learned head that draws fewer
tokens per round than the frozen one is rolled back; the trained copy is saved to the user cache
and resumed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.head import EagleHead
from selfspec.drafting.eagle.online import OnlineLearner, OnlineSettings, online_head_folder
from selfspec.errors import ConfigurationError

PROMPTS = [[5, 9, 3, 17, 4, 8], [7, 2, 11, 30, 6], [12, 40, 3, 9, 21, 5, 14], [5, 9, 3, 17, 20]]


@pytest.fixture(scope="module")
def tiny() -> Any:
    return make_model("llama", agreeing=True, dtype=torch.float32)


@pytest.fixture()
def random_head(tiny) -> EagleHead:
    torch.manual_seed(0)
    return EagleHead(tiny).eval().requires_grad_(False)


def online_engine(model: Any, head: EagleHead, **settings: Any) -> SpeculativeEngine:
    quick = {"min_positions": 8, "judge_rounds": 2, "steps_per_swap": 1, "window": 16, "micro_batch": 2, **settings}
    return SpeculativeEngine(
        model,
        drafter="eagle",
        eagle_head=head,
        num_draft_tokens=3,
        learn_online=True,
        drafter_options={"online": OnlineSettings(**quick)},
    )


@pytest.mark.parametrize("background", [False, True], ids=["stepped", "thread"])
def test_greedy_equals_generate_while_heads_swap(tiny, random_head, background) -> None:
    settings = {"background": background, "step_interval": 0.0, "lr": 3e-3, "save_every": 0.0}
    engine = online_engine(tiny, random_head, **settings)
    learner = engine.drafter.learner
    assert isinstance(learner, OnlineLearner) and engine.learn_online
    for prompt in PROMPTS * 2:
        assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == reference_greedy(tiny, prompt, 24)
        if not background:
            learner.train_steps(3)  # between requests: the next one starts with the newest head
    assert learner.steps > 0 and learner.swaps > 0, learner
    learner.close()


def test_learning_changes_the_head_and_raises_acceptance(tiny, random_head) -> None:
    engine = online_engine(tiny, random_head, background=False, lr=3e-3, judge_rounds=1, window=32, micro_batch=4)
    learner = engine.drafter.learner

    def tau() -> float:
        outs = [engine.generate_ids(prompt, max_new_tokens=32) for prompt in PROMPTS]
        return sum(o.stats.num_accepted for o in outs) / sum(o.stats.target_forwards for o in outs)

    before = tau()  # the frozen head serves (and fills the buffer)
    learner.train_steps(150)
    after = tau()  # the first generation takes the newest learned head
    assert learner.serving_learned and learner.steps == 150
    served = learner.head_for_generation()
    changed = [name for name, w in served.state_dict().items() if not torch.equal(w, random_head.state_dict()[name])]
    assert changed, "the learner left the head's weights unchanged"
    assert all(torch.equal(w, random_head.state_dict()[k]) for k, w in learner.frozen.state_dict().items())
    assert after > before + 0.2, (before, after)
    learner.close()


def test_training_leaves_the_target_without_gradients_and_returns_freed_memory() -> None:
    """The head shares the target's embedding, norm and LM head: its steps must not backpropagate into them.

    Before the fix every step computed a dense gradient of the target's whole embedding (108 MB on
    SmolLM2-135M) and kept it in the target's ``.grad``.
    """
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    assert all(p.requires_grad for p in model.parameters())  # as transformers loads it
    torch.manual_seed(0)
    draft_vocab = torch.arange(0, model.config.vocab_size, 2)  # a reduced draft vocabulary: its LM head rows cached
    head = EagleHead(model, draft_token_ids=draft_vocab).eval().requires_grad_(False)
    engine = online_engine(model, head, background=False, steps_per_swap=2)
    learner = engine.drafter.learner
    for prompt in PROMPTS:
        assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == reference_greedy(model, prompt, 24)
    assert learner.train_steps(6) == 6
    assert all(p.grad is None for p in model.parameters()), [
        n for n, p in model.named_parameters() if p.grad is not None
    ]
    assert learner._trainee is not None and any(p.grad is not None for p in learner._trainee.parameters())
    assert learner.trims == 6 and learner.trim_seconds >= 0.0  # after each step
    served = learner.head_for_generation()
    assert served is not head and served._draft_weight is learner._trainee._draft_weight  # shared, not copied
    assert head._draft_weight is not None and head._draft_weight.is_inference()  # cached while serving: its own
    quiet = OnlineLearner(head, OnlineSettings(background=False, release_memory=False))
    assert quiet.trims == 0
    learner.close()


def test_a_learned_head_that_falls_short_is_rolled_back(tiny, random_head) -> None:
    learner = OnlineLearner(random_head, OnlineSettings(background=False, judge_rounds=3, margin=0.1, ema_decay=0.5))
    learned = learner.frozen  # stands in for nothing: a real learned copy below
    for _ in range(3):
        learner.record_round(learner.head_for_generation(), 3)  # the frozen head: 3 tokens per round
    from selfspec.drafting.eagle.online import clone_head

    learned = clone_head(random_head).eval()
    learner._published = learned
    assert learner.head_for_generation() is learned and learner.swaps == 1
    for _ in range(2):
        learner.record_round(learned, 1)
    assert learner.serving_learned  # not judged before judge_rounds rounds
    learner.record_round(learned, 1)
    assert not learner.serving_learned and learner.guard.rollbacks == 1
    assert learner.head_for_generation() is learner.frozen


def test_saved_to_the_user_cache_and_resumed(tmp_path, monkeypatch, tiny, random_head) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    folder = online_head_folder("tiny-llama")
    learner = OnlineLearner(random_head, OnlineSettings(background=False, min_positions=4, window=8), folder)
    from selfspec.drafting.eagle.online import OnlineSequence

    states = torch.randn(12, tiny.config.hidden_size)
    learner.observe(OnlineSequence(), states, list(range(3, 16)))
    assert learner.train_steps(2) == 2
    learner.close()
    assert (folder / "eagle_head.safetensors").is_file() and str(folder).startswith(str(tmp_path))
    again = OnlineLearner(random_head, OnlineSettings(background=False), folder)
    trained = learner._trainee
    assert trained is not None
    resumed = again._ensure_trainee()
    assert all(torch.equal(w, trained.state_dict()[k]) for k, w in resumed.state_dict().items())


def test_learn_online_needs_an_eagle_drafter(tiny) -> None:
    with pytest.raises(ConfigurationError, match="learn_online"):
        SpeculativeEngine(tiny, drafter="prompt_lookup", learn_online=True)
    with pytest.raises(ConfigurationError, match="learn_online must be True or False"):
        SpeculativeEngine(tiny, drafter="eagle", learn_online="yes")
