"""attnzoo's Hub folders in transformers: `AutoModelForImageClassification`,
`AutoImageProcessor` and `pipeline("image-classification")` run every family after `import
attnzoo`, exactly as timm runs the same folder.

Per family, one model: a checkpoint (random weights) -> `attnzoo publish --dry-run`, once per
session -> transformers loads the folder (its TimmWrapper classes build the model with timm), and
timm loads it through `local-dir:`. A folder, not a repo id from an offline cache: transformers
4.x fixes its cache folder at import, and fetching is huggingface_hub's part, which
tests/test_hub.py checks through timm's `hf-hub:`. The oracle is timm: its pixels
(`resolve_data_config` + `create_transform`), its logits, its class names (`ImageNetInfo` for an
ImageNet head, the `label_names` it reads from config.json for another head).
"""
import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import timm
import torch
from PIL import Image
from timm.data import ImageNetInfo, create_transform, infer_imagenet_subset, resolve_data_config
from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

import attnzoo
import timm_train
from attnzoo import cli, hub
from attnzoo.models import model_family

ORG = "attnzoo-test"
FLOWERS = ["anemone", "bluebell", "crocus", "daisy"]  # a head that is not ImageNet's
# family -> (the model published, its classes: None for ImageNet-1k's; else named by the
# --eval-dir ImageFolder publish is given)
FAMILIES = {
    "nat": ("nat_mini.in1k", None),
    "qna_vit": ("qna_vit_tiny.in1k", None),
    "san": ("san10_pairwise.in1k", None),
    "quest_vit": ("quest_vit_tiny_patch16_224", FLOWERS),
}


def test_one_model_of_every_family_is_checked():
    assert set(FAMILIES) == {model_family(n) for n in attnzoo.list_models()}


class Published:
    """`attnzoo publish --dry-run` of each family's model, on first use: ``folder(family)``, and
    the ``repo_id(family)`` publish was given."""

    def __init__(self, root):
        self.root, self.folders = root, {}

    def folder(self, family):
        if family not in self.folders:
            name, classes = FAMILIES[family]
            arch = name.split(".")[0]
            torch.manual_seed(0)
            model = timm.create_model(arch, num_classes=len(classes or range(1000)))
            checkpoint, out = self.root / f"{arch}.safetensors", self.root / name
            safetensors.torch.save_file(model.state_dict(), checkpoint)
            argv = ["publish", name, str(checkpoint), "--repo-id", self.repo_id(family), "--out",
                    str(out), "--dry-run"]
            if classes:
                argv += ["--eval-dir", str(self._image_folder(classes)), "--workers", "0"]
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                assert cli.main(argv) == 0
            assert "logits identical to the source's" in printed.getvalue()
            self.folders[family] = out
        return self.folders[family]

    def repo_id(self, family):
        return f"{ORG}/{FAMILIES[family][0]}"

    def _image_folder(self, classes):
        root = self.root / "images"
        for i, label in enumerate(classes):
            (root / label).mkdir(parents=True)
            Image.new("RGB", (40, 40), (60 * i, 255 - 60 * i, 128)).save(root / label / "0.png")
        return root


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return Published(tmp_path_factory.mktemp("published"))


def _image():
    """A generated 300x257 RGB image (not square: the resize and the crop both matter)."""
    gen = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 10, 9, generator=gen),
                                             size=(257, 300), mode="bilinear")[0]
    pixels = (smooth * 200 + torch.rand(3, 257, 300, generator=gen) * 55).to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


# nat_mini is also in the floor tier (transformers 4.57 on the lowest torch and timm)
@pytest.mark.parametrize("family", [
    pytest.param(family, id=name, marks=[pytest.mark.floor] * (family == "nat"))
    for family, (name, _) in FAMILIES.items()])
def test_transformers_runs_the_published_folder_with_timms_pixels_logits_and_class_names(
        family, published):
    folder = published.folder(family)
    reference = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    classifier = pipeline("image-classification", model=str(folder))
    image = _image()

    # timm's eval transform for the model, resolved from the model as timm's scripts do
    want_pixels = create_transform(**resolve_data_config({}, model=reference))(image)[None]
    pixels = processor(image, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, want_pixels)
    weights = model.timm_model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in reference.state_dict().items())
    with torch.no_grad():
        want = reference(want_pixels)
        logits = model(pixel_values=pixels).logits
    # Same weights, same ops; not always the same bits: transformers 5 leaves parameters at
    # addresses that are not 64-byte aligned, and the CPU's matmul kernels then sum in another
    # order (measured on nat_mini: max |diff| 9e-8, 0 once the parameters are copied to fresh,
    # aligned memory). So float32's rounding tolerance.
    torch.testing.assert_close(logits, want)

    classes = FAMILIES[family][1]
    if classes:  # names written by publish, read back by both libraries
        assert reference.pretrained_cfg["label_names"] == classes
        names = classes
    else:  # an ImageNet-1k head: timm's own ImageNet info names it in both libraries
        assert "label_names" not in reference.pretrained_cfg
        names = ImageNetInfo(infer_imagenet_subset(reference)).label_descriptions()
        assert len(names) == 1000
    assert [model.config.id2label[i] for i in range(len(names))] == names

    answer = classifier(image, top_k=3)
    top = want[0].softmax(-1).topk(3)
    assert [a["label"] for a in answer] == [names[i] for i in top.indices]
    assert [a["score"] for a in answer] == pytest.approx(top.values.tolist(), rel=1e-5)


