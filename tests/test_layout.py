"""The repository's layout: the design card's top level (``pyproject.toml, attnzoo, configs,
scripts, tests, MODEL_CARDS.md``), one copy of the recipes and cards (setup.py copies them into
a built package; .ci/wheel checks the wheel and the sdist), and test modules that share helpers
through helper modules and conftest.py, never by importing one another."""
import ast
from pathlib import Path

from attnzoo.configs import recipe_names, recipe_path

ROOT = Path(__file__).resolve().parents[1]


def test_the_design_card_s_top_level_holds_the_recipes_and_the_cards():
    for name in ("pyproject.toml", "attnzoo", "configs", "scripts", "tests", "MODEL_CARDS.md"):
        assert (ROOT / name).exists(), name
    assert not list((ROOT / "attnzoo" / "configs").glob("*.yaml"))  # no second copy
    assert not (ROOT / "attnzoo" / "MODEL_CARDS.md").exists()
    assert len(recipe_names()) == 28
    assert recipe_path("nat_tiny") == ROOT / "configs" / "nat_tiny.yaml"  # a checkout's own


def test_no_test_module_imports_another():
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[-1] in tests]
    assert not offenders, offenders
