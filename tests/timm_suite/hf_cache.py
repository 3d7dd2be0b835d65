"""An offline Hugging Face cache for the pretrained tags of our models, for timm's suite.

timm's ``test_model_load_pretrained`` / ``test_model_features_pretrained`` call
``create_model(<arch.tag>, pretrained=True, ...)``, which fetches ``pretrained_cfg['hf_hub_id']``
(file ``hf_hub_filename``, default ``pytorch_model.bin``, after probing ``model.safetensors``) through
``huggingface_hub``. We run them with ``HF_HUB_OFFLINE=1`` against a per-run cache laid out with
``tests/hub_cache.py`` (``refs/main`` -> ``snapshots/<commit>/<filename>``, ``.no_exist`` marker for
``model.safetensors``).

The file holds random weights of the right architecture (the tag's ``num_classes``), converted to
the layout the real Hub repo has (``LAYOUTS``; the ``shi-labs`` NAT/DiNAT repos hold transformers
``NatForImageClassification`` / ``DinatForImageClassification`` state dicts in ``pytorch_model.bin``),
so the test goes through the model's real checkpoint filter. Each generated checkpoint is first
passed through the model module's ``checkpoint_filter_fn`` and must give exactly the model's state
dict keys and shapes: a layout mismatch shows up as a clear error here, not as a confusing failure.

Generated lazily (by the first test that needs a tag), once per run, built on the meta device (no
real init of 200M-param models). Identical files (same architecture, classes, channels, layout) are
generated once and shared by every tag/repo through symlinks; pytest-xdist workers serialize on
file locks.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import re
from pathlib import Path
from typing import Callable

import torch

import checkpoint_layouts  # tests/checkpoint_layouts.py
from hub_cache import offline_hf_cache, write_hf_cache  # noqa: F401  (tests/hub_cache.py)

from .fetch import file_lock

DEFAULT_FILENAME = "pytorch_model.bin"


def hub_dir(run_dir: Path) -> Path:
    return run_dir / "hf-hub"


# ---------------------------------------------------------------------------------------------------
# layouts: timm state dict of our model -> the state dict the hf_hub_id repo really holds

def _identity(state_dict: dict, model, repo_id: str) -> dict:
    return state_dict


# (fnmatch-free) regex on hf_hub_id -> converter. First match wins; the timm layout is the default.
LAYOUTS: list[tuple[str, Callable[[dict, torch.nn.Module, str], dict]]] = []


def register_layout(pattern: str):
    def deco(fn):
        LAYOUTS.append((pattern, fn))
        return fn
    return deco


def _layout_for(hf_hub_id: str):
    for pattern, fn in LAYOUTS:
        if re.match(pattern, hf_hub_id):
            return pattern, fn
    return "timm", _identity


# ---------------------------------------------------------------------------------------------------
# generation

def _random_state_dict(model: torch.nn.Module, seed: int) -> dict:
    """Random values for every float entry of the state dict; the model may live on the meta device."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            out[k] = torch.randn(v.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(v.dtype)
        elif v.device.type == "meta":
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = v.detach().clone()
    return out


def _check_roundtrip(model, model_module, converted: dict, model_name: str) -> None:
    filter_fn = getattr(model_module, "checkpoint_filter_fn", None)
    if filter_fn is None:
        return
    filtered = filter_fn(dict(converted), model)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in filtered.items()}
    if want != got:
        missing = sorted(set(want) - set(got))[:8]
        extra = sorted(set(got) - set(want))[:8]
        shapes = sorted(k for k in set(want) & set(got) if want[k] != got[k])[:8]
        raise RuntimeError(
            f"generated checkpoint for {model_name} does not map back onto the model through "
            f"{model_module.__name__}.checkpoint_filter_fn: missing {missing}, unexpected {extra}, "
            f"shape mismatch {shapes} (tests/timm_suite/hf_cache.py LAYOUTS out of date?)")


