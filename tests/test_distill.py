"""Distillation from the donor: the top-k KL against a naive full-logits reference, plain CE at
weight 0, zero KL when the student is the teacher; the teach cache against a direct donor forward;
the named refusals (config values, a cache of other data or another donor, top_k beyond the vocab
or the cache, instruction rows); bit-exact resume with a cached and an online teacher; and the two
stages in-process, with the CE and KD parts in MLflow."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import DataConfig, DistillConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from pipeline.data.corpus import load_documents
from pipeline.data.packed import load_split, split_fingerprint, spread_spans
from pipeline.data.teacher_cache import META_FILE, VAL_CHOICE_FILE, TeacherCache, read_meta, read_val_choice
from pipeline.data.text import pack
from pipeline.distill.teach import run_teach, teacher_windows
from pipeline.donor.load import load_donor
from pipeline.errors import ConfigError, DataError
from pipeline.inference.speculative import draft_acceptance
from pipeline.init.realize import realize
from pipeline.io.files import sha256_file
from pipeline.modeldir import load_model_dir, save_model_dir
from pipeline.models.devices import resolve_precision
from pipeline.models.llama_gguf import export_llama
from pipeline.models.ops.losses import (
    head_targets,
    linear_cross_entropy,
    linear_distill_loss,
    narrow_targets,
    top_k_targets,
)
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training import checkpoint as ckpt
from pipeline.training.batches import MixedSampler, distill_share, make_sampler
from pipeline.training.loop import TrainJob, train
from pipeline.training.resume import plan_checkpoints
from pipeline.training.trainer import load_teacher
from pipeline.training.validation import scored_windows
from stages._input_records import donor_record
from stages._lineage import check_teach
from stages._malloc import allocator_in_use
from stages._run.lifecycle import run_stage
from stages._run.paths import Paths
from stages._run.typed import typed_config
from stages.compose import compose_config
from stages.evaluate import body as evaluate_body
from stages.train import lineage

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
VOCAB = 49152
STUDENT = ModelConfig(d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=64)
# a sharper donor than a default init, so its top-k is well separated
DONOR = ModelConfig(d_model=48, n_layer=2, n_head=4, n_kv_head=2, d_ff=96, context_length=64, init_std=0.3)
DISTILL = DistillConfig(weight=0.5, top_k=8, context=48)
TCFG = TrainConfig(
    steps=8,
    batch_size=4,
    seq_len=16,
    eval_every=4,
    log_every=1,
    checkpoint_every=2,
    keep_checkpoints=3,
    distill=DISTILL,
)


@dataclass
class Project:
    root: Path
    donor: Path

    @property
    def packed(self) -> Path:
        return self.root / "data" / "packed"

    @property
    def inputs(self) -> Path:
        return self.root / "data" / "inputs"

    @property
    def teach(self) -> Path:
        return self.root / "data" / "teach"

    def teach_with(self, tcfg: TrainConfig, out: Path, precision: str = "fp32"):
        record = json.loads((self.inputs / "donor.json").read_text())
        return run_teach(self.donor, record, self.packed, out, tcfg, CPU, progress=False, precision=precision)


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Project:
    """Real packed text, tiny student weights, a tiny donor GGUF, its inputs record and a teach cache."""
    root = tmp_path_factory.mktemp("distill")
    docs = load_documents(DataConfig())[:4]
    meta, _ = pack(docs, tokenizer_from_gguf(smollm2), DataConfig(val_fraction=0.25), root / "data" / "packed")
    (root / "models" / "init").mkdir(parents=True)
    save_model_dir(root / "models" / "init", realize(STUDENT, "scratch", meta.vocab_size, 0))
    donor = export_llama(realize(DONOR, "scratch", VOCAB, 1), root / "donor.gguf", {}, {"general.name": "tiny"}, "f32")
    (root / "data" / "inputs").mkdir(parents=True)
    (root / "data" / "inputs" / "donor.json").write_text(json.dumps(donor_record(str(donor), donor)))
    p = Project(root, donor)
    p.teach_with(TCFG, p.teach)
    return p


def naive_distill(h, w, y, t_logits, k, weight, temperature):
    """The loss from full logits: both distributions over the teacher's top-k plus one bucket for the rest."""
    logits = (h @ w.t()).float()
    t_lp, s_lp = torch.log_softmax(t_logits.float(), -1), torch.log_softmax(logits, -1)
    top, ids = t_lp.topk(k, -1)
    rest = torch.zeros_like(t_lp, dtype=torch.bool).scatter_(1, ids, True)

    def coarse(lp_k, lp):
        tail = torch.logsumexp(lp.masked_fill(rest, float("-inf")), -1, keepdim=True)
        return torch.log_softmax(torch.cat((lp_k, tail), -1) / temperature, -1)

    log_q, log_r = coarse(top, t_lp), coarse(s_lp.gather(1, ids), s_lp)
    kl = (log_q.exp() * (log_q - log_r)).sum(-1).mean() * temperature**2
    return (1 - weight) * F.cross_entropy(logits, y) + weight * kl


