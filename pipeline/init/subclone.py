"""Whole-network transfer (`recipe.init=subclone`): a smaller llama that takes every weight from its donor.

After SliceGPT (arXiv 2401.15024), weight subcloning (2312.09299), weight selection (2311.18823) and
Minitron (2407.14679):

1. Fold each RMSNorm weight into the matrices that read its output; the norms are then plain
   RMS normalisations, which commute with any orthogonal rotation Q of the residual stream.
2. Rotate the whole residual stream by the donor's PCA basis (one Q for every layer, so one rotated
   embedding table serves them all): E -> E Q, readers W -> W diag(g) Q, writers W -> Q^T W. At full
   width this is exact. Slicing keeps the first d_model columns of Q.
3. RMSNorm divides by sqrt(width): slicing to k of D dimensions, keeping a fraction f of a
   position's energy, shrinks its normalised output by sqrt(k / (D f)); each student norm weight
   is that compensation (a scalar per position, measured by the calibration).
4. Keep n_layer blocks (`LAYER_RULES`), whole kv groups of query heads by the energy the heads write,
   and FFN neurons by RMS activation x the norm of their `down` column.
5. The head: untied (model.tie_embeddings=false) is exact, H diag(g_final) Q. Tied cannot be exact
   (the final norm weight sits between the shared table and the logits), so the student's final
   norm weight is the per-direction gain that best reproduces the donor's logits (least squares
   over the calibration's final-position moment), times the compensation of step 3.
6. With fewer layers the student's final states are not the donor's, and that gain misjudges the
   logits' scale (SmolLM2 at 8 of 30 layers: step-0 val loss 12.2, worse than uniform). `fit_gain`
   refits the final-norm gain by cross-entropy on the student's own final states (L-BFGS over d_model
   numbers; the blocks are left as transferred).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config import LAYER_RULES, explicit_layers
from pipeline.donor.calibrate import Calibration, check_student
from pipeline.donor.circuits import circuit_layers, copy_head
from pipeline.errors import ConfigError, problem
from pipeline.models.devices import native_bf16
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig


@dataclass(frozen=True)
class Selection:
    """Which donor parts the student keeps: per student layer, in student order."""

    layers: tuple[int, ...]
    q_heads: tuple[tuple[int, ...], ...]  # donor query heads; student head i reads kv group i // (n_head/n_kv)
    kv_heads: tuple[tuple[int, ...], ...]  # donor kv head copied into each student kv head (may repeat)
    neurons: tuple[tuple[int, ...], ...]  # donor FFN neurons, ascending


def select_layers(
    influence: np.ndarray, n: int, rule: str, circuit: tuple[int, ...] = (), copying: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """`n` donor layers, ascending: the most influential (ShortGPT); those with the copy `circuit`'s layers
    in place of the least influential that hold no copy head (`circuit`: `copying` lists the layers that
    hold one); evenly spaced, the first n, the first n-1 and the last; or the ones `rule` lists (e.g. from
    a search scored by loss)."""
    total = len(influence)
    listed = explicit_layers(rule)
    if listed is not None:
        if len(listed) != n or listed[-1] >= total:
            expected = f"{n} donor layer indexes below {total} (model.n_layer={n}; the donor has {total})"
            short = len(listed) != n
            fix = f"list {n} layers, or set model.n_layer={len(listed)}" if short else f"list layers below {total}"
            raise ConfigError(problem("config key recipe.subclone.layers", expected, rule, fix))
        return listed
    if rule in ("importance", "circuit"):
        picked = [int(i) for i in np.argsort(-influence, kind="stable")[:n]]
        missing = [c for c in circuit if c not in picked] if rule == "circuit" else []
        spare = [i for i in reversed(picked) if i not in circuit and i not in copying]  # least influential first
        for add, drop in zip(missing, spare):
            picked[picked.index(drop)] = add
    elif rule == "even":
        picked = np.round(np.linspace(0, total - 1, n)).astype(int)
    elif rule == "first":
        picked = np.arange(n)
    elif rule == "first_last":
        picked = np.r_[np.arange(n - 1), total - 1] if n > 1 else np.array([0])
    else:
        raise ConfigError(problem("config key recipe.subclone.layers", f"one of {LAYER_RULES}", rule, "pick one"))
    return tuple(sorted(int(i) for i in picked))


def select_heads(
    energy: np.ndarray, donor_kv: int, n_head: int, n_kv: int, keep: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Student kv heads as copies of donor kv heads, each with `n_head / n_kv` of that group's query heads.

    A donor group of r query heads offers floor(r / s) candidate groups of s heads (its best heads
    first); the candidate holding head `keep` (a copy head of the circuit) wins first, then the ones
    whose heads write the most energy. Every query head keeps its own keys and values, so attention
    is exact for the kept heads. Returns (q heads, kv heads).
    """
    r, s = len(energy) // donor_kv, n_head // n_kv
    candidates: list[tuple[bool, float, int, tuple[int, ...]]] = []
    for g in range(donor_kv):
        first = [keep] if keep is not None and keep // r == g else []
        heads = first + sorted((h for h in range(g * r, (g + 1) * r) if h not in first), key=lambda h: -energy[h])
        for c in range(r // s):
            chunk = tuple(sorted(heads[c * s : (c + 1) * s]))
            candidates.append((keep in chunk, float(energy[list(chunk)].sum()), g, chunk))
    best = sorted(sorted(candidates, key=lambda c: (not c[0], -c[1]))[:n_kv], key=lambda c: c[3])
    return tuple(h for c in best for h in c[3]), tuple(c[2] for c in best)


def select(calib: Calibration, donor: Llama, cfg: TransformerConfig, rule: str) -> Selection:
    """Layers by `rule`, heads by written energy (`circuit`: each layer's copy head first), neurons by RMS
    activation x |down column|."""
    heads: list[int | None] = [None] * len(calib.layer_influence)  # each layer's copy head (`circuit` only)
    circuit: tuple[int, ...] = ()
    if rule == "circuit":
        heads = [copy_head(i, p) for i, p in zip(calib.head_induction, calib.head_previous)]
        circuit = circuit_layers(calib.head_induction, calib.head_previous, cfg.n_layer)
    holders = tuple(i for i, h in enumerate(heads) if h is not None)
    layers = select_layers(calib.layer_influence, cfg.n_layer, rule, circuit, holders)
    q_heads, kv_heads, neurons = [], [], []
    for layer in layers:
        keep = heads[layer]
        q, kv = select_heads(calib.head_energy[layer], donor.cfg.n_kv_head, cfg.n_head, cfg.n_kv_head, keep)
        q_heads.append(q)
        kv_heads.append(kv)
        down = donor.blocks[layer].ffn.down.weight.detach().float().norm(dim=0).numpy()
        score = calib.neuron_rms[layer] * down
        neurons.append(tuple(sorted(int(i) for i in np.argsort(-score, kind="stable")[: cfg.d_ff])))
    return Selection(layers, tuple(q_heads), tuple(kv_heads), tuple(neurons))


def norm_scales(calib: Calibration, k: int) -> np.ndarray:
    """Per norm position, sqrt(D f / k): what RMSNorm over k of D dimensions keeping energy f lost."""
    d = calib.position_energy.shape[1]
    kept = calib.position_energy[:, :k].sum(1).clip(1e-6, None)
    return np.sqrt(d * kept / k).astype(np.float32)


def _rows(heads: tuple[int, ...], hd: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])


