"""The release pipeline (attnzoo/hub.py, `attnzoo publish` / `attnzoo info`), offline.

Per family, a checkpoint in its official layout (written here from tests/checkpoint_layouts.py,
random weights) goes through `attnzoo publish --dry-run`; the folder must then load through
timm's `local-dir:`, through `hf-hub:ORG/NAME` from an offline Hugging Face cache and through the
tag's own `pretrained=True`, each with the logits of the checkpoint converted directly. The
upload runs the real huggingface_hub client, in subprocesses, against tests/hub_server.py.
"""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import safetensors.torch
import pytest
import timm
import torch
import yaml
from PIL import Image

import attnzoo
from attnzoo import cli, hub
from attnzoo.models._weights import WEIGHTS
from checkpoint_layouts import (nat_to_official, nest, qna_official_manifest, san_to_official,
                                san_training_checkpoint, write_flax_checkpoint)
from hub_cache import offline_hf_cache, write_hf_cache
from hub_server import HubServer
from timm_suite.families import smallest_per_family
from tiny_models import quest_vit

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "scripts" / "model_card_facts.json"


def _random_state_dict(name: str, seed: int = 0, **kwargs) -> dict:
    """Random weights for a registered model's state dict (built on the meta device: no init):
    floats N(0, 0.02), BatchNorm running variances 1, integer buffers 0."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in timm.create_model(name, device="meta", **kwargs).state_dict().items():
        if k.endswith("running_var"):
            out[k] = torch.ones(v.shape)
        elif v.is_floating_point():
            out[k] = torch.randn(v.shape, generator=gen) * 0.02
        else:
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
    return out


def _write_nat(path):
    torch.save(nat_to_official(_random_state_dict("nat_mini")), path)


def _write_qna(path):
    manifest = qna_official_manifest(64, (2, 3, 2, 0), (0, 0, 4, 2), (8, 16, 32, 64),
                                     (2, 4, 8, 16), (3,) * 4, (7, 7, 14, 7))
    rng = np.random.default_rng(0)
    write_flax_checkpoint(path, nest({p: rng.standard_normal(s).astype(np.float32) * 0.02
                                      for p, s in manifest.items()}))


def _write_san(path):
    torch.save(san_training_checkpoint(san_to_official(_random_state_dict("san10_pairwise"))),
               path)


# tag -> (writer of its official checkpoint file, file name, input for the logits comparison)
OFFICIAL = {
    "nat_mini.in1k": (_write_nat, "nat_mini.pth", 64),
    "qna_vit_tiny.in1k": (_write_qna, "checkpoint_375000", 64),
    "san10_pairwise.in1k": (_write_san, "model_best.pth", 128),
}


def _logits(model, size, seed=1):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(x)


def _publish(capsys, *argv):
    assert cli.main(["publish", *map(str, argv)]) == 0
    return capsys.readouterr().out


def _folder_files(folder: Path) -> dict:
    return {p.name: p for p in folder.iterdir()}


def _assert_state_dict(model, want: dict):
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


# nat_mini is also in the floor tier: timm's save_for_hf and local-dir:/hf-hub: reload changed
# after timm's floor (1.0.29).
@pytest.mark.parametrize("tag", [
    pytest.param(tag, marks=[pytest.mark.floor] * (tag == "nat_mini.in1k")) for tag in OFFICIAL])
def test_official_checkpoint_publishes_a_folder_that_loads_identically_everywhere(
        tag, tmp_path, capsys):
    """publish --dry-run (which itself reloads the folder through local-dir: and requires the
    source's logits) -> the folder as an offline Hub cache -> hf-hub:ORG/NAME and the tag's
    pretrained=True hold the directly converted weights and give identical logits; config.json
    and README.md are timm's, with the card's facts."""
    write, filename, size = OFFICIAL[tag]
    checkpoint, out = tmp_path / filename, tmp_path / "out"
    write(checkpoint)
    repo_id = f"attnzoo-test/{tag}"
    printed = _publish(capsys, tag, checkpoint, "--repo-id", repo_id, "--out", out, "--dry-run")
    assert "--dry-run: nothing uploaded" in printed
    assert f"reloaded timm.create_model('local-dir:{out}', pretrained=True): logits identical" \
        in printed
    assert set(_folder_files(out)) == {"README.md", "config.json", "model.safetensors"}
    converted = hub.load_official(tag, checkpoint)

    cache, home = tmp_path / "hf", hub.hub_repo(tag)
    for repo in (repo_id, home):
        write_hf_cache(cache, repo, _folder_files(out), missing=())
    with offline_hf_cache(cache):
        models = [timm.create_model(f"hf-hub:{repo_id}", pretrained=True)]
        if timm.get_pretrained_cfg(tag).hf_hub_id == home:  # NAT's tags load the authors' repos
            models.append(timm.create_model(tag, pretrained=True))
    want = _logits(models[0], size)
    for model in models:
        _assert_state_dict(model, converted)
        assert torch.equal(_logits(model, size), want)

    arch = tag.split(".")[0]
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == arch and config["num_classes"] == 1000
    assert "num_classes" not in config.get("model_args", {})  # transformers passes it apart
    assert "label_names" not in config  # ImageNet-1k's: named from the head by timm's info
    assert config["pretrained_cfg"]["tag"] == "in1k" and "notes" not in config["pretrained_cfg"]

    text = (out / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    cfg = models[0].pretrained_cfg
    arxiv = cfg["paper_ids"].split(":")[1]
    assert front["library_name"] == "timm" and front["license"] == cfg["license"] == "mit"
    assert front["pipeline_tag"] == "image-classification"
    assert front["datasets"] == ["imagenet-1k"]
    assert {"timm", "attnzoo", f"arxiv:{arxiv}"} <= set(front["tags"])
    assert f"# Model card for {tag}" in text
    params = sum(p.numel() for p in models[0].parameters()) / 1e6
    assert f"Params (M): {params:.2f}" in text and "at 224x224" in text
    top1, where = hub.PAPER_TOP1[arch]
    assert f"| paper | {top1} | | {where} |" in text
    assert re.search(r"```bibtex\n@\w+\{", text) and f"abs/{arxiv}" in text
    usage = text[text.index("## Model Usage"):]
    assert usage.index("import attnzoo") < usage.index(f"timm.create_model('hf-hub:{repo_id}'")
    assert filename in text and cfg["origin_url"] in text


def _train_checkpoint(path, name, num_classes):
    """What timm's train.py (CheckpointSaver) saves, with model EMA."""
    torch.save({"epoch": 3, "arch": "visiontransformer",
                "state_dict": _random_state_dict(name, seed=1, num_classes=num_classes),
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]}, "version": 2,
                "args": argparse.Namespace(model=name, num_classes=num_classes, lr=1e-3),
                "metric": 12.5,
                "state_dict_ema": _random_state_dict(name, seed=2, num_classes=num_classes)},
               path)


