"""The options of timm's ``train.py``, read from its source, for checking ``configs/*.yaml``.

``train.py --config FILE`` hands the YAML to ``parser.set_defaults(**cfg)``: every key must be an
option's *dest* (an unknown one is ignored without a word) and every value the type argparse
would have produced, since set_defaults converts nothing. ``train.py`` is in timm's repository,
not in its wheel, so the table the tests use is kept here, in ``timm_train_options.json``, made by

    python tests/timm_train_options.py PATH/TO/pytorch-image-models/train.py

It reads the script with ``ast`` and imports nothing from the clone: per option of the main
parser (the last ``argparse.ArgumentParser`` the script builds; the first only reads
``--config``), its dest, type, action, nargs, choices and default, with the clone's timm version.
``ATTNZOO_TIMM_CHECKOUT=PATH`` makes tests/test_train_configs.py compare the table with that
clone's train.py.
"""
import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict

TABLE = Path(__file__).with_name("timm_train_options.json")
REGENERATE = "python tests/timm_train_options.py PATH/TO/pytorch-image-models/train.py"


def _value(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:  # arithmetic on literals (`3. / 4.`); names are kept as their source
        source = ast.unparse(node)
        try:
            return eval(compile(ast.Expression(node), "<option>", "eval"), {"__builtins__": {}})
        except NameError:
            return source


def _option(call: ast.Call) -> Dict[str, Any]:
    flags = [a.value for a in call.args if isinstance(a, ast.Constant)]
    kw = {k.arg: k.value for k in call.keywords}
    if "dest" in kw:
        dest = _value(kw["dest"])
    else:
        long = [f for f in flags if f.startswith("--")]
        dest = (long or flags)[0].lstrip("-").replace("-", "_")
    action = kw.get("action")
    if isinstance(action, ast.Attribute):  # a custom Action class, e.g. utils.ParseKwargs
        action = action.attr
    elif action is not None:
        action = _value(action)
    return {
        "dest": dest,
        "flags": flags,
        "type": ast.unparse(kw["type"]) if "type" in kw else None,
        "action": action,
        "nargs": _value(kw["nargs"]) if "nargs" in kw else None,
        "choices": _value(kw["choices"]) if "choices" in kw else None,
        "default": _value(kw["default"]) if "default" in kw else (
            False if action == "store_true" else True if action == "store_false" else None),
    }


def read_options(train_py: str) -> Dict[str, Dict[str, Any]]:
    """dest -> option of train.py's main parser, from the script's source text."""
    options: Dict[str, Dict[str, Any]] = {}
    calls = [n for n in ast.walk(ast.parse(train_py))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):  # in source order
        if node.func.attr == "ArgumentParser":
            options = {}  # a new parser: keep only the last one's options
        elif node.func.attr == "add_argument":
            option = _option(node)
            options[option.pop("dest")] = option
    return options


def timm_version(checkout: Path) -> str:
    text = (checkout / "timm" / "version.py").read_text()
    return re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text).group(1)


def load_table() -> Dict[str, Any]:
    return json.loads(TABLE.read_text())


def check_config(config: Dict[str, Any]) -> None:
    """``AssertionError`` unless every key of a ``train.py --config`` YAML is an option's dest
    and every value the type argparse would have produced (set_defaults converts nothing)."""
    options = load_table()["options"]
    element = {"int": int, "float": (int, float), "str": str, None: str}
    for key, value in config.items():
        assert key in options, f"{key!r} is not an option of timm's train.py (it would be ignored)"
        option = options[key]
        if value is None:
            assert option["default"] is None, f"{key}: null, but its default is not"
            continue
        if option["action"] in ("store_true", "store_false"):
            assert isinstance(value, bool), f"{key}: {value!r} is not a bool"
        elif option["action"] == "ParseKwargs":
            assert isinstance(value, dict), f"{key}: {value!r} is not a mapping"
        else:
            items = value
            if option["nargs"] in ("+", "*") or isinstance(option["nargs"], int):
                assert isinstance(value, list), f"{key}: {value!r} is not a list"
                if isinstance(option["nargs"], int):
                    assert len(value) == option["nargs"], f"{key}: needs {option['nargs']} values"
            else:
                items = [value]
            for item in items:  # a YAML float needs a dot: 1e-3 is read as the string '1e-3'
                assert isinstance(item, element[option["type"]]) and not isinstance(item, bool), \
                    f"{key}: {item!r} is not of type {option['type'] or 'str'}"
                assert option["choices"] is None or item in option["choices"], \
                    f"{key}: {item!r} is not one of {option['choices']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_py", type=Path, help="train.py of a timm clone")
    args = parser.parse_args(argv)
    table = {
        "timm_version": timm_version(args.train_py.resolve().parent),
        "command": REGENERATE,
        "options": read_options(args.train_py.read_text()),
    }
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE}: {len(table['options'])} options of timm {table['timm_version']}'s "
          "train.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
