"""``attnzoo`` command line.

``attnzoo list [FILTER]``               the registered attnzoo models (``--pretrained``: their tags)
``attnzoo bench [MODEL]``               params, GMACs and throughput per backend, random input
``attnzoo info MODEL[.TAG]``            family, paper, config, cost, input sizes, weights, backends
``attnzoo convert MODEL CKPT OUT``      an official checkpoint -> safetensors timm loads
``attnzoo publish MODEL[.TAG] CKPT --repo-id ORG/NAME``  a checkpoint -> a checked Hub repo
``attnzoo export MODEL[.TAG] OUT.onnx``  an ONNX graph onnxruntime runs (timm's onnx_export)
``attnzoo configs [NAME] [-o FILE]``    the training recipes shipped in the package, their paths
``attnzoo timm SCRIPT.py [ARGS...]``    run one of timm's scripts with attnzoo's models registered
``attnzoo check``                       every op on every backend here against the float64 reference
``attnzoo attention MODEL IMAGE``       one query's attention in one layer, drawn over the image

Also ``python -m attnzoo ...``, which works as one process of a torchrun launch, from a timm clone
too: ``torchrun --nproc_per_node=N -m attnzoo timm train.py --config ...`` (docs/training.md).

A user's mistake (unknown model or backend, a size <= 0, a checkpoint that does not match, a
file that cannot be read or written, a package a timm script needs) is reported in one line,
``attnzoo COMMAND: error: ...``, with exit status 2 and no traceback: every command's
``ValueError``, ``OSError`` and ``ImportError`` go through :func:`main`'s one error path (the
scripts ``attnzoo timm`` runs keep their own tracebacks). When the reader of the output goes
away (``attnzoo list | head -1``), the command stops quietly with status 141, as a Unix tool
killed by SIGPIPE does; Ctrl-C stops it with status 130. ``--help`` of every command lists its
choices and defaults.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import fnmatch
import importlib.util
import itertools
import math
import os
import re
import runpy
import signal
import statistics
import sys
import textwrap
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import __version__, backends, hub
from .check import check_backend, severity
from .models import list_models, model_family
from .models._weights import WEIGHTS, pending_repo
from .profiling import count_macs, count_params, first_line, model_step, time_steps

# attnzoo export --check: onnxruntime's fp32 logits against PyTorch's (issue 26's bound; each
# family's smallest model differs by 3e-8 to 1.3e-6, BENCHMARKS.md "ONNX export")
EXPORT_TOLERANCE = 1e-4
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CHECK_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # either spelling, both


def _long_dtype(name: str) -> str:
    return {short: long for long, short in _SHORT.items()}.get(name, name)


def _short_dtype(name: str) -> str:
    return _SHORT.get(name, name)
# bench's rows: what auto picks, then every backend that runs ops
_BENCH_BACKENDS = ("auto",) + backends.CONCRETE_BACKENDS


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"int >= {minimum}"
    return parse


def _key_value(text: str):
    """``KEY=VALUE`` -> ``(KEY, VALUE)``, the value a Python literal where it parses as one
    (``img_size=96``, ``dynamic_img_size=True``), else the string (``padding_mode=zeros``), as
    timm's ``--model-kwargs``."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _check_model_kwargs(parser: argparse.ArgumentParser, model_name: str, kwargs) -> None:
    """A ``--model-kwargs`` string where the model's argument takes another type (a number, a
    bool, a tuple): one line naming the argument and its type, not a failure deep inside."""
    strings = [(key, value) for key, value in kwargs if isinstance(value, str)]
    if not strings:
        return
    import inspect

    import timm
    try:
        model_cls = type(timm.create_model(model_name, device="meta"))
    except Exception:  # noqa: BLE001 - building it again reports the error where it belongs
        return
    defaults = {}
    for cls in reversed(model_cls.__mro__):
        if "__init__" in vars(cls):
            defaults.update((p.name, p.default)
                            for p in inspect.signature(cls.__init__).parameters.values())
    for key, value in strings:
        default = defaults.get(key)
        if default is not None and default is not inspect.Parameter.empty and not isinstance(
                default, str):
            kind = type(default).__name__
            parser.error(f"--model-kwargs {key}={value}: {key} takes "
                         f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} (default {default!r}), "
                         f"got the string {value!r}")