def _image_folder(root: Path):
    """Two constant-colour 240x240 images per class: their eval transform is exact (a resize
    and crop of a constant image is that constant), so the oracle below needs no resampling."""
    colours = {"cls_a": [(255, 0, 0), (0, 0, 0)], "cls_b": [(0, 255, 0), (30, 60, 90)],
               "cls_c": [(0, 0, 255), (200, 200, 200)]}
    for label, cols in colours.items():
        (root / label).mkdir(parents=True)
        for i, c in enumerate(cols):
            Image.new("RGB", (240, 240), c).save(root / label / f"{i}.png")
    return [(c, i) for i, cols in enumerate(colours.values()) for c in cols]


def test_train_checkpoint_publishes_the_weights_asked_for(tmp_path, capsys):
    """A train.py checkpoint (3 classes, with EMA): its non-EMA weights by default, the EMA
    ones with --use-ema; --eval-dir's top-1 equals a count of the model's own answers, and its
    class folders name the classes."""
    name = "quest_vit_tiny_patch16_224"
    checkpoint, out = tmp_path / "checkpoint-3.pth.tar", tmp_path / "out"
    _train_checkpoint(checkpoint, name, num_classes=3)
    saved = torch.load(checkpoint, weights_only=False)
    model, source, model_args, from_args = hub.load_checkpoint_model(name, checkpoint)
    assert source == ("state_dict (non-EMA weights) of checkpoint-3.pth.tar, epoch 3; it also "
                      "holds state_dict_ema")
    assert from_args == "model arguments num_classes=3" and model_args == {}
    _assert_state_dict(model, saved["state_dict"])

    images = _image_folder(tmp_path / "images")
    printed = _publish(capsys, name, checkpoint, "--repo-id", "me/quest", "--out", out,
                       "--dry-run", "--use-ema", "--eval-dir", tmp_path / "images",
                       "--workers", "0")
    assert "took state_dict_ema (EMA weights) of checkpoint-3.pth.tar, epoch 3" in printed
    published = safetensors.torch.load_file(out / "model.safetensors")
    assert published.keys() == saved["state_dict_ema"].keys()
    assert all(torch.equal(published[k], v) for k, v in saved["state_dict_ema"].items())
    config = json.loads((out / "config.json").read_text())
    assert config["num_classes"] == 3 and config["label_names"] == ["cls_a", "cls_b", "cls_c"]
    assert "model_args" not in config  # nothing but the classes differs from the defaults
    model.load_state_dict(saved["state_dict_ema"])
    hub.check_reload(model, out)  # what publish did before writing "logits identical"
    with torch.no_grad():
        model.head.bias[0] += 1e-3
    with pytest.raises(ValueError, match=r"logits differ from the source's .*nothing uploaded"):
        hub.check_reload(model, out)

    model.load_state_dict(saved["state_dict_ema"])
    model.eval()
    mean, std = (torch.tensor(model.pretrained_cfg[k]) for k in ("mean", "std"))
    x = torch.stack([((torch.tensor(c, dtype=torch.float32) / 255 - mean) / std)[:, None, None]
                     .expand(3, 224, 224) for c, _ in images])
    with torch.no_grad():
        hits = (model(x).argmax(-1) == torch.tensor([y for _, y in images])).sum().item()
    top1 = 100 * hits / len(images)
    assert f"top-1 {top1:.2f}%" in printed
    card = (out / "README.md").read_text()
    # 3 classes on 3 images: said apart from the paper's ImageNet-1k top-1, never beside it
    assert f"on {len(images)} images (3 classes): top-1 {top1:.2f}" in card
    assert "| measured |" not in card and "not comparable with a paper's" in card
    model_card = hub.model_card(timm.create_model("nat_mini", device="meta"),
                                {"gmacs": 1.0, "ops": []},
                                evaluation=dict(top1=81.5, top5=95.6, images=50_000))
    assert "| measured | 81.50 | 95.60 |" in model_card["comparison"]  # the paper's own measure


