"""QUEST attention and QUEST-ViT: the attention against the paper's Algorithm A1, its invariances,
the ViT variants against timm's standard counterparts (state dicts, weights, configs), a model
oracle, the toy training of the paper's Section 2, and QUEST on neighborhood attention."""
import functools
import math

import re

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerScale
from timm.models.vision_transformer import Block, VisionTransformer

import attnzoo
from attnzoo.layers import NeighborhoodAttention2d
from attnzoo.layers.quest import (FORMULATIONS, QKNormAttention, QNormAttention, QuestAttention,
                                  StandardAttention, attn_layer_for, l2_normalize)
from attnzoo.models.quest_vit import TIMM_COUNTERPARTS, checkpoint_filter_fn, from_timm_weights
from attnzoo.profiling import count_params
from checkpoint_layouts import deit3_official_manifest
from hub_cache import offline_hf_cache, write_hf_cache
from oracles import neighborhood_attention
import tiny_models

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)

DIM, HEADS = 24, 3


def _attention(formulation='quest', fused=True, seed=0, **kwargs):
    """A QuestAttention with O(1) projections (timm's init would give near-uniform softmax)."""
    torch.manual_seed(seed)
    attn = QuestAttention(DIM, HEADS, qkv_bias=True, formulation=formulation, **kwargs)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, DIM ** -0.5)
    attn.fused_attn = fused
    return attn


# ----------------------------------------------------------------------------------------------
# the attention: the paper's Algorithm A1 and the compared formulations, written out
# ----------------------------------------------------------------------------------------------

def _assert_close(actual, expected, tol):
    """|actual - expected| <= tol on the scale of ``expected`` (its largest magnitude, >= 1)."""
    err = (actual.double() - expected).abs().max().item()
    assert err <= tol * max(1., expected.abs().max().item()), err


def _softmax(logits):
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _algorithm_a1(x, attn, formulation='quest'):
    """Algorithm A1 per head with a manual softmax, in float64, on ``attn``'s weights; and the
    formulations of the paper's Table 1 by the same recipe."""
    x = x.double()
    W, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    q, k, v = (x @ W.T + b).split(DIM, -1)
    D = DIM // HEADS
    outs = []
    for h in range(HEADS):
        Q, K, V = (t[..., h * D:(h + 1) * D] for t in (q, k, v))
        norm_q = 1 / Q.pow(2).sum(-1, keepdim=True).sqrt()  # diag(1 / ||Q_i||)
        norm_k = 1 / K.pow(2).sum(-1, keepdim=True).sqrt()  # diag(1 / ||K_j||), line 16
        if formulation == 'quest':
            logits = Q @ (norm_k * K).transpose(-1, -2)      # lines 17-18, no scale
        elif formulation == 'qnorm':
            logits = (norm_q * Q) @ K.transpose(-1, -2)
        elif formulation == 'qknorm':
            c = attn.logit_scale.double()[h].exp().clamp(max=100.)
            logits = c * (norm_q * Q) @ (norm_k * K).transpose(-1, -2)
        else:
            logits = Q @ K.transpose(-1, -2) / math.sqrt(D)  # line 8
        outs.append(_softmax(logits) @ V)
    return torch.cat(outs, -1) @ attn.proj.weight.double().T + attn.proj.bias.double()


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'explicit'])
@pytest.mark.parametrize('formulation', FORMULATIONS)
def test_attention_equals_algorithm_a1(formulation, fused):
    attn = _attention(formulation, fused)
    if formulation == 'qknorm':
        with torch.no_grad():  # per-head scales, one above the cap of 100
            attn.logit_scale.copy_(torch.tensor([1.5, 3.0, 5.0]).view(3, 1, 1))
    # float32 rounding; a learned scale of up to 100 multiplies the logits' rounding error
    tol = 5e-5 if formulation == 'qknorm' else 1e-6
    x = torch.randn(2, 9, DIM, requires_grad=True)
    out = attn(x)
    ref = _algorithm_a1(x, attn, formulation)
    _assert_close(out, ref, tol)
    # backward: the input and every parameter
    g = torch.randn_like(out)
    params = [x] + list(attn.parameters())
    grads = torch.autograd.grad(out, params, g)
    grads_ref = torch.autograd.grad(ref, params, g.double())
    for a, r in zip(grads, grads_ref):
        _assert_close(a, r, tol)