def _license_id(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", text):
        raise argparse.ArgumentTypeError(
            f"a Hub licence id is lowercase letters, digits, '.', '+' and '-' (apache-2.0, mit, "
            f"cc-by-nc-4.0, other), got {text!r}")
    return text


def _backend_list(text: str) -> List[str]:
    try:
        return [backends._check_name(name) for name in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_model(parser: argparse.ArgumentParser, name: str) -> None:
    import timm
    arch = name.split(".", 1)[0]
    if timm.is_model(arch):
        if arch != name:
            tags = timm.list_models(arch, include_tags=True)
            if name not in tags:
                parser.error(f"unknown pretrained tag {name!r}; {arch}'s tags: {', '.join(tags)}")
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `attnzoo list` names ours"
    parser.error(f"unknown model {name!r}{hint}")


def _check_device(parser: argparse.ArgumentParser, device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    return torch.device(device)


def _families() -> List[str]:
    return sorted({model_family(name) for name in list_models()})


def _pending_tags(filter: str, family: str) -> List[str]:
    """The tags matching ``filter`` / ``family`` whose weights are not on the Hub yet."""
    archs = set(list_models(family=family))
    return sorted(t for t in WEIGHTS if pending_repo(t) and t.split(".", 1)[0] in archs
                  and (not filter or fnmatch.fnmatch(t, filter)))


def _cmd_list(args, parser) -> int:
    family = "nat" if args.family == "dinat" else args.family  # DiNAT: NAT's family, dilated
    names = list_models(args.filter, pretrained=args.pretrained, family=family)
    pending = _pending_tags(args.filter, family) if args.pretrained else []
    if args.family == "dinat":
        names = [n for n in names if n.startswith("dinat")]
        pending = [t for t in pending if t.startswith("dinat")]
    pending_line = (f"not on the Hub yet, so not pretrained (`attnzoo info TAG` says where the "
                    f"official weights are): {', '.join(pending)}")
    if not names:
        family = f" of family {args.family}" if args.family else ""
        if pending:
            matches = f" matches {args.filter!r}" if args.filter else ""
            parser.error(f"no downloadable pretrained tag{family}{matches}; " + pending_line)
        what = "pretrained tag" if args.pretrained else "model"
        close = difflib.get_close_matches(args.filter, list_models(pretrained=args.pretrained),
                                          n=4, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else (
            f"`attnzoo list{' --pretrained' if args.pretrained else ''}` names them all")
        parser.error(f"no attnzoo {what}{family} matches {args.filter!r}; {hint}")
    for name in names:
        print(name)
    if pending:  # on stderr: stdout stays a list of loadable tags
        print(pending_line, file=sys.stderr)
    return 0


def _ops_used(model, x) -> Dict[str, str]:
    """The attnzoo ops one forward runs, each with the backend that ran it."""
    used: Dict[str, str] = {}

    @contextlib.contextmanager
    def observer(op: str, backend: str, macs: int):
        used[op] = backend
        yield

    with torch.no_grad(), backends.observe_ops(observer):
        model(x[:1])
    return used


def _cmd_bench(args, parser) -> int:
    import timm

    _check_model(parser, args.model)
    device = _check_device(parser, args.device)
    dtype = _DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    _check_model_kwargs(parser, args.model, args.model_kwargs)
    kwargs = dict(args.model_kwargs)
    try:
        model = timm.create_model(args.model, pretrained=False, **kwargs)
        if args.img_size and "img_size" not in kwargs and model.pretrained_cfg.get(
                "fixed_input_size") and args.img_size != model.pretrained_cfg["input_size"][-1]:
            # a fixed-size model (a ViT) is built for the size asked, as its own error advises
            model = timm.create_model(args.model, pretrained=False, img_size=args.img_size,
                                      **kwargs)
    except (TypeError, ValueError) as e:
        parser.error(f"cannot build {args.model}: {_one_line(e)}")
    model = model.to(device=device, dtype=dtype)
    model.train(args.backward)
    hw = _input_hw(model.pretrained_cfg, args.img_size)
    size = "x".join(map(str, hw))
    shape = hub.input_shape(model, (3, *hw))  # the stem's channels
    x = torch.randn(args.batch_size, *shape, device=device, dtype=dtype)
    try:  # on the torch reference: each row below runs its own backend
        with backends.use_backend("torch"):
            macs = count_macs(model, (1, *shape))
            ops = _ops_used(model, x)
    except (ValueError, AssertionError, RuntimeError) as e:
        # the model rejects this input: below its minimum, or not the size a fixed-size model
        # (timm's own ViTs assert it) was built for
        parser.error(f"--img-size {hw[0]}: {args.model} cannot run a {size} input: "
                     f"{first_line(e)}")
    print(f"{args.model}: {count_params(model) / 1e6:.2f} M params, "
          f"{macs / 1e9:.2f} GMACs at {size}", flush=True)
    print(f"throughput, batch {args.batch_size}, {args.dtype} on {device}, "
          f"{'forward+backward' if args.backward else 'inference'}, {args.steps} steps:",
          flush=True)
    if not ops:
        rows = [None]  # no attnzoo op: the backend switch does not apply, one row says so
    else:
        rows = args.backends
    for i, name in enumerate(rows):
        label = "(no attnzoo ops: backends do not apply)" if name is None else name
        print(f"  [{i + 1}/{len(rows)}] {label}: ", end="", flush=True)
        try:
            with backends.use_backend(name) if name else contextlib.nullcontext():
                picked = _ops_used(model, x) if name == "auto" else {}
                seconds = statistics.median(time_steps(
                    model_step(model, x, args.backward), device, args.warmup, args.steps))
        except backends.BackendUnsupportedError as e:
            print(f"unavailable ({e})", flush=True)
            continue
        chosen = f" [auto picked {', '.join(f'{op}: {b}' for op, b in picked.items())}]" \
            if picked else ""
        print(f"{args.batch_size / seconds:9.1f} img/s ({seconds * 1e3:.1f} ms/step){chosen}",
              flush=True)
    return 0


def _missing(path: str) -> str:
    """Why ``path`` is not a file, in a phrase."""
    return "is a folder, not a file" if os.path.isdir(path) else "does not exist"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _input_hw(cfg, img_size: Optional[int]) -> Tuple[int, int]:
    """``(H, W)`` of a command's input: ``--img-size``'s square, else the model's own size (a
    fixed-size model's may not be square)."""
    return tuple(cfg["input_size"][1:]) if img_size is None else (img_size, img_size)


def _check_new_file(parser, path: str, force: bool) -> None:
    """An existing file is replaced only with --force (as configs -o and publish --out refuse
    to overwrite): a second export or conversion to one name would end the first."""
    if os.path.isfile(path) and not force:
        parser.error(f"{path}: the file exists; pass --force to replace it")


def _cmd_convert(args, parser) -> int:
    _check_model(parser, args.model)
    hub.check_output_path(args.out)  # before the conversion, which may take a while
    _check_new_file(parser, args.out, args.force)
    try:
        state_dict = hub.load_official(args.model, args.checkpoint)
    except (ValueError, OSError, ImportError) as e:
        message = _one_line(e)
        parser.error(message if args.checkpoint in message else f"{args.checkpoint}: {message}")
    try:
        hub.save_converted(state_dict, args.out)
    except OSError as e:
        parser.error(_one_line(e))
    import timm
    meta = timm.create_model(args.model, device="meta")
    sizes = {**hub.head_and_stem_args(meta.pretrained_cfg, state_dict),
             **hub.grid_args(meta, state_dict)}
    # timm keeps a checkpoint's classifier only where the pretrained cfg has its class count
    overlay = f", num_classes={sizes['num_classes']}" if "num_classes" in sizes else ""
    kwargs = "".join(f", {k}={v}" for k, v in sizes.items())
    print(f"wrote {args.out} ({len(state_dict)} tensors). Load it with timm.create_model("
          f"'{args.model}', pretrained=True{kwargs}, pretrained_cfg_overlay=dict("
          f"file='{args.out}'{overlay}))")
    return 0


def _cmd_info(args, parser) -> int:
    import timm

    _check_model(parser, args.model)
    arch = args.model.split(".", 1)[0]
    if arch not in list_models():
        parser.error(f"{arch} is not an attnzoo model; `attnzoo list` names them")
    device = _check_device(parser, args.device)  # before any line is printed
    meta = timm.create_model(args.model, device="meta")
    cfg = meta.pretrained_cfg
    facts = hub.measure_facts(meta)
    print(f"{arch}: family {model_family(arch)}; paper: {cfg.get('paper_name', '?')} "
          f"({cfg.get('paper_ids', '?')})")
    print(f"config: {hub.config_line(meta)}")
    size = "x".join(map(str, cfg["input_size"][1:]))
    print(f"parameters: {count_params(meta) / 1e6:.2f} M; GMACs at {size}: "
          f"{facts['gmacs']:.2f}")
    print(f"input sizes: {hub.input_sizes(cfg)}")
    if arch in hub.PAPER_TOP1:
        print("paper ImageNet-1k top-1: {} ({})".format(*hub.PAPER_TOP1[arch]))
    tags = [args.model] if "." in args.model else timm.list_models(arch, include_tags=True)
    print("pretrained tags:" if tags and "." in tags[0] else "pretrained tags: none")
    for tag in (t for t in tags if "." in t):
        tag_cfg = timm.get_pretrained_cfg(tag)
        print(f"  {tag}: {hub.weights_source(tag)}; license {tag_cfg.license or '?'}")
    if not facts["ops"]:
        print("backends: none needed (no attnzoo op)")
        return 0
    model = timm.create_model(arch).eval().to(device)
    size, calls = hub.op_calls(model)
    print(f"attnzoo ops of a {size} forward: " + ", ".join(
        f"{op} x {n}" for op, n in calls.items()), flush=True)
    print(f"backends here ({device}):", flush=True)
    for name, reason in hub.backends_here(model).items():
        print(f"  {name}: {'runs it' if reason is None else 'no: ' + reason}", flush=True)
    return 0


def _cmd_publish(args, parser) -> int:
    _check_model(parser, args.model)
    name = args.repo_id.split("/")[-1]
    steps = 5 if args.dry_run else 6
    try:
        repo_id = hub.check_repo_id(args.repo_id)
        out = hub.check_out_dir(args.out or name)
        if not args.dry_run:
            hub.check_token()
        print(f"[1/{steps}] reading {args.checkpoint}", flush=True)
        model, source, model_args, from_args = hub.load_checkpoint_model(
            args.model, args.checkpoint, args.use_ema)
        print(f"        took {source}: {type(model).__name__}, {model.num_classes} classes, "
              "loaded strictly", flush=True)
        if from_args:
            print(f"        from its train.py args: {from_args}", flush=True)
        logits = hub.check_finite(model)
        print(f"[2/{steps}] logits of a random "
              f"{'x'.join(map(str, hub.input_shape(model)))} image: finite",
              flush=True)
        evaluation = None
        if args.eval_dir:
            evaluation = hub.evaluate(model, args.eval_dir, args.batch_size, args.workers)
            print(f"        {args.eval_dir}: top-1 {evaluation['top1']:.2f}%, top-5 "
                  f"{evaluation['top5']:.2f}% on {evaluation['images']} images", flush=True)
        if args.license:
            model.pretrained_cfg = model.default_cfg = {**model.pretrained_cfg,
                                                        "license": args.license}
        origin = model.pretrained_cfg.get("origin_url")
        weights = (f"{source}{f' (official code and weights: {origin})' if origin else ''}, "
                   f"converted and checked by `attnzoo publish` (attnzoo {__version__})")
        card = hub.model_card(model, hub.measure_facts(model), repo_id=repo_id, weights=weights,
                              evaluation=evaluation)
        hub.write_hub_folder(model, out, card, name, (evaluation or {}).get("classes"),
                             model_args)
        print(f"[3/{steps}] wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}",
              flush=True)
        hub.check_reload(model, out, logits)
        print(f"[4/{steps}] reloaded timm.create_model('local-dir:{out}', pretrained=True): "
              "logits identical to the source's", flush=True)
    except (ValueError, FileNotFoundError, ImportError) as e:
        parser.error(_one_line(e))
    if args.dry_run:
        print(f"[5/{steps}] --dry-run: nothing uploaded. Without --dry-run (and a new --out), "
              f"this uploads {out} to https://huggingface.co/{repo_id}")
        return 0
    print(f"[5/{steps}] uploading {out} to {repo_id}", flush=True)
    try:
        url = hub.upload(out, repo_id, private=args.private, revision=args.revision)
    except Exception as e:  # noqa: BLE001 - the Hub client's errors differ per version
        parser.error(f"upload to {repo_id} failed: {type(e).__name__}: {_one_line(e)}")
    revision = f"@{args.revision}" if args.revision else ""
    print(f"[6/{steps}] uploaded: {url}\nload it with: import attnzoo, timm; "
          f"timm.create_model('hf-hub:{repo_id}{revision}', pretrained=True)")
    return 0


def _cmd_export(args, parser) -> int:
    """A thin command over ``timm.utils.onnx.onnx_export`` (what timm's ``onnx_export.py``
    runs), for pip users without a timm checkout."""
    import timm

    _check_model(parser, args.model)
    needed = ["onnx"] + ["onnxscript"] * args.dynamo + ["onnxruntime"] * args.check
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(f"exporting needs {', '.join(missing)}, not installed: "
                     f"pip install {' '.join(missing)}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        parser.error(f"{args.out}: folder {out_dir} does not exist")
    if os.path.isdir(args.out):
        parser.error(f"{args.out}: a folder; give the .onnx file's path")
    _check_new_file(parser, args.out, args.force)
    opsets = _export_opsets(args.dynamo)
    if args.opset is not None and args.opset not in opsets:
        other = _export_opsets(not args.dynamo)
        parser.error(f"--opset {args.opset}: the {'dynamo' if args.dynamo else 'TorchScript'} "
                     f"exporter writes opsets {opsets[0]} to {opsets[-1]}; the "
                     f"{'TorchScript' if args.dynamo else 'dynamo'} exporter "
                     f"({'without' if args.dynamo else 'with'} --dynamo) {other[0]} to "
                     f"{other[-1]}")
    _check_model_kwargs(parser, args.model, args.model_kwargs)
    from timm.layers import set_layer_config
    try:
        with set_layer_config(exportable=True):
            if args.checkpoint:  # any layout convert or publish reads, its head size included
                model = hub.load_checkpoint_model(args.model, args.checkpoint,
                                                  model_kwargs=dict(args.model_kwargs)).model
            else:
                model = timm.create_model(args.model, pretrained=False,
                                          **dict(args.model_kwargs))
    except (RuntimeError, TypeError, ValueError, OSError) as e:
        where = f"--checkpoint {args.checkpoint}" if args.checkpoint else (
            f"cannot build {args.model}")
        parser.error(f"{where}: {_one_line(e)}")
    if not args.checkpoint:
        print(f"no --checkpoint: {args.model} with random weights (nothing is downloaded)",
              flush=True)
    cfg = model.pretrained_cfg
    refusal = hub.dynamic_size_refusal(cfg)
    if args.dynamic_size and refusal:
        parser.error(f"--dynamic-size: {args.model} cannot export with a dynamic size: {refusal}")
    hw = _input_hw(cfg, args.img_size)
    if refusal and hw != tuple(cfg["input_size"][1:]):
        parser.error(f"--img-size {args.img_size}: {args.model}: {refusal}")
    size = "x".join(map(str, hw))
    x = torch.randn(2, *hub.input_shape(model, (3, *hw)))  # the stem's channels
    # the exported graph takes every op's export formula whatever the backend: the eager
    # forwards here (the size check, onnx_export's own, --check's reference) run the torch
    # reference
    reference = backends.use_backend("torch")
    try:
        with torch.no_grad(), reference:
            model.eval()(x)
    except ValueError as e:
        parser.error(f"--img-size {hw[0]}: {args.model} cannot run a {size} input: "
                     f"{first_line(e)}")
    exporter = "dynamo (torch.export)" if args.dynamo else "TorchScript"
    print(f"exporting {args.model} at {size} with the {exporter} exporter, dynamic "
          f"batch{' and size' if args.dynamic_size else ''}...", flush=True)
    from timm.utils.onnx import onnx_export
    with warnings.catch_warnings():  # torch's notes, which name none of the user's choices:
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # Python checks of traced sizes
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's future
        warnings.filterwarnings("ignore", "Constant folding - Only steps=1", UserWarning)
        try:
            with reference:  # timm's onnx_export runs the model eagerly too
                onnx_export(model, args.out, example_input=x, opset=args.opset,
                            dynamic_size=args.dynamic_size, use_dynamo=args.dynamo, check=True)
        except Exception as e:  # noqa: BLE001 - an exporter's failure, in one line
            cause = e
            while cause.__cause__ is not None:  # torch.export wraps the model's own error
                cause = cause.__cause__
            if os.path.isfile(args.out):  # a partial file is no export
                os.remove(args.out)
            why = type(cause).__name__ + (f": {first_line(cause)}" if str(cause).strip() else "")
            parser.error(f"{args.model} at {size}: the {exporter} exporter failed: {why}; "
                         "nothing written")
    import onnx
    written = next(o.version for o in onnx.load(args.out, load_external_data=False).opset_import
                   if o.domain in ("", "ai.onnx"))
    if args.opset is not None and written != args.opset:  # never a file of another opset
        os.remove(args.out)
        parser.error(f"--opset {args.opset}: the exporter wrote opset {written} instead; "
                     "nothing written")
    print(f"wrote {args.out} (opset {written}): onnx.checker.check_model(full_check=True) "
          "passes", flush=True)
    if args.check:  # the export's input, then another batch (and size, where it is dynamic)
        import onnxruntime
        session = onnxruntime.InferenceSession(args.out, providers=["CPUExecutionProvider"])
        # another batch; where the size is dynamic, a larger size and the smallest the model
        # takes too (its last maps of side 1, where a formula may divide by zero)
        others = [(hw[0] + 32,) * 2, (hub.smallest_size(model),) * 2] if args.dynamic_size \
            else [hw]
        diffs = []
        for inputs in [x] + [torch.randn(3, x.shape[1], *o) for o in dict.fromkeys(others)]:
            with torch.no_grad(), reference:
                logits = model(inputs)
            got = session.run(None, {session.get_inputs()[0].name: inputs.numpy()})[0]
            diff = float((torch.from_numpy(got) - logits).abs().max())
            print(f"onnxruntime vs PyTorch, input {list(inputs.shape)}: largest difference "
                  f"{diff:.2e}", flush=True)
            diffs.append((diff, list(inputs.shape)))
        # a nan logit makes its difference nan, which ranks above any number and fails
        diff, shape = max(diffs, key=lambda d: math.inf if math.isnan(d[0]) else d[0])
        if not diff <= EXPORT_TOLERANCE:
            print(f"attnzoo export: FAILED: {args.out} differs from PyTorch by {diff:.2e} "
                  f"(input {shape}), above the tolerance {EXPORT_TOLERANCE:.0e}",
                  file=sys.stderr, flush=True)
            return 1
    return 0


def _query(text: str):
    try:
        y, x = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Y,X (pixels of the image), got {text!r}")
    return y, x


def _head(text: str):
    if text in ("mean", "all"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected mean, all or a head index, got {text!r}")


def _cmd_attention(args, parser) -> int:
    """Draw one query's attention weights in one layer over the image (the model's own input,
    the whole image resized to the model's input size and normalised as its config says)."""
    import timm
    from PIL import Image

    from .layers import attention_layers, attention_maps
    from .visualize import draw_attention, query_grid, query_heat

    _check_model(parser, args.model)
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("drawing needs matplotlib, not installed: pip install matplotlib")
    if args.pretrained and args.checkpoint:
        parser.error("--pretrained and --checkpoint: give one")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        parser.error(f"-o {args.out}: folder {out_dir} does not exist")
    from matplotlib.figure import Figure
    formats = sorted(Figure().canvas.get_supported_filetypes())
    suffix = os.path.splitext(args.out)[1].lstrip(".").lower()
    if suffix not in formats:  # before the model runs, not after
        parser.error(f"-o {args.out}: the picture's format is its extension, one of "
                     f"{', '.join(formats)}")
    try:
        image = Image.open(args.image).convert("RGB")
    except (OSError, ValueError) as e:
        parser.error(f"{args.image}: cannot read the image: {_one_line(e)}")
    _check_model_kwargs(parser, args.model, args.model_kwargs)
    try:
        if args.checkpoint:  # any layout convert or publish reads, its head size included
            model = hub.load_checkpoint_model(args.model, args.checkpoint,
                                              model_kwargs=dict(args.model_kwargs)).model
        else:
            model = timm.create_model(args.model, pretrained=args.pretrained,
                                      **dict(args.model_kwargs)).eval()
    except (RuntimeError, TypeError, ValueError, OSError) as e:
        where = f"--checkpoint {args.checkpoint}" if args.checkpoint else (
            f"cannot build {args.model}")
        parser.error(f"{where}: {_one_line(e)}")
    if not (args.pretrained or args.checkpoint):
        print(f"no --checkpoint or --pretrained: {args.model} with random weights", flush=True)
    channels = hub.input_shape(model)[0]
    if channels != 3:
        parser.error(f"{args.model} takes {channels}-channel images; attention draws over an "
                     "RGB image, for a 3-channel model")
    cfg = model.pretrained_cfg
    in_h, in_w = _input_hw(cfg, args.img_size)
    resized = image.resize((in_w, in_h), Image.BILINEAR).tobytes()
    pixels = torch.frombuffer(bytearray(resized), dtype=torch.uint8).reshape(in_h, in_w, 3) / 255
    mean, std = (torch.tensor(cfg.get(key, default)) for key, default in (
        ("mean", (0.485, 0.456, 0.406)), ("std", (0.229, 0.224, 0.225))))
    x = ((pixels - mean) / std).permute(2, 0, 1).unsqueeze(0)
    try:
        (name, amap), = attention_maps(model, x, args.layer).items()
    except backends.BackendUnsupportedError as e:
        parser.error(_one_line(e))
    except ValueError as e:
        if not attention_layers(model):
            parser.error(f"{args.model}: {_one_line(e)}")
        option = "--layer" if str(e).startswith("layers:") else f"--img-size {in_h}"
        parser.error(f"{option}: {_one_line(e).removeprefix('layers: ')}")
    prefix = getattr(model, "num_prefix_tokens", 0)
    rows, cols = query_grid(amap, prefix)
    W, H = image.size
    qy, qx = args.query
    if not (0 <= qy < H and 0 <= qx < W):
        parser.error(f"--query {qy:g},{qx:g}: outside the {H}x{W} (HxW) image")
    if amap.keys is None:  # tokens: the patch grid covers the image
        gy, gx = int(qy * rows / H), int(qx * cols / W)
    else:  # a query at grid (gy, gx) sits at (gy, gx) * stride of the layer's input map
        (mh, mw), s = amap.map_size, amap.stride
        gy = min(int(qy * mh / H) // s, rows - 1)
        gx = min(int(qx * mw / W) // s, cols - 1)
    try:
        heat = query_heat(amap, (gy, gx), args.head, prefix)
    except ValueError as e:
        parser.error(f"--head {args.head}: {_one_line(e)}")
    group = "group" if "group" in amap.axes else "head"
    n = amap.weights.shape[amap.axes.index(group)]
    labels = ([f"{group} {i}" for i in range(n)] if args.head == "all" else
              [f"mean of {n} {group}s"] if args.head == "mean" else [f"{group} {args.head}"])
    if amap.keys is not None and "query" in amap.axes:  # QnA: per learned query, mean drawn
        # (global attention's "query" axis is the tokens', of which one row is drawn)
        queries = amap.weights.shape[amap.axes.index("query")]
        labels = [f"{label}, mean of {queries} learned queries" for label in labels]
    title = (f"{args.model} {name}: query ({gy}, {gx}) of its {rows}x{cols} grid\n"
             f"the model saw the {W}x{H} image resized to {in_w}x{in_h}; drawn at its own size")
    draw_attention(image, heat, (qx, qy), args.out, title, labels)
    print(f"wrote {args.out}: {name}, query at pixel ({qy:g}, {qx:g}) = grid ({gy}, {gx}) of "
          f"{rows}x{cols}, {labels[0] if len(labels) == 1 else f'{len(labels)} {group}s'}",
          flush=True)
    return 0


def _export_opsets(dynamo: bool) -> range:
    """The ONNX opsets an exporter writes: torch's dynamo exporter builds opset 18 graphs and
    newer (onnxscript's torchlib), the TorchScript one 7 to its maximum."""
    from torch.onnx import _constants
    if dynamo:
        return range(18, _constants.ONNX_MAX_OPSET + 1)
    return range(_constants.ONNX_MIN_OPSET, _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET + 1)


def _cmd_check(args, parser) -> int:
    device = _check_device(parser, args.device)
    choice = args.dtype or ("all" if device.type == "cuda" else "fp32")
    dtypes = list(_CHECK_DTYPES) if choice == "all" else [choice]
    ops, names = args.op or backends.registered_ops(), args.backend or backends.CONCRETE_BACKENDS
    print(f"attnzoo check: {len(ops)} ops x {', '.join(names)} on {device}, "
          f"{', '.join(dtypes)}: each op's check cases, the output and every input's gradient "
          "against the float64 torch reference (error: max |got - ref| / max(1, max |ref|))")
    print(f"{'op':<17}{'backend':<8}{'dtype':<6}{'cases':<14}{'forward':>9}{'backward':>10}"
          f"{'tolerance':>11}{'time':>9}  result", flush=True)
    reasons: List[str] = []  # why cases did not run: the notes under the table
    rows = []
    with warnings.catch_warnings():
        # NATTEN's CPU path runs flex_attention uncompiled, which warns about speed on every run
        warnings.filterwarnings("ignore", module=r"torch\.nn\.attention\.flex_attention")
        for op, name, dtype in itertools.product(ops, names, dtypes):
            print(f"{op:<17}{name:<8}{dtype:<6}", end="", flush=True)
            row = check_backend(op, name, device, _CHECK_DTYPES[dtype])
            rows.append((dtype, row))
            print(_check_row(row, reasons), flush=True)
    for i, reason in enumerate(reasons):
        print(f"[{i + 1}] {reason}")
    for dtype in dtypes:
        ran = [row for d, row in rows if d == dtype]
        worst = [max(ran, key=lambda r: severity(getattr(r, kind))) for kind in ("forward",
                                                                                   "backward")]
        print(f"{dtype}: worst error forward {_worst_text(worst[0], 'forward')}, backward "
              f"{_worst_text(worst[1], 'backward')}; tolerance {ran[0].tolerance:.0e}")
    failed = [f"{row.op}/{row.backend}/{dtype} {label!r}"
              for dtype, row in rows for label, _ in row.failures]
    if failed:
        print(f"FAILED: {len(failed)} case(s) above tolerance or in error: {', '.join(failed)}")
        return 1
    ran = {name: sum(len(row.checked) + len(row.forward_only) for _, row in rows
                     if row.backend == name) for name in names}
    idle = [name for name in names if not ran[name]]
    if args.backend and idle:  # asked for by name: a backend that checks nothing has failed
        print(f"FAILED: no case ran on {', '.join(idle)} here: the notes above say why")
        return 1
    print(f"ok: {sum(ran.values())} case(s) checked, every error within tolerance")
    return 0


def _check_row(row, reasons: List[str]) -> str:
    """A row of `attnzoo check`'s table after the op, backend and dtype; the reasons for cases
    that did not run are added to ``reasons`` and referred to by number."""
    notes = []
    for reason in row.not_run:
        if reason not in reasons:
            reasons.append(reason)
        notes.append(f"[{reasons.index(reason) + 1}]")
    ran = len(row.checked) + len(row.forward_only)
    cases = f"{ran}/{row.cases}" + (" fwd only" if row.forward_only and not row.checked else "")
    result = "FAIL" if row.failures else "ok" if ran else "not run"
    if notes:
        result += f"; {row.cases - ran} not run " if ran else " "
        result += " ".join(notes)
    failures = "".join(f"\n    {label}: {what}" for label, what in row.failures)
    return (f"{cases:<14}{_error_text(row.forward):>9}{_error_text(row.backward):>10}"
            f"{row.tolerance:>11.0e}{row.seconds:>7.1f} s  {result}{failures}")


def _error_text(error: Optional[float]) -> str:
    return "-" if error is None else f"{error:.1e}"


def _worst_text(row, kind: str) -> str:
    error = getattr(row, kind)
    return "-" if error is None else f"{error:.1e} ({row.op} on {row.backend})"


# import name -> pip package, where they differ (what timm's scripts import)
_PIP_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


def _cmd_configs(args, parser) -> int:
    from .configs import recipe_names, recipe_path, short_job
    if args.name is None:
        if args.out or args.short:
            parser.error(f"{'-o/--out' if args.out else '--short'} needs a recipe NAME: "
                         "`attnzoo configs NAME ...`")
        width = max(map(len, recipe_names()))
        for name in recipe_names():
            print(f"{name:<{width}}  {recipe_path(name)}")
        return 0
    path = recipe_path(args.name)
    if args.short and args.num_classes is None:
        parser.error("--short needs --num-classes: the class count of your data")
    if args.num_classes is not None and not args.short:
        parser.error("--num-classes goes with --short (a recipe's class count is ImageNet's)")
    text = short_job(args.name, args.num_classes) if args.short else None
    if not args.out:
        print(text.rstrip("\n") if args.short else path)
        return 0
    if os.path.exists(args.out):
        kind = "a folder" if os.path.isdir(args.out) else "the file exists"
        parser.error(f"-o {args.out}: {kind}; give a new file's path")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        parser.error(f"-o {args.out}: folder {folder!r} does not exist")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text or path.read_text(encoding="utf-8"))
    what = "a short CPU job from" if args.short else "a copy of"
    print(f"wrote {args.out}, {what} {path}: train.py --config {args.out}")
    return 0


def _cmd_timm(args, parser) -> int:
    """Run a timm script as ``__main__`` with attnzoo's models registered. The installed timm
    (already imported with attnzoo) serves the script even inside a timm clone, whose folder
    Python would otherwise put first on sys.path."""
    script = args.script
    if script is None:
        parser.error("the script to run is required, e.g. attnzoo timm "
                     "pytorch-image-models/validate.py --model nat_mini ...")
    if not os.path.isfile(script):
        parser.error(f"script {script!r} {_missing(script)} (timm's train.py, validate.py, "
                     "benchmark.py and inference.py are in timm's GitHub repository)")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the script's own imports
    try:
        runpy.run_path(script, run_name="__main__")
    except SyntaxError as e:
        if not (e.filename and os.path.samefile(e.filename, script)):
            raise  # in a module the script imports: its traceback says where
        parser.error(f"{script}, line {e.lineno}: not valid Python: {e.msg}")
    except ModuleNotFoundError as e:  # a package the script needs (inference.py: pandas)
        top = (e.name or "").split(".")[0]
        if not top or importlib.util.find_spec(top) is not None:
            raise  # not a missing install: the script's own error
        parser.error(f"{os.path.basename(script)} needs the module {top!r}, which is not "
                     f"installed here: pip install {_PIP_NAMES.get(top, top)}")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with every error on one line, ``attnzoo COMMAND: error: ...`` (``--help`` shows
    the usage), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")


def _has_default(action: argparse.Action) -> bool:
    """Whether ``--help`` shows ``action``'s default: not for flags and empty defaults (their
    help says what leaving them out does)."""
    default = action.default
    return not (default is None or default is False or default == "" or default == []
                or default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in ``--help`` (as argparse's ArgumentDefaultsHelpFormatter, less
    the empty ones), and epilogs kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _has_default(action) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _convert_epilog() -> str:
    by_family: Dict[str, List[str]] = {}
    for name in list_models():
        by_family.setdefault(model_family(name), []).append(name)
    models = "\n".join(textwrap.fill(f"{family}: {', '.join(names)}", 79, initial_indent="  ",
                                      subsequent_indent="    ")
                       for family, names in by_family.items())
    formats = ", ".join(hub.CONVERTED_FORMATS)
    return (f"models:\n{models}\n\n" + textwrap.fill(
        "checkpoints read: torch files (.pth, .pth.tar, .pt, .bin; loaded with weights_only=True, "
        "no code from the file runs) and .safetensors, in the family's official layout "
        "(NAT/DiNAT: the original repository's or the shi-labs transformers repos'; SAN: "
        "tool/train.py's; QUEST-ViT: timm's or DeiT's ViT) or attnzoo's; QnA-ViT's Flax "
        "checkpoint_N files (pip install msgpack numpy).", 79) + "\n\n" + textwrap.fill(
        f"output formats, by OUT's extension: {formats} (torch.save); both load with "
        "timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=OUT)).", 79))


def _check_epilog() -> str:
    tolerances = ", ".join(f"{name} {backends.TOLERANCE[dtype]:.0e}"
                           for name, dtype in _CHECK_DTYPES.items())
    return textwrap.fill(
        "Run it after installing attnzoo on a new GPU (or a new driver, torch, Triton or NATTEN), "
        "and before reporting a numerical bug. Each row is one op on one backend in one dtype: "
        "how many of the op's check cases the backend runs here (the others say why not, in "
        "the notes under the table), the worst errors of the output and of the inputs' "
        "gradients, and the time of the check (backend and reference). Tolerances: "
        f"{tolerances}. Without a GPU, the cuda backend's Triton kernels run only under "
        "Triton's interpreter: set TRITON_INTERPRET=1 yourself (slow: TRITON_INTERPRET=1 "
        "attnzoo check --backend cuda --dtype fp32); otherwise its rows say 'not run'.", 79)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnzoo", description="attnzoo: local and robust attention vision "
                                                 "models for timm (`attnzoo COMMAND --help`)")
    parser.add_argument("--version", action="version", version=f"attnzoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help,
                              formatter_class=_HelpFormatter, **kwargs)

    p = command("list", "list attnzoo models registered with timm")
    p.add_argument("filter", nargs="?", default="", help="wildcard, e.g. 'dinat_*' (default: all)")
    p.add_argument("--pretrained", action="store_true",
                   help="list pretrained tags (default: model names)")
    p.add_argument("--family", default="", choices=sorted(_families() + ["dinat"]),
                   help="only this family; nat: NAT and DiNAT, dinat: DiNAT only (default: all)")
    p.set_defaults(func=_cmd_list, parser=p)

    p = command("bench", "params, GMACs and throughput per backend (random input)")
    p.add_argument("model", nargs="?", default="nat_tiny", help="any timm model or tag")
    p.add_argument("--batch-size", type=_int_at_least(1), default=8, help="images per step")
    p.add_argument("--img-size", type=_int_at_least(1), default=None,
                   help="input side (default: the model's); a fixed-size model (QUEST-ViT, "
                        "timm's ViTs) is built for it")
    p.add_argument("--model-kwargs", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="create_model arguments, e.g. padding_mode=zeros dynamic_img_size=True "
                        "(default: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"], help="where to run")
    p.add_argument("--dtype", default="float32", type=_long_dtype, choices=sorted(_DTYPES),
                   help="model and input (fp32, fp16, bf16 too)")
    p.add_argument("--backends", type=_backend_list, default=",".join(_BENCH_BACKENDS),
                   help=f"comma-separated backends to time, of {', '.join(backends.BACKENDS)}")
    p.add_argument("--steps", type=_int_at_least(1), default=5, help="timed steps")
    p.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed steps first")
    p.add_argument("--threads", type=_int_at_least(0), default=0,
                   help="CPU threads (0: torch's default)")
    p.add_argument("--backward", action="store_true",
                   help="time forward+backward (default: inference)")
    p.set_defaults(func=_cmd_bench, parser=p)

    p = command("convert", "convert an official checkpoint to a file timm loads",
                epilog=_convert_epilog())
    p.add_argument("model", metavar="MODEL", help="the attnzoo model the checkpoint belongs to")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="the official checkpoint file")
    p.add_argument("out", metavar="OUT",
                   help=f"output file: {', '.join(hub.CONVERTED_FORMATS)}; its folder must exist")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it exists (default: refuse)")
    p.set_defaults(func=_cmd_convert, parser=p)

    p = command("info", "a model's family, paper, config, cost, input sizes, pretrained weights "
                        "and the backends that run it here")
    p.add_argument("model", help="an attnzoo model or pretrained tag, e.g. nat_mini.in1k")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"], help="where to try the backends")
    p.set_defaults(func=_cmd_info, parser=p)

    p = command("publish", "convert a checkpoint, check it and publish it as a timm repo on the "
                           "Hugging Face Hub")
    p.add_argument("model", help="the attnzoo model or tag the checkpoint belongs to")
    p.add_argument("checkpoint", help="an official checkpoint (any layout `convert` reads), a "
                                      "timm train.py checkpoint or a safetensors file")
    p.add_argument("--repo-id", required=True, help="the Hub repo, ORG/NAME")
    p.add_argument("--out", default=None, help="folder to write, new or empty (default: ./NAME)")
    p.add_argument("--dry-run", action="store_true",
                   help="write and check the folder, upload nothing (default: upload)")
    p.add_argument("--use-ema", action="store_true",
                   help="take a train.py checkpoint's state_dict_ema (default: its state_dict)")
    p.add_argument("--eval-dir", default=None,
                   help="an ImageFolder to measure top-1/top-5 on: one folder per class of the "
                        "head (sorted: the head's order), which then name a non-ImageNet head's "
                        "classes, or ImageNet synset folders, any part of ImageNet val, for a "
                        "1000-class head (default: none)")
    p.add_argument("--batch-size", type=_int_at_least(1), default=32, help="for --eval-dir")
    p.add_argument("--workers", type=_int_at_least(0), default=4, help="for --eval-dir")
    p.add_argument("--license", type=_license_id, default=None,
                   help="the weights' licence, a Hub licence id (apache-2.0, mit, cc-by-4.0, "
                        "other...; default: an official checkpoint's own; 'other' for a "
                        "train.py checkpoint, whose licence is its trainer's to state)")
    p.add_argument("--private", action="store_true",
                   help="create the repo private (default: public)")
    p.add_argument("--revision", default=None,
                   help="branch to upload to, created if needed (default: main)")
    p.set_defaults(func=_cmd_publish, parser=p)

    p = command("export", "export a model to ONNX (timm's onnx_export), dynamic batch, "
                          "optionally dynamic size")
    p.add_argument("model", help="an attnzoo model or pretrained tag, e.g. nat_mini")
    p.add_argument("out", help="the .onnx file to write")
    p.add_argument("--force", action="store_true",
                   help="replace the file if it exists (default: refuse)")
    p.add_argument("--checkpoint", default=None,
                   help="weights to load (timm's checkpoint_path: a train.py checkpoint or a "
                        "state dict); default: random weights, nothing downloaded")
    p.add_argument("--img-size", type=_int_at_least(1), default=None,
                   help="the export's input size (default: the model's)")
    p.add_argument("--model-kwargs", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="create_model arguments, e.g. num_classes=10 for a fine-tuned "
                        "checkpoint (default: none)")
    p.add_argument("--dynamic-size", action="store_true",
                   help="any input height and width, for models whose size is not fixed "
                        "(default: the export's size only)")
    p.add_argument("--dynamo", action="store_true",
                   help="torch.export's exporter (default: the TorchScript exporter)")
    p.add_argument("--opset", type=_int_at_least(7), default=None,
                   help="ONNX opset (default: the exporter's)")
    p.add_argument("--check", action="store_true",
                   help="run onnxruntime and print the largest difference from PyTorch; "
                        f"exit 1 above {EXPORT_TOLERANCE:.0e} (default: onnx's checker only)")
    p.set_defaults(func=_cmd_export, parser=p)

    p = command("check", "every op on every backend here against the float64 torch "
                         "reference (exit 1 if an error is above tolerance)",
                epilog=_check_epilog())
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"], help="where to run the backends")
    p.add_argument("--dtype", default=None, type=_short_dtype, choices=[*_CHECK_DTYPES, "all"],
                   help="dtype of the backends' inputs (float32, float16, bfloat16 too; default: "
                        "all on cuda, fp32 on cpu)")
    p.add_argument("--backend", nargs="+", default=None, choices=backends.CONCRETE_BACKENDS,
                   metavar="NAME",
                   help=f"backends to check, of {', '.join(backends.CONCRETE_BACKENDS)} "
                        "(default: all)")
    p.add_argument("--op", nargs="+", default=None, choices=backends.registered_ops(),
                   metavar="OP", help=f"ops to check, of {', '.join(backends.registered_ops())} "
                                      "(default: all)")
    p.set_defaults(func=_cmd_check, parser=p)

    p = command("attention", "draw one query's attention weights in one layer over an image",
                epilog=textwrap.fill(
                    "The model sees the whole image resized to its square input size (--img-size) "
                    "and normalised as its config says; the picture shows the weights over the "
                    "image at its own size, with a colour bar of their range, the query marked (+). "
                    "QnA-ViT's QnA layers weight each window once per learned query: their mean "
                    "is drawn. SAN's patchwise weights are not normalised and can be negative: "
                    "a diverging map centred on 0 shows them.", 79))
    p.add_argument("model", help="an attnzoo model or pretrained tag, e.g. nat_mini")
    p.add_argument("image", help="an image file (any format PIL reads)")
    p.add_argument("--layer", required=True,
                   help="STAGE.BLOCK (NAT, DiNAT, QnA-ViT, SAN), BLOCK (QUEST-ViT) or a module "
                        "name, e.g. 1.0 or stages.1.downsample.attn")
    p.add_argument("--query", type=_query, required=True, metavar="Y,X",
                   help="the query's position, in pixels of the image (row, column)")
    p.add_argument("--head", type=_head, default="mean",
                   help="a head index (SAN: channel group), mean (their average) or all (one "
                        "panel each); QnA's learned queries are always averaged")
    p.add_argument("--checkpoint", default=None,
                   help="weights to load: an official checkpoint, a train.py checkpoint or a "
                        "safetensors file (as publish reads them); default: random weights")
    p.add_argument("--pretrained", action="store_true",
                   help="the tag's pretrained weights from the Hub (default: random weights)")
    p.add_argument("--img-size", type=_int_at_least(1), default=None,
                   help="the model's input size (default: the model's)")
    p.add_argument("--model-kwargs", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="create_model arguments, e.g. padding_mode=zeros for a SAN checkpoint "
                        "trained so; over those a checkpoint gives (default: none)")
    p.add_argument("-o", "--out", default="attention.png",
                   help="the picture to write; its extension is its format (png, pdf, svg, ...)")
    p.set_defaults(func=_cmd_attention, parser=p)

    p = command("configs", "the training recipes shipped with attnzoo (timm train.py "
                           "--config files)")
    p.add_argument("name", nargs="?", default=None,
                   help="a recipe: print its path, for train.py --config (default: list all)")
    p.add_argument("-o", "--out", default=None,
                   help="write a copy of the recipe to this new file (default: print its path)")
    p.add_argument("--short", action="store_true",
                   help="the recipe as a short CPU job instead (one epoch, no warm-up or "
                        "cooldown, fp32, batch 8, the recipe's peak lr): printed, or written "
                        "with -o (default: the recipe as it is)")
    p.add_argument("--num-classes", type=_int_at_least(1), default=None,
                   help="with --short: the class count of your data (default: none; --short "
                        "needs it)")
    p.set_defaults(func=_cmd_configs, parser=p)

    p = command("timm", "run a timm script (train.py, validate.py, benchmark.py, inference.py) "
                        "with attnzoo's models registered")
    # (optional for argparse, checked by the command: argparse would name script_args too)
    p.add_argument("script", nargs="?",
                   help="path of the script, e.g. pytorch-image-models/validate.py (no "
                        "default: required)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=_cmd_timm, parser=p)
    return parser


# What a command raises for a user's mistake or a file it cannot read or write; main reports
# them in one line. (BrokenPipeError, an OSError, is handled before them.)
_USER_ERRORS = (ValueError, OSError, ImportError)


def _reader_gone() -> int:
    """stdout's reader has gone (``attnzoo list | head -1``): stop quietly with the status of a
    Unix tool killed by SIGPIPE. stdout goes to /dev/null first, so that the interpreter's
    last flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + getattr(signal, "SIGPIPE", 13)


def _joined_negative_values(argv: Sequence[str]) -> List[str]:
    """``--query -1,5`` as ``--query=-1,5``: argparse takes a value starting with ``-`` that is
    not a plain negative number for an option, and says only "expected one argument"; joined,
    the value reaches the option's own check, which names it."""
    out: List[str] = []
    if not argv or argv[0] != "attention":  # `attnzoo timm` passes a script's own arguments on
        return list(argv)
    for token in argv:
        if out and out[-1] == "--query" and re.fullmatch(r"-[\d.]+,.*", token):
            out[-1] = f"--query={token}"
        else:
            out.append(token)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = _joined_negative_values(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's own parser: `attnzoo list: error: ...`
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:  # ATTNZOO_BACKEND, which every model's forward reads: named now, not in a forward
        backends.get_backend()
    except ValueError as e:
        args.parser.error(str(e))
    try:
        status = args.func(args, args.parser)
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except _USER_ERRORS as e:
        if args.command == "timm":
            raise  # the script's own error: its traceback is the user's to read
        args.parser.error(_one_line(e))
    return status


if __name__ == "__main__":
    sys.exit(main())