def _block_weights(donor: Llama, sel: Selection, j: int, q: torch.Tensor, scales: np.ndarray, post: np.ndarray) -> dict:
    """Student block j: the donor block's kept rows/columns, norms folded, rotated and sliced by `q` (D, k)."""
    layer, hd = sel.layers[j], donor.cfg.head_dim
    b = donor.blocks[layer]
    g1, g2 = b.attn_norm.weight.detach().float(), b.ffn_norm.weight.detach().float()
    q_rows, kv_rows = _rows(sel.q_heads[j], hd), _rows(sel.kv_heads[j], hd)
    cols = torch.tensor(sel.neurons[j])
    k = q.shape[1]

    def reads(w: torch.Tensor, rows: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return (w.detach().float()[rows] * gain) @ q

    p = f"blocks.{j}."
    state = {
        p + "attn_norm.weight": torch.full((k,), float(scales[2 * layer])),
        p + "attn.wq.weight": reads(b.attn.wq.weight, q_rows, g1),
        p + "attn.wk.weight": reads(b.attn.wk.weight, kv_rows, g1),
        p + "attn.wv.weight": reads(b.attn.wv.weight, kv_rows, g1),
        p + "attn.wo.weight": q.T @ b.attn.wo.weight.detach().float()[:, q_rows],
        p + "ffn_norm.weight": torch.full((k,), float(scales[2 * layer + 1])),
        p + "ffn.gate.weight": reads(b.ffn.gate.weight, cols, g2),
        p + "ffn.up.weight": reads(b.ffn.up.weight, cols, g2),
        p + "ffn.down.weight": q.T @ b.ffn.down.weight.detach().float()[:, cols],
    }
    return state | _family_weights(b, p, q_rows, kv_rows, q, post[2 * layer : 2 * layer + 2])


def _family_weights(b, p: str, q_rows: torch.Tensor, kv_rows: torch.Tensor, q: torch.Tensor, post: np.ndarray):
    """What the family adds to a block: the kept heads' biases and q/k norms as they are (heads are kept
    whole); a post norm's weight on the kept coordinates (`q` permutes them, see `channel_basis`) times
    the compensation of its input's energy kept (`post_scales`)."""
    out = {}
    for name, rows in (("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)):
        bias = getattr(b.attn, name).bias
        if bias is not None:
            out[p + f"attn.{name}.bias"] = bias.detach().float()[rows]
    if hasattr(b.attn, "q_norm"):
        out[p + "attn.q_norm.weight"] = b.attn.q_norm.weight.detach().float().clone()
        out[p + "attn.k_norm.weight"] = b.attn.k_norm.weight.detach().float().clone()
    if hasattr(b, "post_attn_norm"):
        for i, name in enumerate(("post_attn_norm", "post_ffn_norm")):
            gain = getattr(b, name).weight.detach().float() @ q.abs()  # a permutation: the kept coordinates
            out[p + f"{name}.weight"] = gain * float(post[i])
    return out


def tied_gain(calib: Calibration, donor: Llama, q: torch.Tensor) -> torch.Tensor:
    """The final-norm gain g (k,) for a tied head that best reproduces the donor's logits.

    Donor logits u A H^T (u the normalised final state, A = diag(final norm weight), H the head);
    student u Q diag(g) (E Q)^T with the rotated table E Q. Minimising E||difference||^2 over u's
    measured second moment C gives (Q^T C Q * Q^T E^T E Q) g = diag(Q^T C A H^T E Q). The vocab-sized
    products are formed once at donor width (fp32), the rest in fp64.
    """
    table = donor.tok_embd.weight.detach().float()
    gram = (table.T @ table).double()  # E^T E
    cross = gram if donor.head is None else (donor.head_weight().detach().float().T @ table).double()  # H^T E
    c = torch.from_numpy(calib.final_moment).double()
    a = donor.norm.weight.detach().double()
    qd = q.double()
    lhs = (qd.T @ c @ qd) * (qd.T @ gram @ qd)
    rhs = (((qd.T @ c) * a) @ cross @ qd).diagonal()
    return torch.linalg.solve(lhs, rhs).float()


def post_scales(calib: Calibration, k: int) -> np.ndarray:
    """`norm_scales` of the post norms' inputs (Gemma 3): index 2l+i is layer l's i-th post norm
    (0 attention, 1 feed-forward); empty for a family without them."""
    d = calib.post_energy.shape[1]
    kept = calib.post_energy[:, :k].sum(1).clip(1e-6, None)
    return np.sqrt(d * kept / k).astype(np.float32)


def student_state(donor: Llama, calib: Calibration, cfg: TransformerConfig, sel: Selection, basis: np.ndarray) -> dict:
    """Every student parameter, by name. A scaled table (Gemma: x sqrt(width) at the input) is scaled by
    sqrt(D/k) so the kept coordinates enter the blocks as the donor's do; the tied head's gain undoes it."""
    q = torch.from_numpy(np.ascontiguousarray(basis[:, : cfg.d_model])).float()
    scales, post = norm_scales(calib, cfg.d_model), post_scales(calib, cfg.d_model)
    table_scale = math.sqrt(donor.cfg.d_model / cfg.d_model) if cfg.family.embed_scale else 1.0
    state = {"tok_embd.weight": donor.tok_embd.weight.detach().float() @ q * table_scale}
    for j in range(cfg.n_layer):
        state.update(_block_weights(donor, sel, j, q, scales, post))
    final = float(scales[2 * donor.cfg.n_layer])
    if cfg.tie_embeddings:
        state["norm.weight"] = tied_gain(calib, donor, q) * final / table_scale
    else:
        state["norm.weight"] = torch.full((cfg.d_model,), final)
        head = donor.head_weight().detach().float() * donor.norm.weight.detach().float()
        state["head.weight"] = head @ q
    return state


def subclone(
    donor: Llama, calib: Calibration, cfg: TransformerConfig, rule: str, basis: np.ndarray | None = None
) -> tuple[Llama, Selection]:
    """The student of shape `cfg` built from `donor`; `basis` (D, D orthonormal columns) overrides
    the calibration's PCA basis (a test passes a random rotation)."""
    check_student(cfg, donor.cfg)
    cfg = replace(cfg, rope_freq_factors=donor.cfg.rope_freq_factors)
    sel = select(calib, donor, cfg, rule)
    if donor.cfg.sliding_window:  # each kept layer keeps its kind (llama.cpp reads the pattern per layer)
        cfg = replace(cfg, sliding_layers=tuple(donor.cfg.sliding_layers[i] for i in sel.layers))
    state = student_state(donor, calib, cfg, sel, calib.basis if basis is None else basis)
    with torch.device("meta"):
        model = Llama(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model, sel


def _gain_loss(u: torch.Tensor, y: torch.Tensor, gain: torch.Tensor, head: torch.Tensor) -> float:
    """Mean cross-entropy of logits (u * gain) head^T, accumulating gain's gradient chunk by chunk
    (a chunk's vocab-wide logits are the only large tensor)."""
    total = 0.0
    for i in range(0, len(u), 1024):
        logits = ((u[i : i + 1024] * gain).to(head.dtype) @ head.T).float()
        part = F.cross_entropy(logits, y[i : i + 1024], reduction="sum") / len(u)
        part.backward()
        total += part.item()
    return total


def fit_gain(model: Llama, ids: torch.Tensor, iters: int) -> tuple[float, float]:
    """Refit `model.norm.weight` by L-BFGS on next-token cross-entropy over the (n, T+1) windows
    `ids`, with the final states computed once (bf16 head matmul where bf16 runs at speed). Returns the
    loss before and after."""
    norm = model.norm.weight
    start = norm.detach().float().clone()
    with torch.no_grad():
        norm.fill_(1.0)
        u = torch.cat([model.hidden(ids[i : i + 8, :-1]).float() for i in range(0, len(ids), 8)]).flatten(0, 1)
        norm.copy_(start)
    y, head = ids[:, 1:].flatten(), model.head_weight().detach()
    if model.head_vocab is not None:  # a large vocabulary: the ids in use (`ops.head_rows`)
        rows, _ = model.head_vocab.rows(training=False)
        y, head = model.head_vocab.map(y), head.index_select(0, rows)
    head = head.to(torch.bfloat16 if native_bf16(head.device) else torch.float32)
    gain = torch.nn.Parameter(start.clone())
    opt = torch.optim.LBFGS([gain], max_iter=iters, history_size=10, line_search_fn="strong_wolfe")

    def closure() -> float:
        opt.zero_grad()
        with torch.enable_grad():
            return _gain_loss(u, y, gain, head)

    before = closure()
    opt.step(closure)
    after = closure()
    if after < before:
        with torch.no_grad():
            norm.copy_(gain.detach())
    return before, min(before, after)


def transfer_report(donor: Llama, student: Llama, calib: Calibration, sel: Selection) -> dict[str, float]:
    """What fraction of the donor the student kept: parameters, residual variance, block influence,
    head energy and FFN activation energy (the last two over the kept layers)."""
    layers = list(sel.layers)
    heads = calib.head_energy[layers]
    neurons = calib.neuron_rms[layers] ** 2
    kept_heads = sum(float(heads[j, list(q)].sum()) for j, q in enumerate(sel.q_heads))
    kept_neurons = sum(float(neurons[j, list(n)].sum()) for j, n in enumerate(sel.neurons))
    donor_params = sum(p.numel() for p in donor.parameters())
    student_params = sum(p.numel() for p in student.parameters())
    return {
        "parameters": float(student_params),
        "donor_parameters": float(donor_params),
        "parameter_fraction": student_params / donor_params,
        "residual_variance_kept": calib.kept_fraction(student.cfg.d_model),
        "layers_kept": float(len(layers)),
        "layer_influence_kept": float(calib.layer_influence[layers].sum() / calib.layer_influence.sum()),
        "head_energy_kept": kept_heads / float(heads.sum()),
        "ffn_energy_kept": kept_neurons / float(neurons.sum()),
    }
