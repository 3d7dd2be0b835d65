"""configs/*.yaml: timm's train.py reads each as it is, and builds the paper's recipe from it.

train.py ignores a config key it does not know and converts no value, so the first tests check
every key against its options and every value against the option's type (the option table in
timm_train_options.json, read from a timm clone's train.py). The others build what train.py would
build from each config at the recipe's global batch, with timm's own factories
(tests/timm_train.py), on the model it names (on the meta device: no weights are computed), and
compare it with the recipe's facts written below, independently of the configs: optimizer and
its settings, the parameters it decays, the lr at warmup start, peak and end, the number of
epochs, the augmentation in the transforms, mixup and the loss. The facts come from
../shared/specs/training.md and the official repositories each config names.
"""
import argparse
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import pytest
import torch

import attnzoo
import timm_train
from timm_train_options import check_config, load_table, read_options, timm_version

IMAGENET_TRAIN = 1281167  # images; train.py's training loader drops the last partial batch


class Recipe(NamedTuple):
    optimizer: str
    settings: dict                       # optimizer.defaults the recipe fixes
    weight_decay: float
    exempt: Callable[[str, torch.Tensor], bool]  # parameters the recipe does not decay
    global_batch: int
    peak_lr: float
    per_step: bool                       # lr stepped per update (else per epoch)
    lr: Callable[..., float]             # the recipe's lr at step/epoch t
    clip_grad: Optional[float]
    randaugment: Optional[str]           # "inc" (timm's inc1 ops), "tf" (TF's ops), "3a", None
    color_jitter: Optional[float]        # colour jitter strength left in the transform
    grayscale: Optional[float]
    reprob: float
    train_interpolation: tuple
    mixup: bool                          # DeiT's mixup 0.8 / cutmix 1.0, p 1, switch 0.5, batch
    smoothing: float
    loss: str
    eval_interpolation: str
    eval_resize: int                     # at 224 px
    aug_repeats: int
    amp: bool


def _warmup_cosine(t, warmup, total, peak, start, floor):
    """Linear warmup from ``start`` over ``warmup``, then a cosine from ``peak`` to ``floor`` whose
    phase counts from 0 (the warmup inside the cosine's length, as timm's and DeiT's)."""
    if t < warmup:
        return start + t * (peak - start) / warmup
    if t >= total:
        return floor
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t / total))


def _nat_lr(s, updates, epochs, warmup):
    return _warmup_cosine(s, 20 * updates, 300 * updates, 1e-3, 1e-6, 5e-6)


def _qna_lr(s, updates, epochs, warmup):
    # optax: linear 0 -> peak over the warmup, then cosine_decay_schedule over the rest to 0
    w, total = warmup * updates, 300 * updates
    if s < w:
        return 2e-3 * s / w
    return 2e-3 * 0.5 * (1 + math.cos(math.pi * min(s - w, total - w) / (total - w)))


def _san_lr(e, updates, epochs, warmup):
    return 0.1 * 0.5 * (1 + math.cos(math.pi * e / 100))  # torch's CosineAnnealingLR(T_max=100)


def _deit_lr(peak):
    return lambda e, updates, epochs, warmup: _warmup_cosine(e, 5, epochs, peak, 1e-6, 1e-5)


def _decayed_2d_but(*suffixes):
    return lambda name, p: p.ndim <= 1 or name.endswith(".bias") or name.endswith(suffixes)


_ADAMW = dict(optimizer="AdamW", settings=dict(eps=1e-8, betas=(0.9, 0.999)))
_MIXUP = dict(mixup=True, loss="SoftTargetCrossEntropy")
_DEIT = dict(exempt=_decayed_2d_but("pos_embed", "cls_token"), per_step=False, clip_grad=None,
             train_interpolation=("bicubic",), eval_interpolation="bicubic", amp=True)
