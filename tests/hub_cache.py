"""Offline Hugging Face Hub caches for tests.

``timm.create_model(name, pretrained=True)`` fetches ``pretrained_cfg['hf_hub_id']`` through
``huggingface_hub.hf_hub_download``. With ``HF_HUB_OFFLINE=1`` that function never touches the
network: it reads ``<cache>/models--ORG--NAME/refs/<revision>`` (a commit id) and returns
``<cache>/models--ORG--NAME/snapshots/<commit>/<filename>`` if that file exists, else raises
``LocalEntryNotFoundError`` (a subclass of ``EntryNotFoundError``, which timm catches when it
probes for ``model.safetensors`` before ``pytorch_model.bin``).

Usage::

    from hub_cache import write_hf_cache, offline_hf_cache

    write_hf_cache(tmp_path, "shi-labs/nat-mini-in1k-224",
                   {"pytorch_model.bin": path_or_bytes, "config.json": b"{}"})
    with offline_hf_cache(tmp_path):
        model = timm.create_model("nat_mini.in1k", pretrained=True)

Lay out any number of repos in the same ``cache_dir`` (one call per repo), then enter
:func:`offline_hf_cache` once. As a pytest fixture::

    @pytest.fixture
    def hf_cache(tmp_path):
        with offline_hf_cache(tmp_path / "hub") as cache_dir:
            yield cache_dir
"""
import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Union

__all__ = ["write_hf_cache", "offline_hf_cache", "repo_cache_dir"]

FileSource = Union[bytes, str, os.PathLike]


def repo_cache_dir(cache_dir: Union[str, os.PathLike], repo_id: str,
                   repo_type: str = "model") -> Path:
    """``<cache_dir>/models--ORG--NAME`` (``datasets--`` / ``spaces--`` for other repo types)."""
    return Path(cache_dir) / f"{repo_type}s--{repo_id.replace('/', '--')}"


def write_hf_cache(
        cache_dir: Union[str, os.PathLike],
        repo_id: str,
        files: Mapping[str, FileSource],
        commit: Optional[str] = None,
        revision: str = "main",
        missing: Iterable[str] = ("model.safetensors",),
        link: bool = False,
        repo_type: str = "model",
) -> Path:
    """Lay out one repo of an offline Hugging Face cache; returns its snapshot folder.

    Args:
        cache_dir: the cache root (what ``HF_HUB_CACHE`` will point to).
        repo_id: ``"ORG/NAME"``.
        files: snapshot-relative file name (may contain ``/``) -> content, as ``bytes`` or the
            path of an existing file (copied, or symlinked with ``link=True`` to save disk when
            laying out big checkpoints for many repos).
        commit: the 40-hex commit id the revision points to; default: derived from repo_id, so
            repeated calls for one repo share a snapshot.
        revision: the branch / tag name written under ``refs/`` (timm asks for ``main``).
        missing: file names recorded as absent on the Hub for this commit (under
            ``.no_exist/``), as huggingface_hub itself does after a 404; offline lookups of
            them fail fast either way.
        link: symlink path sources instead of copying them.
        repo_type: ``"model"``, ``"dataset"`` or ``"space"``.
    """
    if repo_id.count("/") != 1:
        raise ValueError(f"repo_id must be 'ORG/NAME', got {repo_id!r}")
    if commit is None:
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be 40 lowercase hex digits, got {commit!r}")
    repo_dir = repo_cache_dir(cache_dir, repo_id, repo_type)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)  # no trailing newline, as the hub writes
    snapshot = repo_dir / "snapshots" / commit
    for name, source in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        if isinstance(source, (bytes, bytearray)):
            target.write_bytes(bytes(source))
        elif link:
            target.symlink_to(Path(source).resolve())
        else:
            shutil.copyfile(source, target)
    for name in missing:
        if name not in files:
            marker = repo_dir / ".no_exist" / commit / name
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return snapshot


@contextlib.contextmanager
def offline_hf_cache(cache_dir: Union[str, os.PathLike]) -> Iterator[Path]:
    """Within the block, huggingface_hub reads only ``cache_dir`` and never uses the network.

    Sets the ``HF_HUB_OFFLINE`` / ``HF_HUB_CACHE`` environment variables (for subprocesses and
    late importers) and patches ``huggingface_hub.constants``, which read them once at import
    (``hf_hub_download`` looks up ``constants.HF_HUB_CACHE`` / ``constants.is_offline_mode()``
    at call time). Everything is restored on exit.
    """
    import huggingface_hub.constants as constants

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache_dir),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    attrs = {"HF_HUB_OFFLINE": True, "HF_HUB_CACHE": str(cache_dir),
             "HF_HUB_DISABLE_TELEMETRY": True}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_attrs = {k: getattr(constants, k) for k in attrs if hasattr(constants, k)}
    os.environ.update(env)
    for k, v in attrs.items():
        setattr(constants, k, v)
    try:
        yield cache_dir
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k in attrs:
            if k in saved_attrs:
                setattr(constants, k, saved_attrs[k])
            else:
                delattr(constants, k)
