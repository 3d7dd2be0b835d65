"""Model-level oracle for SAN: the forward written here from the paper (Eq. 2 and 4, Sec. 3.3-3.4)
and the spec, on the *official* parameter names (tests/checkpoint_layouts.py converts the model's
state dict), with its own BatchNorm (batch statistics over every dim but the channels, so in
conv_w over k*k*H*W), ReLU, 1x1 convs, softmax over the footprint, 2x2 max pool, footprints
gathered by explicit reflection index arithmetic (the position differences included) and the
interleaved weight sharing (feature channel c uses weight channel c % Cw), in float64. A changed
activation, epsilon, softmax axis, padding or sharing in the model fails it."""
import pytest
import torch

from attnzoo.layers import SAM
from checkpoint_layouts import san_to_official
from oracles import batch_norm, reflect, relu
from tiny_models import SAN_TINY, randomize, san

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)

BN_EPS = 1e-5  # PyTorch's BatchNorm2d default, which the official code uses


def o_bn(x, sd, prefix, training):
    """On SAM's [N, C, kk, L] tensors the batch statistics pool the footprint and the map:
    k*k*H*W values per sample and channel."""
    return batch_norm(x, sd[prefix + 'weight'], sd[prefix + 'bias'], sd[prefix + 'running_mean'],
                      sd[prefix + 'running_var'], BN_EPS, training)


def o_linear(x, sd, prefix):
    """A 1x1 conv (or Linear) on the channel dim 1."""
    weight = sd[prefix + 'weight']
    y = torch.einsum('oc,nc...->no...', weight.reshape(weight.shape[0], -1), x)
    if prefix + 'bias' in sd:
        y = y + sd[prefix + 'bias'].view([1, -1] + [1] * (x.dim() - 2))
    return y


