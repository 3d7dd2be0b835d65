"""The command line and the cost accounting behind `attnzoo bench` and the model cards."""
import pytest
import timm
import torch

import attnzoo
from attnzoo import cli
from attnzoo.ops import na2d
from attnzoo.profiling import count_macs, count_params
from attnzoo import list_models as list_attnzoo_models

# GMACs at 224x224 from the NAT/DiNAT papers (fvcore convention), ../shared/specs/nat.md.
PAPER_GMACS = {"nat_mini": 2.70, "nat_tiny": 4.30, "nat_small": 7.78, "nat_base": 13.68,
               "dinat_mini": 2.70, "dinat_tiny": 4.30, "dinat_small": 7.78, "dinat_base": 13.68,
               "dinat_large": 30.47}


@pytest.mark.parametrize("name", sorted(PAPER_GMACS))
def test_gmacs_match_paper(name):
    model = timm.create_model(name, device="meta")
    assert round(count_macs(model, (1, 3, 224, 224)) / 1e9, 2) == pytest.approx(
        PAPER_GMACS[name], abs=0.011)


def test_na_macs_counted_independently_of_the_computation():
    class OneNA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):  # x: [B, H, W, heads, d]
            return na2d(x * self.w, x, x, kernel_size=5, dilation=2)

    B, H, W, heads, d = 2, 20, 12, 3, 8
    # QK and AV: B * heads * H * W * d * K^2 each; the multiply by w is not a matmul.
    assert count_macs(OneNA(), (B, H, W, heads, d)) == 2 * B * heads * H * W * d * 25


def test_list_models_and_tags():
    names = list_attnzoo_models()
    assert {"nat_mini", "nat_tiny", "nat_small", "nat_base", "dinat_large"} <= set(names)
    assert all(timm.is_model(n) for n in names)
    assert "resnet50" not in names
    assert list_attnzoo_models("dinat_*") == [n for n in names if n.startswith("dinat_")]
    assert "nat_mini.in1k" in list_attnzoo_models(pretrained=True)


def test_cli_list(capsys):
    assert cli.main(["list", "nat_*"]) == 0
    out = capsys.readouterr().out.split()
    assert out == ["nat_base", "nat_mini", "nat_small", "nat_tiny"]


def test_cli_bench_reports_every_backend(capsys):
    assert cli.main(["bench", "nat_mini", "--img-size", "64", "--batch-size", "1", "--steps", "1",
                     "--warmup", "0", "--backends", "auto,torch,natten,cuda"]) == 0
    out = capsys.readouterr().out
    params = count_params(timm.create_model("nat_mini")) / 1e6
    assert f"nat_mini: {params:.2f} M params" in out
    assert "GMACs at 64x64" in out
    rows = [line.strip() for line in out.splitlines() if line.strip().startswith("[")]
    assert [r.split(":")[0] for r in rows] == ["[1/4] auto", "[2/4] torch", "[3/4] natten",
                                              "[4/4] cuda"]
    assert "img/s" in rows[0] and "img/s" in rows[1]
    assert "[auto picked na2d: torch]" in rows[0]  # auto names the backend it chose per op
    # NAT uses relative positional bias: NATTEN >= 0.20 and the cuda backend (on CPU tensors)
    # must say why they cannot run it rather than fall back.
    assert "unavailable" in rows[2] and "unavailable" in rows[3]


def test_cli_bench_model_without_attnzoo_ops(capsys):
    assert cli.main(["bench", "resnet18", "--img-size", "32", "--batch-size", "1", "--steps", "1",
                     "--warmup", "0"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("[")]
    assert len(rows) == 1 and "no attnzoo ops" in rows[0] and "img/s" in rows[0]


@pytest.mark.parametrize("argv,message", [
    (["bench", "nat_mni"], "unknown model 'nat_mni'; did you mean nat_mini"),
    (["bench", "nat_mini", "--backends", "auto,tpu"], "unknown backend 'tpu'"),
    (["bench", "nat_mini", "--img-size", "0"], "--img-size: must be >= 1, got 0"),
    (["bench", "nat_mini", "--batch-size", "-1"], "--batch-size: must be >= 1"),
    (["bench", "nat_mini", "--steps", "0"], "--steps: must be >= 1"),
    (["bench", "nat_mini", "--steps", "many"], "--steps: invalid int value: 'many'"),
    (["bench", "nat_mini.bogus"], "unknown pretrained tag 'nat_mini.bogus'; nat_mini's tags: "),
    (["bench", "vit_tiny_patch16_224", "--img-size", "100"],
     "--img-size 100: vit_tiny_patch16_224 cannot run a 100x100 input: "),
    (["list", "--family", "bogus"], "family must be one of nat, qna_vit, quest_vit, san, got "),
    (["convert", "nat_mini", "/does/not/exist.pth", "out.safetensors"], "does not exist"),
    (["timm", "/does/not/train.py"], "does not exist"),
])
def test_cli_user_errors_are_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("attnzoo")


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnzoo {attnzoo.__version__}"


def _write_script(tmp_path, body):
    script = tmp_path / "script.py"
    script.write_text(body)
    return str(script)


def test_cli_timm_runner_registers_models_and_passes_arguments(tmp_path, capsys):
    script = _write_script(tmp_path, (
        "import sys, timm\n"
        "if __name__ == '__main__':\n"
        "    model = sys.argv[sys.argv.index('--model') + 1]\n"
        "    print('argv', sys.argv[1:], 'is_model', timm.is_model(model))\n"
        "    sys.exit(3 if '--fail' in sys.argv else 0)\n"))
    assert cli.main(["timm", script, "--model", "nat_mini", "-b", "2"]) == 0
    out = capsys.readouterr().out
    assert "argv ['--model', 'nat_mini', '-b', '2'] is_model True" in out
    assert cli.main(["timm", script, "--model", "qna_vit_nope", "--fail"]) == 3


def test_cli_timm_runner_uses_the_installed_timm(tmp_path, capsys):
    # a timm clone puts its own timm/ next to its scripts: the runner must not import it
    (tmp_path / "timm").mkdir()
    (tmp_path / "timm" / "__init__.py").write_text("raise ImportError('the clone was imported')\n")
    script = _write_script(tmp_path, "import timm\nprint('timm from', timm.__file__)\n")
    assert cli.main(["timm", script]) == 0
    assert str(tmp_path) not in capsys.readouterr().out


def test_cli_timm_runner_exit_message(tmp_path, capsys):
    script = _write_script(tmp_path, "raise SystemExit('bad dataset path')\n")
    assert cli.main(["timm", script]) == 1
    assert "bad dataset path" in capsys.readouterr().err
