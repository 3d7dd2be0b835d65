"""Each attnzoo model is one explicit ``@register_model def <name>(pretrained=False, **kwargs)`` in
its family's module, timm's way (attnzoo/models/__init__.py, "Registration"): jump-to-definition,
``help()`` and tracebacks land on the variant, and timm builds it under its own name."""
import importlib
import inspect
import pkgutil
import re

import pytest
import timm

import attnzoo
from attnzoo.models import model_family

NAMES = attnzoo.list_models()


def test_every_family_module_registers_models():
    families = {m.name for m in pkgutil.iter_modules(attnzoo.models.__path__)
                if not m.name.startswith("_")}
    assert families and {model_family(n) for n in NAMES} == families


@pytest.mark.parametrize("name", NAMES)
def test_entrypoint_is_defined_in_its_family_module_under_its_own_name(name):
    module = importlib.import_module(f"attnzoo.models.{model_family(name)}")
    fn = timm.models.model_entrypoint(name)
    assert getattr(module, name) is fn
    assert fn.__name__ == fn.__qualname__ == fn.__code__.co_name == name
    assert fn.__module__ == module.__name__
    assert inspect.getsourcefile(fn) == inspect.getsourcefile(module)
    assert re.match(rf"@register_model\ndef {name}\(pretrained=False, \*\*kwargs\) -> \w+:\n",
                    inspect.getsource(fn))
    assert re.search(rf"^def {name}\(", inspect.getsource(module), re.MULTILINE)
    doc = inspect.getdoc(fn)
    assert doc and "\n" not in doc, f"{name}: a one-line docstring, got {doc!r}"


@pytest.mark.parametrize("name", NAMES)
def test_create_model_records_the_entrypoint_name_as_architecture(name):
    model = timm.create_model(name, pretrained=False, device="meta")
    assert model.pretrained_cfg["architecture"] == name


def test_caller_kwargs_override_the_variant_config():
    """nat_small's config sets depths and a layer scale of 1e-5, dinat_mini's dilations: a
    caller's value wins (timm's create_model drops kwargs that are None, so none is passed)."""
    model = timm.create_model("nat_small", layer_scale=0.5, depths=(1, 1, 1, 1), embed_dim=8,
                              num_heads=1)
    assert [len(s.blocks) for s in model.stages] == [1, 1, 1, 1]
    assert model.stages[0].blocks[0].ls1.gamma.detach().eq(0.5).all()
    assert timm.create_model("dinat_mini", device="meta").stages[0].blocks[1].attn.dilation == 8
    undilated = timm.create_model("dinat_mini", dilations=1, device="meta")
    assert {b.attn.dilation for s in undilated.stages for b in s.blocks} == {1}