def test_fused_path_is_sdpa_with_scale_one(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs['scale'])
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', spy)
    x = torch.randn(1, 4, DIM)
    assert QuestAttention(DIM, HEADS).fused_attn == timm.layers.use_fused_attn()
    _attention('quest', fused=True)(x)
    _attention('standard', fused=True)(x)
    _attention('quest', fused=False)(x)
    assert calls == [1.0, (DIM // HEADS) ** -0.5]
    monkeypatch.setattr(timm.layers.config, '_USE_FUSED_ATTN', 0)  # as set_fused_attn(False)
    assert not QuestAttention(DIM, HEADS).fused_attn


def test_standard_formulation_is_timms_attention():
    """formulation='standard' is timm's Attention on the same weights, on both paths."""
    ours = _attention('standard')
    timms = timm.layers.Attention(DIM, HEADS, qkv_bias=True)
    timms.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, DIM)
    for fused in (True, False):
        ours.fused_attn = timms.fused_attn = fused
        torch.testing.assert_close(ours(x), timms(x), rtol=0, atol=0)


def test_state_dict_is_timms_attention_except_qknorm_scale():
    timms = timm.layers.Attention(DIM, HEADS, qkv_bias=True, qk_norm=True,
                                  norm_layer=nn.LayerNorm)
    for formulation in FORMULATIONS:
        ours = QuestAttention(DIM, HEADS, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm,
                              formulation=formulation)
        extra = {'logit_scale'} if formulation == 'qknorm' else set()
        assert set(ours.state_dict()) == set(timms.state_dict()) | extra
    assert attn_layer_for('qnorm') is QNormAttention and attn_layer_for('quest') is QuestAttention
    assert QKNormAttention(DIM, HEADS).formulation == 'qknorm'
    assert StandardAttention(DIM, HEADS).formulation == 'standard'
    assert QNormAttention(DIM, HEADS, formulation='quest').formulation == 'quest'
    with pytest.raises(ValueError, match="formulation must be one of 'quest'"):
        QuestAttention(DIM, HEADS, formulation='cosine')
    with pytest.raises(TypeError):
        QuestAttention(DIM, HEADS, not_an_arg=1)
    # a model's attn_layer: a formulation, timm's own names, or a class; anything else named
    with pytest.raises(ValueError, match="unknown attn_layer 'cosine'; accepted: 'quest', "
                                         "'qnorm', 'qknorm', 'standard'"):
        timm.create_model('quest_vit_tiny_patch16_224', device='meta', attn_layer='cosine')


def _scale_keys(attn, factors):
    """Forward hook multiplying each token's key, per head, by ``factors`` [N, heads]."""
    D = DIM // HEADS

    def hook(module, inputs, out):
        out = out.clone()
        k = out[..., DIM:2 * DIM].unflatten(-1, (HEADS, D))
        out[..., DIM:2 * DIM] = (k * factors[..., None]).flatten(-2)
        return out
    return attn.qkv.register_forward_hook(hook)


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'explicit'])
def test_key_scale_invariance(fused):
    x = torch.randn(2, 9, DIM)
    factors = torch.empty(9, HEADS).uniform_(0.01, 100.)
    for formulation, invariant in (('quest', True), ('qknorm', True), ('standard', False),
                                   ('qnorm', False)):
        attn = _attention(formulation, fused)
        ref = attn(x)
        handle = _scale_keys(attn, factors)
        out = attn(x)
        handle.remove()
        if invariant:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:  # the check can fail: scaled keys change standard attention
            assert (out - ref).abs().max() > 1e-2, formulation


def test_logits_bounded_by_query_norm():
    attn = _attention('quest')
    with torch.no_grad():
        attn.qkv.weight.mul_(10)  # large queries and keys
        x = torch.randn(2, 9, DIM)
        logits = attn.attention_logits(x)
        # queries and keys straight from the projection (QUEST leaves the queries untouched)
        q, k = (x @ attn.qkv.weight[:2 * DIM].T + attn.qkv.bias[:2 * DIM]).split(DIM, -1)
        q, k = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in (q, k))
        q_norm = q.norm(dim=-1, keepdim=True)  # [B, heads, N, 1]
        cosine = F.cosine_similarity(q.unsqueeze(3), k.unsqueeze(2), dim=-1)
        torch.testing.assert_close(logits, q_norm * cosine)  # ||q_i|| cos(q_i, k_j)
        assert (logits.abs() <= q_norm * (1 + 1e-6)).all()
        standard = _attention('standard')
        standard.load_state_dict(attn.state_dict())
        assert (standard.attention_logits(x).abs() > q_norm).any()  # the bound is QUEST's


