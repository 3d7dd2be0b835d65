"""Training from the configs, for real, on a generated ImageFolder (no network).

Each family's smallest model (at a tiny width, 32 px) trains a few dozen steps from its own
config: the config's optimizer, schedule, augmentation, mixup, loss and clipping, built by
timm's factories as train.py builds them (tests/timm_train.py), in train.py's loop (timm's
ClassificationTask). The overrides are only sizes, epochs and the lr: the recipe's lr at its own
global batch. The clean validation loss falls; timm's CheckpointSaver writes the checkpoints
train.py writes; resuming one (train.py's ``--resume``) restores the model and optimizer exactly;
``attnzoo publish --dry-run`` takes one (the model built with its ``--model-kwargs``), and the
folder it writes reloads through timm's ``local-dir:`` with the same validation logits.
QUEST's DeiT-3 recipe hands phase 1's checkpoint to phase 2 the way its config says.

With ``ATTNZOO_TIMM_CHECKOUT`` set to a timm clone, the ``slow`` tier runs that clone's own
train.py from each of these configs (``python -m attnzoo timm train.py --config ...``), one
epoch and a resumed second one.
"""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import PIL.ImageOps
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_dataset
from timm.task import ClassificationTask, resume_task_checkpoint
from timm.utils import CheckpointSaver, dispatch_clip_grad, random_seed

import timm_train
from attnzoo import cli