RECIPES = {
    "nat": Recipe(**_ADAMW, weight_decay=0.05, exempt=_decayed_2d_but(".rpb"),
                  global_batch=1024, peak_lr=1e-3, per_step=True, lr=_nat_lr, clip_grad=5.0,
                  randaugment="inc", color_jitter=None, grayscale=None, reprob=0.25,
                  train_interpolation=("bilinear", "bicubic"), **_MIXUP, smoothing=0.1,
                  eval_interpolation="bicubic", eval_resize=256, aug_repeats=0, amp=True),
    "qna": Recipe(**_ADAMW, weight_decay=0.05,
                  exempt=lambda name, p: name.endswith(
                      (".rpb", ".window_weights", ".relative_position_bias_table")),
                  global_batch=1024, peak_lr=2e-3, per_step=True, lr=_qna_lr, clip_grad=None,
                  randaugment="tf", color_jitter=None, grayscale=0.2, reprob=0.25,
                  train_interpolation=("bicubic",), **_MIXUP, smoothing=0.1,
                  eval_interpolation="bicubic", eval_resize=256, aug_repeats=0, amp=True),
    "san": Recipe(optimizer="SGD", settings=dict(momentum=0.9, nesterov=False),
                  weight_decay=1e-4, exempt=lambda name, p: False, global_batch=256,
                  peak_lr=0.1, per_step=False, lr=_san_lr, clip_grad=None, randaugment=None,
                  color_jitter=None, grayscale=None, reprob=0.0,
                  train_interpolation=("bilinear",), mixup=False, smoothing=0.1,
                  loss="LabelSmoothingCrossEntropy", eval_interpolation="bilinear",
                  eval_resize=256, aug_repeats=0, amp=False),
    "deit": Recipe(**_ADAMW, **_DEIT, weight_decay=0.05, global_batch=1024, peak_lr=1e-3,
                   lr=_deit_lr(1e-3), randaugment="inc", color_jitter=None, grayscale=None,
                   reprob=0.25, **_MIXUP, smoothing=0.1, eval_resize=256, aug_repeats=3),
    "deit3_phase1": Recipe(optimizer="Lamb", settings=dict(eps=1e-8), **_DEIT, weight_decay=0.05,
                           global_batch=2048, peak_lr=3e-3, lr=_deit_lr(3e-3), randaugment="3a",
                           color_jitter=0.3, grayscale=None, reprob=0.0, mixup=True,
                           smoothing=0.0, loss="BinaryCrossEntropy", eval_resize=224,
                           aug_repeats=3),
    "deit3_phase2": Recipe(**_ADAMW, **_DEIT, weight_decay=0.1, global_batch=512, peak_lr=1e-5,
                           lr=_deit_lr(1e-5), randaugment="inc", color_jitter=None,
                           grayscale=None, reprob=0.0, **_MIXUP, smoothing=0.1, eval_resize=224,
                           aug_repeats=0),
}


class Fact(NamedTuple):
    recipe: str
    top1: float          # the paper's ImageNet-1k top-1 (after phase 2 for DeiT-3)
    drop_path: Optional[float]
    epochs: int          # epochs train.py runs, warmup and cooldown included
    warmup: int = 0      # warmup epochs where the recipe varies them per model
    img_size: int = 224


_NAT = dict(nat_mini=(81.8, 0.2), nat_tiny=(83.2, 0.2), nat_small=(83.7, 0.3),
            nat_base=(84.3, 0.5), dinat_mini=(81.8, 0.2), dinat_tiny=(82.7, 0.2),
            dinat_small=(83.8, 0.3), dinat_base=(84.4, 0.5))
_QNA = dict(qna_vit_tiny=(81.7, 0.05, 5), qna_vit_tiny_7x7=(82.0, 0.05, 5),
            qna_vit_small=(83.2, 0.2, 5), qna_vit_base=(83.7, 0.5, 20))
_SAN = dict(san10_pairwise=74.9, san10_patchwise=77.1, san15_pairwise=76.6,
            san15_patchwise=78.0, san19_pairwise=76.9, san19_patchwise=78.2)
_DEIT_RUNS = dict(tiny=(73.4, 300), small=(80.2, 200), base=(79.7, 100), large=(74.9, 100))
_DEIT3_RUNS = dict(base_patch16=(83.2, 0.2, 0.2, 192), large_patch16=(84.1, 0.45, 0.45, 192),
                   huge_patch14=(83.4, 0.6, 0.55, 126))
FACTS = {
    **{name: Fact("nat", top1, dp, 310) for name, (top1, dp) in _NAT.items()},
    **{name: Fact("qna", top1, dp, 300, warmup) for name, (top1, dp, warmup) in _QNA.items()},
    **{name: Fact("san", top1, None, 100) for name, top1 in _SAN.items()},
    **{f"quest_vit_{size}_patch16_224": Fact("deit", top1, 0.1, epochs)
       for size, (top1, epochs) in _DEIT_RUNS.items()},
    **{f"quest_deit3_{size}_224_phase1": Fact("deit3_phase1", top1, dp1, 400, img_size=px)
       for size, (top1, dp1, dp2, px) in _DEIT3_RUNS.items()},
    **{f"quest_deit3_{size}_224_phase2": Fact("deit3_phase2", top1, dp2, 20)
       for size, (top1, dp1, dp2, px) in _DEIT3_RUNS.items()},
}
# registered models without a config, and why
NO_RECIPE = {name: "its ImageNet-22k pre-training recipe is unpublished"
             for name in ("dinat_large", "dinat_large_384", "dinat_large_11x11_384")}

