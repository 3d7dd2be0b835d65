"""``attnzoo`` command line.

``attnzoo list [FILTER]``               the registered attnzoo models (``--pretrained``: their tags)
``attnzoo bench [MODEL]``               params, GMACs and throughput per backend, random input
``attnzoo info MODEL[.TAG]``            family, paper, config, cost, input sizes, weights, backends
``attnzoo convert MODEL CKPT OUT``      an official checkpoint -> safetensors timm loads
``attnzoo publish MODEL[.TAG] CKPT --repo-id ORG/NAME``  a checkpoint -> a checked Hub repo
``attnzoo timm SCRIPT.py [ARGS...]``    run one of timm's scripts with attnzoo's models registered

Also ``python -m attnzoo ...``, which works as one process of a torchrun launch, from a timm clone
too: ``torchrun --nproc_per_node=N -m attnzoo timm train.py --config ...`` (README "Train").

A user's mistake (unknown model or backend, a size <= 0, a checkpoint that does not match) is
reported in one line, argparse-style, with exit status 2 and no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import runpy
import statistics
import sys
from typing import Dict, List, Optional, Sequence

import torch

from . import __version__, backends, hub
from .models import list_models, model_family
from .profiling import count_macs, count_params, first_line, model_step, time_steps

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
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


def _cmd_list(args, parser) -> int:
    try:
        names = list_models(args.filter, pretrained=args.pretrained, family=args.family)
    except ValueError as e:
        parser.error(str(e))
    for name in names:
        print(name)
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
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    dtype = _DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = timm.create_model(args.model, pretrained=False).to(device=device, dtype=dtype)
    except (TypeError, ValueError) as e:
        parser.error(f"cannot build {args.model}: {e}")
    model.train(args.backward)
    size = args.img_size or model.pretrained_cfg["input_size"][-1]
    x = torch.randn(args.batch_size, 3, size, size, device=device, dtype=dtype)
    try:
        macs = count_macs(model, (1, 3, size, size))
    except (ValueError, AssertionError, RuntimeError) as e:
        # the model rejects this input: below its minimum, or not the size a fixed-size model
        # (timm's own ViTs assert it) was built for
        parser.error(f"--img-size {size}: {args.model} cannot run a {size}x{size} input: "
                     f"{first_line(e)}")
    print(f"{args.model}: {count_params(model) / 1e6:.2f} M params, "
          f"{macs / 1e9:.2f} GMACs at {size}x{size}", flush=True)
    print(f"throughput, batch {args.batch_size}, {args.dtype} on {device}, "
          f"{'forward+backward' if args.backward else 'inference'}, {args.steps} steps:",
          flush=True)
    if not _ops_used(model, x):
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


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _cmd_convert(args, parser) -> int:
    _check_model(parser, args.model)
    try:
        state_dict = hub.load_official(args.model, args.checkpoint)
    except (ValueError, FileNotFoundError, ImportError) as e:
        parser.error(f"{args.checkpoint}: {_one_line(e)}")
    hub.save_converted(state_dict, args.out)
    print(f"wrote {args.out} ({len(state_dict)} tensors). Load it with timm.create_model("
          f"'{args.model}', pretrained=True, pretrained_cfg_overlay=dict(file='{args.out}'))")
    return 0


def _cmd_info(args, parser) -> int:
    import timm

    _check_model(parser, args.model)
    arch = args.model.split(".", 1)[0]
    if arch not in list_models():
        parser.error(f"{arch} is not an attnzoo model; `attnzoo list` names them")
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
    print(f"attnzoo ops: {', '.join(facts['ops'])}; backends here (a forward on {args.device}):",
          flush=True)
    model = timm.create_model(arch).eval().to(args.device)
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
        model, source = hub.load_checkpoint_model(args.model, args.checkpoint, args.use_ema)
        print(f"        took {source}: {type(model).__name__}, {model.num_classes} classes, "
              "loaded strictly", flush=True)
        logits = hub.check_finite(model)
        print(f"[2/{steps}] logits of a random "
              f"{'x'.join(map(str, model.pretrained_cfg['input_size']))} image: finite",
              flush=True)
        evaluation = None
        if args.eval_dir:
            evaluation = hub.evaluate(model, args.eval_dir, args.batch_size, args.workers)
            print(f"        {args.eval_dir}: top-1 {evaluation['top1']:.2f}%, top-5 "
                  f"{evaluation['top5']:.2f}% on {evaluation['images']} images", flush=True)
        origin = model.pretrained_cfg.get("origin_url")
        weights = (f"{source}{f' (official code and weights: {origin})' if origin else ''}, "
                   f"converted and checked by `attnzoo publish` (attnzoo {__version__})")
        card = hub.model_card(model, hub.measure_facts(model), repo_id=repo_id, weights=weights,
                              evaluation=evaluation)
        hub.write_hub_folder(model, out, card, name)
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


def _cmd_timm(args, parser) -> int:
    """Run a timm script as ``__main__`` with attnzoo's models registered. The installed timm
    (already imported with attnzoo) serves the script even inside a timm clone, whose folder
    Python would otherwise put first on sys.path."""
    script = args.script
    if not os.path.isfile(script):
        parser.error(f"script {script!r} does not exist (timm's train.py, validate.py, "
                     "benchmark.py and inference.py are in timm's GitHub repository)")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the script's own imports
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"attnzoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="list attnzoo models registered with timm")
    p.add_argument("filter", nargs="?", default="", help="wildcard, e.g. 'dinat_*'")
    p.add_argument("--pretrained", action="store_true", help="list pretrained tags")
    p.add_argument("--family", default="", help="nat, qna_vit, san or quest_vit")
    p.set_defaults(func=_cmd_list, parser=p)

    p = sub.add_parser("bench", help="params, GMACs and throughput per backend (random input)")
    p.add_argument("model", nargs="?", default="nat_tiny")
    p.add_argument("--batch-size", type=_int_at_least(1), default=8)
    p.add_argument("--img-size", type=_int_at_least(1), default=None,
                   help="default: the model's input size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--backends", type=_backend_list, default=list(_BENCH_BACKENDS),
                   help=f"comma-separated backends to time, of {', '.join(backends.BACKENDS)} "
                        f"(default: {','.join(_BENCH_BACKENDS)})")
    p.add_argument("--steps", type=_int_at_least(1), default=5)
    p.add_argument("--warmup", type=_int_at_least(0), default=1)
    p.add_argument("--threads", type=_int_at_least(0), default=0,
                   help="CPU threads (0: torch's default)")
    p.add_argument("--backward", action="store_true", help="time forward+backward")
    p.set_defaults(func=_cmd_bench, parser=p)

    p = sub.add_parser("convert", help="convert an official checkpoint to safetensors for timm")
    p.add_argument("model", help="the attnzoo model the checkpoint belongs to")
    p.add_argument("checkpoint", help="the official checkpoint file")
    p.add_argument("out", help="output .safetensors path")
    p.set_defaults(func=_cmd_convert, parser=p)

    p = sub.add_parser("info", help="a model's family, paper, config, cost, input sizes, "
                                    "pretrained weights and the backends that run it here")
    p.add_argument("model", help="an attnzoo model or pretrained tag, e.g. nat_mini.in1k")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"], help="where to try the backends")
    p.set_defaults(func=_cmd_info, parser=p)

    p = sub.add_parser("publish", help="convert a checkpoint, check it and publish it as a "
                                       "timm repo on the Hugging Face Hub")
    p.add_argument("model", help="the attnzoo model or tag the checkpoint belongs to")
    p.add_argument("checkpoint", help="an official checkpoint (any layout `convert` reads), a "
                                      "timm train.py checkpoint or a safetensors file")
    p.add_argument("--repo-id", required=True, help="the Hub repo, ORG/NAME")
    p.add_argument("--out", default=None, help="folder to write (new or empty; default ./NAME)")
    p.add_argument("--dry-run", action="store_true", help="write and check the folder, upload "
                                                          "nothing")
    p.add_argument("--use-ema", action="store_true",
                   help="take a train.py checkpoint's state_dict_ema (default: its state_dict)")
    p.add_argument("--eval-dir", default=None,
                   help="an ImageFolder (e.g. ImageNet val) to measure top-1/top-5 on")
    p.add_argument("--batch-size", type=_int_at_least(1), default=32, help="for --eval-dir")
    p.add_argument("--workers", type=_int_at_least(0), default=4, help="for --eval-dir")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to upload to (created if needed)")
    p.set_defaults(func=_cmd_publish, parser=p)

    p = sub.add_parser("timm", help="run a timm script (train.py, validate.py, benchmark.py, "
                                    "inference.py) with attnzoo's models registered")
    p.add_argument("script", help="path of the script, e.g. pytorch-image-models/validate.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=_cmd_timm, parser=p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
