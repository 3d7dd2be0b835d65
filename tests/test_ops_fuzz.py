"""Fuzz test of the ops' argument validation: random calls of every public op (shapes, dtypes,
kernel sizes, dilations, strides, devices, backends, non-contiguous, channels_last and expanded
inputs), each built from a valid call and 0-2 mutations of known effect. A call whose mutations
are all valid must equal the float64 torch reference on the same values (contiguous, on the
CPU), forward and, for float32/float64, backward; a call with an invalid mutation must raise a
``ValueError`` or ``TypeError`` whose message names a mutated argument. Anything else (another
exception, an invalid call that returns, a wrong result) fails, printing the case's seed.

Expected validity comes from the ops' documented contracts (the docstrings of
``attnzoo.ops``), written here independently of their checks. The default tier runs
``DEFAULT_CASES`` calls from a fixed seed; ``-m slow`` runs ``SLOW_CASES`` more
(``ATTNZOO_FUZZ_SEED`` picks another seed).
"""
from __future__ import annotations

import collections
import os
import random
import re
from typing import Callable, Dict, List, NamedTuple, Tuple

import pytest
import torch

from attnzoo.ops import (na1d, na1d_av, na1d_qk, na2d, na2d_av, na2d_qk, qna2d, san_aggregation,
                         san_neighbours, san_subtraction, san_subtraction2)

DEFAULT_CASES = 600
SLOW_CASES = 20000

# max |got - ref| / max(1, max |ref|) per dtype of the call (the torch reference computes half
# precision in its own dtype, or float32 for qna2d)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2,
             torch.bfloat16: 1e-1}
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FLOAT_WEIGHTS = (6, 2, 1, 1)


class Call(NamedTuple):
    """One fuzzed call: ``fn(*tensors, **kwargs)``; ``invalid``: the arguments an error must
    name (empty: the call is valid); ``maybe``: arguments a backend may refuse by name."""
    op: str
    fn: Callable
    tensors: List[object]
    kwargs: Dict[str, object]
    invalid: frozenset
    maybe: frozenset
    mutations: Tuple[str, ...]


# --------------------------------------------------------------------------------------------
# tensors: values, layouts, devices
# --------------------------------------------------------------------------------------------

def _layout(rng: random.Random, t: torch.Tensor) -> Tuple[torch.Tensor, str]:
    """``t``'s values in a random memory layout."""
    kind = rng.choices(["contiguous", "transposed", "channels_last", "sliced", "expanded"],
                       [5, 2, 2, 1, 1])[0]
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1), kind
    if kind == "channels_last" and t.dim() in (4, 5):
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        return t.contiguous(memory_format=fmt), kind
    if kind == "sliced" and t.dim() >= 1:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2], kind
    if kind == "expanded" and t.dim() >= 1 and t.shape[0] > 0:
        return t[:1].expand(t.shape), kind  # every batch entry the same values, stride 0
    return t, "contiguous"


def _tensor(rng: random.Random, shape, dtype: torch.dtype, layouts: collections.Counter
            ) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    t = torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)
    t, kind = _layout(rng, t)
    layouts[kind] += 1
    return t


# --------------------------------------------------------------------------------------------
# generators: a valid call of each op, then mutations
# --------------------------------------------------------------------------------------------

def _odd(rng: random.Random, most: int) -> int:
    return rng.choice([k for k in range(1, max(most, 1) + 1, 2)])


def _backend(rng: random.Random, mutations: list, invalid: set, maybe: set):
    choice = rng.choices(["none", "auto", "torch", "natten", "cuda", "bogus", "int"],
                         [6, 2, 2, 1, 1, 1, 1])[0]
    if choice in ("bogus", "int"):
        invalid.add("backend")
        mutations.append(f"backend {choice}")
        return "bogus" if choice == "bogus" else 3
    if choice in ("natten", "cuda"):
        maybe.add("backend")  # valid name; the backend may not run this call here
        mutations.append(f"backend {choice}")
    return {"none": None}.get(choice, choice)