CONFIG_NAMES = [path.stem for path in timm_train.config_paths()]


def _model_of(config_name: str) -> str:
    return re.sub(r"_phase[12]$", "", config_name)


@functools.lru_cache(maxsize=None)
def _built(name: str):
    """train.py's arguments at the recipe's global batch and its model, on the meta device."""
    fact = FACTS[name]
    config = timm_train.read_config(timm_train.CONFIGS / f"{name}.yaml")
    processes = RECIPES[fact.recipe].global_batch // config["batch_size"]
    # phase 2 loads phase 1's file (checked in test_train_smoke.py); no file here
    args = timm_train.train_args(config, world_size=processes, pretrained=False, workers=0)
    with torch.device("meta"):
        model = timm_train.create_model(args)
    return args, model


def test_there_is_a_config_per_registered_model_with_a_published_recipe():
    models = {_model_of(name) for name in CONFIG_NAMES}
    assert set(CONFIG_NAMES) == set(FACTS)
    assert models | set(NO_RECIPE) == set(attnzoo.list_models())
    assert not models & set(NO_RECIPE)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_keys_are_train_py_options_and_values_have_their_types(name):
    config = timm_train.read_config(timm_train.CONFIGS / f"{name}.yaml")
    check_config(config)
    assert config["device_modules"] == ["attnzoo"]
    assert config["model"] == _model_of(name)


def test_the_option_table_is_the_one_read_from_a_timm_checkout():
    checkout = os.environ.get("ATTNZOO_TIMM_CHECKOUT")
    if not checkout:
        pytest.skip("set ATTNZOO_TIMM_CHECKOUT to a timm clone to compare the table with its "
                    "train.py")
    table = load_table()
    train_py = Path(checkout) / "train.py"
    assert table["timm_version"] == timm_version(Path(checkout))
    # as JSON stores it (tuples become lists)
    assert table["options"] == json.loads(json.dumps(read_options(train_py.read_text())))


