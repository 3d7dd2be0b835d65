"""QnA (Query and Attend; Arar, Shamir, Bermano, CVPR 2022): learned-query local attention, with
backend dispatch.

Semantics, per batch ``b``, learned query ``l`` and head ``h``. ``logits[b, y, x, l, h]`` is the
score of query ``l`` against the key at ``(y, x)`` (QnA's layer computes it "fused", as
``x . (W_k q_hat)``, so the keys are never built). Output position ``(i, j)`` attends to the
``k x k`` window centred at input ``(i * stride, j * stride)``; positions outside the map are
*excluded* from the softmax (not zero keys, not shifted windows). With ``t = (a, b)`` the window
offset (``a, b`` in ``0..k-1``, centre ``(k-1)/2``)::

    p_l(i, j, t) = softmax_t(logits_l(i*s + a - r, j*s + b - r) + rpb[l, h, a, b])   (in bounds)
    out(i, j)    = sum_l sum_t p_l(i, j, t) * window_weights[l, h, a, b] * v(key of t)

so the window weights scale the softmax weights in the numerator only (the ``L`` per-query
results are not a convex combination). Output size ``ceil(H / stride) x ceil(W / stride)``.
With ``sum_queries=False`` the ``L`` per-query results are returned unsummed (QnA's upsampling
layer makes each one a sub-pixel).

Layout is NATTEN's heads-last: ``logits [B, H, W, L, heads]``, ``v [B, H, W, heads, head_dim]``,
output ``[B, H_out, W_out, heads, head_dim]`` (``[B, H_out, W_out, L, heads, head_dim]`` unsummed).

The torch reference is the paper's depthwise-convolution form (Appendix D): with
``E = exp(logits - c)``, ``num = dwconv(E * v, exp(rpb) * window_weights)``,
``den = dwconv(E, exp(rpb))``, ``out = sum_l num / den``; zero padding keeps out-of-bounds keys
out of both sums. Memory is O(B * H * W * L * heads * head_dim): no window is ever unfolded.
The shift ``c`` must be one constant per window for it to cancel, and a convolution can only
subtract one constant per ``(b, l, h)`` map: a map whose logits span more than the exponent range
would underflow whole windows to 0/0. So each call first checks, per window, that the window's
largest logit is within ``0.7 * -log(tiny)`` (61 in float32) of its map's maximum (the usual
case: QnA's unit-norm queries keep logits moderate); if any window is further below, the call
instead runs the exact tap form: a softmax per window, stabilised by the window's own
maximum, accumulated one window offset at a time (still O(H*W*L*F), slower). Half-precision
inputs are computed in float32. The backward pass (written out: transposed depthwise
convolutions, or the tap form offset by offset) recomputes what it needs from the inputs, so
nothing larger than the inputs is kept between the passes.

The reference runs as ``torch.library`` custom ops (``attnzoo::qna2d`` and its backward):
torch.compile and torch.fx see one opaque call each way, so the data-dependent choice of form
stays out of their graphs.
"""
# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as
# types, and torch 2.4 evaluates string annotations outside this module.
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import backends, kernels
from ._args import as_int, plain_int

__all__ = ["qna2d", "qna2d_weights", "qna_window_positions", "qna2d_reference",
           "qna2d_export", "qna_export_rows"]


# --------------------------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------------------------