def test_key_norm_in_float32_under_autocast():
    x = torch.randn(4, 7, 32, dtype=torch.bfloat16) * 30
    y = l2_normalize(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.normalize(x.float(), dim=-1).bfloat16(), rtol=0, atol=0)
    assert torch.equal(l2_normalize(torch.zeros(3)), torch.zeros(3))  # no NaN for a zero key
    attn = _attention('quest')
    x = torch.randn(2, 9, DIM)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, k, _ = attn.heads_qkv(x)
        out = attn(x)
    assert k.dtype == out.dtype == torch.bfloat16
    torch.testing.assert_close(k.float().norm(dim=-1), torch.ones(k.shape[:-1]), rtol=0,
                               atol=1e-2)
    torch.testing.assert_close(out.float(), attn(x), rtol=0.05, atol=0.05)


def test_attention_script_and_fx():
    x = torch.randn(2, 5, DIM)
    for formulation in FORMULATIONS:
        for fused in (True, False):
            attn = _attention(formulation, fused).eval()
            ref = attn(x)
            torch.testing.assert_close(torch.jit.script(attn)(x), ref)
            # as inside a ViT block (torch < 2.5's SDPA rejects a traced is_causal, as for timm's
            # Attention)
            traced = torch.fx.symbolic_trace(attn, concrete_args=dict(attn_mask=None,
                                                                      is_causal=False))
            torch.testing.assert_close(traced(x), ref)


# ----------------------------------------------------------------------------------------------
# the toy task of the paper's Section 2: logits under training at a high learning rate
# ----------------------------------------------------------------------------------------------

def _toy_data(gen, n, S, b, N=20, d=10, classes=10):
    """The paper's toy retrieval task (Section 2.2, A.3): N tokens of a real part (d) and a
    one-hot value; the answer location L ~ round(N(10, 2)) holds an out-of-distribution vector,
    N(0, S S^T) (unbiased) or, for half the samples, N(b, 0.1 I) (a spurious, easy cue)."""
    L = (torch.randn(n, generator=gen) * 2 + 10).round().long().clamp(0, N - 1)
    biased = torch.rand(n, generator=gen) < 0.5
    xk = torch.randn(n, N, d, generator=gen)
    answer = torch.where(biased[:, None], b + 0.1 ** 0.5 * torch.randn(n, d, generator=gen),
                         torch.randn(n, d, generator=gen) @ S.T)
    xk[torch.arange(n), L] = answer
    values = torch.randint(classes, (n, N), generator=gen)
    return torch.cat([xk, F.one_hot(values, classes).float()], -1), values[torch.arange(n), L]


class _ToyTransformer(nn.Module):
    """One pre-norm timm Block, one head, CLS token, learned position embedding (A.3)."""

    def __init__(self, attn_layer, N=20, D=20, classes=10):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, N + 1, D) * .02)
        self.block = Block(D, num_heads=1, mlp_ratio=1., qkv_bias=True, attn_layer=attn_layer)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, classes)

    def tokens(self, x):
        return torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed

    def forward(self, x):
        return self.head(self.norm(self.block(self.tokens(x)))[:, 0])