def _header(name: str) -> str:
    text = (timm_train.CONFIGS / f"{name}.yaml").read_text()
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_header_names_sources_reference_batch_lr_rule_and_expected_top1(name):
    fact, header = FACTS[name], _header(name)
    recipe = RECIPES[fact.recipe]
    config = timm_train.read_config(timm_train.CONFIGS / f"{name}.yaml")
    top1 = re.search(r"^# Top-1 to expect[^:]*: ([0-9.]+) \((.+?)[,:)]", header, re.M)
    assert top1 and float(top1.group(1)) == fact.top1 and "paper" in top1.group(2)
    assert re.search(r"^# Sources: \S+", header, re.M)
    batch = re.search(r"^# Global batch: (\d+) = (\d+) processes x batch_size (\d+)\b", header,
                      re.M)
    assert batch, "the header states the reference global batch and how it splits"
    total, processes, per_process = map(int, batch.groups())
    assert total == processes * per_process == recipe.global_batch
    assert per_process == config["batch_size"]
    assert "lr = lr_base x global batch / lr_base_size" in header
    assert re.search(r"^# (Where timm has no exact equivalent|Phase 1's weights)", header, re.M)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_lr_follows_the_global_batch_and_is_the_recipes_at_its_batch(name):
    args, _ = _built(name)
    recipe = RECIPES[FACTS[name].recipe]
    assert args.lr == pytest.approx(recipe.peak_lr, rel=1e-12)
    config = timm_train.read_config(timm_train.CONFIGS / f"{name}.yaml")
    processes = recipe.global_batch // config["batch_size"]
    half = timm_train.train_args(config, world_size=processes // 2)
    assert half.lr == pytest.approx(recipe.peak_lr / 2, rel=1e-12)  # linear, whatever the opt
    # fewer processes, the same global batch through gradient accumulation: the same lr
    accum = timm_train.train_args(config, world_size=1, grad_accum_steps=processes)
    assert accum.lr == pytest.approx(recipe.peak_lr, rel=1e-12)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_optimizer_settings_and_decayed_parameters_are_the_recipes(name):
    args, model = _built(name)
    recipe = RECIPES[FACTS[name].recipe]
    optimizer = timm_train.create_optimizer(args, model)
    assert type(optimizer).__name__ == recipe.optimizer
    for key, value in recipe.settings.items():
        got = optimizer.defaults[key]
        assert (tuple(got) if isinstance(got, list) else got) == value, key
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0
               for p in g["params"]}
    assert {g["weight_decay"] for g in optimizer.param_groups} - {0.0} == {recipe.weight_decay}
    assert decayed == {n for n, p in model.named_parameters() if not recipe.exempt(n, p)}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)
    assert args.clip_grad == recipe.clip_grad and args.clip_mode == "norm"


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_lr_schedule_matches_the_recipe_at_warmup_peak_and_end(name):
    args, model = _built(name)
    fact = FACTS[name]
    recipe = RECIPES[fact.recipe]
    updates = IMAGENET_TRAIN // recipe.global_batch
    optimizer = timm_train.create_optimizer(args, model)
    scheduler, epochs = timm_train.create_scheduler(args, optimizer, updates)
    assert epochs == fact.epochs
    assert scheduler.t_in_epochs is not recipe.per_step
    length = epochs * updates if recipe.per_step else epochs
    warmup = (fact.warmup or args.warmup_epochs) * (updates if recipe.per_step else 1)
    points = sorted({0, warmup // 2, warmup, (warmup + length) // 2, length - 1})
    for t in points:
        if recipe.per_step:
            scheduler.step_update(num_updates=t)
        else:
            scheduler.step(t)
        expected = recipe.lr(t, updates, epochs, fact.warmup)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-6, abs=1e-12), t


def _transform_ops(transform):
    return {type(t).__name__: t for t in transform.transforms}


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_augmentation_mixup_and_loss_are_the_recipes(name):
    args, model = _built(name)
    fact = FACTS[name]
    recipe = RECIPES[fact.recipe]
    cfg = timm_train.data_config(args, model)
    assert cfg["input_size"] == (3, fact.img_size, fact.img_size)

    class NoImages(torch.utils.data.Dataset):
        transform = None

        def __len__(self):
            return 1

    # repeated augmentation changes the sampler (under DDP only), not the transform
    assert args.aug_repeats == recipe.aug_repeats
    one_process = argparse.Namespace(**{**vars(args), "aug_repeats": 0})
    train = _transform_ops(
        timm_train.create_train_loader(one_process, NoImages(), cfg).dataset.transform)
    crop = train["RandomResizedCropAndInterpolation"]
    assert crop.size == (fact.img_size,) * 2 and crop.scale == (0.08, 1.0)
    assert tuple(str(m.value) for m in (
        crop.interpolation if isinstance(crop.interpolation, (list, tuple))
        else [crop.interpolation])) == recipe.train_interpolation
    assert train["RandomHorizontalFlip"].p == 0.5
    randaugment = train.get("RandAugment")
    if recipe.randaugment in ("inc", "tf"):
        assert randaugment.num_layers == 2
        assert {(op.magnitude, op.magnitude_std, op.prob) for op in randaugment.ops} == \
            {(9, 0.5, 0.5)}
        increasing = {op.name for op in randaugment.ops if op.name.endswith("Increasing")}
        assert bool(increasing) == (recipe.randaugment == "inc")
    else:
        assert randaugment is None
    three = train.get("AutoAugment")
    assert (three is not None) == (recipe.randaugment == "3a")
    if three is not None:
        assert {op.name for ops in three.policy for op in ops} == \
            {"Solarize", "Desaturate", "GaussianBlurRand"}
    jitter = train.get("ColorJitter")
    strength = jitter and jitter.brightness and 1 - jitter.brightness[0]
    assert strength == pytest.approx(recipe.color_jitter) if recipe.color_jitter else not strength
    assert getattr(train.get("RandomGrayscale"), "p", None) == recipe.grayscale
    erasing = train.get("RandomErasing")
    assert (erasing.probability, erasing.mode) == (recipe.reprob, "pixel") if recipe.reprob \
        else erasing is None

    evaluate = _transform_ops(
        timm_train.create_eval_loader(args, NoImages(), cfg).dataset.transform)
    resize = recipe.eval_resize * fact.img_size // 224
    assert (evaluate["Resize"].size, str(evaluate["Resize"].interpolation.value)) == \
        (resize, recipe.eval_interpolation)
    assert evaluate["CenterCrop"].size == (fact.img_size,) * 2

    mixup = timm_train.create_mixup(args)
    if recipe.mixup:
        assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.mix_prob, mixup.switch_prob,
                mixup.mode, mixup.label_smoothing) == (0.8, 1.0, 1.0, 0.5, "batch",
                                                       recipe.smoothing)
    else:
        assert mixup is None
    loss = timm_train.create_loss(args)
    assert type(loss).__name__ == recipe.loss
    if recipe.loss == "BinaryCrossEntropy":  # DeiT-3: BCEWithLogitsLoss on targets.gt(0.0)
        logits, mixed = torch.randn(2, 4), torch.tensor([[0.7, 0.3, 0, 0], [0, 0, 0.2, 0.8]])
        torch.testing.assert_close(loss(logits, mixed), torch.nn.functional.
                                   binary_cross_entropy_with_logits(logits, (mixed > 0).float()))
    if recipe.loss == "LabelSmoothingCrossEntropy":
        assert loss.smoothing == recipe.smoothing


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_model_drop_path_precision_ema_and_batchnorm_are_the_recipes(name):
    args, model = _built(name)
    fact = FACTS[name]
    recipe = RECIPES[fact.recipe]
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    if fact.drop_path is None:
        assert not rates and args.drop_path is None
    else:
        assert max(rates) == pytest.approx(fact.drop_path)
    assert args.amp is recipe.amp and args.model_ema is False
    if fact.recipe == "san":  # per-process BatchNorm statistics, as the official runs
        assert args.sync_bn is False and args.dist_bn == ""
    if fact.recipe == "deit3_phase2":
        assert args.pretrained is False  # overridden: the config itself asks for phase 1's file
        assert timm_train.read_config(timm_train.CONFIGS / f"{name}.yaml")["pretrained"] is True