def test_a_fine_tuned_checkpoint_is_not_published_as_the_official_weights(tmp_path, capsys):
    """nat_mini.in1k fine-tuned to 2 classes by train.py: its folder and card carry no "in1k"
    tag, no official origin and not the official licence ('other', or --license's); the card
    says what the head is. An official checkpoint keeps its tag, origin and licence."""
    name = "nat_mini.in1k"
    checkpoint = tmp_path / "checkpoint-0.pth.tar"
    _train_checkpoint(checkpoint, name, num_classes=2)
    for license_args, license in (([], "other"), (["--license", "apache-2.0"], "apache-2.0")):
        out = tmp_path / f"out-{license}"
        _publish(capsys, name, checkpoint, "--repo-id", "me/nat-pets", "--out", out, "--dry-run",
                 *license_args)
        cfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
        assert "tag" not in cfg and "origin_url" not in cfg
        assert cfg.get("license") == (None if license == "other" else license)
        card = (out / "README.md").read_text()
        front = yaml.safe_load(card.split("---\n")[1])
        assert front["license"] == license
        assert "in1k" not in card and "Neighborhood-Attention-Transformer" not in card.split(
            "## Citation")[0].replace("https://arxiv.org", "")
        assert "2, a head of its own (not ImageNet-1k's 1000 classes)" in card
    with pytest.raises(SystemExit):
        cli.main(["publish", name, str(checkpoint), "--repo-id", "me/x", "--license", "MIT!"])
    assert "a Hub licence id is lowercase" in capsys.readouterr().err

    official = tmp_path / "official.pth"
    torch.save({"model": nat_to_official(_random_state_dict("nat_mini"))}, official)
    out = tmp_path / "out-official"
    _publish(capsys, name, official, "--repo-id", "me/nat", "--out", out, "--dry-run")
    cfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    assert cfg["tag"] == "in1k" and cfg["license"] == "mit"
    assert cfg["origin_url"] == "https://github.com/SHI-Labs/Neighborhood-Attention-Transformer"
    # every file as a new file is under the umask (0644 with the usual 022; safetensors' own
    # was 0600): others can read the weights as they read the card
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(
        ("model.safetensors", "config.json", "README.md"), 0o666 & ~umask)


def test_a_model_whose_stem_is_not_three_channel_publishes_and_reloads_identically(
        tmp_path, capsys):
    """A 1-channel model (train.py --in-chans 1; its pretrained cfg still says 3 channels, as
    timm leaves it): publish checks, measures and reloads it on 1-channel images, and
    config.json's model_args says in_chans, so local-dir: rebuilds the same model."""
    name = "quest_vit_tiny_patch16_224"
    checkpoint, out = tmp_path / "last.pth.tar", tmp_path / "out"
    _tiny_train_checkpoint(checkpoint, in_chans=1)
    printed = _publish(capsys, name, checkpoint, "--repo-id", "me/gray", "--out", out,
                       "--dry-run")
    assert "logits of a random 1x32x32 image: finite" in printed
    assert "logits identical to the source's" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"]["in_chans"] == 1 and config["num_classes"] == 3
    model = hub.load_checkpoint_model(name, checkpoint).model
    reloaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(x), model(x))
    assert hub.input_shape(reloaded) == (1, 32, 32)
    assert set(hub.backends_here(model).values()) == {None}  # a forward on 1 channel: no op


def _tiny_classifier(num_classes: int, favourite: int):
    """A 32 px QUEST-ViT whose top-1 is always class ``favourite``."""
    model = quest_vit(num_classes=num_classes)
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, 32, 32)}
    with torch.no_grad():
        model.head.bias[favourite] = 1e3
    return model


