"""SAN's self-attention module (SAM): pairwise and patchwise vector attention on NCHW maps.

Zhao, Jia, Koltun, "Exploring Self-attention for Image Recognition" (CVPR 2020), Sec. 3:

* pairwise ``y_i = sum_{j in R(i)} gamma(delta(x_i, x_j), p_i - p_j) * beta(x_j)``, the weights
  softmax-normalised over the footprint ``R(i)``;
* patchwise ``y_i = sum_{j in R(i)} gamma(delta(x_R(i)))_j * beta(x_j)``, no softmax;

with ``phi = conv1``, ``psi = conv2``, ``beta = conv3`` (1x1 convs), the mapping ``gamma =
conv_w`` (BN - ReLU - 1x1 conv - BN - ReLU - 1x1 conv) applied to ``[N, C, kk, L]`` tensors, so
its BatchNorm statistics pool over the footprint and the map, and ``Cw = out_dim / share_planes``
weight channels shared interleaved (feature channel ``c`` uses weight ``c % Cw``). Pairwise
attention adds the relative position ``p_i - p_j`` of a learned linear map ``conv_p`` of the
``[-1, 1]``-normalised coordinates (channel 0 along the width, channel 1 along the height).

Relation functions ``delta`` (the paper's Table 4), ``relation=``:

* pairwise: ``'subtraction'`` (default, the paper's models) ``phi(x_i) - psi(x_j)``,
  ``'summation'`` ``phi(x_i) + psi(x_j)``, ``'hadamard_product'`` ``phi(x_i) * psi(x_j)``,
  ``'concatenation'`` ``[phi(x_i), psi(x_j)]``, ``'dot_product'`` ``phi(x_i)^T psi(x_j)``;
* patchwise: ``'concatenation'`` (default) ``[phi(x_i), [psi(x_j)]_j]`` (channel ``c * kk + j``
  for ``psi``), ``'star_product'`` ``[phi(x_i)^T psi(x_j)]_j``, ``'clique_product'``
  ``[phi(x_j)^T psi(x_k)]_{j, k}``.

Module and parameter names are the official code's (``conv1``, ``conv2``, ``conv3``,
``conv_w.{0,2,3,5}``, ``conv_p``). Every neighbourhood op goes through :mod:`attnzoo.ops.san`
in one module-level function, :func:`sa_op`: ``@torch.jit.ignore`` (scripted models call it as
Python, so the backend switch keeps working) and an FX leaf (the ops' argument checks depend on
shapes)."""
from typing import Optional

import torch
import torch.nn as nn
from timm.models import register_notrace_function

from .. import backends
from ..ops import san_aggregation, san_neighbours, san_subtraction, san_subtraction2
from ..ops.san import PADDING_MODES, footprint_positions
from .attention_map import AttentionMap

__all__ = ["SAM", "PAIRWISE_RELATIONS", "PATCHWISE_RELATIONS"]

PAIRWISE_RELATIONS = ("subtraction", "summation", "hadamard_product", "concatenation",
                      "dot_product")
PATCHWISE_RELATIONS = ("concatenation", "star_product", "clique_product")


_SAN_OPS = {"subtraction": san_subtraction, "subtraction2": san_subtraction2,
            "aggregation": san_aggregation}


@register_notrace_function
@torch.jit.ignore
def sa_op(op: str, x: torch.Tensor, y: Optional[torch.Tensor], kernel_size: int, dilation: int,
          stride: int, padding_mode: str, backend: Optional[str]) -> torch.Tensor:
    """``san_{op}`` of :mod:`attnzoo.ops.san` on ``x`` and, for the two-tensor ops
    (``subtraction2``, ``aggregation``), ``y``; ``op='neighbours'`` ignores ``backend`` (a
    gather has none)."""
    geometry = dict(kernel_size=kernel_size, dilation=dilation, stride=stride,
                    padding_mode=padding_mode)
    if op == "neighbours":
        return san_neighbours(x, **geometry)
    tensors = (x,) if y is None else (x, y)
    return _SAN_OPS[op](*tensors, backend=backend, **geometry)


def sa_centre(x: torch.Tensor, stride: int) -> torch.Tensor:
    """``x`` at each output position (the footprint's centre), ``[N, C, 1, L]``."""
    centre = x[:, :, ::stride, ::stride]
    # sizes written out, never -1: an empty batch must reshape too (here and below)
    return centre.reshape(x.shape[0], x.shape[1], 1, centre.shape[-2] * centre.shape[-1])


@register_notrace_function
def position_grid(x: torch.Tensor) -> torch.Tensor:
    """``[1, 2, H, W]`` coordinates of ``x``'s map normalised to ``[-1, 1]``: channel 0 along
    the width, channel 1 along the height (the official order)."""
    H, W = x.shape[-2], x.shape[-1]
    loc_w = _unit_axis(W, x).view(1, W).expand(H, W)
    loc_h = _unit_axis(H, x).view(H, 1).expand(H, W)
    return torch.stack([loc_w, loc_h]).unsqueeze(0)