def test_docs_table_lists_every_config_with_its_expected_top1():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text()
    section = doc.split("\n## The recipes", 1)[1].split("\n## ", 1)[0]
    for name, fact in FACTS.items():
        row = re.search(rf"^\| `{name}` \|[^\n]*$", section, re.M)
        assert row, f"docs/training.md's recipe table has no row for {name}"
        assert re.search(rf"\| {fact.top1}( after phase 2)? \|$", row.group(0)), row.group(0)
    for name, reason in NO_RECIPE.items():
        assert name in section


def _recipe_augmentations():
    import yaml
    from attnzoo.configs import recipe_names, recipe_path
    return sorted({yaml.safe_load(recipe_path(n).read_text()).get("aa") for n in recipe_names()}
                  - {None})


@pytest.mark.parametrize("aa", _recipe_augmentations())
def test_every_augmentation_op_of_the_recipes_runs_with_the_installed_pillow(aa):
    """Each recipe's auto-augmentation, every op at its strongest (magnitude 10, no noise), on
    the installed timm and Pillow: timm <= 1.0.31's PosterizeIncreasing asks Pillow >= 13 for 0
    bits, which stops NAT's, DiNAT's and DeiT's recipes in their first epoch (the ``train`` and
    ``dev`` extras keep Pillow below 13)."""
    from PIL import Image
    from timm.data import create_transform
    from timm.data.auto_augment import AugmentOp
    image = Image.radial_gradient("L").convert("RGB").resize((32, 32))
    ops = [t for t in create_transform(32, is_training=True, auto_augment=aa).transforms
           if hasattr(t, "ops") or hasattr(t, "policy")]
    ops = [op for t in ops for op in (t.ops if hasattr(t, "ops") else
                                       [o for sub in t.policy for o in sub])]
    assert ops and all(isinstance(op, AugmentOp) for op in ops)
    for op in ops:
        strongest = AugmentOp(op.name, prob=1.0, magnitude=10, hparams={
            **op.hparams, "magnitude_std": 0})
        assert strongest(image).size == image.size, op.name


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_the_short_job_of_every_recipe_is_valid_and_keeps_its_lr_above_the_floor(name):
    """`attnzoo configs NAME --short --num-classes N`: the recipe as train.py takes it, with
    every override a train.py option of its type: one epoch, no warm-up or cooldown, fp32, a
    small batch, the CPU, the data's classes, and a fixed lr at the recipe's peak, above its
    min_lr (the linear rule at batch 8 put NAT's 3.9e-6 under its 5e-6 floor, which the cosine
    then raised to)."""
    import yaml
    from attnzoo.configs import SHORT_JOB, short_job
    text = short_job(name, num_classes=3)
    assert text.startswith(f"# A short CPU job from attnzoo's {name} recipe")
    config = yaml.safe_load(text)
    check_config(config)
    recipe = timm_train.read_config(timm_train.CONFIGS / f"{name}.yaml")
    overrides = dict(SHORT_JOB, num_classes=3)
    assert {k: config[k] for k in overrides} == overrides
    assert config["lr"] == recipe.get("lr", recipe.get("lr_base"))
    assert config["lr"] >= config.get("min_lr", 0)  # DeiT III's phase 2: a constant 1e-5
    assert all(config[k] == v for k, v in recipe.items() if k not in overrides and k != "lr")