def test_evaluate_scores_imagenet_synset_folders_against_their_imagenet_index(tmp_path):
    """A part of ImageNet val (2 synset folders, sorted indices 0 and 1) on a 1000-class head
    that always answers the second folder's ImageNet index: half the images are right (the
    folders' own indices would give 0%)."""
    synsets = timm.data.ImageNetInfo().label_names()
    for synset in (synsets[5], synsets[700]):
        (tmp_path / synset).mkdir()
        Image.new("RGB", (40, 40), (90, 20, 200)).save(tmp_path / synset / "0.png")
    result = hub.evaluate(_tiny_classifier(1000, 700), tmp_path)
    assert result["top1"] == 50.0
    assert result["classes"] == [synsets[5], synsets[700]] and result["images"] == 2


def test_evaluate_takes_other_folders_only_as_the_heads_classes(tmp_path):
    """Folders that are not ImageNet synsets: exactly one per class of the head, scored by
    their sorted order; else a one-line ValueError naming both counts (a top-1 of 3 folders on
    a 1000- or 4-class head would compare unrelated indices)."""
    _image_folder(tmp_path)  # cls_a, cls_b, cls_c, two images each
    with pytest.raises(ValueError, match=(
            r"^--eval-dir '.*' has 3 class folders \(cls_a, cls_b, cls_c\) and 6 images; the "
            r"1000-class head needs an ImageFolder with exactly 1000 class folders, in the "
            r"head's order when sorted or ImageNet-1k synset folders [^\n]*\)$")):
        hub.evaluate(_tiny_classifier(1000, 0), tmp_path)
    with pytest.raises(ValueError, match=r"has 3 class folders .* the 4-class head needs an "
                                         r"ImageFolder with exactly 4 class folders, in the "
                                         r"head's order when sorted$"):
        hub.evaluate(_tiny_classifier(4, 0), tmp_path)
    result = hub.evaluate(_tiny_classifier(3, 2), tmp_path)  # always cls_c
    assert result["top1"] == 100 * 2 / 6 and result["top5"] == 100.0
    assert result["classes"] == ["cls_a", "cls_b", "cls_c"]


def test_a_card_for_a_head_that_is_not_imagenets_says_what_classes_it_has():
    """A 4-class nat_mini.in1k (fine-tuned on other data): no ImageNet-1k dataset in the card
    or its front matter; its classes, named by --eval-dir's folders or not at all."""
    model = timm.create_model("nat_mini.in1k", num_classes=4, device="meta")
    facts = json.loads(FACTS.read_text())["models"]["nat_mini"]
    flowers = {"classes": ["anemone", "bluebell", "crocus", "daisy"], "top1": 50.0,
               "top5": 100.0, "images": 8}
    for evaluation, shown in ((flowers, "anemone, bluebell, crocus, daisy"),
                              (None, "no names (LABEL_0 to LABEL_3)")):
        card = hub.model_card(model, facts, repo_id="me/flowers", evaluation=evaluation)
        text = hub.readme(card, "flowers")
        assert "datasets" not in yaml.safe_load(text.split("---\n")[1])
        assert "ImageNet-1k**" not in text and "Dataset" not in card["details"]
        assert card["details"]["Classes"] == (
            f"4, a head of its own (not ImageNet-1k's 1000 classes): {shown}")
    assert "| | top-1 | top-5 | source |" in text
    model = timm.create_model("nat_mini.in1k", device="meta")
    card = hub.model_card(model, facts)
    assert card["details"]["Dataset"] == "ImageNet-1k" and "Classes" not in card["details"]


