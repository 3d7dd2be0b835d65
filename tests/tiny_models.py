"""The small models the tests build, written once: test modules import them from here, never from
one another. Each builder seeds torch first (the same weights on every call) and returns the model
in eval mode; the configs are plain dicts, for the tests that pass them on (to
``timm.create_model``, to the checkpoint readers)."""
import timm
import torch

from attnzoo.models.nat import NAT
from attnzoo.models.qna_vit import QnAViT
from attnzoo.models.san import SAN

# NAT / DiNAT: DiNAT-style dilations, with padding at most levels for 32-64 px inputs.
NAT_TINY = dict(embed_dim=16, depths=(1, 2, 2, 1), num_heads=(1, 2, 2, 4), mlp_ratio=2.,
                dilations=((2,), (1, 2), (2, 1), (1,)), kernel_size=3, num_classes=7,
                drop_path_rate=0.)
# One block less at the third level: the torch.compile checks and the model oracle.
NAT_SHALLOW = dict(NAT_TINY, depths=(1, 2, 1, 1), dilations=((2,), (1, 2), (2,), (1,)),
                   num_classes=5)
# Overrides that cut the registered nat_mini / dinat_mini down for Triton's interpreter: one
# block per level, narrow; at 64 px the levels are 16, 8, 4 and 2 px (the last two below K, the
# dilated ones below K*d, so the layers' padding path runs too).
NAT_MINI_CUT = dict(depths=(2, 1, 1, 1), embed_dim=16, num_heads=(1, 2, 2, 2), num_classes=5,
                    drop_path_rate=0.)


def nat(config=NAT_TINY, **kwargs) -> NAT:
    """A NAT of ``config`` (:data:`NAT_TINY` or :data:`NAT_SHALLOW`) changed by ``kwargs``."""
    torch.manual_seed(0)
    return NAT(**dict(config, **kwargs)).eval()


# SAN: five stages of 8-64 channels, rel 1-4, Cw 2-8 weight channels (shared by 2).
SAN_TINY = dict(depths=(1, 2, 1, 1, 1), widths=(16, 32, 32, 64, 64), stem_width=8,
                share_planes=2, num_classes=7)
# One block per stage and 3x3 footprints: inputs from 64 px (the contract tests).
SAN_SMALL = dict(SAN_TINY, depths=(1,) * 5, kernel_sizes=3)


def san(sa_type="pairwise", seed=0, **kwargs) -> SAN:
    """A SAN of :data:`SAN_TINY` changed by ``kwargs``."""
    torch.manual_seed(seed)
    return SAN(sa_type=sa_type, **dict(SAN_TINY, **kwargs)).eval()


def san_small(sa_type="pairwise", **kwargs) -> SAN:
    """A SAN of :data:`SAN_SMALL` changed by ``kwargs``."""
    return san(sa_type, **dict(SAN_SMALL, **kwargs))


def randomize(model: torch.nn.Module, seed=0) -> torch.nn.Module:
    """Every parameter and BN statistic random (biases, BN affine and running stats included), so
    no term of the forward can hide behind an init of 0 or 1; returns ``model``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) * 1.5 + 0.5)
            elif name.endswith(("running_mean", ".bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
            elif t.dim() == 1:  # BN weight
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
    return model


# QnA-ViT: every kind of block: LSA blocks in three stages (stage 1: 2x2 windows at 64 px, stage
# 2: one global window, stage 3: 2x2), QnA blocks with k = 3 and 5, downsampling blocks of both
# kernels.
QNA_VIT_SMALL = dict(embed_dim=16, qna_depths=(1, 1, 1, 0), lsa_depths=(0, 1, 1, 1),
                     qna_heads=(2, 4, 8, 16), lsa_heads=(1, 2, 2, 4), kernel_size=(3, 5, 3, 3),
                     window_sizes=(4, 4, 4, 2), num_classes=10, drop_path_rate=0.)


def qna_vit(**kwargs) -> QnAViT:
    """A QnA-ViT of :data:`QNA_VIT_SMALL` changed by ``kwargs``."""
    torch.manual_seed(0)
    return QnAViT(**dict(QNA_VIT_SMALL, **kwargs)).eval()


# Whole models through Triton's interpreter (a second or more per kernel launch) in seconds: one
# or two stages, narrow, for 32 px inputs (NA's dilation 2 there: four groups of 4 x 4).
NAT_ONE_STAGE = dict(depths=(1,), embed_dim=16, num_heads=(1,), mlp_ratio=1., kernel_size=3,
                     dilations=((2,),), num_classes=5, drop_path_rate=0.)
QNA_VIT_TWO_STAGES = dict(embed_dim=16, qna_depths=(1, 0), lsa_depths=(0, 1), qna_heads=(2, 4),
                          lsa_heads=(1, 2), kernel_size=(3, 3), window_sizes=(4, 4),
                          num_classes=5, drop_path_rate=0.)
SAN_TWO_STAGES = dict(depths=(1, 1), widths=(16, 16), kernel_sizes=(3, 3), stem_width=8,
                      share_planes=2, padding_mode="zeros", num_classes=5)


# QUEST-ViT: 32 px, 8 px patches, two blocks of three heads.
QUEST_VIT_TINY = dict(img_size=32, patch_size=8, embed_dim=24, depth=2, num_heads=3,
                      num_classes=5)


def quest_vit(name="quest_deit3_base_patch16_224", **kwargs) -> torch.nn.Module:
    """Registered QUEST-ViT ``name`` at :data:`QUEST_VIT_TINY`'s size, changed by ``kwargs``."""
    torch.manual_seed(0)
    return timm.create_model(name, **dict(QUEST_VIT_TINY, **kwargs)).eval()