def _unit_axis(n: int, x: torch.Tensor) -> torch.Tensor:
    """``n`` points from -1 to 1 in ``x``'s dtype and device."""
    # (is_scripting() first: TorchScript compiles neither the check nor the export branch)
    if not torch.jit.is_scripting():
        if backends.exporting():  # torch.export bakes linspace's length in, arange's follows n
            # a map of side 1 gets -1, as from linspace (not 0 * inf); the ONNX tracer's sizes
            # are tensors, torch.export's symbolic ints
            gaps = (n - 1).clamp(min=1) if isinstance(n, torch.Tensor) else torch.sym_max(n - 1, 1)
            return torch.arange(n, device=x.device, dtype=x.dtype) * (2 / gaps) - 1
    return torch.linspace(-1., 1., n, device=x.device, dtype=x.dtype)


class SAM(nn.Module):
    """SAN's self-attention module on ``[N, dim, H, W]`` maps.

    Args:
        dim: input channels.
        rel_dim: channels of ``phi`` / ``psi`` (``conv1`` / ``conv2``; the paper's ``C / r1``).
        out_dim: channels of ``beta`` (``conv3``) and of the output (``C / r2``).
        share_planes: feature channels sharing one attention weight; ``out_dim`` must be a
            multiple of it (``Cw = out_dim / share_planes`` weight channels, shared interleaved).
        kernel_size: odd footprint size ``k``.
        stride: output positions every ``stride`` pixels (``ceil(H / stride)`` per axis).
        dilation: footprint dilation.
        sa_type: ``'pairwise'`` or ``'patchwise'``.
        relation: the relation function (module docstring); ``None``: ``'subtraction'``
            (pairwise) / ``'concatenation'`` (patchwise), the paper's models.
        padding_mode: ``'reflect'`` (official; needs maps larger than ``dilation * (k - 1) / 2``)
            or ``'zeros'``.
        backend: backend of the SAN ops, one of :data:`attnzoo.backends.BACKENDS`; ``None``
            follows :func:`attnzoo.use_backend` / :func:`attnzoo.set_backend` /
            ``ATTNZOO_BACKEND``.
    """

    def __init__(
            self,
            dim: int,
            rel_dim: int,
            out_dim: int,
            share_planes: int = 8,
            kernel_size: int = 7,
            stride: int = 1,
            dilation: int = 1,
            sa_type: str = 'pairwise',
            relation: Optional[str] = None,
            padding_mode: str = 'reflect',
            backend: Optional[str] = None,
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        if sa_type not in ('pairwise', 'patchwise'):
            raise ValueError(f"sa_type must be 'pairwise' or 'patchwise', got {sa_type!r}")
        relations = PAIRWISE_RELATIONS if sa_type == 'pairwise' else PATCHWISE_RELATIONS
        relation = relations[0] if relation is None else relation
        if relation not in relations:
            raise ValueError(f"relation {relation!r} is not a {sa_type} relation; accepted: "
                             f"{', '.join(relations)}")
        for name, value in (('kernel_size', kernel_size), ('stride', stride),
                            ('dilation', dilation)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        if share_planes < 1 or out_dim % share_planes:
            raise ValueError(f"out_dim ({out_dim}) must be a multiple of share_planes "
                             f"({share_planes})")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got "
                             f"{padding_mode!r}")
        if backend is not None:
            backends.get_backend(backend)  # unknown names raise ValueError now, not at forward
        self.sa_type = sa_type
        self.relation = relation
        self.kernel_size = kernel_size
        self.stride = stride
        self.dilation = dilation
        self.padding_mode = padding_mode
        self.backend = backend
        self.taps = kernel_size * kernel_size
        weight_dim = out_dim // share_planes

        self.conv1 = nn.Conv2d(dim, rel_dim, 1, **dd)
        self.conv2 = nn.Conv2d(dim, rel_dim, 1, **dd)
        self.conv3 = nn.Conv2d(dim, out_dim, 1, **dd)
        if sa_type == 'pairwise':
            in_w = {'concatenation': 2 * rel_dim, 'dot_product': 1}.get(relation, rel_dim) + 2
            self.conv_w = nn.Sequential(
                nn.BatchNorm2d(in_w, **dd), nn.ReLU(inplace=True),
                nn.Conv2d(in_w, rel_dim, 1, bias=False, **dd),
                nn.BatchNorm2d(rel_dim, **dd), nn.ReLU(inplace=True),
                nn.Conv2d(rel_dim, weight_dim, 1, **dd))
            self.conv_p = nn.Conv2d(2, 2, 1, **dd)
        else:
            in_w = {'concatenation': rel_dim * (self.taps + 1), 'star_product': self.taps,
                    'clique_product': self.taps * self.taps}[relation]
            self.conv_w = nn.Sequential(
                nn.BatchNorm2d(in_w, **dd), nn.ReLU(inplace=True),
                nn.Conv2d(in_w, weight_dim, 1, bias=False, **dd),
                nn.BatchNorm2d(weight_dim, **dd), nn.ReLU(inplace=True),
                nn.Conv2d(weight_dim, self.taps * weight_dim, 1, **dd))
            self.conv_p = None

    def extra_repr(self) -> str:
        return (f"sa_type={self.sa_type!r}, relation={self.relation!r}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}, padding_mode={self.padding_mode!r}, "
                f"backend={self.backend!r}")

    def neighbours(self, x: torch.Tensor) -> torch.Tensor:
        return self.op("neighbours", x)

    def op(self, op: str, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """An :mod:`attnzoo.ops.san` op with this module's footprint and backend."""
        return sa_op(op, x, y, self.kernel_size, self.dilation, self.stride, self.padding_mode,
                     self.backend)

    def pairwise_relation(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """``delta(x_i, x_j)``, ``[N, C, kk, L]``."""
        if self.relation == 'subtraction':
            return self.op("subtraction2", x1, x2)
        if self.relation == 'summation':  # x1_i - (-x2_j), exactly
            return self.op("subtraction2", x1, -x2)
        centre, nbrs = sa_centre(x1, self.stride), self.neighbours(x2)
        if self.relation == 'hadamard_product':
            return centre * nbrs
        if self.relation == 'concatenation':
            return torch.cat([centre.expand_as(nbrs), nbrs], 1)
        return (centre * nbrs).sum(1, keepdim=True)  # dot_product

    def patchwise_relation(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """``delta(x_R(i))``, ``[N, C, 1, L]``."""
        centre = sa_centre(x1, self.stride)
        nbrs = self.neighbours(x2)                                        # [N, C, kk, L]
        if self.relation == 'concatenation':
            return torch.cat([centre, nbrs.flatten(1, 2).unsqueeze(2)], 1)
        if self.relation == 'star_product':
            return (centre * nbrs).sum(1).unsqueeze(2)
        # clique_product: every pair (j, k) of the footprint, index j * kk + k
        clique = torch.einsum('ncjl,nckl->njkl', self.neighbours(x1), nbrs)
        return clique.flatten(1, 2).unsqueeze(2)

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``gamma``'s weights ``[N, Cw, kk, L]``: per weight channel (channel group), footprint
        tap and output position."""
        x1, x2 = self.conv1(x), self.conv2(x)
        if self.conv_p is not None:  # pairwise
            p = self.conv_p(position_grid(x))
            p = self.op("subtraction", p)
            r = self.pairwise_relation(x1, x2)
            r = torch.cat([r, p.expand(r.shape[0], -1, -1, -1).to(r.dtype)], 1)
            return self.conv_w(r).softmax(dim=-2)
        w = self.conv_w(self.patchwise_relation(x1, x2))
        return w.unflatten(1, (w.shape[1] // self.taps, self.taps)).squeeze(3)

    def attention_map(self, x: torch.Tensor) -> AttentionMap:
        """The vector attention weights of ``forward(x)``, ``[B, H_out, W_out, group, k*k]``
        (group ``g`` weighs feature channels ``c`` with ``c % groups == g``), and the footprint's
        positions on the map (reflected at the borders with ``padding_mode='reflect'``; outside
        the map with ``'zeros'``)."""
        H, W, s = x.shape[-2], x.shape[-1], self.stride
        Ho, Wo = (H - 1) // s + 1, (W - 1) // s + 1
        w = self.attention_weights(x)
        weights = w.reshape(w.shape[0], w.shape[1], self.taps, Ho, Wo).permute(0, 3, 4, 1, 2)
        k, reflect = self.kernel_size, self.padding_mode == "reflect"
        ys, xs = (footprint_positions(n, n_out, k, self.dilation, s, reflect, x.device).t()
                  for n, n_out in ((H, Ho), (W, Wo)))                          # [n_out, k] each
        keys = torch.stack([ys.reshape(Ho, 1, k, 1).expand(Ho, Wo, k, k),
                            xs.reshape(1, Wo, 1, k).expand(Ho, Wo, k, k)], -1)
        return AttentionMap(weights, ("batch", "y", "x", "group", "key"),
                            keys.reshape(Ho, Wo, self.taps, 2), (H, W), s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.attention_weights(x)
        x3 = self.conv3(x)
        # autocast runs the softmax in float32; the aggregation takes one dtype
        return self.op("aggregation", x3, w.to(x3.dtype))


# leaves for torch.fx's own tracer too (timm's honours register_notrace_function only)
for _leaf in ('sa_op', 'position_grid'):
    torch.fx.wrap(_leaf)
