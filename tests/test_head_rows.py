"""Training's softmax over the corpus's ids (`train.vocab=corpus`): the same loss as the plain softmax
over those rows, sampled others standing for the rest, exact resume, and the whole vocabulary kept."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import TrainConfig
from pipeline.models.llama import Llama
from pipeline.models.ops.head_rows import HeadVocab, corpus_vocabulary, wants_corpus_vocab
from pipeline.models.ops.losses import linear_cross_entropy, linear_distill_loss
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.training.trainer import head_vocabulary

V = 300


def tiny(seed: int = 0) -> Llama:
    cfg = TransformerConfig(vocab_size=V, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=48, context_length=32)
    model = Llama(cfg)
    init_weights(model, 0.2, seed)
    return model


def test_the_corpus_vocabulary_is_every_id_in_use() -> None:
    used = corpus_vocabulary([np.array([3, 5, 5, 9], np.uint32), np.array([9, 1])], np.array([[7, 3], [2, 2]]), 12)
    assert np.flatnonzero(used).tolist() == [1, 2, 3, 5, 7, 9]
    hv = HeadVocab.of(used, 12, negatives=4)
    assert hv.ids.tolist() == [1, 2, 3, 5, 7, 9] and hv.rest.tolist() == [0, 4, 6, 8, 10, 11]
    assert hv.map(torch.tensor([9, 1, 5])).tolist() == [5, 0, 3]
    assert wants_corpus_vocab("auto", 262144) and not wants_corpus_vocab("auto", 49152)
    assert wants_corpus_vocab("corpus", 100) and not wants_corpus_vocab("full", 262144)


def test_training_rows_add_sampled_others_with_their_weight() -> None:
    hv = HeadVocab.of(np.arange(20) < 5, 20, negatives=3)
    torch.manual_seed(0)
    rows, bias = hv.rows(training=True)
    assert rows[:5].tolist() == list(range(5)) and all(r >= 5 for r in rows[5:].tolist())
    assert bias[:5].tolist() == [0.0] * 5 and bias[5:].tolist() == pytest.approx([math.log(15 / 3)] * 3)
    torch.manual_seed(0)
    assert torch.equal(hv.rows(training=True)[0], rows)  # the host generator: a checkpoint restores it
    assert hv.rows(training=False) == (hv.ids, None)  # validation: the corpus's rows alone


def test_the_loss_is_the_plain_softmax_over_the_rows() -> None:
    """Without sampled others, `model.loss` is F.cross_entropy over the corpus rows' logits, with its
    gradients; with them, each other row's logit carries log(rest / negatives)."""
    model, x = tiny(), torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    used = np.zeros(V, bool)
    used[:60] = True
    model.head_vocab = HeadVocab.of(used, V, negatives=0)
    loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    ours = model.blocks[0].attn.wq.weight.grad.clone()
    model.zero_grad()
    logits = F.linear(model.hidden(x[:, :-1]), model.tok_embd.weight[:60])
    ref = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, model.blocks[0].attn.wq.weight.grad, rtol=1e-4, atol=1e-6)
    h, w, t = torch.randn(7, 16), torch.randn(40, 16), torch.randint(0, 40, (7,))
    bias = torch.cat((torch.zeros(30), torch.full((10,), 2.5)))
    torch.testing.assert_close(linear_cross_entropy(h, w, t, bias=bias), F.cross_entropy(h @ w.T + bias, t))


def test_distillation_maps_the_teachers_ids_into_the_rows() -> None:
    h, w = torch.randn(6, 16), torch.randn(50, 16)
    rows = torch.arange(10, 40)
    t = torch.randint(10, 40, (6,))
    ids = torch.stack([torch.randperm(30)[:4] + 10 for _ in range(6)])
    logp = torch.log_softmax(torch.randn(6, 5), -1)
    teacher = (ids, logp[:, :4], logp[:, 4])
    used = np.zeros(50, bool)
    used[10:40] = True
    hv = HeadVocab.of(used, 50, negatives=0)
    ours = linear_distill_loss(h, w[rows], hv.map(t), (hv.map(ids), *teacher[1:]), 0.5, 1.0)[0]
    ref = linear_distill_loss(h, w[rows], t - 10, (ids - 10, *teacher[1:]), 0.5, 1.0)[0]
    torch.testing.assert_close(ours, ref)


def test_the_trainer_restricts_only_what_it_is_asked_to() -> None:
    train, val = np.array([1, 2, 3, 2], np.uint32), np.array([4, 1], np.uint32)
    assert head_vocabulary(TrainConfig(vocab="full"), train, val, None, 100_000) is None
    assert head_vocabulary(TrainConfig(vocab="auto"), train, val, None, 50_000) is None
    hv = head_vocabulary(TrainConfig(vocab="auto", vocab_negatives=10), train, val, None, 100_000)
    assert hv.ids.tolist() == [1, 2, 3, 4] and hv.negatives == 10