def _one_line_error(capsys, argv) -> str:
    """The one line `attnzoo publish ARGV` writes to stderr (all it writes there), status 2."""
    with pytest.raises(SystemExit) as info:
        cli.main(["publish", *map(str, argv)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("attnzoo publish: error: ") and err.count("\n") == 1 \
        and err.endswith("\n"), err
    return err.rstrip("\n")


def test_refusals_are_one_line_before_anything_is_written(tmp_path, capsys):
    checkpoint = tmp_path / "nat_mini.pth"
    _write_nat(checkpoint)
    data = checkpoint.read_bytes()
    out = tmp_path / "out"
    base = ["--repo-id", "org/name", "--out", out, "--dry-run"]
    line = _one_line_error(capsys, ["nat_tiny", checkpoint, *base])
    assert "checkpoint does not match NAT" in line and "missing from the checkpoint" in line
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(data[: len(data) // 2])
    assert "corrupted or truncated" in _one_line_error(capsys, ["nat_mini", truncated, *base])
    st = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(1000)}, st)
    st.write_bytes(st.read_bytes()[:-100])
    assert "corrupted or truncated" in _one_line_error(capsys, ["nat_mini", st, *base])
    for repo_id in ("nat_mini", "a/b/c", "org/with space", "org/"):
        line = _one_line_error(capsys, ["nat_mini", checkpoint, "--repo-id", repo_id, "--out",
                                        out, "--dry-run"])
        assert "--repo-id must be ORG/NAME" in line and repr(repo_id) in line
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _one_line_error(capsys, ["nat_mini", checkpoint, *base])
    assert "exists and is not an empty folder" in line
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "name").exists()


def _tiny_train_checkpoint(path, name="quest_vit_tiny_patch16_224", in_chans=None):
    """A train.py checkpoint of a 32 px, 2-block QUEST-ViT with 3 classes (--model-kwargs,
    --num-classes and --in-chans in its args)."""
    kwargs = dict(img_size=32, patch_size=8, embed_dim=24, depth=2, num_heads=3)
    state_dict = _random_state_dict(name, num_classes=3, in_chans=in_chans or 3, **kwargs)
    args = argparse.Namespace(model=name, num_classes=3, in_chans=in_chans, model_kwargs=kwargs)
    torch.save({"epoch": 0, "state_dict": state_dict, "args": args}, path)


def test_a_refusal_without_dry_run_uploads_nothing(tmp_path, capsys, monkeypatch):
    """A folder whose reload differs from the source (its weights changed once written) stops
    publish before the upload: the Hub server sees no request, no repo exists; the same run
    with the folder intact creates the repo (so the refusal, not the setup, kept it away)."""
    import huggingface_hub.constants as constants
    checkpoint = tmp_path / "last.pth.tar"
    _tiny_train_checkpoint(checkpoint)
    write = hub.write_hub_folder

    def write_then_change(model, out, *args, **kwargs):
        folder = write(model, out, *args, **kwargs)
        weights = safetensors.torch.load_file(folder / "model.safetensors")
        weights["head.bias"] += 1e-3
        safetensors.torch.save_file(weights, folder / "model.safetensors")
        return folder

    with HubServer() as server:
        for name, value in (("ENDPOINT", server.endpoint), ("HF_HUB_OFFLINE", False),
                            ("HF_HUB_DISABLE_XET", True)):
            monkeypatch.setattr(constants, name, value, raising=False)
        monkeypatch.setenv("HF_TOKEN", server.token)
        with monkeypatch.context() as patch:
            patch.setattr(hub, "write_hub_folder", write_then_change)
            line = _one_line_error(capsys, ["quest_vit_tiny_patch16_224", checkpoint,
                                            "--repo-id", "org/refused", "--out", tmp_path / "a"])
        assert "logits differ from the source's" in line and "nothing uploaded" in line
        assert server.requests == [] and server.repos == {}
        _publish(capsys, "quest_vit_tiny_patch16_224", checkpoint, "--repo-id", "org/refused",
                 "--out", tmp_path / "b")
        assert set(server.repos) == {"org/refused"}


def _package_publishing(tmp_path, tag) -> Path:
    """A copy of the attnzoo package whose only change is ``tag``'s weights record flipped to
    published (what a maintainer does after the upload): the folder to put on PYTHONPATH."""
    import shutil
    root = tmp_path / "published-pkg"
    shutil.copytree(Path(attnzoo.__file__).parent, root / "attnzoo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    record = root / "attnzoo" / "models" / "_weights.py"
    text = record.read_text()
    assert text.count(f"_project('{tag}')") == 1
    record.write_text(text.replace(f"_project('{tag}')", f"_project('{tag}', published=True)"))
    return root


def test_upload_round_trip_through_a_hub_server(tmp_path):
    """`attnzoo publish` (the real huggingface_hub client, in a subprocess) uploads to a Hub
    server on 127.0.0.1: the files that arrive are the folder's bytes. While the tag's record
    says unpublished, the tag is not pretrained and pretrained=True refuses in one line though
    the server has the repo; with the record flipped (and nothing else), in a fresh process with
    an empty cache, the tag is pretrained and its pretrained=True and hf-hub: download the
    published weights; without a token the private repo is one clear error."""
    tag = "san10_pairwise.in1k"
    repo_id = hub.hub_repo(tag)
    checkpoint, out = tmp_path / "model_best.pth", tmp_path / "out"
    _write_san(checkpoint)
    with HubServer() as server:
        publish = subprocess.run(
            [sys.executable, "-m", "attnzoo.cli", "publish", tag, str(checkpoint), "--repo-id",
             repo_id, "--out", str(out), "--private"],
            env=server.client_env(tmp_path / "hf-up"), capture_output=True, text=True,
            timeout=600)
        assert publish.returncode == 0, publish.stderr
        assert f"uploaded: {server.endpoint}/{repo_id}" in publish.stdout
        arrived = server.files(repo_id)
        assert arrived.pop(".gitattributes")
        assert arrived == {p.name: p.read_bytes() for p in out.iterdir()}
        assert server.repos[repo_id].private
        script = (
            "import os, sys, safetensors.torch, timm, torch\n"
            "try:\n"
            f"    timm.create_model('hf-hub:{repo_id}', pretrained=True)\n"
            "except RuntimeError as e:\n"
            "    print('WITHOUT ATTNZOO:', e)\n"
            "import attnzoo\n"
            "token = os.environ.pop('HF_TOKEN')\n"
            "try:\n"
            f"    timm.create_model('{tag}', pretrained=True)\n"
            "except OSError as e:\n"
            "    print('NO TOKEN:', e)\n"
            "os.environ['HF_TOKEN'] = token\n"
            "want = safetensors.torch.load_file(sys.argv[1])\n"
            "x = torch.randn(1, 3, 128, 128)\n"
            f"for name in ('{tag}', 'hf-hub:{repo_id}'):\n"
            "    model = timm.create_model(name, pretrained=True).eval()\n"
            "    got = model.state_dict()\n"
            "    same = got.keys() == want.keys() and all(torch.equal(got[k], v)\n"
            "                                             for k, v in want.items())\n"
            "    with torch.no_grad():\n"
            "        print(name, 'weights identical:', same, 'logits finite:',\n"
            "              bool(torch.isfinite(model(x)).all()))\n")
        state = ("import timm, attnzoo\n"
                 f"print('PRETRAINED:', timm.list_models('san10*', pretrained=True), "
                 f"timm.is_model_pretrained('{tag}'))\n"
                 "try:\n"
                 f"    timm.create_model('{tag}', pretrained=True)\n"
                 "except ValueError as e:\n"
                 "    print('REFUSED:', e)\n")
        env = server.client_env(tmp_path / "hf-down")
        before = subprocess.run([sys.executable, "-c", state], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert before.returncode == 0, before.stderr
        assert "PRETRAINED: [] False" in before.stdout
        assert f"REFUSED: {tag}: its weights are not on the Hugging Face Hub yet" in before.stdout
        env["PYTHONPATH"] = os.pathsep.join([str(_package_publishing(tmp_path, tag)),
                                             env.get("PYTHONPATH", "")])
        reload = subprocess.run(
            [sys.executable, "-c", script + "print('FROM', attnzoo.__file__)\n" + state,
             str(out / "model.safetensors")], env=env, cwd=tmp_path,
            capture_output=True, text=True, timeout=600)
        assert reload.returncode == 0, reload.stderr
    assert f"FROM {tmp_path / 'published-pkg'}" in reload.stdout
    assert f"PRETRAINED: ['{tag}'] True" in reload.stdout and "REFUSED" not in reload.stdout
    for name in (tag, f"hf-hub:{repo_id}"):
        assert f"{name} weights identical: True logits finite: True" in reload.stdout
    # timm alone knows no attnzoo architecture (its own message: the card says import attnzoo)
    assert "WITHOUT ATTNZOO: Unknown model (san10_pairwise)" in reload.stdout
    no_token = reload.stdout.split("NO TOKEN:", 1)[1].splitlines()[0]
    assert f"Hub repo {repo_id}: not found" in no_token and "private" in no_token
    assert "attnzoo convert san10_pairwise" in no_token
    # LFS content went to the pre-signed storage URL and came back from it without credentials
    cdn = [(method, sent_token) for method, path, sent_token in server.requests
           if path.startswith("cdn:")]
    assert ("PUT", False) in cdn and ("GET", False) in cdn and not any(t for _, t in cdn)


def test_upload_to_a_branch_leaves_main_alone(tmp_path, monkeypatch):
    """hub.upload's --revision path, in process against the same server (the client's
    endpoint and Xet switch are read at import: set here as the subprocesses get them)."""
    import huggingface_hub.constants as constants
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text('{"architecture": "nat_mini"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    with HubServer() as server:
        for name, value in (("ENDPOINT", server.endpoint), ("HF_HUB_OFFLINE", False),
                            ("HF_HUB_DISABLE_XET", True)):
            monkeypatch.setattr(constants, name, value, raising=False)
        monkeypatch.setenv("HF_TOKEN", server.token)
        url = hub.upload(folder, "org/branchy", revision="v1")
        assert url == f"{server.endpoint}/org/branchy/tree/v1"
        assert server.files("org/branchy", "v1") == {
            ".gitattributes": server.files("org/branchy")[".gitattributes"],
            "config.json": (folder / "config.json").read_bytes(),
            "model.safetensors": b"\0" * 64}
        assert set(server.files("org/branchy")) == {".gitattributes"}
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        with pytest.raises(ValueError, match="no Hugging Face token"):
            hub.upload(folder, "org/branchy")


def test_pretrained_is_one_clear_error_where_the_weights_cannot_be_had(tmp_path):
    """An unpublished tag: not on the Hub yet, the authors' link, convert and load; a published
    one offline with an empty cache: the repo and why; both one line, never a random model."""
    for tag, origin in (("qna_vit_tiny.in1k", "https://github.com/moabarar/qna"),
                        ("san10_pairwise.in1k", "https://github.com/hszhao/SAN")):
        arch = tag.split(".")[0]
        with pytest.raises(ValueError) as e:
            timm.create_model(tag, pretrained=True, device="meta")
        assert "\n" not in str(e.value)
        assert str(e.value) == (
            f"{tag}: its weights are not on the Hugging Face Hub yet (they are to be published "
            f"as attnzoo/{tag}); pretrained=True would give a randomly initialised model. "
            f"Download the official checkpoint from {origin}, convert it with `attnzoo convert "
            f"{arch} CHECKPOINT {arch}.safetensors`, then load it with timm.create_model("
            f"'{tag}', pretrained=True, pretrained_cfg_overlay=dict(file='{arch}.safetensors')).")
    with offline_hf_cache(tmp_path), pytest.raises(OSError, match=(
            r"^nat_mini.in1k: cannot load its weights from the Hugging Face Hub repo "
            r"shi-labs/nat-mini-in1k-224: offline: HF_HUB_OFFLINE is set .*attnzoo convert "
            r"nat_mini CHECKPOINT nat_mini.safetensors.*pretrained_cfg_overlay=dict\(file=")):
        timm.create_model("nat_mini.in1k", pretrained=True, device="meta")


def test_where_each_tags_weights_are_is_one_record():
    """Every tag with weights has one record (_weights.WEIGHTS); timm's view (hf_hub_id,
    list_models(pretrained=True), is_model_pretrained), info, the cards and docs' publishing
    table all follow it."""
    tags = {t for arch in attnzoo.list_models() for t in timm.list_models(arch, include_tags=True)
            if "." in t}
    assert tags == set(WEIGHTS)
    published = {t for t, w in WEIGHTS.items() if w.published}
    assert set(attnzoo.list_models(pretrained=True)) == published
    assert published == {t for t in tags if t.startswith(("nat_", "dinat_"))}
    for tag, record in WEIGHTS.items():
        cfg = timm.get_pretrained_cfg(tag)
        assert cfg.hf_hub_id == (record.repo if record.published else None)
        assert cfg.hf_hub_filename == (record.filename if record.published else None)
        assert timm.is_model_pretrained(tag) == record.published
    assert WEIGHTS["nat_mini.in1k"] == ("shi-labs/nat-mini-in1k-224", True, "pytorch_model.bin")
    assert WEIGHTS["san10_pairwise.in1k"] == ("attnzoo/san10_pairwise.in1k", False, None)
    table = hub.publish_table()
    assert ("| `nat_mini.in1k` | shi-labs/nat-mini-in1k-224 | attnzoo/nat_mini.in1k | "
            "`pytorch_model.bin` of https://huggingface.co/shi-labs/nat-mini-in1k-224 |") in table
    assert ("| `san10_pairwise.in1k` | nothing: not on the Hub yet | attnzoo/san10_pairwise.in1k "
            "| the official san10_pairwise checkpoint linked from https://github.com/hszhao/SAN "
            "|") in table
    assert hub.weights_source("nat_mini.in1k") == (
        "Hub repo shi-labs/nat-mini-in1k-224, the authors' upload (converted on load); a "
        "timm-native copy can be published as attnzoo/nat_mini.in1k, and the tag then pointed "
        "at it")
    assert hub.weights_source("san10_pairwise.in1k") == (
        "not on the Hub yet (to be published as attnzoo/san10_pairwise.in1k); the official "
        "checkpoint is at https://github.com/hszhao/SAN: `attnzoo convert` it and load the file "
        "(pretrained=True says how)")
    doc = (ROOT / "docs" / "publishing.md").read_text()
    assert table in doc, ("docs/publishing.md's publishing table is stale: "
                          "python scripts/make_model_cards.py")
    for tag in tags:
        assert f"`attnzoo publish {tag} CHECKPOINT --repo-id {hub.hub_repo(tag)} " in table
    # the cards of unpublished tags load the converted official file, never random weights
    # that would classify; a model without any weights says it is random
    cards = (ROOT / "MODEL_CARDS.md").read_text()
    assert ("# attnzoo convert san10_pairwise CHECKPOINT san10_pairwise.safetensors\n"
            "model = timm.create_model('san10_pairwise.in1k', pretrained=True, "
            "pretrained_cfg_overlay=dict(file='san10_pairwise.safetensors')).eval()") in cards
    assert "timm.create_model('nat_mini.in1k', pretrained=True)" in cards
    assert "pretrained=False).eval()  # no published weights: random until trained" in cards
    assert "pretrained=False).eval()\n" not in cards


def test_cards_say_which_backends_run_each_op_from_the_registry():
    """Per op the model's forward calls, each backend's machine-independent limit on those
    calls (Backend.limits): NAT's rpb, which NATTEN >= 0.20 lacks, a kernel size beyond the
    Triton kernels', ops NATTEN has not; gone when the model changes (no rpb: NATTEN runs it).
    One block per stage: the calls' kinds are the registered models'."""
    def backends_of(name, **kwargs):
        facts = hub.measure_facts(timm.create_model(name, device="meta", **kwargs))
        return facts["backends"], hub.backends_lines(name, facts)

    na, lines = backends_of("nat_mini", depths=(1, 1, 1, 1))
    assert na == {"na2d": {"torch": None, "cuda": None,
                           "natten": "NATTEN >= 0.20 has no relative positional bias (rpb)"}}
    line = ("`na2d`: torch: runs it; natten: no, NATTEN >= 0.20 has no relative positional "
            "bias (rpb); cuda: runs it")
    assert lines[0] == line and "`attnzoo info nat_mini` tries each on your machine" in lines[-1]
    cards = (ROOT / "MODEL_CARDS.md").read_text()
    section = cards[cards.index("## nat_mini\n"):cards.index("## nat_small\n")]
    assert f"- **Attention backends:**\n  - {line}\n" in section
    na, _ = backends_of("nat_mini", depths=(1, 1, 1, 1), rel_pos_bias=False, kernel_size=15)
    # the kernels' limits are declared in their module, which needs a usable Triton
    beyond = "attnzoo's Triton NA kernels support kernel sizes up to 13, got (15, 15)"
    assert na["na2d"] == {"torch": None, "natten": None,
                          "cuda": None if attnzoo.kernels.triton_missing() else beyond}
    san, lines = backends_of("san10_pairwise", depths=(1,) * 5)
    assert list(san) == ["san_subtraction", "san_subtraction2", "san_aggregation"]
    assert san["san_aggregation"] == {"torch": None, "natten": "NATTEN has no san_aggregation",
                                      "cuda": None}
    assert len(lines) == 4  # one per op, then where each backend runs
    qna, _ = backends_of("qna_vit_tiny", qna_depths=(1, 1, 1, 0), lsa_depths=(0, 0, 1, 1))
    assert qna["qna2d"]["natten"] == "NATTEN cannot express QnA"


def test_model_cards_md_is_generated_from_the_facts_file():
    facts = json.loads(FACTS.read_text())
    assert sorted(facts["models"]) == attnzoo.list_models(), \
        "scripts/model_card_facts.json is stale: python scripts/make_model_cards.py --measure"
    assert (ROOT / "MODEL_CARDS.md").read_text() == hub.model_cards_markdown(facts), \
        "MODEL_CARDS.md is stale: python scripts/make_model_cards.py"


# Measuring all 28 models takes about 25 s on 2 cores: the default tier measures the smallest
# model of each family (about 3 s), the slow tier the others.
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.slow] * (name not in smallest_per_family().values()))
    for name in attnzoo.list_models()])