def random_case(n=300, d=16, vocab=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(vocab, d, generator=g) * 0.5).requires_grad_()
    return h, w, torch.randint(0, vocab, (n,), generator=g), torch.randn(n, vocab, generator=g) * 2


@pytest.mark.parametrize(("weight", "temperature"), [(0.5, 1.0), (1.0, 1.0), (0.9, 2.0), (0.3, 0.5)])
def test_top_k_kl_matches_a_naive_full_logits_reference(weight: float, temperature: float) -> None:
    h, w, y, t_logits = random_case()
    ref = naive_distill(h, w, y, t_logits, 8, weight, temperature)
    ref_grads = torch.autograd.grad(ref, (h, w))
    # cached with k=12, used with k=8: the 4 dropped tokens join the tail exactly
    teacher = narrow_targets(*top_k_targets(t_logits, 12), 8)
    loss, parts = linear_distill_loss(h, w, y, teacher, weight, temperature, chunk=128)
    grads = torch.autograd.grad(loss, (h, w))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert float((1 - weight) * parts[0] + weight * parts[1]) == pytest.approx(float(loss.detach()), rel=1e-6)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weight_zero_is_plain_cross_entropy(precision: str) -> None:
    h, w, y, t_logits = random_case(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        plain = linear_cross_entropy(h, w, y, chunk=128)
        distill, parts = linear_distill_loss(h, w, y, top_k_targets(t_logits, 8), 0.0, 1.0, chunk=128)
    assert torch.equal(plain, distill) and float(parts[0]) == float(plain.detach())
    for a, b in zip(torch.autograd.grad(plain, (h, w)), torch.autograd.grad(distill, (h, w))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_is_zero_when_the_student_is_the_teacher(temperature: float) -> None:
    model = realize(DONOR, "scratch", 1000, 3)
    x = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher = head_targets(model.hidden(x).flatten(0, 1), model.head_weight(), 16)
    loss, parts = model.distill_loss(x, x.roll(-1, 1), teacher, 1.0, temperature)
    loss.backward()
    assert float(parts[1]) < 1e-6 and float(loss.detach()) < 1e-6
    assert max(p.grad.abs().max().item() for p in model.parameters()) < 1e-5


def test_teacher_windows_tile_the_stream_with_seq_len_of_context() -> None:
    for n, context, seq_len in [(1000, 48, 16), (1001, 512, 128), (40, 48, 16), (97, 20, 7)]:
        windows = teacher_windows(n, context, seq_len)
        kept = [p for _, keep, end in windows for p in range(keep, end)]
        assert kept == list(range(n))
        assert all(end - start == min(context, n) for start, _, end in windows)
        assert all(keep - start >= seq_len for start, keep, _ in windows[1:])


def test_teach_cache_round_trips_against_a_direct_donor_forward(project: Project) -> None:
    cache = TeacherCache(project.teach)
    tokens = load_split(project.packed, "train")
    assert cache.meta.positions == len(tokens) and cache.ids.dtype == np.uint16 and cache.logprobs.dtype == np.float16
    assert cache.meta.train_sha256 == sha256_file(project.packed / "train.bin")
    assert cache.meta.donor_sha256 == sha256_file(project.donor) and cache.meta.donor_val_loss > 0
    donor = load_donor(project.donor, VOCAB)
    windows = teacher_windows(len(tokens), DISTILL.context, TCFG.seq_len)
    for start, keep, end in (windows[0], windows[1], windows[len(windows) // 2], windows[-1]):
        with torch.no_grad():
            lp = torch.log_softmax(donor(torch.from_numpy(np.asarray(tokens[start:end], dtype=np.int64))[None])[0], -1)
        lp = lp[keep - start :]
        ids = torch.from_numpy(cache.ids[keep:end].astype(np.int64))
        cached = torch.from_numpy(cache.logprobs[keep:end].astype(np.float32))
        assert torch.allclose(cached, lp.gather(1, ids), atol=2e-2, rtol=1e-3)  # float16
        kth = lp.topk(DISTILL.top_k, -1).values[:, -1:]
        assert bool((lp.gather(1, ids) >= kth - 1e-5).all())  # they are the top-k (ties aside)
        rest = torch.logsumexp(lp.scatter(1, ids, float("-inf")), -1)
        assert torch.allclose(torch.from_numpy(np.array(cache.tail[keep:end])), rest, atol=1e-4)
    val, seq = load_split(project.packed, "val"), TCFG.seq_len
    n = (len(val) - 1) // seq
    with torch.no_grad():  # the donor's greedy choices over evaluate's val windows, for draft scoring
        direct = donor(torch.from_numpy(np.asarray(val[: n * seq], dtype=np.int64).reshape(n, seq))).argmax(-1)
    choice = read_val_choice(project.teach)
    assert choice.shape == (n, seq) and (choice == direct.numpy()).mean() > 0.99  # batching may flip a near-tie
    ids, logp, tail = cache.gather(np.array([0, 3]), 16)
    assert ids.shape == (2, 16, 8) and np.array_equal(ids[1, 0], cache.ids[3]) and tail.shape == (2, 16)
    assert logp.dtype == np.float32 and np.array_equal(logp[0, 5], cache.logprobs[5].astype(np.float32))


def test_cache_spans_are_disjoint_evenly_spread_and_within_the_budget() -> None:
    assert spread_spans(1000, 0, 64) == [] and spread_spans(1000, 1000, 64) == []
    for n, budget, span in [(10_000, 3000, 1000), (10_001, 4096, 1024), (5000, 700, 1024), (100_000, 99_999, 8192)]:
        spans = spread_spans(n, budget, span)
        assert sum(e - s for s, e in spans) <= budget and spans[0][0] == 0
        assert spans[-1][1] == (n if len(spans) > 1 else min(span, budget))  # spread to the end
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # ordered, disjoint


def test_a_cache_budget_caches_spans_and_training_draws_from_them(project: Project, tmp_path: Path) -> None:
    """Over `cache_tokens` train tokens the donor caches spread spans; a share of train's batches
    distil on windows of them, the rest are plain windows of the whole split."""
    tokens = load_split(project.packed, "train")
    budget = len(tokens) // 2
    steps = 2 * budget // (TCFG.batch_size * TCFG.seq_len)  # the run reads twice what is cached
    tcfg = replace(
        TCFG, steps=steps, eval_every=steps, checkpoint_every=0, distill=replace(DISTILL, cache_tokens=budget)
    )
    meta, metrics = project.teach_with(tcfg, tmp_path / "teach")
    cache = TeacherCache(tmp_path / "teach")
    expected = np.concatenate([tokens[s:e] for s, e in meta.spans])
    assert len(meta.spans) >= 1 and meta.positions == len(expected) <= len(tokens) // 2
    assert np.array_equal(cache.tokens, expected) and len(cache.ids) == len(expected)
    assert metrics["cached_positions"] == len(expected)
    quarter = replace(tcfg, distill=replace(tcfg.distill, span=budget // 4))  # train.distill.span reaches teach
    assert [e - s for s, e in project.teach_with(quarter, tmp_path / "teach4")[0].spans] == [budget // 4] * 4
    donor = load_donor(project.donor, VOCAB)
    with torch.no_grad():  # the first window of the spans' stream is the donor's own forward over it
        lp = torch.log_softmax(donor(torch.from_numpy(expected[: DISTILL.context].astype(np.int64))[None])[0], -1)
    ids = torch.from_numpy(cache.ids[: DISTILL.context].astype(np.int64))
    cached = torch.from_numpy(cache.logprobs[: DISTILL.context].astype(np.float32))
    assert torch.allclose(cached, lp.gather(1, ids), atol=2e-2)
    sampler = make_sampler(tokens, tcfg, 0, cache)
    share = distill_share(len(expected), tcfg)
    assert isinstance(sampler, MixedSampler) and 0 < share < 1
    kinds = [len(sampler()) for _ in range(tcfg.steps)]
    assert kinds.count(5) == int(tcfg.steps * share)  # distillation batches, evenly interleaved with plain ones
    every = replace(tcfg, distill=replace(tcfg.distill, share=1.0))  # every batch distils, the cache read twice
    assert all(len(b) == 5 for b in (make_sampler(tokens, every, 0, cache)() for _ in range(tcfg.steps)))
    state = copy.deepcopy(sampler.state())  # its state is its whole future (checkpoints carry it)
    ahead = [sampler() for _ in range(5)]
    again = make_sampler(tokens, tcfg, 0, cache)
    again.set_state(state)
    assert all(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(ahead, [again() for _ in range(5)]))
    model = load_model_dir(project.root / "models" / "init")
    val = load_split(project.packed, "val")
    result = train(model, tokens, val, TrainJob(tcfg, OptimConfig(), 0, progress=False), teacher=cache)
    assert result.steps == tcfg.steps and any("train_kd" in h for h in result.history)
    with pytest.raises(DataError, match="cached positions"):  # a span cache of a shorter split
        train(
            load_model_dir(project.root / "models" / "init"),
            tokens[: len(tokens) // 3],
            val,
            TrainJob(tcfg, OptimConfig(), 0, progress=False),
            teacher=cache,
        )


def test_a_donor_source_caches_its_greedy_continuations_and_training_reads_them_whole(
    project: Project, tmp_path: Path
) -> None:
    """source=donor: each cached sequence is a train prompt and the donor's own greedy continuation
    to one training window, with the donor's targets at every position; with weight 1 every batch
    is one of those windows, drawn whole."""
    tokens, seq, prompt = load_split(project.packed, "train"), TCFG.seq_len + 1, 5
    distill = replace(DISTILL, weight=1.0, source="donor", prompt_tokens=prompt, cache_tokens=6 * seq)
    tcfg = replace(TCFG, steps=4, eval_every=4, checkpoint_every=0, distill=distill)
    meta, _ = project.teach_with(tcfg, tmp_path / "teach")
    cache = TeacherCache(tmp_path / "teach")
    assert meta.source == "donor" and meta.sequence == seq and len(meta.spans) == 6 and meta.positions == 6 * seq
    rows = np.asarray(cache.tokens, dtype=np.int64).reshape(6, seq)
    for (start, end), row in zip(meta.spans, rows):
        assert end - start == prompt and np.array_equal(row[:prompt], tokens[start:end])
    ids_k, logp_k = cache.ids.astype(np.int64).reshape(6, seq, -1), cache.logprobs.reshape(6, seq, -1)
    for r in range(6):  # greedy: each next id is the donor's best there (bf16 logits tie: any of the best)
        for p in range(prompt - 1, seq - 1):
            best = ids_k[r, p][logp_k[r, p] == logp_k[r, p, 0]]
            assert rows[r, p + 1] in best
    donor = load_donor(project.donor, VOCAB)
    with torch.no_grad():  # the cached targets are the donor's own distribution over the sequence
        lp = torch.log_softmax(donor(torch.from_numpy(rows[:2]))[0:2], -1).flatten(0, 1)
    ids = torch.from_numpy(cache.ids[: 2 * seq].astype(np.int64))
    err = (torch.from_numpy(cache.logprobs[: 2 * seq].astype(np.float32)) - lp.gather(1, ids)).abs()
    assert err.max() < 0.5 and err.mean() < 0.05  # bf16 decoding vs this fp32 forward; a shift is nats off
    sampler = make_sampler(tokens, tcfg, 0, cache)
    batches = [sampler() for _ in range(4)]
    assert all(len(b) == 5 for b in batches)  # weight 1: every batch distils
    assert all(s % seq == 0 for s in sampler.distill.windows.starts)  # whole continuations
    model = load_model_dir(project.root / "models" / "init")
    val = load_split(project.packed, "val")
    assert train(model, tokens, val, TrainJob(tcfg, OptimConfig(), 0, progress=False), teacher=cache).steps == 4
    with pytest.raises(ConfigError, match="train.seq_len=16"):  # its windows are one continuation long
        train(model, tokens, val, TrainJob(replace(tcfg, seq_len=8), OptimConfig(), 0, progress=False), teacher=cache)


def test_teach_with_distillation_off_records_off_and_caches_nothing(project: Project, tmp_path: Path) -> None:
    meta, metrics = project.teach_with(replace(TCFG, distill=DistillConfig()), tmp_path / "off")
    assert meta.mode == "off" and sorted(p.name for p in (tmp_path / "off").iterdir()) == [META_FILE, VAL_CHOICE_FILE]
    assert metrics["cached_positions"] == 0
    measured = read_meta(project.teach).donor_val_loss  # the same donor over the same val windows, cached mode
    assert read_meta(tmp_path / "off").donor_val_loss == pytest.approx(measured, abs=1e-6)
    with pytest.raises(DataError, match="mode cached"):
        TeacherCache(tmp_path / "off")


@pytest.mark.parametrize("distill", [DISTILL, DistillConfig()])
def test_teach_refuses_a_seq_len_beyond_the_donors_context_with_distillation_on_or_off(
    project: Project, tmp_path: Path, distill: DistillConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off too: the donor's val loss is still measured over windows of train.seq_len (it was a traceback).
    From the donor's header, before its weights load (the loader raising here: the check came after it)."""

    def no_load(*_: object) -> None:
        raise AssertionError("the donor's weights were loaded before train.seq_len was checked")

    monkeypatch.setattr("pipeline.distill.teach.load_donor", no_load)
    tcfg = replace(TCFG, seq_len=DONOR.context_length + 1, distill=replace(distill, context=DONOR.context_length + 1))
    with pytest.raises(ConfigError, match=r"config key train.seq_len: expected at most the donor's context_length=64"):
        project.teach_with(tcfg, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_teach_refuses_top_k_beyond_the_vocab_and_instruction_rows(project: Project, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        project.teach_with(replace(TCFG, distill=replace(DISTILL, top_k=VOCAB + 1)), tmp_path / "t")
    assert "train.distill.top_k" in str(err.value) and str(VOCAB) in str(err.value) and "\n" not in str(err.value)
    rows = tmp_path / "rows"
    shutil.copytree(project.packed, rows)
    meta = json.loads((rows / "meta.json").read_text())
    (rows / "meta.json").write_text(json.dumps({**meta, "format": "instruct", "source": "instruct"}))
    (rows / "train.npz").write_bytes(b"rows")
    record = json.loads((project.inputs / "donor.json").read_text())
    with pytest.raises(DataError, match="distillation needs|a token corpus"):
        run_teach(project.donor, record, rows, tmp_path / "t2", TCFG, CPU, progress=False)
    assert not (tmp_path / "t2").exists()


@pytest.mark.parametrize(
    ("distill", "key"),
    [
        ("train.distill.weight=1.5", "train.distill.weight"),
        ("train.distill.temperature=0", "train.distill.temperature"),
        ("train.distill.top_k=0", "train.distill.top_k"),
        ("train.distill.mode=live", "train.distill.mode"),
        ("train.distill.context=128", "train.distill.context"),  # not more than train.seq_len=128
    ],
)
def test_bad_distill_values_are_rejected_naming_the_key(distill: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        typed_config(compose_config(["train.distill.weight=0.5", distill]))
    assert key in str(err.value) and "\n" not in str(err.value)


def test_recipe_distill_sets_the_weight() -> None:
    cfg = typed_config(compose_config(["recipe=distill"]))
    assert cfg.recipe.init == "pca" and cfg.train.distill.weight > 0
    assert typed_config(compose_config(["recipe=distill", "train.distill.weight=0.9"])).train.distill.weight == 0.9


def test_train_refuses_a_cache_of_other_data_or_donor_or_too_small_a_k(project: Project, tmp_path: Path) -> None:
    cfg = PipelineConfig(train=TCFG)
    assert check_teach(cfg, project.teach, project.packed, project.inputs)["lineage.teacher"].endswith(":cached:k8")
    assert check_teach(PipelineConfig(), tmp_path / "absent", project.packed, project.inputs) == {}  # off: no check
    stale = tmp_path / "teach"
    shutil.copytree(project.teach, stale)
    meta = json.loads((stale / META_FILE).read_text())
    for changed, named in (({"train_sha256": "0" * 64}, "train.bin"), ({"donor_sha256": "1" * 64}, "donor")):
        (stale / META_FILE).write_text(json.dumps({**meta, **changed}))
        with pytest.raises(ConfigError) as err:
            check_teach(cfg, stale, project.packed, project.inputs)
        assert named in str(err.value) and "dvc repro teach" in str(err.value) and "\n" not in str(err.value)
    online = replace(TCFG, distill=replace(DISTILL, mode="online"))
    with pytest.raises(ConfigError, match="config key train.distill.mode: expected 'cached'"):
        check_teach(PipelineConfig(train=online), project.teach, project.packed, project.inputs)
    (stale / META_FILE).write_text(json.dumps({**meta, "mode": "off"}))  # teach ran with distillation off
    with pytest.raises(ConfigError) as err:  # the fix must be a value the config takes (mode has no 'off')
        check_teach(cfg, stale, project.packed, project.inputs)
    assert str(err.value).startswith("config key train.distill.weight: expected 0.0, what ")
    assert "found 0.5" in str(err.value) and "or set train.distill.weight=0.0 to use them" in str(err.value)
    (stale / META_FILE).write_text(json.dumps({**meta, "mode": "online"}))
    with pytest.raises(ConfigError, match="config key donor.path: expected '.*donor.gguf'"):  # not the recorded file
        check_teach(PipelineConfig(train=online), stale, project.packed, project.inputs)
    wide = PipelineConfig(train=replace(TCFG, distill=replace(DISTILL, top_k=16)))
    with pytest.raises(ConfigError, match="train.distill.top_k: expected at most 8"):
        check_teach(wide, project.teach, project.packed, project.inputs)
    model = load_model_dir(project.root / "models" / "init")
    data = load_split(project.packed, "train"), load_split(project.packed, "val")
    with pytest.raises(ConfigError, match="train.distill.top_k: expected at most 8"):
        train(model, *data, TrainJob(wide.train, OptimConfig(), 0, progress=False), teacher=TeacherCache(project.teach))


def test_a_hand_run_on_another_recipe_names_the_init_before_the_teach_cache(project: Project, tmp_path: Path) -> None:
    """`dvc exp run -S recipe=from-scratch` (no distillation), then a hand-run train on the default
    (distilling) config: the error names the recipe the inputs were made with, the cause, rather
    than the teach cache that the from-scratch run did not need."""

    root = tmp_path / "project"
    shutil.copytree(project.root / "data", root / "data")
    (root / "models" / "init").mkdir(parents=True)
    (root / "models" / "init" / "realize.json").write_text(json.dumps({"recipe": "from-scratch", "init": "scratch"}))
    meta = json.loads((root / "data" / "teach" / META_FILE).read_text())
    (root / "data" / "teach" / META_FILE).write_text(json.dumps({**meta, "mode": "off"}))
    cfg = PipelineConfig(data=DataConfig(val_fraction=0.25), train=TCFG)
    with pytest.raises(ConfigError, match=r"^config key recipe.init: expected 'scratch', what "):
        lineage(cfg, Paths(root))


def run_distill(project: Project, tcfg: TrainConfig, ckpt_dir: Path):
    optim = OptimConfig(lr=3e-3, warmup_steps=2)
    plan = plan_checkpoints(
        tcfg, optim, 0, project.root / "models/init", project.packed, ckpt_dir, teach_dir=project.teach
    )
    model = load_model_dir(project.root / "models" / "init")
    teacher = load_teacher(tcfg, project.teach, project.donor, VOCAB)
    data = load_split(project.packed, "train"), load_split(project.packed, "val")
    result = train(model, *data, TrainJob(tcfg, optim, 0, plan=plan, progress=False), teacher=teacher)
    return model, result, plan


@pytest.mark.parametrize("mode", ["cached", "online"])
def test_resume_with_distillation_is_bit_identical(project: Project, tmp_path: Path, mode: str) -> None:
    tcfg = replace(TCFG, distill=replace(DISTILL, mode=mode))
    full, full_result, plan = run_distill(project, tcfg, tmp_path)
    assert plan.compat["distill"]["mode"] == mode and plan.compat["distill"]["teacher"]
    assert all({"train_ce", "train_kd"} <= set(h) for h in full_result.history)
    first = full_result.history[0]
    assert first["train_loss"] == pytest.approx(0.5 * first["train_ce"] + 0.5 * first["train_kd"], rel=1e-5)
    for s in (8, 6):
        shutil.rmtree(plan.root / ckpt.step_name(s))
    resumed, result, _ = run_distill(project, tcfg, tmp_path)
    assert result.resumed_from == 4
    for k, v in full.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    assert [(h["train_loss"], h["train_kd"]) for h in result.history] == [
        (h["train_loss"], h["train_kd"]) for h in full_result.history
    ]


def test_checkpoints_of_a_run_without_distillation_keep_their_key(project: Project, tmp_path: Path) -> None:
    off = replace(TCFG, distill=DistillConfig())
    plan = plan_checkpoints(off, OptimConfig(), 0, project.root / "models/init", project.packed, tmp_path)
    assert "distill" not in plan.compat
    on = plan_checkpoints(TCFG, OptimConfig(), 0, project.root / "models/init", project.packed, tmp_path)
    assert on.root != plan.root and asdict(DISTILL).items() <= on.compat["distill"].items()


def test_teach_and_train_stages_log_the_loss_parts_and_refuse_another_donor(
    project: Project, tmp_path: Path, monkeypatch, capsys
) -> None:
    from mlflow.tracking import MlflowClient

    from stages._run.lifecycle import run_stage
    from stages.teach import body as teach_body
    from stages.train import body as train_body
    from stages.train import prepared

    root = tmp_path / "project"
    shutil.copytree(project.root, root, ignore=shutil.ignore_patterns("teach"))
    monkeypatch.chdir(root)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = compose_config(
        [f"donor.path={root / 'donor.gguf'}", "data.val_fraction=0.25", "train.device=cpu", "train.threads=1"]
        + ["train.steps=4", "train.batch_size=4", "train.seq_len=16", "train.eval_every=4", "train.log_every=1"]
        + ["train.distill.weight=0.5", "train.distill.top_k=8", "train.distill.context=48"]
        + [f"train.checkpoint_dir={tmp_path / 'checkpoints'}"]
    )
    teach = run_stage("teach", cfg, teach_body)
    assert teach["cached_positions"] == len(load_split(root / "data/packed", "train"))
    assert json.loads((root / "metrics" / "teach.json").read_text())["donor_val_loss"] == teach["donor_val_loss"]
    assert read_meta(root / "data" / "teach").precision == resolve_precision("auto", CPU)  # what the donor ran in
    stage, plan = prepared(cfg)
    metrics = stage.run(lambda ctx: train_body(ctx, plan))
    assert metrics["final_train_kd"] > 0 and metrics["final_train_ce"] > 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("smollm-pipeline").experiment_id], "tags.stage = 'train'"
    )
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss/train_kd")] == [1, 2, 3, 4]
    assert run.data.tags["lineage.teacher"].startswith("donor.gguf:")
    assert run.data.tags["train.precision_ran"] == resolve_precision("auto", CPU) == plan.compat["train"]["precision"]
    assert run.data.tags["train.allocator"] == allocator_in_use()  # this process's: pytest does not restart
    record = root / "data" / "inputs" / "donor.json"
    other = json.loads(record.read_text())
    other["file"]["sha256"] = "f" * 64
    record.write_text(json.dumps(other))
    with pytest.raises(SystemExit) as exit_info:
        prepared(cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "the donor" in lines[0] and "dvc repro teach" in lines[0]


def test_evaluate_reports_bits_per_byte_and_the_gap_to_the_donor(project: Project, tmp_path: Path) -> None:
    from pipeline.evaluate.evaluate_text import reference_metrics

    meta = json.loads((project.packed / "meta.json").read_text())
    donor = read_meta(project.teach).donor_val_loss
    out = reference_metrics(4.0, project.packed, project.teach, TCFG.seq_len)
    assert out["val_bpb"] == pytest.approx(4.0 * meta["tokens"]["val"] / meta["bytes"]["val"] / np.log(2))
    assert out["donor_val_loss"] == donor and out["gap_to_donor"] == pytest.approx(4.0 - donor)
    assert out["donor_val_bpb"] == pytest.approx(out["val_bpb"] * donor / 4.0)
    assert set(reference_metrics(4.0, project.packed, project.teach, 32)) == {"val_bpb"}  # another seq_len
    assert set(reference_metrics(4.0, project.packed, tmp_path / "none", 16)) == {"val_bpb"}


def test_the_evaluate_stage_hashes_the_val_split_once(project: Project, tmp_path: Path, monkeypatch, smollm2) -> None:
    """The val_data tag and the donor val loss check each read val.bin through sha256 (twice per run)."""
    root = tmp_path / "project"
    shutil.copytree(project.root, root)
    (root / "models" / "export").mkdir(parents=True)
    export_llama(
        load_model_dir(root / "models/init"),
        root / "models/export/model.gguf",
        donor_tokenizer_metadata(smollm2),
        {},
        "f32",
    )
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    reads: list[str] = []

    def counted(path) -> str:
        reads.append(Path(path).name)
        return sha256_file(path)

    for module in ("pipeline.io.files", "pipeline.evaluate.evaluate_text", "pipeline.data.packed"):
        monkeypatch.setattr(f"{module}.sha256_file", counted, raising=False)
    cfg = compose_config(
        [f"donor.path={root / 'donor.gguf'}", "data.val_fraction=0.25", "train.device=cpu", "train.threads=1"]
        + ["train.seq_len=16", "train.batch_size=4", "evaluate.prompts=[a]", "evaluate.max_new_tokens=2"]
        + ["evaluate.llamacpp_windows=0"]
    )
    metrics = run_stage("evaluate", cfg, evaluate_body)
    assert reads.count("val.bin") == 1 and metrics["donor_val_loss"] == read_meta(project.teach).donor_val_loss
    model, _ = load_gguf(root / "models/export/model.gguf")  # its agreement with the donor, as a draft
    _, choice = scored_windows(model, load_split(root / "data/packed", "val"), 16, 4, torch.device("cpu"))
    expected = draft_acceptance(read_val_choice(project.teach), choice)
    assert metrics["draft_top1_agreement"] == pytest.approx(expected["draft_top1_agreement"])
    assert metrics["draft_accepted_k1"] <= metrics["draft_accepted_k8"] == pytest.approx(expected["draft_accepted_k8"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smollm-pipeline").experiment_id])
    assert run.data.tags["val_data"] == split_fingerprint(root / "data/packed", "val")


def test_gap_closed_against_a_baseline() -> None:
    from pipeline.evaluate.evaluate_text import gap_closed

    metrics = {"val_loss": 4.0, "donor_val_loss": 3.0}
    assert gap_closed(metrics, 5.0) == {"gap_closed": pytest.approx(0.5)}
    assert gap_closed({**metrics, "val_loss": 2.5}, 5.0)["gap_closed"] == pytest.approx(1.25)  # past the donor
    assert gap_closed(metrics, 0.0) == {} and gap_closed(metrics, 2.0) == {} and gap_closed({"val_loss": 4.0}, 5) == {}
