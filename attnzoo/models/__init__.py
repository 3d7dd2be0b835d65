"""attnzoo's model families; importing a family's module registers its models with timm.

The model policy: every family follows it, so a user who knows one timm model knows ours.

Module tree, in timm's layout and names
    ``stem`` (image -> first stage), ``stages.{i}`` (``downsample`` first, an identity where the
    stem already reduced, then ``blocks.{j}``), ``norm`` (the final norm of the last stage) and
    ``head`` (timm's ``ClassifierHead``: ``head.fc``). A stage takes and returns NCHW maps
    (blocks may work on NHWC inside), so its output *is* its feature tap: ``feature_info[i]``
    names ``stages.{i}`` with its channels and reduction, and ``features_only=True`` returns the
    same NCHW maps with every ``feature_cls`` (the default list, ``'hook'``, ``'fx'``, ``'dict'``,
    ``'getter'``). Blocks use timm's names: ``norm1``, ``attn``, ``ls1`` (``LayerScale``,
    ``ls1.gamma``), ``drop_path1``, ``norm2``, ``mlp`` (``Mlp``: ``fc1``/``fc2``), ``ls2``,
    ``drop_path2``. Token models (QUEST-ViT) *are* timm's ``VisionTransformer``, changed only
    through its ``attn_layer`` hook, with its exact state dict; their ``features_only`` maps
    come from ``forward_intermediates`` (``feature_cls='getter'``), and any other
    ``feature_cls``, which would tap token sequences, is a ``ValueError``.

Layers come from ``timm.layers`` (LayerNorm / LayerNorm2d, Mlp, DropPath, LayerScale,
ClassifierHead, trunc_normal_, calculate_drop_path_rates); attention from
:mod:`attnzoo.layers`, which dispatch to :mod:`attnzoo.ops` and so to every backend.

Official checkpoints
    The module tree never bends to an official key layout. Each family's
    ``checkpoint_filter_fn(state_dict, model)`` converts every official layout (the original
    training code, the transformers port, ...) onto it, and raises one ``ValueError`` listing
    every missing, unexpected or mis-shaped key (``_helpers.check_state_dict``).
    ``attnzoo.hub.load_official(model_name, path)`` is the one entry point over all of
    them, with a family's own reader where the file is not a torch checkpoint.

Pretrained cfgs
    Every tag names its weights' origin (``origin_url``, ``paper_ids``). ``hf_hub_id`` is the
    authors' Hub repo where they published one, else the tag's repo in the project namespace
    (``_helpers.hub_repo``: ``attnzoo/<model>.<tag>``, filled by ``attnzoo publish``). Where the
    Hub cannot give the weights (offline, no such repo yet, no token) ``pretrained=True``
    raises one ``OSError`` naming the repo and why; a tag with no source at all raises a
    ``ValueError``; both say how to convert and load the official file
    (``pretrained_cfg_overlay=dict(file=...)``), never a silently random model
    (``_helpers.build_model``). ``min_input_size`` is set where the architecture has one.

The timm contract
    ``forward_features`` (unpooled), ``forward_head(pre_logits=)``, ``forward_intermediates``
    (``indices``, ``norm``, ``stop_early``, ``output_fmt``, ``intermediates_only``),
    ``prune_intermediate_layers``, ``reset_classifier(num_classes, global_pool=None)``,
    ``get_classifier``, ``set_grad_checkpointing``, ``group_matcher``, ``no_weight_decay``;
    constructors pass ``device=`` / ``dtype=`` to every layer and reject unknown kwargs with
    ``TypeError``; bad input raises a ``ValueError`` naming what is accepted
    (``_helpers.check_image_input``; for QUEST-ViT a pre-hook on timm's ``patch_embed``).
    The hierarchical families get all of it from one base class, ``_staged.StagedModel``
    (their stages from ``_staged.Stage``, builder and cfg defaults from ``build_staged`` and
    ``staged_cfg``); a family writes only its constructor, ``no_weight_decay`` and its
    checkpoint filter (official names mapped by ``_helpers.rename_key`` rules). Variant
    functions default ``drop_path_rate`` to the paper's training value (timm's
    ``--drop-path`` overrides it).

Registration
    As timm's: one ``@register_model def <variant>(pretrained=False, **kwargs) -> <Model>`` per
    variant in its family's module, below ``default_cfgs``: a one-line docstring (params,
    GMACs), the variant's config as a dict (built on the family's shared config dicts) and a
    call to the family's ``_create_*`` (the caller's kwargs override the config), so
    ``grep "def nat_tiny"``, tracebacks and ``help()`` land on the variant. ``register_model``
    is :mod:`attnzoo.models._registry`'s: timm's, plus the record behind
    :func:`attnzoo.list_models` (the one definition of "our models").
"""
from ._registry import list_models, model_family
from . import nat, qna_vit, quest_vit, san  # noqa: F401

__all__ = ["list_models", "model_family"]