def test_card_facts_are_what_the_model_measures(name):
    """scripts/model_card_facts.json (GMACs, ops, backends on the cards) against
    hub.measure_facts on the meta device: a stale figure fails here."""
    want = json.loads(FACTS.read_text())["models"][name]
    got = hub.measure_facts(timm.create_model(name, device="meta"))
    assert {k: want.get(k) for k in got} == got, \
        f"scripts/model_card_facts.json is stale: python scripts/make_model_cards.py " \
        f"--measure --models {name}"


def test_cli_info_names_sources_and_backends_here(capsys):
    assert cli.main(["info", "san10_pairwise.in1k"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("san10_pairwise: family san; paper: Exploring Self-attention")
    assert "parameters: 10.53 M; GMACs at 224x224: 2.05" in out
    assert "input sizes: any from 128x128 (default 224x224)" in out
    assert "san10_pairwise.in1k: not on the Hub yet (to be published as " \
        f"{hub.hub_repo('san10_pairwise.in1k')})" in out
    assert "license mit" in out and "paper ImageNet-1k top-1: 74.9" in out
    assert "  torch: runs it" in out and "  cuda: no: " in out
    # the model's calls, named; each refusal a phrase, not the probe call's signature
    assert "attnzoo ops of a 128x128 forward: san_subtraction x 10, san_subtraction2 x 10, " \
        "san_aggregation x 10" in out, out
    assert "The call: " not in out and "Backends that can" not in out and len(out) < 1500
    assert cli.main(["info", "quest_vit_tiny_patch16_224"]) == 0
    out = capsys.readouterr().out
    assert "pretrained tags: none" in out and "backends: none needed" in out


def test_list_pretrained_names_the_downloadable_tags_and_the_rest_apart(capsys):
    """stdout: the tags pretrained=True loads; stderr, one line: those not on the Hub yet."""
    assert cli.main(["list", "--pretrained"]) == 0
    captured = capsys.readouterr()
    assert set(captured.out.split()) == {t for t, w in WEIGHTS.items() if w.published}
    assert captured.err.startswith("not on the Hub yet, so not pretrained")
    assert captured.err.count("\n") == 1 and "qna_vit_base.in1k" in captured.err
    assert "san10_patchwise.in1k" in captured.err
    assert cli.main(["list", "--pretrained", "*mini*"]) == 0
    assert capsys.readouterr() == ("dinat_mini.in1k\nnat_mini.in1k\n", "")