def _train_toy(formulation, lr=0.1, steps=200, seed=0):
    """AdamW at 10x the paper's largest learning rate (0.01; 200 steps instead of its 50
    epochs); every 25 steps, on held-out samples, the largest |logit| and the largest
    |logit| / ||q|| of any query."""
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(10, 10, generator=gen)
    b = torch.randn(10, generator=gen) @ S.T
    x_train, y_train = _toy_data(gen, 2000, S, b)
    x_eval, _ = _toy_data(gen, 256, S, b)
    torch.manual_seed(seed)
    model = _ToyTransformer(attn_layer_for(formulation))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.)
    max_logits, max_ratio = [], 0.
    for step in range(steps + 1):
        if step % 25 == 0:
            with torch.no_grad():
                h = model.block.norm1(model.tokens(x_eval))
                attn = model.block.attn
                logits = attn.attention_logits(h)
                q_raw = attn.qkv(h)[..., :20].unsqueeze(1)  # one head: the projected queries
                max_logits.append(logits.abs().max().item())
                max_ratio = max(max_ratio, (logits.abs() / q_raw.norm(dim=-1)[..., None]).max())
        if step == steps:
            break
        i = torch.randint(len(x_train), (32,), generator=gen)
        loss = F.cross_entropy(model(x_train[i]), y_train[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return max_logits, float(max_ratio)


def test_toy_training_logit_growth():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest
    try:
        standard, standard_ratio = _train_toy('standard')
        quest, quest_ratio = _train_toy('quest')
    finally:
        torch.set_num_threads(threads)
    # QUEST: every logit stays within its query's norm throughout training ...
    assert quest_ratio <= 1 + 1e-5
    # ... while standard attention's logits outgrow their queries' norms (key norms multiply
    # in: the paper's query-key cross-play), and its largest logit grows far beyond QUEST's.
    # (Over 10 seeds: standard peaks 250-950x its initial logit and 7-25x QUEST's peak.)
    assert standard_ratio > 4
    assert max(standard) > 100 * standard[0]
    assert max(standard) > 4 * max(quest), (standard, quest)


# ----------------------------------------------------------------------------------------------
# QUEST-ViT variants vs timm's standard counterparts
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _meta(name, **kwargs):
    """Model on the meta device (no memory, no init cost); shared, do not mutate."""
    return timm.create_model(name, device='meta', **kwargs)


def test_every_variant_has_a_counterpart():
    assert set(attnzoo.list_models(family='quest_vit')) == set(TIMM_COUNTERPARTS)


@pytest.mark.parametrize('name', sorted(TIMM_COUNTERPARTS))
def test_state_dict_and_params_equal_timm_counterpart(name):
    ours, theirs = _meta(name), _meta(TIMM_COUNTERPARTS[name])
    assert type(ours) is VisionTransformer
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
        {k: v.shape for k, v in theirs.state_dict().items()}
    assert count_params(ours) == count_params(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    attns = [blk.attn for blk in ours.blocks]
    assert all(type(a) is QuestAttention and a.formulation == 'quest' and a.scale == 1.0
               for a in attns)
    deit3 = name.startswith('quest_deit3')
    assert ours.no_embed_class == deit3
    assert ours.pos_embed.shape[1] == ours.patch_embed.num_patches + (0 if deit3 else 1)
    assert isinstance(ours.blocks[0].ls1, LayerScale) == deit3


def test_variant_sizes():
    # ViT-Ti/S/B/L/H as in the spec table: width / depth / heads / patch
    expected = {'quest_vit_tiny_patch16_224': (192, 12, 3, 16),
                'quest_vit_small_patch16_224': (384, 12, 6, 16),
                'quest_vit_base_patch16_224': (768, 12, 12, 16),
                'quest_vit_large_patch16_224': (1024, 24, 16, 16),
                'quest_deit3_base_patch16_224': (768, 12, 12, 16),
                'quest_deit3_large_patch16_224': (1024, 24, 16, 16),
                'quest_deit3_huge_patch14_224': (1280, 32, 16, 14)}
    for name, (width, depth, heads, patch) in expected.items():
        m = _meta(name)
        assert (m.embed_dim, len(m.blocks), m.blocks[0].attn.num_heads,
                m.patch_embed.patch_size[0]) == (width, depth, heads, patch), name
    assert round(count_params(_meta('quest_vit_large_patch16_224')) / 1e6) == 304
    assert round(count_params(_meta('quest_deit3_huge_patch14_224')) / 1e6) == 632


def test_deit3_layer_scale_init():
    m = timm.create_model('quest_deit3_base_patch16_224', depth=1, img_size=32)
    assert torch.equal(m.blocks[0].ls1.gamma, torch.full((768,), 1e-6))


def test_no_weights_and_pretrained_refuses():
    assert timm.list_models('quest_*', pretrained=True) == []
    for name in TIMM_COUNTERPARTS:
        cfg = timm.get_pretrained_cfg(name)
        assert not (cfg.hf_hub_id or cfg.url or cfg.file) and not cfg.tag
        assert cfg.paper_ids == 'arXiv:2604.00199'
    with pytest.raises(ValueError, match='no QUEST weights exist.*from_timm_weights'):
        timm.create_model('quest_vit_tiny_patch16_224', pretrained=True)
    with pytest.raises(TypeError):
        timm.create_model('quest_vit_tiny_patch16_224', device='meta', not_a_model_arg=1)


def test_attn_layer_option():
    for formulation in FORMULATIONS:
        m = _meta('quest_vit_tiny_patch16_224', attn_layer=formulation)
        assert all(blk.attn.formulation == formulation for blk in m.blocks)
    qk = _meta('quest_vit_tiny_patch16_224', attn_layer='qknorm')
    assert set(qk.state_dict()) - set(_meta('deit_tiny_patch16_224').state_dict()) == \
        {f'blocks.{i}.attn.logit_scale' for i in range(12)}


def test_standard_checkpoint_initialises_quest(tmp_path):
    """A timm DeiT checkpoint loads strictly; with attn_layer='standard' the model *is* DeiT,
    with QUEST (the default) its logits change: an initialisation, not a pretrained model."""
    torch.manual_seed(0)
    deit = timm.create_model('deit_tiny_patch16_224', img_size=64, depth=2).eval()
    path = tmp_path / 'deit.pth'
    torch.save({'model': deit.state_dict()}, path)  # the FB DeiT wrapper
    kw = dict(img_size=64, depth=2, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    standard = timm.create_model('quest_vit_tiny_patch16_224', attn_layer='standard', **kw).eval()
    quest = timm.create_model('quest_vit_tiny_patch16_224', **kw).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(standard(x), deit(x), rtol=0, atol=0)
        assert (quest(x) - deit(x)).abs().max() > 1e-3
    for k, v in deit.state_dict().items():
        assert torch.equal(quest.state_dict()[k], v), k
    # QKNorm's per-head scale is new: it keeps its initial value (10)
    qk = timm.create_model('quest_vit_tiny_patch16_224', attn_layer='qknorm', **kw)
    assert torch.equal(qk.blocks[1].attn.logit_scale.exp(), torch.full((3, 1, 1), 10.))
    assert torch.equal(qk.blocks[1].attn.qkv.weight, deit.blocks[1].attn.qkv.weight)


def test_from_timm_weights_offline(tmp_path):
    torch.manual_seed(0)
    deit = timm.create_model('deit_tiny_patch16_224').eval()
    import safetensors.torch
    weights = tmp_path / 'model.safetensors'
    safetensors.torch.save_file(deit.state_dict(), str(weights))
    with offline_hf_cache(tmp_path / 'hub') as hub:
        write_hf_cache(hub, 'timm/deit_tiny_patch16_224.fb_in1k',
                       {'model.safetensors': weights}, missing=())
        quest = from_timm_weights('quest_vit_tiny_patch16_224').eval()
        standard = from_timm_weights('quest_vit_tiny_patch16_224', 'deit_tiny_patch16_224.fb_in1k',
                                     attn_layer='standard').eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(standard(x), deit(x), rtol=0, atol=0)
        assert (quest(x) - deit(x)).abs().max() > 1e-3
    assert 'not a trained QUEST model' in quest.pretrained_cfg['notes'][0]
    assert quest.pretrained_cfg['architecture'] == 'quest_vit_tiny_patch16_224'
    with pytest.raises(ValueError, match='does not have quest_vit_tiny_patch16_224'):
        from_timm_weights('quest_vit_tiny_patch16_224', 'deit3_small_patch16_224.fb_in1k')
    with pytest.raises(ValueError, match='timm_tag must be a timm model tag'):
        from_timm_weights('quest_vit_tiny_patch16_224', 'deit_tiny_patch16_224.bogus')
    with pytest.raises(ValueError, match='model_name must be a QUEST-ViT'):
        from_timm_weights('deit_tiny_patch16_224')


def test_official_deit3_layout_loads():
    """FB's DeiT-3 release layout (``gamma_1`` / ``gamma_2``, wrapped in ``model``) maps onto
    quest_deit3_*, and a mismatch is named."""
    manifest = deit3_official_manifest(embed_dim=768, depth=12, patch_size=16, img_size=224)
    gen = torch.Generator().manual_seed(0)
    official = {k: torch.randn(shape, generator=gen) for k, shape in manifest.items()}
    model = _meta('quest_deit3_base_patch16_224')
    converted = checkpoint_filter_fn({'model': official}, model)
    assert {k: tuple(v.shape) for k, v in converted.items()} == \
        {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert torch.equal(converted['blocks.3.ls2.gamma'], official['blocks.3.gamma_2'])
    deit = _meta('deit_base_patch16_224').state_dict()  # class-token position, no layer scale
    with pytest.raises(ValueError, match='pos_embed has 197 positions'):
        checkpoint_filter_fn(deit, model)
    with pytest.raises(ValueError, match=r'missing from the checkpoint \(25\): blocks.0.ls1.gamma'):
        checkpoint_filter_fn({k: v for k, v in deit.items() if k != 'pos_embed'}, model)


# ----------------------------------------------------------------------------------------------
# model oracle: a ViT forward written from the papers, on a tiny config sharing the weights
# ----------------------------------------------------------------------------------------------

def _layer_norm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _vit_reference(model, img, deit3):
    """ViT (Dosovitskiy et al.): patchify + linear embedding, class token, learned position
    embedding (DeiT-3: patches only, class token appended after), pre-norm blocks of QUEST
    attention (Algorithm A1) and an exact-GELU MLP (DeiT-3: each branch times its LayerScale),
    final LayerNorm (eps 1e-6), classifier on the class token."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    img = img.double()
    B, _, H, W = img.shape
    P = model.patch_embed.patch_size[0]
    patches = img.unfold(2, P, P).unfold(3, P, P)           # B, C, H/P, W/P, P, P
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(B, (H // P) * (W // P), -1)
    x = patches @ sd['patch_embed.proj.weight'].flatten(1).T + sd['patch_embed.proj.bias']
    cls = sd['cls_token'].expand(B, -1, -1)
    if deit3:
        x = torch.cat([cls, x + sd['pos_embed']], 1)
    else:
        x = torch.cat([cls, x], 1) + sd['pos_embed']
    C = x.shape[-1]
    heads = model.blocks[0].attn.num_heads
    D = C // heads
    for i in range(len(model.blocks)):
        p = lambda n: sd[f'blocks.{i}.{n}']  # noqa: E731
        h = _layer_norm(x, p('norm1.weight'), p('norm1.bias'))
        q, k, v = (h @ p('attn.qkv.weight').T + p('attn.qkv.bias')).split(C, -1)
        out = []
        for j in range(heads):
            Q, K, V = (t[..., j * D:(j + 1) * D] for t in (q, k, v))
            K = K / K.pow(2).sum(-1, keepdim=True).sqrt()
            out.append(_softmax(Q @ K.transpose(-1, -2)) @ V)
        a = torch.cat(out, -1) @ p('attn.proj.weight').T + p('attn.proj.bias')
        x = x + (a * p('ls1.gamma') if deit3 else a)
        h = _layer_norm(x, p('norm2.weight'), p('norm2.bias'))
        h = h @ p('mlp.fc1.weight').T + p('mlp.fc1.bias')
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))     # exact GELU
        m = h @ p('mlp.fc2.weight').T + p('mlp.fc2.bias')
        x = x + (m * p('ls2.gamma') if deit3 else m)
    x = _layer_norm(x, sd['norm.weight'], sd['norm.bias'])
    return x[:, 0] @ sd['head.weight'].T + sd['head.bias']


@pytest.mark.parametrize('name', ['quest_vit_tiny_patch16_224', 'quest_deit3_base_patch16_224'])
def test_model_oracle(name):
    model = tiny_models.quest_vit(name)
    with torch.no_grad():
        for p in model.parameters():  # every weight matters, LayerScale gammas included
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
        # small embeddings: the first LayerNorm's eps matters (1e-5 instead of 1e-6 fails this
        # test, as do tanh-GELU, standard attention, a missing or extra LayerScale)
        for p in (model.patch_embed.proj.weight, model.patch_embed.proj.bias, model.cls_token,
                  model.pos_embed):
            p.mul_(0.01)
    img = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(img)
    ref = _vit_reference(model, img, deit3='deit3' in name)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# timm workflow on a tiny QUEST-ViT
# ----------------------------------------------------------------------------------------------

def test_dynamic_img_size_and_features():
    model = tiny_models.quest_vit(dynamic_img_size=True)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 40, 56)).shape == (1, 5)
        inter = model.forward_intermediates(torch.randn(1, 3, 40, 56), intermediates_only=True)
    assert [tuple(t.shape) for t in inter] == [(1, 24, 5, 7)] * 2
    feats = timm.create_model('quest_vit_tiny_patch16_224', features_only=True, out_indices=(1,),
                              **dict(tiny_models.QUEST_VIT_TINY, num_classes=0))
    assert feats(torch.randn(1, 3, 32, 32))[0].shape == (1, 24, 4, 4)


def test_script_fx_compile_autocast_checkpointing():
    from timm.layers import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    model = tiny_models.quest_vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(torch.jit.script(model)(x), ref)
        kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
        # the mask arguments as constants: torch < 2.5's SDPA rejects a traced is_causal (for
        # timm's own ViTs alike)
        const = dict(attn_mask=None, is_causal=False)
        nodes = get_graph_node_names(model, tracer_kwargs=kw, concrete_args=const)[1]
        fx = create_feature_extractor(model, return_nodes=[nodes[-1]], tracer_kwargs=kw,
                                      concrete_args=const)
        torch.testing.assert_close(next(iter(fx(x).values())), ref)
        compiled = torch.compile(model, backend='aot_eager', fullgraph=True)
        torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), ref)
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast('cpu', dtype=dtype):
                out = model(x)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)
    model.train()
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    model.set_grad_checkpointing(True)
    out2 = model(x)
    grads2 = torch.autograd.grad(out2.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out2, out)
    for a, b in zip(grads2, grads):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------------------------
# QUEST on neighborhood attention (NAT / DiNAT)
# ----------------------------------------------------------------------------------------------

def _na_quest_reference(attn, x):
    """qkv, zero-padding to K*d as the layer does, brute-force NA with L2-normalised keys and
    scale 1, crop, proj."""
    heads, dim = attn.num_heads, attn.dim
    K, d = attn.kernel_size, attn.dilation
    H, W = x.shape[1:3]
    xp = F.pad(x, (0, 0, 0, max(K * d - W, 0), 0, max(K * d - H, 0)))
    q, k, v = attn.qkv(xp).reshape(*xp.shape[:3], 3, heads, dim // heads).unbind(3)
    k = k / k.norm(dim=-1, keepdim=True)
    rpb = attn.rpb if attn.rpb is not None else torch.zeros(heads, 2 * K - 1, 2 * K - 1)
    out = neighborhood_attention(q, k, v, K, d, rpb, 1.0)
    return attn.proj(out.flatten(-2)[:, :H, :W])


def test_nat_quest_every_block_matches_bruteforce():
    model = tiny_models.nat(attn_norm='quest')
    layers = [m for m in model.modules() if isinstance(m, NeighborhoodAttention2d)]
    assert len(layers) == 6 and all(m.attn_norm == 'quest' and m.scale == 1.0 for m in layers)
    assert set(model.state_dict()) == set(tiny_models.nat().state_dict())  # no new parameters
    with torch.no_grad():
        for m in layers:
            m.qkv.weight.mul_(20)  # keys far from unit norm: the normalisation matters
            m.qkv.bias.normal_()
            m.rpb.normal_()
    for attn, hw in ((layers[1], (7, 6)), (layers[2], (5, 9)), (layers[5], (2, 3))):
        x = torch.randn(2, *hw, attn.dim, requires_grad=True)
        with attnzoo.use_backend('torch'):
            out = attn(x)
        ref = _na_quest_reference(attn, x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(out)
        params = [x, attn.qkv.weight, attn.rpb]
        for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # and the output differs from NAT's scaled dot product on the same weights
        attn.attn_norm, attn.scale = 'none', attn.head_dim ** -0.5
        with torch.no_grad():
            assert (attn(x) - out).abs().max() > 1e-3
        attn.attn_norm, attn.scale = 'quest', 1.0
    from timm.layers import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor
    with torch.no_grad():  # the whole model runs, scripted and FX-traced too
        x = torch.randn(1, 3, 40, 48)
        ref = model(x)
        torch.testing.assert_close(torch.jit.script(model)(x), ref)
        kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
        fx = create_feature_extractor(model, return_nodes=['head.fc'], tracer_kwargs=kw)
        torch.testing.assert_close(fx(x)['head.fc'], ref)


def test_na_quest_natten_backend():
    pytest.importorskip('natten')
    torch.manual_seed(0)
    # NATTEN >= 0.20 has no rpb, and on CPU runs forward only with a power-of-two head dim
    attn = NeighborhoodAttention2d(16, 2, kernel_size=3, dilation=2, rel_pos_bias=False,
                                   attn_norm='quest').eval()
    with torch.no_grad():
        attn.qkv.weight.mul_(20)
        x = torch.randn(2, 8, 7, 16)
        with attnzoo.use_backend('natten'):
            out = attn(x)
        torch.testing.assert_close(out, _na_quest_reference(attn, x), rtol=1e-4, atol=1e-4)


def test_na_quest_key_scale_invariance_and_errors():
    attn = NeighborhoodAttention2d(12, 3, kernel_size=3, attn_norm='quest').eval()
    x = torch.randn(1, 6, 5, 12)
    factors = torch.empty(6, 5, 3, 1).uniform_(0.01, 100.)

    def hook(module, inputs, out):
        out = out.clone()
        out[..., 12:24] = (out[..., 12:24].unflatten(-1, (3, 4)) * factors).flatten(-2)
        return out
    with torch.no_grad():
        ref = attn(x)
        handle = attn.qkv.register_forward_hook(hook)
        torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)
        handle.remove()
    with pytest.raises(ValueError, match="attn_norm must be one of 'none', 'quest'"):
        NeighborhoodAttention2d(12, 3, attn_norm='qknorm')
    with pytest.raises(ValueError, match='attn_norm'):
        timm.create_model('dinat_mini', device='meta', attn_norm='spherical')
    dinat = _meta('dinat_mini', attn_norm='quest')
    assert all(m.attn_norm == 'quest' for m in dinat.modules()
               if isinstance(m, NeighborhoodAttention2d))


# ----------------------------------------------------------------------------------------------
# QUEST on QnA-ViT's window self-attention (LSA) blocks
# ----------------------------------------------------------------------------------------------

def _lsa_quest_bruteforce(attn, x, window):
    """Per window of ``window`` (the map a multiple of it, or one global window), per head and
    query: logits q . k/|k| (scale 1) + Swin relative bias, a manual softmax, float64."""
    B, H, W, C = x.shape
    heads, D = attn.num_heads, C // attn.num_heads
    w = attn.window_size
    q, k, v = (x.double() @ attn.qkv.weight.double().T).unflatten(-1, (3, heads, D)).unbind(3)
    k = k / k.norm(dim=-1, keepdim=True)
    table = attn.relative_position_bias_table.double()
    out = torch.zeros(B, H, W, heads, D, dtype=torch.float64)
    wh, ww = min(window, H), min(window, W)
    for y in range(H):
        for xx in range(W):
            y0, x0 = y // wh * wh, xx // ww * ww
            keys = [(a, b) for a in range(y0, y0 + wh) for b in range(x0, x0 + ww)]
            bias = torch.stack([table[(y - a + w - 1) * (2 * w - 1) + (xx - b + w - 1)]
                                for a, b in keys])                                # [n, heads]
            K = torch.stack([k[:, a, b] for a, b in keys], 1)                     # [B, n, h, D]
            V = torch.stack([v[:, a, b] for a, b in keys], 1)
            logits = torch.einsum('bhd,bnhd->bhn', q[:, y, xx], K) + bias.T
            out[:, y, xx] = torch.einsum('bhn,bnhd->bhd', _softmax(logits), V)
    return out.flatten(-2) @ attn.proj.weight.double().T


@pytest.mark.parametrize('hw, window', [((8, 8), 4), ((5, 3), 7)], ids=['2x2-windows', 'global'])
def test_lsa_quest_matches_bruteforce(hw, window):
    from attnzoo.layers import LocalSelfAttention
    torch.manual_seed(0)
    attn = LocalSelfAttention(DIM, HEADS, window_size=window, attn_norm='quest')
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 3.)     # keys far from unit norm: the normalisation matters
        attn.relative_position_bias_table.normal_()
    x = torch.randn(2, *hw, DIM, dtype=torch.float64)
    out = attn.double()(x)
    ref = _lsa_quest_bruteforce(attn, x, window)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(out)
    params = [attn.qkv.weight, attn.relative_position_bias_table]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    attn.attn_norm = 'none'  # the same weights with the scaled dot product differ
    with torch.no_grad():
        assert (attn(x) - out).abs().max() > 1e-3


def test_qna_vit_quest_option():
    model = timm.create_model('qna_vit_tiny', device='meta', attn_norm='quest')
    from attnzoo.layers import LocalSelfAttention, QnA
    lsa = [m for m in model.modules() if isinstance(m, LocalSelfAttention)]
    assert len(lsa) == 6 and all(m.attn_norm == 'quest' for m in lsa)
    assert any(isinstance(m, QnA) for m in model.modules())  # QnA layers keep their attention
    plain = timm.create_model('qna_vit_tiny', device='meta')
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in plain.state_dict().items()}   # same weights load into either
    with pytest.raises(ValueError, match="attn_norm must be one of 'none', 'quest'"):
        timm.create_model('qna_vit_tiny', device='meta', attn_norm='qknorm')


@pytest.mark.interpreter
def test_nat_quest_on_the_cuda_backend():
    """The cuda backend (Triton; interpreted on CPU) runs QUEST's normalised keys and scale 1
    as the torch reference does, forward and backward."""
    from attnzoo import kernels
    if kernels.triton_missing():
        pytest.skip(kernels.triton_missing())
    if not torch.cuda.is_available():
        from attnzoo.kernels import neighborhood as kn
        if not kn.INTERPRETED:
            pytest.skip("the kernels were compiled for a GPU and there is none")
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    torch.manual_seed(0)
    attn = NeighborhoodAttention2d(16, 2, kernel_size=3, attn_norm='quest').to(device)
    with torch.no_grad():
        attn.qkv.weight.mul_(20)
        attn.rpb.normal_()
    x = torch.randn(1, 5, 6, 16, device=device)
    outs, grads = [], []
    for backend in ('torch', 'cuda'):
        with attnzoo.use_backend(backend):
            out = attn(x)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [attn.qkv.weight, attn.rpb]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("size", [(200, 260), (224, 160)])
def test_the_advice_for_another_size_runs(size):
    """A fixed-size model given another size names two ways to create one for it; both run (at
    sizes that are no multiple of the patch, as timm's own ViTs do)."""
    model = timm.create_model("quest_vit_tiny_patch16_224", depth=1).eval()
    x = torch.randn(1, 3, *size)
    with pytest.raises(ValueError) as info:
        model(x)
    advice = re.findall(r"(img_size=\(\d+, \d+\)|dynamic_img_size=True(?:, "
                        r"dynamic_img_pad=True)?)", str(info.value))
    assert advice and advice[0] == f"img_size={size}", str(info.value)
    for kwargs in advice:
        built = eval(f"dict({kwargs})")
        assert timm.create_model("quest_vit_tiny_patch16_224", depth=1, **built).eval()(
            x).shape == (1, 1000), kwargs