CLASSES = 4
# the recipe's peak lr, at its global batch (tests/test_train_configs.py checks the configs give it)
SMOKE = {"nat_mini": 1e-3, "qna_vit_tiny": 2e-3, "san10_pairwise": 0.1,
         "quest_vit_tiny_patch16_224": 1e-3}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: threads cost more than they save (10x on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pillow12_posterize(image, bits):
    """Pillow < 13's posterize: 0 bits kept is a black image (Pillow 13 raises instead)."""
    return image.point([i & ~(2 ** (8 - bits) - 1) for i in range(256)] * len(image.getbands()))


@pytest.fixture(autouse=True)
def posterize_as_pillow_12(monkeypatch):
    """timm <= 1.0.31's RandAugment with `inc1` (NAT, DiNAT, DeiT recipes) asks for 0-bit
    posterize when the sampled magnitude reaches 10 (2.3% of its draws at m9, mstd 0.5: about
    one image in 660); Pillow >= 13 rejects that with a ValueError, which ends a training run
    (docs/training.md, "Pillow 13": pip install "pillow<13"). The training here gets Pillow 12's
    result."""
    monkeypatch.setattr(PIL.ImageOps, "posterize", _pillow12_posterize)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """train/ and validation/ (train.py's default split names), one folder per class: a colour
    and a stripe direction per class, plus noise, so a tiny model learns it in a few dozen
    steps even under RandAugment, mixup and random erasing."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    colours = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]])
    grid = np.indices((40, 40))  # rows, columns
    for split, count in (("train", 16), ("validation", 4)):
        for k in range(CLASSES):
            folder = root / split / f"class{k}"
            folder.mkdir(parents=True)
            stripes = ((grid[k % 2] // 4) % 2)[..., None] * 40
            for i in range(count):
                pixels = colours[k] + stripes + rng.normal(0, 20, (40, 40, 3))
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def _setup(config_name, image_folder, **overrides):
    config = timm_train.read_config(timm_train.CONFIGS / f"{config_name}.yaml")
    tiny = dict(timm_train.TINY.get(config["model"], {}), **overrides.pop("model_kwargs", {}))
    sizes = dict(img_size=32, batch_size=8, workers=0, num_classes=CLASSES, epochs=6,
                 warmup_epochs=1, cooldown_epochs=0, aug_repeats=0)
    args = timm_train.train_args(config, **dict(sizes, **overrides),
                                 model_kwargs=dict(config.get("model_kwargs", {}), **tiny))
    random_seed(args.seed)  # as train.py: python's, numpy's and torch's generators
    model = timm_train.create_model(args)
    cfg = timm_train.data_config(args, model)
    train = timm_train.create_train_loader(
        args, create_dataset("", root=str(image_folder), split="train", is_training=True), cfg)
    val = timm_train.create_eval_loader(
        args, create_dataset("", root=str(image_folder), split="validation"), cfg)
    return args, model, train, val


def _train(args, model, loader):
    """train.py's loop: mixup, the task's loss, clipping, optimizer and scheduler steps."""
    task = ClassificationTask(model, criterion=timm_train.create_loss(args), verbose=False)
    optimizer = timm_train.create_optimizer(args, model)
    scheduler, epochs = timm_train.create_scheduler(args, optimizer, len(loader))
    mixup = timm_train.create_mixup(args)
    updates = 0
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            if mixup is not None:
                x, y = mixup(x, y)
            loss = task(x, y)["loss"]
            optimizer.zero_grad()
            loss.backward()
            if args.clip_grad is not None:
                dispatch_clip_grad(model.parameters(), args.clip_grad, mode=args.clip_mode)
            optimizer.step()
            updates += 1
            scheduler.step_update(num_updates=updates)
        scheduler.step(epoch + 1)
    return task, optimizer, epochs, updates


def _evaluate(model, loader):
    model.eval()
    with torch.no_grad():
        pairs = [(model(x), y) for x, y in loader]
    logits = torch.cat([p[0] for p in pairs])
    return logits, torch.nn.functional.cross_entropy(logits, torch.cat([p[1] for p in pairs]))


@pytest.mark.parametrize("config_name", sorted(SMOKE, key=list(timm_train.TINY).index),
                         ids=lambda n: n.split("_")[0])
def test_smallest_model_trains_from_its_config_resumes_and_publishes_its_checkpoint(
        config_name, image_folder, tmp_path, capsys):
    args, model, train, val = _setup(config_name, image_folder, lr=SMOKE[config_name])
    _, loss_before = _evaluate(model, val)
    task, optimizer, epochs, updates = _train(args, model, train)
    logits, loss_after = _evaluate(model, val)
    assert updates == epochs * len(train) >= 48  # 64 images in batches of 8, 6+ epochs
    assert loss_after < 0.8 * loss_before, (loss_before.item(), loss_after.item())

    saver = CheckpointSaver(model, optimizer, args=args, checkpoint_dir=str(tmp_path),
                            recovery_dir=str(tmp_path), decreasing=True, max_history=2,
                            task=task)
    saver.save_checkpoint(epochs - 1, metric=loss_after.item())
    assert {p.name for p in tmp_path.iterdir()} >= {"last.pth.tar", "model_best.pth.tar",
                                                     f"checkpoint-{epochs - 1}.pth.tar"}

    torch.manual_seed(1)  # another initialisation, which the checkpoint must replace
    fresh = timm_train.create_model(args)
    fresh_optimizer = timm_train.create_optimizer(args, fresh)
    fresh_task = ClassificationTask(fresh, criterion=timm_train.create_loss(args), verbose=False)
    epoch = resume_task_checkpoint(fresh_task, str(tmp_path / "last.pth.tar"),
                                   optimizer=fresh_optimizer, log_info=False)
    assert epoch == epochs  # train.py resumes at the epoch after the saved one
    assert torch.equal(_evaluate(fresh, val)[0], logits)
    state, fresh_state = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert fresh_state["param_groups"] == state["param_groups"]
    for i, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(fresh_state["state"][i][key]),
                               torch.as_tensor(value)), (i, key)

    out = tmp_path / "published"
    assert cli.main(["publish", args.model, str(tmp_path / "model_best.pth.tar"), "--repo-id",
                     "me/x", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "logits identical to the source's" in printed
    assert f"model arguments num_classes={CLASSES}" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"] == json.loads(json.dumps(args.model_kwargs))
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]  # train.py's data config
    reloaded = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert torch.equal(_evaluate(reloaded, val)[0], logits)


def test_deit3_phase2_loads_phase1_checkpoint_as_its_config_says(image_folder, tmp_path):
    """Phase 1 (32 px here) trains and saves; phase 2 (48 px) loads the file through
    ``--model-kwargs pretrained_cfg_overlay={'file': ...}`` with the config's pretrained: true:
    the position embedding is resampled, every other weight, the head included, is phase 1's."""
    tiny = timm_train.TINY["quest_vit_tiny_patch16_224"]
    args, model, train, _ = _setup("quest_deit3_base_patch16_224_phase1", image_folder,
                                   model_kwargs=dict(tiny, img_size=32), epochs=1, lr=3e-3)
    task, optimizer, epochs, _ = _train(args, model, train)
    saver = CheckpointSaver(model, optimizer, args=args, checkpoint_dir=str(tmp_path),
                            recovery_dir=str(tmp_path), task=task)
    saver.save_checkpoint(epochs - 1, metric=0.0)

    # num_classes: this test's 4 classes (the hub config says 1000, which would drop the head)
    overlay = dict(pretrained_cfg_overlay={"file": str(tmp_path / "last.pth.tar"),
                                           "num_classes": CLASSES})
    args2, model2, _, val = _setup("quest_deit3_base_patch16_224_phase2", image_folder,
                                   img_size=48, model_kwargs=dict(tiny, img_size=48, **overlay))
    assert args2.pretrained is True
    phase1, phase2 = model.state_dict(), model2.state_dict()
    assert phase2["pos_embed"].shape == (1, 36, tiny["embed_dim"]) != phase1["pos_embed"].shape
    for key, value in phase1.items():
        if key != "pos_embed":
            assert torch.equal(phase2[key], value), key
    assert _evaluate(model2, val)[0].shape == (4 * CLASSES, CLASSES)


@pytest.mark.slow
@pytest.mark.parametrize("config_name", sorted(SMOKE, key=list(timm_train.TINY).index),
                         ids=lambda n: n.split("_")[0])
def test_timm_train_py_trains_an_epoch_from_the_config_and_resumes(
        config_name, image_folder, tmp_path):
    checkout = os.environ.get("ATTNZOO_TIMM_CHECKOUT")
    if not checkout:
        pytest.skip("set ATTNZOO_TIMM_CHECKOUT to a timm clone to run its train.py")
    model = timm_train.read_config(timm_train.CONFIGS / f"{config_name}.yaml")["model"]
    command = [
        sys.executable, "-m", "attnzoo", "timm", "train.py",
        "--config", str(timm_train.CONFIGS / f"{config_name}.yaml"),
        "--data-dir", str(image_folder), "--device", "cpu", "--img-size", "32", "-b", "8",
        "--warmup-epochs", "0", "--cooldown-epochs", "0", "--workers", "0", "--num-classes",
        str(CLASSES), "--aug-repeats", "0", "--amp-dtype", "bfloat16", "--output", str(tmp_path),
        "--model-kwargs", *[f"{k}={v!r}" for k, v in timm_train.TINY[model].items()]]

    def train(*extra):
        proc = subprocess.run([*command, *extra], cwd=checkout, capture_output=True, text=True,
                              timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    train("--epochs", "1", "--experiment", "first")
    last = tmp_path / "first" / "last.pth.tar"
    assert last.is_file()
    log = train("--epochs", "2", "--experiment", "resumed", "--resume", str(last))
    assert "Train: 1 [" in log and "Train: 0 [" not in log  # resumed at the second epoch
    with open(tmp_path / "resumed" / "summary.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["1"]


@pytest.mark.slow
def test_the_short_job_of_docs_training_runs_as_written(image_folder, tmp_path):
    """docs/training.md's "A short job from a recipe": `attnzoo configs nat_mini --short`, then
    the clone's train.py from that file as it is and validate.py on its checkpoint, with the
    data's class count (at 224 px: the recipe's size)."""
    checkout = os.environ.get("ATTNZOO_TIMM_CHECKOUT")
    if not checkout:
        pytest.skip("set ATTNZOO_TIMM_CHECKOUT to a timm clone to run its train.py")
    short = tmp_path / "nat_mini_short.yaml"
    assert cli.main(["configs", "nat_mini", "--short", "--num-classes", str(CLASSES), "-o",
                     str(short)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for command in (
            [sys.executable, "-P", "train.py", "--config", str(short), "--data-dir",
             str(image_folder), "--output", str(tmp_path / "out"), "--experiment", "short"],
            [sys.executable, "-m", "attnzoo", "timm", "validate.py", "--data-dir",
             str(image_folder), "--split", "validation", "--model", "nat_mini",
             "--num-classes", str(CLASSES), "--checkpoint",
             str(tmp_path / "out" / "short" / "model_best.pth.tar"), "--device", "cpu",
             "-b", "8", "--results-file", str(tmp_path / "results.json"),
             "--results-format", "json"]):
        proc = subprocess.run(command, cwd=checkout, capture_output=True, text=True,
                              timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["model"] == "nat_mini" and 0 <= results["top1"] <= 100
