"""Where each pretrained tag's weights are downloaded from: one record per tag, the only place
that says so.

``WEIGHTS[tag]`` names the Hugging Face Hub repo that ``pretrained=True`` loads the tag from and
whether the weights are there now. A tag's cfg gets ``hf_hub_id`` only while its record is
published, so an unpublished tag is not "pretrained" to timm (``list_models(pretrained=True)``,
``is_model_pretrained``), and ``pretrained=True`` on it says in one line where the official
checkpoint is and how to convert and load it (``_helpers.build_model``).

Publishing a tag: ``attnzoo publish TAG CHECKPOINT --repo-id REPO``, then set its record to
``published=True`` (a tag that moves to another repo: ``Weights(REPO, published=True)``), then
``python scripts/make_model_cards.py``. Nothing else changes.
"""
from typing import Any, Dict, NamedTuple, Optional

__all__ = ["HUB_ORG", "hub_repo", "Weights", "WEIGHTS", "hub_weights", "pending_repo"]

# The project's namespace on the Hugging Face Hub: `attnzoo publish` puts tag ``<model>.<tag>``
# in ``HUB_ORG/<model>.<tag>``, the naming of timm's own ``timm/<model>.<tag>``.
HUB_ORG = 'attnzoo'


def hub_repo(tag: str) -> str:
    """The project's Hub repo of a pretrained tag: ``attnzoo/qna_vit_tiny.in1k``."""
    return f'{HUB_ORG}/{tag}'


class Weights(NamedTuple):
    repo: str                        # the Hub repo, ORG/NAME
    published: bool                  # whether the repo holds the weights now
    filename: Optional[str] = None   # hf_hub_filename, where not timm's model.safetensors


def _authors(repo: str) -> Weights:
    # the NAT authors' transformers-layout uploads, converted on load
    return Weights(repo, published=True, filename='pytorch_model.bin')


def _project(tag: str, published: bool = False) -> Weights:
    # official checkpoints that are not on the Hub (Flax files, a Google Drive folder): `attnzoo
    # publish` converts them into the project's namespace
    return Weights(hub_repo(tag), published)


WEIGHTS: Dict[str, Weights] = {
    'nat_mini.in1k': _authors('shi-labs/nat-mini-in1k-224'),
    'nat_tiny.in1k': _authors('shi-labs/nat-tiny-in1k-224'),
    'nat_small.in1k': _authors('shi-labs/nat-small-in1k-224'),
    'nat_base.in1k': _authors('shi-labs/nat-base-in1k-224'),
    'dinat_mini.in1k': _authors('shi-labs/dinat-mini-in1k-224'),
    'dinat_tiny.in1k': _authors('shi-labs/dinat-tiny-in1k-224'),
    'dinat_small.in1k': _authors('shi-labs/dinat-small-in1k-224'),
    'dinat_base.in1k': _authors('shi-labs/dinat-base-in1k-224'),
    'dinat_large.in22k_ft_in1k': _authors('shi-labs/dinat-large-in22k-in1k-224'),
    'dinat_large_384.in22k_ft_in1k': _authors('shi-labs/dinat-large-in22k-in1k-384'),
    'dinat_large_11x11_384.in22k_ft_in1k': _authors('shi-labs/dinat-large-11x11-in22k-in1k-384'),
    'qna_vit_tiny.in1k': _project('qna_vit_tiny.in1k'),
    'qna_vit_tiny_7x7.in1k': _project('qna_vit_tiny_7x7.in1k'),
    'qna_vit_small.in1k': _project('qna_vit_small.in1k'),
    'qna_vit_base.in1k': _project('qna_vit_base.in1k'),
    'san10_pairwise.in1k': _project('san10_pairwise.in1k'),
    'san10_patchwise.in1k': _project('san10_patchwise.in1k'),
    'san15_pairwise.in1k': _project('san15_pairwise.in1k'),
    'san15_patchwise.in1k': _project('san15_patchwise.in1k'),
    'san19_pairwise.in1k': _project('san19_pairwise.in1k'),
    'san19_patchwise.in1k': _project('san19_patchwise.in1k'),
}


def hub_weights(tag: str) -> Dict[str, Any]:
    """The cfg fields that let timm download ``tag``: ``hf_hub_id`` (and ``hf_hub_filename``)
    once its record is published, none before."""
    record = WEIGHTS[tag]
    if not record.published:
        return {}
    return dict(hf_hub_id=record.repo, **({'hf_hub_filename': record.filename}
                                          if record.filename else {}))


def pending_repo(tag: str) -> Optional[str]:
    """The Hub repo ``tag``'s weights are to be published in, while they are not there yet."""
    record = WEIGHTS.get(tag)
    return record.repo if record is not None and not record.published else None
