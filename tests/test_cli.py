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
    for line in out.splitlines():
        if line.strip().startswith(("auto:", "torch:")):
            assert "img/s" in line
    # NAT uses relative positional bias: NATTEN >= 0.20 and the unimplemented cuda backend
    # must say why they cannot run it rather than fall back.
    assert "natten: unavailable" in out and "cuda: unavailable" in out


def test_cli_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        cli.main(["bench", "nat_mini", "--img-size", "32", "--steps", "1", "--warmup", "0",
                  "--backends", "tpu"])