def o_footprint(x, k, s):
    """[N, C, kk, L]: tap (kh, kw) of output (ho, wo) reads (ho*s - p + kh, wo*s - p + kw),
    reflected; kk = kh*k + kw, L = ho*Wo + wo."""
    H, W = x.shape[-2:]
    p = (k - 1) // 2
    Ho, Wo = -(-H // s), -(-W // s)
    rows = [[reflect(ho * s - p + kh, H) for ho in range(Ho) for wo in range(Wo)]
            for kh in range(k) for kw in range(k)]
    cols = [[reflect(wo * s - p + kw, W) for ho in range(Ho) for wo in range(Wo)]
            for kh in range(k) for kw in range(k)]
    return x[:, :, torch.tensor(rows), torch.tensor(cols)]


def o_centre(x, s):
    return x[:, :, ::s, ::s].flatten(2).unsqueeze(2)  # [N, C, 1, L]


def o_position(H, W, dtype):
    """Channel 0: the column's coordinate, channel 1: the row's, both -1..1."""
    col = torch.tensor([-1 + 2 * j / (W - 1) for j in range(W)], dtype=dtype)
    row = torch.tensor([-1 + 2 * i / (H - 1) for i in range(H)], dtype=dtype)
    return torch.stack([col.view(1, W).expand(H, W), row.view(H, 1).expand(H, W)])[None]


def o_sam(x, sd, pre, sa_type, relation, k, s, share, training):
    """Eq. (2) / (4): y_i = sum_j alpha_ij (.) beta(x_j), alpha = gamma(delta)."""
    N, _, H, W = x.shape
    x1, x2, x3 = (o_linear(x, sd, pre + f'conv{n}.') for n in (1, 2, 3))
    c1, n2 = o_centre(x1, s), o_footprint(x2, k, s)
    L, kk = n2.shape[-1], k * k

    def gamma(r):
        r = o_linear(relu(o_bn(r, sd, pre + 'conv_w.0.', training)), sd, pre + 'conv_w.2.')
        return o_linear(relu(o_bn(r, sd, pre + 'conv_w.3.', training)), sd, pre + 'conv_w.5.')

    if sa_type == 'pairwise':
        delta = {'subtraction': lambda: c1 - n2, 'summation': lambda: c1 + n2,
                 'hadamard_product': lambda: c1 * n2,
                 'concatenation': lambda: torch.cat([c1.expand_as(n2), n2], 1),
                 'dot_product': lambda: (c1 * n2).sum(1, keepdim=True)}[relation]()
        p = o_linear(o_position(H, W, x.dtype), sd, pre + 'conv_p.')
        rel_pos = o_centre(p, s) - o_footprint(p, k, s)             # p_i - p_j, reflected
        logits = gamma(torch.cat([delta, rel_pos.expand(N, -1, -1, -1)], 1))
        e = torch.exp(logits - logits.amax(2, keepdim=True))
        w = e / e.sum(2, keepdim=True)                               # softmax over the footprint
    else:
        if relation == 'concatenation':                              # [phi(x_i), psi(x_j)...]
            delta = torch.cat([c1, n2.reshape(N, -1, 1, L)], 1)
        elif relation == 'star_product':                             # phi(x_i)^T psi(x_j)
            delta = torch.stack([(c1[:, :, 0] * n2[:, :, j]).sum(1) for j in range(kk)], 1)
            delta = delta.unsqueeze(2)
        else:                                                        # phi(x_j)^T psi(x_m)
            n1 = o_footprint(x1, k, s)
            delta = torch.stack([(n1[:, :, j] * n2[:, :, m]).sum(1)
                                 for j in range(kk) for m in range(kk)], 1).unsqueeze(2)
        w = gamma(delta).reshape(N, -1, kk, L)                       # weight cw*kk + j
    C, Cw = x3.shape[1], w.shape[1]
    assert C // share == Cw
    w = w[:, [c % Cw for c in range(C)]]                             # interleaved sharing
    y = (w * o_footprint(x3, k, s)).sum(2)
    return y.reshape(N, C, -(-H // s), -(-W // s))


def o_maxpool(x):
    N, C, H, W = x.shape
    x = x[:, :, :H // 2 * 2, :W // 2 * 2]
    return x.reshape(N, C, H // 2, 2, W // 2, 2).amax((3, 5))


def o_san(x, sd, depths, kernels, sa_type, relation, share, training):
    """The official forward: stem; per stage pool, 1x1 conv, pre-activation blocks, BN + ReLU;
    global average pool; fc."""
    x = relu(o_bn(o_linear(x, sd, 'conv_in.'), sd, 'bn_in.', training))
    for i, (depth, k) in enumerate(zip(depths, kernels)):
        x = o_linear(o_maxpool(x), sd, f'conv{i}.')
        for j in range(depth):
            b = f'layer{i}.{j}.'
            out = relu(o_bn(x, sd, b + 'bn1.', training))
            out = o_sam(out, sd, b + 'sam.', sa_type, relation, k, 1, share, training)
            out = relu(o_bn(out, sd, b + 'bn2.', training))
            x = x + o_linear(out, sd, b + 'conv.')
        x = relu(o_bn(x, sd, f'bn{i}.', training))
    return o_linear(x.mean((2, 3)), sd, 'fc.')


@pytest.mark.parametrize('training', [False, True], ids=['eval', 'train'])
@pytest.mark.parametrize('sa_type', ['pairwise', 'patchwise'])
def test_model_matches_oracle(sa_type, training):
    """The whole network against the oracle, float64, eval (running statistics) and train (batch
    statistics, where BN in conv_w pools over k*k*H*W) mode, on a non-square input."""
    model = randomize(san(sa_type)).double().train(training)
    sd = san_to_official(model.state_dict())
    x = torch.randn(2, 3, 128, 136, dtype=torch.float64)
    out = model(x)
    relation = 'subtraction' if sa_type == 'pairwise' else 'concatenation'  # the paper's
    expected = o_san(x, sd, SAN_TINY['depths'], (3, 7, 7, 7, 7), sa_type, relation,
                     SAN_TINY['share_planes'], training)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('sa_type,relation,k,stride', [
    ('pairwise', 'subtraction', 5, 2),
    ('pairwise', 'summation', 3, 1),
    ('pairwise', 'hadamard_product', 5, 1),
    ('pairwise', 'concatenation', 3, 2),
    ('pairwise', 'dot_product', 3, 1),
    ('patchwise', 'concatenation', 5, 2),
    ('patchwise', 'star_product', 3, 1),
    ('patchwise', 'clique_product', 3, 2),
])
def test_sam_relations_match_oracle(sa_type, relation, k, stride):
    torch.manual_seed(0)
    sam = SAM(16, 4, 8, share_planes=4, kernel_size=k, stride=stride, sa_type=sa_type,
              relation=relation).double().train()
    randomize(sam)
    sd = sam.state_dict()
    x = torch.randn(2, 16, 9, 7, dtype=torch.float64, requires_grad=True)
    out = sam(x)
    expected = o_sam(x, sd, '', sa_type, relation, k, stride, 4, True)
    assert out.shape == (2, 8, -(-9 // stride), -(-7 // stride))
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0],
                               torch.autograd.grad(expected, x, g)[0], rtol=1e-8, atol=1e-9)


