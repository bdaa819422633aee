"""Greedy speculative decoding gives the target's own ids; the acceptance metric against hand counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.inference.decode import PackedLlama
from pipeline.inference.sampling import generate_ids
from pipeline.inference.speculative import draft_acceptance, speculative_greedy
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig, init_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def packed(n_layer: int, seed: int) -> PackedLlama:
    """A random llama over a 96-token vocab, packed for fp32 decoding."""
    model = Llama(TransformerConfig(96, 64, n_layer, 4, 2, 96, 128, 100000.0, 1e-5))
    init_weights(model, 0.2, seed=seed)
    return PackedLlama(model.eval(), "fp32")


@pytest.fixture(scope="module")
def target() -> PackedLlama:
    return packed(4, 0)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_kind", ["itself", "another model"])
@pytest.mark.parametrize("p_min", [0.0, 0.3])
def test_speculative_greedy_gives_the_targets_own_ids(target: PackedLlama, k: int, draft_kind: str, p_min) -> None:
    draft = target if draft_kind == "itself" else packed(2, 7)
    for prompt in ([5], [1, 2, 3, 4, 5, 6, 7], list(range(10, 40))):
        plain = generate_ids(target, prompt, 24)
        spec = speculative_greedy(target, draft, prompt, 24, k=k, p_min=p_min)
        assert spec.ids == plain, (prompt, k)
        assert 0 <= spec.accepted <= spec.drafted <= k * spec.target_calls
        if p_min == 0:
            assert spec.drafted == k * spec.target_calls
        if draft_kind == "itself":  # every draft is the target's own choice
            assert spec.accepted == spec.drafted
        if draft_kind == "itself" and p_min == 0:
            assert spec.target_calls <= -(-23 // (k + 1))  # each call yields k + 1 tokens


def test_p_min_keeps_unsure_drafts_from_the_target(target: PackedLlama) -> None:
    """A draft whose top probability is under p_min proposes nothing: every token is the target's own
    one-position step; a low p_min drafts less than none at all, and only the unsure ones are cut."""
    draft = packed(2, 7)
    prompt = list(range(10, 20))
    none = speculative_greedy(target, draft, prompt, 16, k=3, p_min=1.0)
    assert none.ids == generate_ids(target, prompt, 16) and none.drafted == 0 and none.target_calls == 15
    free = speculative_greedy(target, draft, prompt, 16, k=3)
    some = speculative_greedy(target, draft, prompt, 16, k=3, p_min=0.3)
    assert 0 < some.drafted < free.drafted


def test_a_stop_id_ends_the_speculative_continuation(target: PackedLlama) -> None:
    plain = generate_ids(target, [3, 1, 4], 30)
    stop = plain[11]
    spec = speculative_greedy(target, target, [3, 1, 4], 30, k=4, stop_ids=(stop,))
    assert spec.ids == generate_ids(target, [3, 1, 4], 30, stop_ids=(stop,)) == plain[: plain.index(stop)]


def test_draft_acceptance_against_a_hand_count() -> None:
    target = np.array([[1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]])
    draft = np.array([[1, 2, 0, 4, 5, 6], [7, 7, 7, 7, 7, 0]])
    m = draft_acceptance(target, draft, max_k=3)
    # agreement: row 0 T T F T T T, row 1 T T T T T F -> 10 of 12
    assert m["draft_top1_agreement"] == pytest.approx(10 / 12)
    # k = 1, row 0: at 0 run 2 -> keep 1, move to 2; at 2 run 0 -> keep 0, move to 3; at 3 run 3 -> keep 1,
    # move to 5; at 5 keep 1. Row 1: at 0 keep 1 -> 2, keep 1 -> 4, at 4 run 1 -> keep 1 -> 6. [1,0,1,1,1,1,1]
    assert m["draft_accepted_k1"] == pytest.approx(6 / 7)
    # k = 3, row 0: at 0 keep 2 -> 3; at 3 keep 3 -> 7. Row 1: at 0 keep 3 -> 4; at 4 keep 1 -> 6. [2,3,3,1]
    assert m["draft_accepted_k3"] == pytest.approx(9 / 4) and m["draft_tokens_per_call_k3"] == pytest.approx(13 / 4)


def test_bad_arguments_are_refused(target: PackedLlama) -> None:
    with pytest.raises(ValueError, match="at least one prompt token"):
        speculative_greedy(target, target, [], 4)
    with pytest.raises(ValueError, match="p_min"):
        speculative_greedy(target, target, [1], 4, p_min=1.5)
    with pytest.raises(ValueError, match="context_length"):
        speculative_greedy(target, target, list(range(90)) + list(range(30)), 20, k=4)
    with torch.no_grad():
        assert speculative_greedy(target, target, [1], 1).ids == generate_ids(target, [1], 1)


def test_generate_with_a_draft_gives_the_donors_greedy_text(smollm2, smollm2_path, tmp_path) -> None:
    """`python -m stages.generate model_path=<donor> draft=<student>`: the donor's own ids, counted."""
    from pipeline.config import GenerateConfig
    from pipeline.errors import ConfigError
    from pipeline.inference.generate import run_generate
    from pipeline.models.llama_gguf import export_llama
    from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

    student = Llama(TransformerConfig(49152, 64, 2, 4, 2, 128, 512, 100000.0, 1e-5))
    init_weights(student, 0.02, seed=1)
    tok_meta = donor_tokenizer_metadata(smollm2)
    draft = export_llama(student, tmp_path / "draft.gguf", tok_meta, {"general.name": "d"}, "f32")
    base = dict(model_path=str(smollm2_path), prompt="The for statement", max_new_tokens=12, precision="fp32")
    plain = run_generate(GenerateConfig(**base))
    spec = run_generate(GenerateConfig(**base, draft=str(draft), draft_k=3))
    assert spec["ids"] == plain["ids"] and spec["completion"] == plain["completion"]
    assert 0 <= spec["accepted"] <= spec["drafted"] <= 3 * spec["target_calls"]
    with pytest.raises(ConfigError, match="config key draft|draft"):
        GenerateConfig(**base, draft=str(draft), temperature=0.8)


def test_preset_draft_composes_and_recipe_draft_refuses_what_cannot_draft() -> None:
    from pipeline.errors import ConfigError
    from stages._run.typed import typed_config
    from stages.compose import compose_config

    cfg = typed_config(compose_config(["preset=draft"]))
    assert cfg.recipe.name == "draft" and cfg.recipe.init == "subclone" and cfg.train.distill.weight == 1.0
    shallowest = typed_config(compose_config([])).donor.student.shallow.n_layer  # the default's, on any corpus
    assert cfg.model.n_layer < shallowest and cfg.optim.lr == 0.001 and cfg.export.dtype == "q8_0"
    for override, key in (
        ("train.distill.weight=0", "train.distill.weight"),
        ("data=instruct", "data.source"),
        ("model=gpt2-tiny", "model.arch"),
    ):
        with pytest.raises(ConfigError) as err:
            typed_config(compose_config(["preset=draft", override]))
        assert (
            str(err.value).startswith(f"config key {key}:") and "fix:" in str(err.value) and "\n" not in str(err.value)
        )