# Every family in the floor tier too: the config.json publish writes (model_args of a run's
# --model-kwargs, lists where they were tuples) must build the model in timm 1.0.29's local-dir:
# and transformers 4.57's TimmWrapper. Tiny widths at 32 px: about 2 s a family.
@pytest.mark.floor
@pytest.mark.parametrize("name", list(timm_train.TINY), ids=lambda n: n.split("_")[0])
def test_a_tiny_train_checkpoint_of_every_family_publishes_a_folder_timm_and_transformers_load(
        name, tmp_path):
    kwargs = timm_train.TINY[name]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=3, **kwargs).eval()
    checkpoint, out = tmp_path / "last.pth.tar", tmp_path / "out"
    args = argparse.Namespace(model=name, num_classes=3, model_kwargs=kwargs, img_size=32)
    torch.save({"epoch": 0, "state_dict": model.state_dict(), "args": args}, checkpoint)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main(["publish", name, str(checkpoint), "--repo-id", f"{ORG}/tiny", "--out",
                         str(out), "--dry-run"]) == 0
    assert "logits identical to the source's" in printed.getvalue()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        assert torch.equal(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), want)
        wrapped = AutoModelForImageClassification.from_pretrained(out).eval()
        torch.testing.assert_close(wrapped(pixel_values=x).logits, want)  # see the test above
    assert wrapped.config.model_args == json.loads(json.dumps(kwargs))


def test_each_kind_of_head_gets_its_class_names():
    """ImageNet heads (a tag's, an untagged 1000-class model's, one evaluated on ImageNet's own
    synset folders) write no names: timm and transformers infer ImageNet-1k's from the head, as
    for timm's own repos; an ImageFolder that names every class of another head names it;
    fewer folders than classes name nothing."""
    synsets = ImageNetInfo().label_names()
    for name, num_classes, folders in (("nat_mini.in1k", 1000, None),
                                       ("quest_vit_tiny_patch16_224", 1000, None),
                                       ("san10_pairwise", 1000, synsets)):
        fields, card = hub.class_names(timm.create_model(name, device="meta"), folders)
        assert fields == {}
        assert card.startswith("imagenet-1k's 1000 classes") and "tench, Tinca tinca" in card
    model = timm.create_model("quest_vit_tiny_patch16_224", num_classes=4, device="meta")
    fields, card = hub.class_names(model, FLOWERS)
    assert fields == {"label_names": FLOWERS}
    assert "anemone, bluebell, crocus, daisy" in card and "--eval-dir" in card
    fields, card = hub.class_names(model, FLOWERS[:2])
    assert fields == {}
    assert card.startswith("4 classes without names") and "`LABEL_0` to `LABEL_3`" in card


def test_without_import_attnzoo_transformers_fails_as_the_card_says(published):
    """A fresh process that never imports attnzoo: transformers cannot build the architecture
    and raises the error the card quotes; the card shows the transformers usage with `import
    attnzoo` first, on the repo publish was given."""
    folder = published.folder("nat")
    script = ("from transformers import AutoModelForImageClassification\n"
              "try:\n"
              "    AutoModelForImageClassification.from_pretrained(__import__('sys').argv[1])\n"
              "except Exception as e:\n"
              "    print(f'{type(e).__name__}: {e}')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # attnzoo reachable or not, the script never imports it
    run = subprocess.run([sys.executable, "-c", script, str(folder)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    quoted = hub.TRANSFORMERS_WITHOUT_ATTNZOO.format(arch="nat_mini")
    assert quoted in run.stdout

    card = (folder / "README.md").read_text()
    usage = card[card.index("With transformers"):]
    assert f"`{quoted}...`" in usage
    assert usage.index("import attnzoo") < usage.index("from transformers import pipeline")
    assert f'repo = "{published.repo_id("nat")}"\nclassifier = pipeline(' in usage