def _generate(model, model_name: str, layout_fn, path: Path) -> Path:
    """Write the converted random checkpoint for ``model`` (on the meta device) to ``path``."""
    if path.exists():
        return path
    with file_lock(path.parent / f".{path.name}.lock"):
        if path.exists():
            return path
        model_module = importlib.import_module(type(model).__module__)
        seed = int(hashlib.sha256(path.name.encode()).hexdigest()[:8], 16)
        converted = layout_fn(_random_state_dict(model, seed), model)
        _check_roundtrip(model, model_module, converted, model_name)
        tmp = path.parent / f".{path.name}.tmp"
        if path.suffix == ".safetensors":
            import safetensors.torch

            safetensors.torch.save_file({k: v.contiguous() for k, v in converted.items()}, str(tmp))
        else:
            torch.save(converted, tmp)
        os.replace(tmp, path)
    return path


def ensure_pretrained(model_name: str, hub: Path) -> Path | None:
    """Make ``create_model(model_name, pretrained=True)`` load offline: an ``hf_hub_id`` from
    ``hub``, a ``url`` from torch.hub's checkpoint cache (``torch.hub.get_dir()``, pointed at the
    run's folder by the plugin). Returns the file it will load."""
    import timm.models

    cfg = timm.models.get_pretrained_cfg(model_name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
        return None  # no weights: timm's suite does not list the tag as pretrained
    if cfg.file:
        if not Path(cfg.file).is_file():
            raise RuntimeError(f"{model_name}: pretrained_cfg file {cfg.file!r} does not exist; a "
                               "cfg shipped with a local file path cannot be tested offline")
        return Path(cfg.file)
    # Build on the meta device: only names, shapes and dtypes are needed (fast for 200M params).
    model = timm.create_model(model_name, pretrained=False, device="meta")
    if cfg.hf_hub_id:
        repo_id, _, revision = cfg.hf_hub_id.partition("@")
        filename = cfg.hf_hub_filename or DEFAULT_FILENAME
        layout_name, layout = _layout_for(repo_id)
    else:
        repo_id, revision, filename = "", "", os.path.basename(cfg.url)
        layout_name, layout = _layout_for(cfg.url)
    layout_fn = lambda sd, model: layout(sd, model, repo_id or cfg.url)  # noqa: E731
    # Identical converted key/shape/dtype lists -> one shared file (e.g. dinat_large and
    # dinat_large_384 differ only in dilations; tags of one architecture share weights).
    signature = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in layout_fn(model.state_dict(), model).items())
    digest = hashlib.sha256(repr((layout_name, signature)).encode()).hexdigest()[:16]
    suffix = ".safetensors" if filename.endswith(".safetensors") else ".bin"
    store = _store_dir(hub)
    store.mkdir(parents=True, exist_ok=True)
    src = _generate(model, model_name, layout_fn, store / f"{digest}{suffix}")
    if not cfg.hf_hub_id:
        target = Path(torch.hub.get_dir()) / "checkpoints" / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():  # absent, or left dangling by release_pretrained
            target.unlink(missing_ok=True)
            target.symlink_to(src)
        return target
    # tests/hub_cache.py lays out refs/<revision> + snapshots/<commit>/<filename> (a symlink to
    # the shared file) and records model.safetensors as absent, as the real repos have it.
    with file_lock(hub / f".{repo_id.replace('/', '--')}.lock"):
        snapshot = write_hf_cache(hub, repo_id, {filename: src}, revision=revision or "main", link=True)
    return snapshot / filename


def _store_dir(hub: Path) -> Path:
    return hub.parent / "weights-store"


def release_pretrained(path: Path, hub: Path) -> None:
    """Delete the generated checkpoint behind ``path`` (what ``ensure_pretrained`` returned) once
    its test is done, so the run holds one model's weights at a time instead of every pretrained
    model's (GBs with DiNAT-L); a later test of the same weights generates them again. A user's
    ``pretrained_cfg`` file is never touched."""
    real = path.resolve()
    if real.parent == _store_dir(hub).resolve():
        real.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------
# layouts of specific Hub repos

@register_layout(r"shi-labs/(nat|dinat)-")
def _nat_to_transformers(state_dict: dict, model, repo_id: str) -> dict:
    prefix = "dinat." if repo_id.split("/", 1)[1].startswith("dinat-") else "nat."
    return checkpoint_layouts.nat_to_transformers(state_dict, prefix)