def _bad_int(rng: random.Random, kwargs: dict, arg: str, mutations: list, invalid: set) -> None:
    """Give ``arg`` a value an int size argument must refuse (a bool, float, str, 3-tuple or
    None)."""
    kwargs[arg], label = rng.choice([(True, "bool"), (2.0, "float"), ("3", "str"),
                                     ((3, 3, 3), "3-tuple"), (None, "None")])
    mutations[-1] += f" {label}"
    invalid.add(arg)


def gen_na(rng: random.Random, n: int, layouts) -> Call:
    B = rng.choices([0, 1, 2], [1, 4, 3])[0]
    spatial = [rng.randint(1, 7) for _ in range(n)]
    heads, D = rng.randint(1, 3), rng.choice([1, 2, 4, 8, 3])
    E = D if rng.random() < 0.7 else rng.randint(1, 6)
    ks = [_odd(rng, L) for L in spatial]
    dil = [rng.randint(1, L // K) for L, K in zip(spatial, ks)]
    kernel = ks[0] if len(set(ks)) == 1 and rng.random() < 0.5 else tuple(ks)
    dilation = dil[0] if len(set(dil)) == 1 and rng.random() < 0.5 else tuple(dil)
    dtype = rng.choices(FLOATS, FLOAT_WEIGHTS)[0]
    shape_q = [B, *spatial, heads, D]
    shape_v = [B, *spatial, heads, E]
    use_rpb = rng.random() < 0.5
    rpb_shape = [heads, *(2 * K - 1 for K in ks)]
    kwargs = dict(kernel_size=kernel, dilation=dilation,
                  rpb=None, scale=rng.choice([None, None, 0.5, 1]))
    mutations, invalid, maybe = [], set(), set()
    kwargs["backend"] = _backend(rng, mutations, invalid, maybe)
    names = ["q", "k", "v"]
    shapes = {"q": shape_q, "k": list(shape_q), "v": shape_v}
    dtypes = {name: dtype for name in names}
    for _ in range(rng.choices([0, 1, 2], [5, 4, 1])[0]):
        m = rng.choice(["ndim", "mismatch", "int_dtype", "mixed_dtype", "kernel_even",
                        "kernel_type", "kernel_big", "dilation_zero", "dilation_big",
                        "dilation_type", "rpb_shape", "rpb_type", "rpb_int", "scale_type",
                        "head_dim_zero", "not_tensor"])
        mutations.append(m)
        name = rng.choice(names)
        if m == "ndim":
            shapes[name] = shapes[name] + [1] if rng.random() < 0.5 else shapes[name][1:]
            invalid.add(name)
        elif m == "mismatch":
            shapes["k"] = [shapes["k"][0], *(s + 1 for s in shapes["k"][1:1 + n]),
                           *shapes["k"][1 + n:]]
            invalid.update(("q", "k"))
        elif m == "int_dtype":
            dtypes[name] = rng.choice([torch.int32, torch.bool])
            invalid.add(name)
        elif m == "mixed_dtype":
            dtypes[name] = next(d for d in FLOATS if d != dtype)
            invalid.update(names)
        elif m == "kernel_even":
            kwargs["kernel_size"] = rng.choice([0, -1, 2, 4])
            invalid.add("kernel_size")
        elif m in ("kernel_type", "dilation_type"):
            _bad_int(rng, kwargs, "kernel_size" if m == "kernel_type" else "dilation", mutations,
                     invalid)
        elif m == "kernel_big":
            kwargs["kernel_size"] = 2 * (max(spatial) // 2) + 3  # odd, > every axis
            invalid.add("kernel_size")
        elif m == "dilation_zero":
            kwargs["dilation"] = rng.choice([0, -2])
            invalid.add("dilation")
        elif m == "dilation_big":
            kwargs["dilation"] = max(spatial) + 1
            invalid.update(("dilation", "kernel_size"))
        elif m == "rpb_shape":
            use_rpb = True
            rpb_shape = rng.choice([[heads + 1, *rpb_shape[1:]], rpb_shape[:-1],
                                    [heads, *(s + 2 for s in rpb_shape[1:])]])
            invalid.add("rpb")
        elif m == "rpb_type":
            kwargs["rpb"] = [[0.0]]
            use_rpb = False
            invalid.add("rpb")
        elif m == "rpb_int":
            use_rpb = "int"
            invalid.add("rpb")
        elif m == "scale_type":
            kwargs["scale"] = rng.choice(["0.5", True, [0.5]])
            invalid.add("scale")
        elif m == "head_dim_zero":
            shapes["q"][-1] = shapes["k"][-1] = 0
            invalid.update(("q", "head_dim"))
        elif m == "not_tensor":
            invalid.add(name)
            dtypes[name] = None
    tensors = [_tensor(rng, shapes[nm], dtypes[nm], layouts) if dtypes[nm] is not None
               else shapes[nm] for nm in names]
    if use_rpb:
        rpb = _tensor(rng, rpb_shape, torch.float32 if use_rpb is True and rng.random() < 0.3
                      else dtype, layouts)
        kwargs["rpb"] = rpb.to(torch.int32) if use_rpb == "int" else rpb
    return Call(f"na{n}d", na1d if n == 1 else na2d, tensors, kwargs, frozenset(invalid),
                frozenset(maybe), tuple(mutations))


UNFUSED = {"na1d_qk": na1d_qk, "na2d_qk": na2d_qk, "na1d_av": na1d_av, "na2d_av": na2d_av}


def gen_unfused(rng: random.Random, op: str, layouts) -> Call:
    """``na{n}d_qk(q, k, ...)`` or ``na{n}d_av(attn, v, ...)``: valid per NATTEN 0.17's
    contract (odd kernels with ``K * d <= L``, ``attn [B, *spatial, heads, K**n]``), then 0-2
    mutations."""
    n, step = int(op[2]), op[-2:]
    B = rng.choices([0, 1, 2], [1, 4, 3])[0]
    spatial = [rng.randint(1, 7) for _ in range(n)]
    heads, D = rng.randint(1, 3), rng.choice([1, 2, 4, 3])
    ks = [_odd(rng, L) for L in spatial]
    dil = [rng.randint(1, L // K) for L, K in zip(spatial, ks)]
    kwargs = dict(kernel_size=tuple(ks), dilation=tuple(dil))
    dtype = rng.choices(FLOATS, FLOAT_WEIGHTS)[0]
    names = ["q", "k"] if step == "qk" else ["attn", "v"]
    taps = 1
    for K in ks:
        taps *= K
    shapes = {"q": [B, *spatial, heads, D], "k": [B, *spatial, heads, D],
              "attn": [B, *spatial, heads, taps], "v": [B, *spatial, heads, D]}
    dtypes = {name: dtype for name in names}
    rpb = step == "qk" and rng.random() < 0.5
    rpb_shape = [heads, *(2 * K - 1 for K in ks)]
    mutations, invalid, maybe = [], set(), set()
    kwargs["backend"] = _backend(rng, mutations, invalid, maybe)
    choices = ["ndim", "mismatch", "int_dtype", "mixed_dtype", "kernel_even", "kernel_type",
               "kernel_big", "dilation_zero", "dilation_type", "not_tensor"]
    choices += ["rpb_shape"] if step == "qk" else ["taps"]
    for _ in range(rng.choices([0, 1, 2], [5, 4, 1])[0]):
        m = rng.choice(choices)
        mutations.append(m)
        name = rng.choice(names)
        if m == "ndim":
            shapes[name] = shapes[name] + [1]
            invalid.add(name)
        elif m == "mismatch":
            shapes[names[1]] = [shapes[names[1]][0], *(s + 1 for s in shapes[names[1]][1:1 + n]),
                                *shapes[names[1]][1 + n:]]
            invalid.update(names)
        elif m == "int_dtype":
            dtypes[name] = torch.int32
            invalid.add(name)
        elif m == "mixed_dtype":
            dtypes[names[1]] = next(d for d in FLOATS if d != dtype)
            invalid.update(names)
        elif m == "kernel_even":
            kwargs["kernel_size"] = rng.choice([0, -1, 2])
            invalid.update(("kernel_size", "attn"))
        elif m in ("kernel_type", "dilation_type"):
            _bad_int(rng, kwargs, "kernel_size" if m == "kernel_type" else "dilation", mutations,
                     invalid)
        elif m == "kernel_big":
            kwargs["kernel_size"] = 2 * (max(spatial) // 2) + 3
            invalid.update(("kernel_size", "attn"))
        elif m == "dilation_zero":
            kwargs["dilation"] = 0
            invalid.add("dilation")
        elif m == "not_tensor":
            dtypes[name] = None
            invalid.add(name)
        elif m == "rpb_shape":
            rpb, rpb_shape = True, [heads + 1, *rpb_shape[1:]]
            invalid.add("rpb")
        elif m == "taps":
            shapes["attn"][-1] += 1
            invalid.add("attn")
    tensors = [_tensor(rng, shapes[nm], dtypes[nm], layouts) if dtypes[nm] is not None
               else shapes[nm] for nm in names]
    if rpb:
        kwargs["rpb"] = _tensor(rng, rpb_shape, dtype, layouts)
    return Call(op, UNFUSED[op], tensors, kwargs, frozenset(invalid), frozenset(maybe),
                tuple(mutations))


def gen_qna(rng: random.Random, layouts) -> Call:
    B, H, W = rng.choices([0, 1, 2], [1, 4, 3])[0], rng.randint(1, 6), rng.randint(1, 6)
    L, heads, d = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 5)
    k, stride = _odd(rng, 7), rng.randint(1, 3)
    dtype = rng.choices(FLOATS, FLOAT_WEIGHTS)[0]
    shapes = {"logits": [B, H, W, L, heads], "v": [B, H, W, heads, d],
              "rpb": [L, heads, k, k], "window_weights": [L, heads, k, k]}
    kwargs = dict(kernel_size=k, stride=stride, sum_queries=rng.random() < 0.7)
    mutations, invalid, maybe = [], set(), set()
    kwargs["backend"] = _backend(rng, mutations, invalid, maybe)
    extras = [nm for nm in ("rpb", "window_weights") if rng.random() < 0.5]
    dtypes = {nm: dtype for nm in shapes}
    for _ in range(rng.choices([0, 1, 2], [5, 4, 1])[0]):
        m = rng.choice(["ndim", "heads", "int_dtype", "mixed_dtype", "kernel_even",
                        "kernel_type", "stride_zero", "stride_type", "extra_shape",
                        "extra_int", "sum_queries_type", "not_tensor"])
        mutations.append(m)
        name = rng.choice(["logits", "v"])
        if m == "ndim":
            shapes[name] = shapes[name][1:]
            invalid.add(name)
        elif m == "heads":
            shapes["v"][3] += 1
            invalid.update(("logits", "v"))
        elif m == "int_dtype":
            dtypes[name] = torch.int64
            invalid.add(name)
        elif m == "mixed_dtype":
            dtypes["v"] = next(t for t in FLOATS if t != dtype)
            invalid.update(("logits", "v"))
        elif m == "kernel_even":
            kwargs["kernel_size"] = rng.choice([0, 2, -3])
            invalid.add("kernel_size")
        elif m in ("kernel_type", "stride_type"):
            _bad_int(rng, kwargs, "kernel_size" if m == "kernel_type" else "stride", mutations,
                     invalid)
        elif m == "stride_zero":
            kwargs["stride"] = rng.choice([0, -1])
            invalid.add("stride")
        elif m in ("extra_shape", "extra_int"):
            extra = rng.choice(["rpb", "window_weights"])
            if extra not in extras:
                extras.append(extra)
            if m == "extra_shape":
                shapes[extra] = [shapes[extra][0] + 1, *shapes[extra][1:]]
            else:
                dtypes[extra] = torch.int64
            invalid.add(extra)
        elif m == "sum_queries_type":
            kwargs["sum_queries"] = rng.choice([1, "yes", None])
            invalid.add("sum_queries")
        elif m == "not_tensor":
            dtypes[name] = None
            invalid.add(name)
    if "kernel_size" in invalid:  # the extras' shapes follow a valid kernel only
        extras = [e for e in extras if e in invalid]
    tensors = [_tensor(rng, shapes[nm], dtypes[nm], layouts) if dtypes[nm] is not None
               else shapes[nm] for nm in ("logits", "v")]
    for extra in extras:
        kwargs[extra] = _tensor(rng, shapes[extra], dtypes[extra], layouts)
    return Call("qna2d", qna2d, tensors, kwargs, frozenset(invalid), frozenset(maybe),
                tuple(mutations))


SAN_OPS = {"san_subtraction": (san_subtraction, ("x",)),
           "san_subtraction2": (san_subtraction2, ("x1", "x2")),
           "san_aggregation": (san_aggregation, ("x", "weight")),
           "san_neighbours": (san_neighbours, ("x",))}


def gen_san(rng: random.Random, op: str, layouts) -> Call:
    fn, names = SAN_OPS[op]
    N, C, H, W = rng.choices([0, 1, 2], [1, 4, 3])[0], rng.randint(1, 6), rng.randint(1, 7), \
        rng.randint(1, 7)
    padding_mode = rng.choice(["reflect", "zeros"])
    kh, kw = _odd(rng, 5), _odd(rng, 5)
    dh, dw = rng.randint(1, 2), rng.randint(1, 2)
    if padding_mode == "reflect":  # reflection needs d * (k - 1) / 2 < the map, per axis
        kh, kw = (k if dd * (k - 1) // 2 < L else 1 for k, dd, L in ((kh, dh, H), (kw, dw, W)))
    stride = (rng.randint(1, 3), rng.randint(1, 3))
    kwargs = dict(kernel_size=(kh, kw) if kh != kw or rng.random() < 0.5 else kh,
                  dilation=(dh, dw) if dh != dw or rng.random() < 0.5 else dh,
                  stride=stride if stride[0] != stride[1] else stride[0],
                  padding_mode=padding_mode)
    mutations, invalid, maybe = [], set(), set()
    if op != "san_neighbours":
        kwargs["backend"] = _backend(rng, mutations, invalid, maybe)
    Ho, Wo = -(-H // stride[0]), -(-W // stride[1])
    Cw = rng.choice([c for c in range(1, C + 1) if C % c == 0])
    shapes = {"x": [N, C, H, W], "x1": [N, C, H, W], "x2": [N, C, H, W],
              "weight": [N, Cw, kh * kw, Ho * Wo]}
    dtype = rng.choices(FLOATS, FLOAT_WEIGHTS)[0]
    dtypes = {nm: dtype for nm in shapes}
    for _ in range(rng.choices([0, 1, 2], [5, 4, 1])[0]):
        m = rng.choice(["ndim", "int_dtype", "kernel_even", "kernel_type", "dilation_zero",
                        "stride_zero", "padding_mode", "reflect_small", "not_tensor"]
                       + (["mismatch", "mixed_dtype"] if len(names) == 2 else []))
        mutations.append(m)
        name = rng.choice(names)
        if m == "ndim":
            shapes[name] = shapes[name][1:]
            invalid.add(name)
        elif m == "int_dtype":
            dtypes[name] = torch.int64
            invalid.add(name)
        elif m == "kernel_even":
            kwargs["kernel_size"] = rng.choice([0, 2, (3, 4)])
            invalid.add("kernel_size")
        elif m == "kernel_type":
            _bad_int(rng, kwargs, "kernel_size", mutations, invalid)
        elif m == "dilation_zero":
            kwargs["dilation"] = rng.choice([0, (1, -1)])
            invalid.add("dilation")
        elif m == "stride_zero":
            kwargs["stride"] = rng.choice([0, (0, 1)])
            invalid.add("stride")
        elif m == "padding_mode":
            kwargs["padding_mode"] = rng.choice(["circular", "REFLECT", None])
            invalid.add("padding_mode")
        elif m == "reflect_small":
            kwargs["padding_mode"], kwargs["kernel_size"] = "reflect", 2 * max(H, W) + 1
            kwargs["dilation"] = 1
            invalid.update(("kernel_size", "padding_mode"))
        elif m == "mismatch":
            shapes[names[1]] = [*shapes[names[1]][:-1], shapes[names[1]][-1] + 1]
            invalid.update(names)
        elif m == "mixed_dtype":
            dtypes[names[1]] = next(t for t in FLOATS if t != dtype)
            invalid.update(names)
        elif m == "not_tensor":
            dtypes[name] = None
            invalid.add(name)
    tensors = [_tensor(rng, shapes[nm], dtypes[nm], layouts) if dtypes[nm] is not None
               else shapes[nm] for nm in names]
    return Call(op, fn, tensors, kwargs, frozenset(invalid), frozenset(maybe), tuple(mutations))


def generate(rng: random.Random, layouts) -> Call:
    op = rng.choice(["na1d", "na2d", "na2d", "qna2d", *SAN_OPS, *UNFUSED])
    if op in UNFUSED:
        call = gen_unfused(rng, op, layouts)
    elif op.startswith("na"):
        call = gen_na(rng, int(op[2]), layouts)
    elif op == "qna2d":
        call = gen_qna(rng, layouts)
    else:
        call = gen_san(rng, op, layouts)
    if not call.invalid and rng.random() < 0.1:  # every tensor on the meta device: shapes only
        call = call._replace(tensors=[t.to("meta") for t in call.tensors], mutations=(
            *call.mutations, "meta"), kwargs={k: v.to("meta") if isinstance(v, torch.Tensor)
                                              else v for k, v in call.kwargs.items()})
    elif not call.invalid and len(call.tensors) > 1 and rng.random() < 0.05:
        # one tensor elsewhere: the error names it
        i = rng.randrange(len(call.tensors))
        tensors = list(call.tensors)
        tensors[i] = tensors[i].to("meta")
        names = ["q", "k"] if call.op.endswith("qk") else ["attn", "v"] if call.op.endswith(
            "av") else ["q", "k", "v"] if call.op.startswith("na") else (
            ["logits", "v"] if call.op == "qna2d" else list(SAN_OPS[call.op][1]))
        call = call._replace(tensors=tensors, invalid=frozenset(names + ["device"]),
                             mutations=(*call.mutations, f"{names[i]} on meta"))
    return call


# --------------------------------------------------------------------------------------------
# running a call
# --------------------------------------------------------------------------------------------

def _reference(call: Call, tensors, kwargs):
    """The op on float64 contiguous CPU copies, on the torch reference backend."""
    kwargs = {k: v.detach().to("cpu", torch.float64).contiguous()
              if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if "backend" in kwargs:
        kwargs["backend"] = "torch"
    return call.fn(*(t.detach().to("cpu", torch.float64).contiguous() for t in tensors),
                   **kwargs)


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    ref = ref.detach()
    return float((got.detach().double() - ref).abs().max()) / max(1.0, float(ref.abs().max()))


def _differentiable(call: Call):
    """The call's float tensors made leaves that require grad (float32/float64 on the CPU)."""
    tensors = [t.detach().requires_grad_() for t in call.tensors]
    kwargs = {k: v.detach().requires_grad_() if isinstance(v, torch.Tensor) else v
              for k, v in call.kwargs.items()}
    return tensors, kwargs


def run_call(call: Call, seed: int) -> str:
    """Run one call and check its outcome; returns ``'ok'``, ``'rejected'`` or ``'refused'``
    (a backend refused a valid call by name)."""
    where = f"case seed {seed}: {call.op} mutations {list(call.mutations)}"
    dtype = next((t.dtype for t in call.tensors if isinstance(t, torch.Tensor)), None)
    grad = (not call.invalid and dtype in (torch.float32, torch.float64)
            and all(t.device.type == "cpu" for t in call.tensors))
    tensors, kwargs = _differentiable(call) if grad else (call.tensors, call.kwargs)
    try:
        out = call.fn(*tensors, **kwargs)
    except (ValueError, TypeError) as e:
        names = call.invalid or call.maybe
        assert names, f"{where}: a valid call raised {type(e).__name__}: {e}"
        assert any(re.search(rf"\b{name}\b", str(e)) for name in names), (
            f"{where}: {type(e).__name__} names none of {sorted(names)}: {e}")
        return "rejected" if call.invalid else "refused"
    except Exception as e:  # noqa: BLE001 - the finding this test exists for
        pytest.fail(f"{where}: {type(e).__name__} instead of a ValueError/TypeError: {e}")
    assert not call.invalid, f"{where}: an invalid call returned (should name " \
                             f"{sorted(call.invalid)})"
    if out.device.type == "meta":
        ref = _reference(call, [torch.zeros(t.shape, dtype=t.dtype) for t in tensors],
                         {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor)
                          else v for k, v in kwargs.items()})
        assert out.shape == ref.shape and out.dtype == dtype, where
        return "ok"
    ref_inputs = _differentiable(call._replace(
        tensors=[t.detach().double() for t in call.tensors],
        kwargs={k: v.detach().double() if isinstance(v, torch.Tensor) else v
                for k, v in call.kwargs.items()}))
    ref = _reference(call, *ref_inputs) if not grad else call.fn(
        *ref_inputs[0], **{**ref_inputs[1], **({"backend": "torch"}
                                              if "backend" in ref_inputs[1] else {})})
    assert out.shape == ref.shape, f"{where}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == dtype, f"{where}: dtype {out.dtype} != the inputs' {dtype}"
    err = _error(out, ref)
    assert err <= TOLERANCE[dtype], f"{where}: forward error {err:.2e} > {TOLERANCE[dtype]}"
    if grad:
        weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64)
        leaves = [t for t in [*tensors, *kwargs.values()] if isinstance(t, torch.Tensor)]
        ref_leaves = [t for t in [*ref_inputs[0], *ref_inputs[1].values()]
                      if isinstance(t, torch.Tensor)]
        grads = torch.autograd.grad(out, leaves, weight.to(out.dtype), allow_unused=True)
        ref_grads = torch.autograd.grad(ref, ref_leaves, weight, allow_unused=True)
        for g, r in zip(grads, ref_grads):
            assert (g is None) == (r is None), f"{where}: gradient presence differs"
            if g is not None:
                e = _error(g, r)  # a gradient in its leaf's dtype: rpb's may be float32
                assert e <= TOLERANCE[g.dtype], f"{where}: backward error {e:.2e}"
    return "ok"


def fuzz(cases: int, seed: int) -> Dict[str, collections.Counter]:
    """Run ``cases`` calls from ``seed``; the distribution of what ran and how it ended."""
    stats = collections.defaultdict(collections.Counter)
    for i in range(cases):
        case_seed = seed * 1_000_003 + i
        rng = random.Random(case_seed)
        call = generate(rng, stats["layout"])
        outcome = run_call(call, case_seed)
        stats["op"][call.op] += 1
        stats["outcome"][outcome] += 1
        stats[f"outcome {call.op}"][outcome] += 1
        for m in call.mutations or ("none",):
            stats["mutation"][m.split(" ")[0] if m.startswith("backend") else m] += 1
        first = next((t for t in call.tensors if isinstance(t, torch.Tensor)), None)
        if first is not None:
            stats["dtype"][str(first.dtype).replace("torch.", "")] += 1
            stats["device"][first.device.type] += 1
            stats["batch"]["0" if first.dim() and first.shape[0] == 0 else ">0"] += 1
    return stats


def _report(stats) -> str:
    return "\n".join(f"{key}: {dict(sorted(counter.items()))}" for key, counter in
                     sorted(stats.items()))


def test_fuzzed_op_calls_are_correct_or_name_the_bad_argument():
    stats = fuzz(DEFAULT_CASES, int(os.environ.get("ATTNZOO_FUZZ_SEED", 0)))
    print(f"\n{DEFAULT_CASES} fuzzed op calls\n{_report(stats)}")
    # the generator covers what it claims: every op, valid and invalid calls, every layout
    assert set(stats["op"]) == {"na1d", "na2d", "qna2d", *SAN_OPS, *UNFUSED}
    assert stats["outcome"]["ok"] > DEFAULT_CASES // 4
    assert stats["outcome"]["rejected"] > DEFAULT_CASES // 4
    assert set(stats["layout"]) == {"contiguous", "transposed", "channels_last", "sliced",
                                    "expanded"}
    assert stats["device"]["meta"] and stats["batch"]["0"]


@pytest.mark.slow
def test_many_more_fuzzed_op_calls():
    seed = int(os.environ.get("ATTNZOO_FUZZ_SEED", 1))
    stats = fuzz(SLOW_CASES, seed)
    print(f"\n{SLOW_CASES} fuzzed op calls (seed {seed})\n{_report(stats)}")
