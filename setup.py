"""Packaging (pyproject.toml holds the rest): the recipes and the model cards stand at the top of
the repository (``configs/*.yaml``, ``MODEL_CARDS.md``), where a reader of the checkout finds
them, and go into the package when it is built (``attnzoo/configs/``, ``attnzoo/MODEL_CARDS.md``),
where ``attnzoo configs`` finds them in an installed wheel. One copy is kept: this build step
makes the other. A checkout (``pip install -e .``) reads them where they stand."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # `pip install -e .` reads them in place
            return
        package = Path(self.build_lib) / "attnzoo"
        self.mkpath(str(package / "configs"))
        for recipe in sorted((ROOT / "configs").glob("*.yaml")):
            self.copy_file(str(recipe), str(package / "configs" / recipe.name))
        self.copy_file(str(ROOT / "MODEL_CARDS.md"), str(package / "MODEL_CARDS.md"))


setup(cmdclass={"build_py": BuildPy})