def _out_size(n: int, stride: int) -> int:
    return (n - 1) // stride + 1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _map_max_if_exact(logits: torch.Tensor, rpb: torch.Tensor, stride: int
                      ) -> Optional[torch.Tensor]:
    """Each ``(b, l, h)`` map's max logit ``[B, 1, 1, L, h]`` (the convolution form's shift) if no
    window's largest term falls more than ``0.7 * -log(tiny)`` below it; else None. Within that
    margin the shifted form loses nothing: a window's terms further than the remaining ~26 nats
    (float32) under its own max are below its precision anyway."""
    limit = 0.7 * -math.log(torch.finfo(logits.dtype).tiny)
    B, H, W, L, h = logits.shape
    k = rpb.shape[-1]
    # Per-map max and min, reduced over H first: a reduction over W * L * h contiguous values
    # runs ~10x faster on CPU than one over H * W rows of L * h.
    flat = logits.reshape(B, H, W * L * h)
    hi = flat.amax(1).view(B, W, L, h).amax(1)                        # [B, L, h]
    lo = flat.amin(1).view(B, W, L, h).amin(1)
    spread = rpb.amax((-2, -1)) - rpb.amin((-2, -1))                 # [L, h]
    # no window can be that far down: the usual case (and an empty batch's)
    exact = hi.numel() == 0 or float((hi - lo + spread).max()) < limit
    if not exact:  # per window: its max logit (max-pool pads with -inf: out-of-bounds excluded)
        window_max = F.max_pool2d(logits.reshape(B, H, W, L * h).permute(0, 3, 1, 2), k, stride,
                                  (k - 1) // 2)                      # [B, L*h, Ho, Wo]
        gap = hi.reshape(B, L * h, 1, 1) - window_max + spread.reshape(1, L * h, 1, 1)
        exact = float(gap.max()) < limit
    return hi.reshape(B, 1, 1, L, h) if exact else None


def _dwconv(x: torch.Tensor, kernel: torch.Tensor, stride: int) -> torch.Tensor:
    """Depthwise k x k convolution, zero padding (k-1)/2, on NHWC ``x`` with ``kernel [C, k, k]``.
    NHWC tensors are channels-last NCHW ones: no copies."""
    C, k = kernel.shape[0], kernel.shape[-1]
    out = F.conv2d(x.permute(0, 3, 1, 2), kernel.reshape(C, 1, k, k), stride=stride,
                   padding=(k - 1) // 2, groups=C)
    return out.permute(0, 2, 3, 1)


def _dwconv_grads(x: torch.Tensor, grad: torch.Tensor, kernel: torch.Tensor, stride: int
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`_dwconv` w.r.t. ``x`` and ``kernel``."""
    C, k = kernel.shape[0], kernel.shape[-1]
    gx, gk, _ = torch.ops.aten.convolution_backward(
        grad.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2), kernel.reshape(C, 1, k, k), None,
        [stride, stride], [(k - 1) // 2] * 2, [1, 1], False, [0, 0], C,
        [True, True, False])
    return gx.permute(0, 2, 3, 1), gk.reshape(C, k, k)


class _ConvForm(NamedTuple):
    """Appendix D's form with every factor bounded by 1: ``e = exp(logits - map max)``,
    ``k_den = exp(rpb - max rpb)``, ``k_num = k_den * window_weights``; a window's softmax
    weight is ``e(key) * k_den(offset) / den(window)``."""
    e: torch.Tensor          # [B, H, W, L, h]
    ev: torch.Tensor         # [B, H, W, L, h * d]   e * v
    k_den: torch.Tensor      # [L, h, k, k]
    k_num: torch.Tensor      # [L, h, k, k]
    num: torch.Tensor        # [B, Ho, Wo, L, h, d]
    den: torch.Tensor        # [B, Ho, Wo, L, h]


def _conv_form(logits, v, rpb, ws, stride: int, shift: torch.Tensor) -> _ConvForm:
    B, H, W, L, h = logits.shape
    d, k = v.shape[-1], rpb.shape[-1]
    e = torch.exp(logits - shift)
    k_den = torch.exp(rpb - rpb.amax((-2, -1), keepdim=True))
    k_num = k_den * ws
    # e broadcast over head_dim first: a product over L * h * d contiguous values (~1.5x faster
    # on CPU than broadcasting over an inner head_dim of 8)
    ev = e.unsqueeze(-1).expand(B, H, W, L, h, d).reshape(B, H, W, L, h * d) * v.reshape(
        B, H, W, 1, h * d)
    num = _dwconv(ev.reshape(B, H, W, L * h * d),
                  k_num.reshape(L * h, 1, k, k).expand(L * h, d, k, k).reshape(-1, k, k), stride)
    den = _dwconv(e.reshape(B, H, W, L * h), k_den.reshape(L * h, k, k), stride)
    Ho, Wo = num.shape[1:3]
    return _ConvForm(e, ev, k_den, k_num, num.reshape(B, Ho, Wo, L, h, d),
                     den.reshape(B, Ho, Wo, L, h))


def _conv_form_output(logits, v, rpb, ws, stride: int, sum_queries: bool,
                      shift: torch.Tensor) -> torch.Tensor:
    f = _conv_form(logits, v, rpb, ws, stride, shift)
    r = f.den.reciprocal().unsqueeze(-1)                    # [B, Ho, Wo, L, h, 1]: small
    if not sum_queries:
        return f.num * r
    out = f.num[:, :, :, 0] * r[:, :, :, 0]
    for l in range(1, r.shape[3]):
        out.addcmul_(f.num[:, :, :, l], r[:, :, :, l])
    return out


def _conv_form_backward(g, logits, v, rpb, ws, stride: int, shift: torch.Tensor):
    """``g [B, Ho, Wo, L, h, d]`` -> gradients of logits, v, rpb, window_weights, with
    transposed depthwise convolutions (``P = e * k_den / den`` throughout)."""
    B, H, W, L, h = logits.shape
    d, k = v.shape[-1], rpb.shape[-1]
    f = _conv_form(logits, v, rpb, ws, stride, shift)
    Ho, Wo = f.den.shape[1:3]
    r = 1 / f.den
    dots = (g * f.num).sum(-1) * r                    # <g, out_l>: the softmax's own term
    rg = (g * r.unsqueeze(-1)).reshape(B, Ho, Wo, L * h * d)
    rd = (dots * r).reshape(B, Ho, Wo, L * h)
    kernel_num = f.k_num.reshape(L * h, 1, k, k).expand(L * h, d, k, k).reshape(-1, k, k)
    y, w1 = _dwconv_grads(f.ev.reshape(B, H, W, L * h * d), rg, kernel_num, stride)
    z, w0 = _dwconv_grads(f.e.reshape(B, H, W, L * h), rd, f.k_den.reshape(L * h, k, k), stride)
    y = y.reshape(B, H, W, L, h, d)
    w1 = w1.reshape(L, h, d, k, k).sum(2)
    dv = (f.e.unsqueeze(-1) * y).sum(3)
    dlogits = f.e * ((v.unsqueeze(3) * y).sum(-1) - z.reshape(B, H, W, L, h))
    return dlogits, dv, f.k_den * (ws * w1 - w0.reshape(L, h, k, k)), f.k_den * w1


class _Taps(NamedTuple):
    """The tap form's view of a call: the padded logits (-inf) and values (0), and every
    window's log-sum-exp, stabilised by the window's own maximum."""
    logits: torch.Tensor     # [B, H + 2r, W + 2r, L, h]
    v: torch.Tensor          # [B, H + 2r, W + 2r, h, d]
    rpb: torch.Tensor
    stride: int
    out_hw: Tuple[int, int]
    lse: torch.Tensor        # [B, Ho, Wo, L, h]

    def at(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The key at window offset (a, b) of every output position: a strided view."""
        (Ho, Wo), s = self.out_hw, self.stride
        return t[:, a:a + s * (Ho - 1) + 1:s, b:b + s * (Wo - 1) + 1:s]

    def offsets(self):
        k = self.rpb.shape[-1]
        return [(a, b) for a in range(k) for b in range(k)]

    def logit(self, a: int, b: int) -> torch.Tensor:
        return self.at(self.logits, a, b) + self.rpb[:, :, a, b]

    def softmax(self, a: int, b: int) -> torch.Tensor:
        return torch.exp(self.logit(a, b) - self.lse)


def _taps(logits, v, rpb, stride: int) -> _Taps:
    pad = (rpb.shape[-1] - 1) // 2
    padding = (0, 0, 0, 0, pad, pad, pad, pad)
    out_hw = (_out_size(logits.shape[1], stride), _out_size(logits.shape[2], stride))
    taps = _Taps(F.pad(logits, padding, value=float("-inf")), F.pad(v, padding), rpb, stride,
                 out_hw, logits.new_empty(0))
    m = None
    for a, b in taps.offsets():  # one [B, Ho, Wo, L, h] tensor at a time: nothing unfolded
        m = taps.logit(a, b) if m is None else torch.maximum(m, taps.logit(a, b))
    total = torch.zeros_like(m)
    for a, b in taps.offsets():
        total += torch.exp(taps.logit(a, b) - m)
    return taps._replace(lse=m + total.log())


def _tap_form(logits, v, rpb, ws, stride: int, sum_queries: bool) -> torch.Tensor:
    """Exact for any logits: each window's softmax is shifted by its own maximum, and the window
    is visited one offset at a time (k*k strided views, never unfolded)."""
    taps = _taps(logits, v, rpb, stride)
    out = None
    for a, b in taps.offsets():
        p = taps.softmax(a, b) * ws[:, :, a, b]                       # [B, Ho, Wo, L, h]
        value = taps.at(taps.v, a, b)
        term = (p.sum(3).unsqueeze(-1) * value if sum_queries
                else p.unsqueeze(-1) * value.unsqueeze(3))
        out = term if out is None else out.add_(term)
    return out


def _tap_form_backward(g, logits, v, rpb, ws, stride: int):
    """``g [B, Ho, Wo, L, h, d]`` -> gradients of logits, v, rpb, window_weights, offset by
    offset: ``dz = p * (ws * <g, v(key)> - <g, out_l>)``."""
    taps = _taps(logits, v, rpb, stride)

    def gv(a, b):  # <g_l, v(key)>  [B, Ho, Wo, L, h]
        return (g * taps.at(taps.v, a, b).unsqueeze(3)).sum(-1)

    dots = sum(taps.softmax(a, b) * ws[:, :, a, b] * gv(a, b) for a, b in taps.offsets())
    dlogits, dv = torch.zeros_like(taps.logits), torch.zeros_like(taps.v)
    drpb, dws = torch.zeros_like(rpb), torch.zeros_like(ws)
    for a, b in taps.offsets():
        p, gt, w = taps.softmax(a, b), gv(a, b), ws[:, :, a, b]
        dz = p * (w * gt - dots)
        taps.at(dlogits, a, b).add_(dz)
        drpb[:, :, a, b] = dz.sum((0, 1, 2))
        dws[:, :, a, b] = (p * gt).sum((0, 1, 2))
        taps.at(dv, a, b).add_(((p * w).unsqueeze(-1) * g).sum(3))
    pad = (rpb.shape[-1] - 1) // 2
    H, W = logits.shape[1:3]
    return (dlogits[:, pad:pad + H, pad:pad + W], dv[:, pad:pad + H, pad:pad + W], drpb, dws)


def _forward(logits, v, rpb, ws, stride: int, sum_queries: bool) -> torch.Tensor:
    dtype = _compute_dtype(v.dtype)
    logits, v, rpb, ws = (t.to(dtype) for t in (logits, v, rpb, ws))
    shift = _map_max_if_exact(logits, rpb, stride)
    if shift is None:
        return _tap_form(logits, v, rpb, ws, stride, sum_queries)
    return _conv_form_output(logits, v, rpb, ws, stride, sum_queries, shift)


def _backward(grad, logits, v, rpb, ws, stride: int, sum_queries: bool):
    dtype = _compute_dtype(v.dtype)
    inputs = (logits, v, rpb, ws)
    logits, v, rpb, ws, g = (t.to(dtype) for t in (logits, v, rpb, ws, grad))
    if sum_queries:  # every query's result got the same gradient
        g = g.unsqueeze(3).expand(*g.shape[:3], logits.shape[3], *g.shape[3:])
    shift = _map_max_if_exact(logits, rpb, stride)
    grads = (_tap_form_backward(g, logits, v, rpb, ws, stride) if shift is None
             else _conv_form_backward(g, logits, v, rpb, ws, stride, shift))
    return tuple(gr.to(t.dtype) for gr, t in zip(grads, inputs))


# Custom ops: torch.compile and torch.fx see one opaque call each way, so the data-dependent
# choice of form never enters a graph. Autocast is off inside (the convolutions would otherwise
# run in half precision); nothing here needs autograd. Their outputs are contiguous, as their
# fake implementations state (a compiled graph is told those strides).

@torch.library.custom_op("attnzoo::qna2d", mutates_args=())
def _qna2d_op(logits: torch.Tensor, v: torch.Tensor, rpb: torch.Tensor, ws: torch.Tensor,
              stride: int, sum_queries: bool) -> torch.Tensor:
    with torch.autocast(v.device.type, enabled=False):
        return _forward(logits, v, rpb, ws, stride, sum_queries).to(v.dtype).contiguous()


@_qna2d_op.register_fake
def _(logits, v, rpb, ws, stride, sum_queries):
    B, H, W, L, h = logits.shape
    Ho, Wo = _out_size(H, stride), _out_size(W, stride)
    return v.new_empty((B, Ho, Wo, h, v.shape[-1]) if sum_queries
                       else (B, Ho, Wo, L, h, v.shape[-1]))


@torch.library.custom_op("attnzoo::qna2d_backward", mutates_args=())
def _qna2d_backward_op(grad: torch.Tensor, logits: torch.Tensor, v: torch.Tensor,
                       rpb: torch.Tensor, ws: torch.Tensor, stride: int, sum_queries: bool
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(v.device.type, enabled=False):
        return tuple(g.contiguous() for g in _backward(grad, logits, v, rpb, ws, stride,
                                                        sum_queries))


@_qna2d_backward_op.register_fake
def _(grad, logits, v, rpb, ws, stride, sum_queries):
    return tuple(t.new_empty(t.shape) for t in (logits, v, rpb, ws))


def _setup_context(ctx, inputs, output):
    logits, v, rpb, ws, stride, sum_queries = inputs
    ctx.save_for_backward(logits, v, rpb, ws)
    ctx.args = (stride, sum_queries)


def _autograd_backward(ctx, grad):
    grads = _qna2d_backward_op(grad, *ctx.saved_tensors, *ctx.args)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad)) + (None,) * 2


_qna2d_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def qna2d_reference(logits: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor],
                    window_weights: Optional[torch.Tensor], kernel_size: int, stride: int,
                    sum_queries: bool) -> torch.Tensor:
    """Pure-PyTorch QnA on validated inputs (see the module docstring); differentiable in every
    tensor argument, any device and float dtype."""
    L, h = logits.shape[-2:]
    shape = (L, h, kernel_size, kernel_size)
    if rpb is None:
        rpb = logits.new_zeros(shape)
    if window_weights is None:
        window_weights = logits.new_ones(shape)
    return _qna2d_op(logits, v, rpb, window_weights, stride, sum_queries)


def _unfold_windows(x: torch.Tensor, k: int, stride: int, value: float) -> torch.Tensor:
    """Every ``k x k`` window of NHWC ``x [B, H, W, C]`` centred at each output position,
    ``[B, C, k*k, Ho*Wo]`` (row-major offsets), ``value`` outside the map; sizes follow the
    input's shape (what an export graph needs)."""
    pad = (k - 1) // 2
    x = F.pad(x.permute(0, 3, 1, 2), (pad, pad, pad, pad), value=value)
    return F.unfold(x, k, stride=stride).reshape(x.shape[0], x.shape[1], k * k, -1)


def _window_softmax(logits: torch.Tensor, rpb: Optional[torch.Tensor], k: int, stride: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Each learned query's softmax over each window's in-bounds keys (out-of-bounds keys get
    0), ``[B, L, heads, k*k, Ho*Wo]`` in ``dtype``."""
    B, L, h = logits.shape[0], logits.shape[3], logits.shape[4]
    flat = logits.reshape(logits.shape[0], logits.shape[1], logits.shape[2], L * h)
    z = _unfold_windows(flat if flat.dtype == dtype else flat.to(dtype), k, stride,
                        float("-inf")).reshape(B, L, h, k * k, -1)
    if rpb is not None:
        z = z + (rpb if rpb.dtype == dtype else rpb.to(dtype)).reshape(L, h, k * k, 1)
    return z.softmax(3)


def _window_rows(B, H, W, k: int, stride: int, device: torch.device) -> torch.Tensor:
    """Each output position's ``k x k`` window as rows of a batch of ``B`` maps flattened to
    ``[B * H * W]``, with one row in front for outside the map (0), ``[B * Ho * Wo * k * k]``
    (row-major offsets); tensor ops of the sizes only, so an exported graph derives it from the
    input's shape."""
    r = (k - 1) // 2

    def axis(L):  # [Lo, k]: the taps' positions, and whether they lie in the map
        pos = (torch.arange(_out_size(L, stride), device=device) * stride - r).unsqueeze(1) \
            + torch.arange(k, device=device)
        return pos, (pos >= 0) & (pos < L)

    (y, valid_y), (x, valid_x) = axis(H), axis(W)
    first = torch.arange(B, device=device).view(-1, 1, 1, 1, 1) * (H * W) + 1  # map b's row 0
    flat = y.view(1, -1, 1, k, 1) * W + x.view(1, 1, -1, 1, k) + first   # [B, Ho, Wo, k, k]
    return torch.where(valid_y.view(1, -1, 1, k, 1) & valid_x.view(1, 1, -1, 1, k), flat,
                       0).reshape(-1)


def qna_export_rows(logits: torch.Tensor, v: torch.Tensor, layout: Tuple[int, int, int],
                    kernel_size: int, stride: int, rpb: Optional[torch.Tensor],
                    window_weights: Optional[torch.Tensor], sum_queries: bool) -> torch.Tensor:
    """QnA as an export graph, on the rows of a batch of maps: ``logits [B * H * W, L, heads]``,
    ``v [B * H * W, heads, head_dim]``, ``layout`` ``(B, H, W)``; returns the output map's rows,
    ``[B * Ho * Wo, heads, head_dim]`` (``[B * Ho * Wo, L, heads, head_dim]`` unsummed).

    Every window is gathered by one ``index_select`` (:func:`_window_rows`, from the sizes, once
    per size in a torch.export trace: :func:`attnzoo.backends.export_memo`) of the rows with
    one row in front for outside the map (logit ``-inf``, value 0), then one softmax per
    window. Exact for any logits, with no data-dependent branch and a graph that does not grow
    with the kernel; it holds ``k * k`` copies of the logits and values, which inference
    affords. Rows, not maps: every reshape is then of static sizes, and the exporters'
    symbolic-shape work per node grows with a tensor's symbolic dims. Tensors already in the
    compute dtype are not cast: each cast is two nodes of the exported graph."""
    B, H, W = layout
    k = kernel_size
    L, h = logits.shape[1], logits.shape[2]
    dtype = _compute_dtype(v.dtype)

    def cast(x, to=dtype):
        return x if x.dtype == to else x.to(to)

    index = backends.export_memo(("qna", B, H, W, k, stride, logits.device), logits,
                                 _window_rows, B, H, W, k, stride, logits.device)

    def windows(x, outside: float):  # [N, a, b] -> [No, k * k, a, b]
        x = F.pad(cast(x), (0, 0, 0, 0, 1, 0), value=outside)
        return x.index_select(0, index).reshape(-1, k * k, x.shape[1], x.shape[2])

    z = windows(logits, float("-inf"))
    if rpb is not None:
        z = z + cast(rpb).reshape(L, h, k * k).permute(2, 0, 1)
    p = z.softmax(1)                                                  # [No, k*k, L, h]
    if window_weights is not None:
        p = p * cast(window_weights).reshape(L, h, k * k).permute(2, 0, 1)
    values = windows(v, 0.)                                           # [No, k*k, h, d]
    if sum_queries:
        out = (p.sum(2).unsqueeze(-1) * values).sum(1)                # [No, h, d]
    else:
        out = (p.unsqueeze(-1) * values.unsqueeze(2)).sum(1)          # [No, L, h, d]
    return cast(out, v.dtype)


def qna2d_export(logits: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor],
                 window_weights: Optional[torch.Tensor], kernel_size: int, stride: int,
                 sum_queries: bool) -> torch.Tensor:
    """QnA as an export graph: :func:`qna_export_rows` on the maps' rows."""
    B, H, W = logits.shape[0], logits.shape[1], logits.shape[2]
    L, h, d = logits.shape[3], logits.shape[4], v.shape[-1]
    out = qna_export_rows(logits.reshape(-1, L, h), v.reshape(-1, h, d), (B, H, W), kernel_size,
                          stride, rpb, window_weights, sum_queries)
    Ho, Wo = _out_size(H, stride), _out_size(W, stride)
    return out.reshape((B, Ho, Wo) + tuple(out.shape[1:]))


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------

class QnACall(NamedTuple):
    """What backend selection needs to know about a qna2d call (hashable, cached)."""
    device: str  # the torch device with its index ("cuda:1", "cpu"): support is per device
    dtype: torch.dtype
    kernel_size: int
    stride: int
    sum_queries: bool
    grad: bool
    head_dim: int = 0
    wide: bool = False  # beyond the kernels' offsets (kernels.wide_offsets)


def _natten_limits(call: QnACall) -> Optional[str]:
    return "NATTEN cannot express QnA"


def _natten_support(call: QnACall) -> Optional[str]:
    return (f"{_natten_limits(call)}: its neighborhood attention has one query per pixel and "
            "windows shifted inside the map, while QnA's learned queries are shared by every "
            "window, its out-of-bounds keys are excluded, its windows can be strided and its "
            "per-query results are weighted by window_weights and summed")


def _cuda_support(call: QnACall) -> Optional[str]:
    reason = kernels.triton_missing()
    if reason is not None:
        return reason
    from ..kernels import qna as kernel
    return kernels.joined(kernel.support(call.device, call.dtype, call.head_dim),
                          kernel.LIMITS.offsets_reason() if call.wide else None)


def _cuda_limits(call: QnACall) -> Optional[str]:
    """The kernels' limits that the call alone decides (unchecked without Triton, which their
    module needs; ``support`` then refuses)."""
    if kernels.triton_missing() is not None:
        return None
    from ..kernels import qna as kernel
    return "; ".join(kernel.call_reasons(call.dtype, call.head_dim)) or None


def _qna_cuda(logits, v, rpb, window_weights, kernel_size, stride, sum_queries):
    # (imported by _cuda_support, as neighborhood._na_cuda says)
    return kernels.qna.qna_fused(logits, v, rpb, window_weights, kernel_size, stride,
                                 sum_queries)


def _kernels_trusted(call: QnACall) -> Optional[str]:
    """``auto`` runs the QnA kernels only where a verification record covers the call's GPU
    architecture, dtype and Triton (:func:`attnzoo.kernels.verified`); ``backend="cuda"``
    always runs them."""
    return kernels.unverified("qna", call.device, call.dtype,
                              "the cuda QnA kernels")


def _qna_macs(logits, v, rpb, window_weights, kernel_size, stride, sum_queries) -> int:
    """The window sums of the convolution form, numerator and denominator:
    ``B * H_out * W_out * L * heads * (head_dim + 1) * k * k``."""
    B, H, W, L, h = logits.shape
    return (B * _out_size(H, stride) * _out_size(W, stride) * L * h * (v.shape[-1] + 1)
            * kernel_size ** 2)


def _examples(device, dtype):
    """qna_vit_tiny's QnA layers at 224 px, batch 8 (heads of dim 8, two queries, k = 3; the
    downsampling layers stride 2 with twice the heads), its 7x7 variant's stage 0, the paper's
    Figure 3 setting (one 256 x 256 x 64 map, k = 7), and the largest head dim the cuda
    backend takes (its kernels' register bound: scripts/compile_kernels.py)."""
    cases = [(f"qna_vit_tiny s{i} 8x{56 >> i}x{56 >> i} h{8 << i} k3",
              (8, 56 >> i, 56 >> i), 8 << i, 8, 3, 1) for i in range(3)]
    cases += [(f"qna_vit_tiny down{i} 8x{56 >> i}x{56 >> i} h{16 << i} k3 s2",
               (8, 56 >> i, 56 >> i), 16 << i, 8, 3, 2) for i in range(3)]
    cases += [("qna_vit_tiny_7x7 s0 8x56x56 h8 k7", (8, 56, 56), 8, 8, 7, 1),
              ("figure 3 1x256x256 h8 k7", (1, 256, 256), 8, 8, 7, 1),
              ("head dim 256 1x28x28 h2 k7", (1, 28, 28), 2, 256, 7, 1)]

    out = []
    for label, bhw, heads, d, k, stride in cases:
        def run(backend, bhw=bhw, heads=heads, d=d, k=k, stride=stride):
            new = lambda *shape: torch.randn(shape, device=device, dtype=dtype,  # noqa: E731
                                             requires_grad=True)
            return qna2d(new(*bhw, 2, heads), new(*bhw, heads, d), kernel_size=k, stride=stride,
                         rpb=new(2, heads, k, k), window_weights=new(2, heads, k, k),
                         backend=backend)
        out.append((label, run))
    return out


# Check cases: (label, (B, H, W, L, heads, head_dim), k, stride, sum_queries, rpb and window
# weights, logit scale). Between them: odd and non-square maps, stride 2 on even and odd sizes,
# windows larger than the map, unsummed queries, the defaults (no rpb, no window weights), and
# logits wide enough for float32 to take the per-window form.
_CASES = [
    ("2x7x9 L2 h3 k3", (2, 7, 9, 2, 3, 4), 3, 1, True, True, 1.),
    ("8x5 L1 h1 k3 s2", (1, 8, 5, 1, 1, 3), 3, 2, True, True, 1.),
    ("6x7 L2 k5 s2 unsummed", (1, 6, 7, 2, 2, 3), 5, 2, False, True, 1.),
    ("5x6 k7>map defaults", (1, 5, 6, 2, 2, 2), 7, 1, True, False, 1.),
    ("7x8 k3 s2 logits x20", (1, 7, 8, 2, 2, 3), 3, 2, True, True, 20.),
]


def _cases(device, dtype):
    out = []
    for label, (B, H, W, L, h, d), k, stride, sum_queries, bias, scale in _CASES:
        shapes = [(B, H, W, L, h), (B, H, W, h, d)] + [(L, h, k, k)] * (2 if bias else 0)
        logits, *rest = backends.case_inputs(shapes, device, dtype)

        def call(logits, v, rpb=None, window_weights=None, *, backend, k=k, stride=stride,
                 sum_queries=sum_queries):
            return qna2d(logits, v, kernel_size=k, stride=stride, rpb=rpb,
                         window_weights=window_weights, sum_queries=sum_queries,
                         backend=backend)
        out.append(backends.Case(label, (logits * scale, *rest), call))
    return out


backends.register_op(
    "qna2d", key_type=QnACall, macs=_qna_macs, examples=_examples, cases=_cases,
    export=qna2d_export, backends={"torch": backends.Backend(qna2d_reference),
              "natten": backends.Backend(qna2d_reference, _natten_support,
                                         limits=_natten_limits),
              "cuda": backends.Backend(_qna_cuda, _cuda_support, _kernels_trusted,
                                       _cuda_limits)})


# --------------------------------------------------------------------------------------------
# public op
# --------------------------------------------------------------------------------------------

def _check_int(value, name: str, odd: bool = False, fn: str = "qna2d") -> int:
    """``value`` as an int (NumPy integers too), checked."""
    value, given = as_int(value), value
    if value is None:
        raise TypeError(f"{fn}: {name} must be an int, got {given!r}")
    if value < 1 or (odd and value % 2 == 0):
        raise ValueError(f"{fn}: {name} must be {'an odd int' if odd else 'an int'} >= 1, "
                         f"got {value}")
    return value


def _check_call(logits, v, kernel_size, stride, rpb, window_weights, sum_queries) -> None:
    for name, t, layout in (("logits", logits, "[B, H, W, L, heads]"),
                            ("v", v, "[B, H, W, heads, head_dim]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"qna2d: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 5:
            raise ValueError(f"qna2d: {name} must be 5-D {layout}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"qna2d: {name} must be a floating-point tensor, got {t.dtype}")
    if logits.shape[:3] != v.shape[:3] or logits.shape[4] != v.shape[3]:
        raise ValueError(f"qna2d: logits [B, H, W, L, heads] and v [B, H, W, heads, head_dim] "
                         f"must agree on B, H, W and heads; got logits {tuple(logits.shape)}, "
                         f"v {tuple(v.shape)}")
    if 0 in logits.shape[1:] or v.shape[-1] == 0:
        raise ValueError(f"qna2d: only the batch may be empty (H, W, L, heads and head_dim "
                         f">= 1); got logits {tuple(logits.shape)}, v {tuple(v.shape)}")
    if logits.dtype != v.dtype or logits.device != v.device:
        raise ValueError(f"qna2d: logits and v must share dtype and device; got "
                         f"{logits.dtype}/{v.dtype} on {logits.device}/{v.device}")
    _check_int(kernel_size, "kernel_size", odd=True)
    _check_int(stride, "stride")
    if not isinstance(sum_queries, bool):
        raise TypeError(f"qna2d: sum_queries must be a bool, got {sum_queries!r}")
    expected = (logits.shape[3], logits.shape[4], kernel_size, kernel_size)
    for name, t in (("rpb", rpb), ("window_weights", window_weights)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"qna2d: {name} must be a floating-point torch.Tensor or None, "
                            f"got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != expected:
            raise ValueError(f"qna2d: {name} must have shape [L, heads, k, k] = {expected}, "
                             f"got {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"qna2d: {name} is on {t.device} but logits are on {logits.device}")


def qna2d(logits: torch.Tensor, v: torch.Tensor, *, kernel_size: int, stride: int = 1,
          rpb: Optional[torch.Tensor] = None, window_weights: Optional[torch.Tensor] = None,
          sum_queries: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """QnA's local aggregation with learned queries (see the module docstring).

    Args:
        logits: ``[B, H, W, L, heads]``, each learned query's score against the key at every
            position (QnA: ``q_hat[l, h] . k[b, y, x, h]``, best computed fused as
            ``x @ (W_k q_hat)``, which never builds the keys).
        v: values ``[B, H, W, heads, head_dim]`` (same dtype and device as ``logits``).
        kernel_size: odd window size k (square windows centred on the output position).
        stride: window stride; the output is ``ceil(H / stride) x ceil(W / stride)``.
        rpb: relative bias ``[L, heads, k, k]`` added to the logits per window offset
            (``None``: zero).
        window_weights: ``[L, heads, k, k]``, multiply each query's softmax weights per window
            offset in the numerator only (``None``: ones, each query a plain softmax average).
        sum_queries: sum the ``L`` per-query results (QnA) or return them separately
            (QnA upsampling).
        backend: one of :data:`attnzoo.backends.BACKENDS` (``natten`` cannot express QnA and
            raises :class:`~attnzoo.BackendUnsupportedError`); ``None`` follows
            :func:`attnzoo.use_backend` / :func:`attnzoo.set_backend` / ``ATTNZOO_BACKEND``.

    Returns:
        ``[B, H_out, W_out, heads, head_dim]``, or ``[B, H_out, W_out, L, heads, head_dim]``
        with ``sum_queries=False``; in ``v``'s dtype.
    """
    if type(kernel_size) is not int or type(stride) is not int:  # NumPy integers as ints
        kernel_size, stride = plain_int(kernel_size), plain_int(stride)

    def check():  # once per call metadata: the call's keys without and with gradients, and
        # whether a tensor is empty
        _check_call(logits, v, kernel_size, stride, rpb, window_weights, sum_queries)
        _, H, W, L = logits.shape[:4]  # an output sample: [Ho, Wo, (L,) heads, head_dim]
        out = -(-H // stride) * -(-W // stride) * (1 if sum_queries else L) * math.prod(v.shape[3:])
        wide = kernels.wide_offsets(logits, v, elements=out)
        return tuple(QnACall(str(v.device), v.dtype, kernel_size, stride, sum_queries, grad,
                             v.shape[-1], wide) for grad in (False, True)), (
            logits.numel() == 0 or v.numel() == 0)

    tensors = backends.tensors_key(logits, v, rpb, window_weights)
    key = None  # (exact types: a bool equals an int)
    if type(kernel_size) is int and type(stride) is int and type(sum_queries) is bool \
            and tensors is not None:
        key = ("qna2d", kernel_size, stride, sum_queries, tensors)
    calls, empty = backends.checked_once(key, check)
    grad = torch.is_grad_enabled() and (
        logits.requires_grad or v.requires_grad or rpb is not None and rpb.requires_grad
        or window_weights is not None and window_weights.requires_grad)
    return backends.dispatch("qna2d", calls[grad], backend, logits, v, rpb, window_weights,
                             kernel_size, stride, sum_queries, empty=empty)


def qna2d_weights(logits: torch.Tensor, *, kernel_size: int, stride: int = 1,
                  rpb: Optional[torch.Tensor] = None) -> torch.Tensor:
    """QnA's attention weights, unfused: each learned query's softmax over each window,
    ``[B, H_out, W_out, L, heads, k*k]`` in ``logits``' dtype (computed in float32 for half
    precision, as :func:`qna2d`). Entry ``t = a * k + b`` is window offset ``(a, b)``, the key at
    :func:`qna_window_positions`; keys outside the map get 0, so each query's weights sum to 1
    over its window. :func:`qna2d` multiplies them by ``window_weights`` and sums each window's
    values with them (torch only: inspection, not a backend-dispatched op)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 5:
        raise ValueError("qna2d_weights: logits must be a 5-D tensor [B, H, W, L, heads], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else logits!r}")
    probe = logits.new_empty((*logits.shape[:3], logits.shape[4], 1))
    _check_call(logits, probe, kernel_size, stride, rpb, None, True)
    B, L, h, k = logits.shape[0], logits.shape[3], logits.shape[4], kernel_size
    Ho, Wo = _out_size(logits.shape[1], stride), _out_size(logits.shape[2], stride)
    p = _window_softmax(logits, rpb, k, stride, _compute_dtype(logits.dtype))
    return p.reshape(B, L, h, k * k, Ho, Wo).permute(0, 4, 5, 1, 2, 3).to(logits.dtype)


def qna_window_positions(H: int, W: int, *, kernel_size: int, stride: int = 1,
                         device: Optional[torch.device] = None) -> torch.Tensor:
    """``[H_out, W_out, k*k, 2]`` int64: the ``(y, x)`` of each window's keys on the ``H x W``
    map, in :func:`qna2d_weights`' order; positions outside the map (a window at the border)
    are kept, with weight 0."""
    H, W, stride = (_check_int(value, name, fn="qna_window_positions")
                    for name, value in (("H", H), ("W", W), ("stride", stride)))
    k = _check_int(kernel_size, "kernel_size", odd=True, fn="qna_window_positions")
    r = (k - 1) // 2
    ys = torch.arange(_out_size(H, stride), device=device) * stride - r
    xs = torch.arange(_out_size(W, stride), device=device) * stride - r
    offsets = torch.arange(k, device=device)
    y = (ys.view(-1, 1, 1, 1) + offsets.view(1, 1, k, 1)).expand(-1, len(xs), k, k)
    x = (xs.view(1, -1, 1, 1) + offsets.view(1, 1, 1, k)).expand(len(ys), -1, k, k)
    return torch.stack([y, x], -1).reshape(len(ys), len(xs), k * k, 2)
