"""The command line and the cost accounting behind `attnzoo bench` and the model cards."""
import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch

import attnzoo
from attnzoo import cli, hub
from attnzoo.ops import na2d
from attnzoo.profiling import count_macs, count_params
from attnzoo import list_models as list_attnzoo_models

ROOT = Path(__file__).resolve().parents[1]

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
    # an input tensor, as fvcore and thop take one, is counted as it is
    assert count_macs(OneNA(), torch.randn(B, H, W, heads, d)) == 2 * B * heads * H * W * d * 25
    with pytest.raises(TypeError, match="input_size must be a shape .* or an input tensor, got "
                                        "'224'"):
        count_macs(OneNA(), "224")


def test_list_models_and_tags():
    names = list_attnzoo_models()
    assert {"nat_mini", "nat_tiny", "nat_small", "nat_base", "dinat_large"} <= set(names)
    assert all(timm.is_model(n) for n in names)
    assert "resnet50" not in names
    assert list_attnzoo_models("dinat_*") == [n for n in names if n.startswith("dinat_")]
    assert "nat_mini.in1k" in list_attnzoo_models(pretrained=True)


def test_cli_configs_lists_prints_and_copies_the_packaged_recipes(tmp_path, capsys):
    """`attnzoo configs` lists every recipe with its path (in a checkout the top-level
    configs/; in an installed wheel the package's copy: .ci/wheel), `configs NAME` prints the
    path train.py --config takes, `-o` writes a copy (never over a file)."""
    from attnzoo.configs import recipe_names
    package = ROOT / "configs"
    assert cli.main(["configs"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows == [[p.stem, str(p.resolve())] for p in sorted(package.glob("*.yaml"))]
    assert len(rows) == 28 and [r[0] for r in rows] == recipe_names()
    assert cli.main(["configs", "quest_deit3_base_patch16_224_phase2"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == (package / "quest_deit3_base_patch16_224_phase2.yaml").resolve()
    copy = tmp_path / "mine.yaml"
    assert cli.main(["configs", "nat_tiny", "-o", str(copy)]) == 0
    assert copy.read_text() == (package / "nat_tiny.yaml").read_text()
    assert f"wrote {copy}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["configs", "nat_mini", "-o", str(copy)])
    assert "the file exists" in capsys.readouterr().err
    assert copy.read_text() == (package / "nat_tiny.yaml").read_text()


def test_cli_list(capsys):
    assert cli.main(["list", "nat_*"]) == 0
    out = capsys.readouterr().out.split()
    assert out == ["nat_base", "nat_mini", "nat_small", "nat_tiny"]
    # a model's name lists its tags, as timm.list_models('nat_mini', pretrained=True) does
    assert cli.main(["list", "--pretrained", "nat_mini"]) == 0
    assert capsys.readouterr().out.split() == timm.list_models("nat_mini", pretrained=True) \
        == ["nat_mini.in1k"]


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


def test_cli_bench_and_export_feed_a_model_its_stem_s_channels(tmp_path, capsys):
    """A model built with in_chans=1 (timm's cfg keeps 3 channels): bench and export build
    1-channel inputs, where both refused the model, blaming --img-size."""
    assert cli.main(["bench", "nat_mini", "--img-size", "64", "--batch-size", "1", "--steps", "1",
                     "--warmup", "0", "--backends", "torch", "--model-kwargs", "in_chans=1"]) == 0
    assert "GMACs at 64x64" in capsys.readouterr().out
    torch.manual_seed(7)
    model = timm.create_model("nat_mini", in_chans=1).eval()
    checkpoint, out_file = tmp_path / "gray.pth", tmp_path / "gray.onnx"
    torch.save(model.state_dict(), checkpoint)
    assert cli.main(["export", "nat_mini", str(out_file), "--checkpoint", str(checkpoint),
                     "--img-size", "64", "--check"]) == 0  # the checkpoint's channels
    out = capsys.readouterr().out
    assert "onnxruntime vs PyTorch, input [2, 1, 64, 64]" in out, out


def test_a_quest_vit_built_at_another_size_keeps_it_through_convert_export_and_loading(
        tmp_path, capsys):
    """A QUEST-ViT trained at 64 px (img_size=64): its cfg says 64; its checkpoint is built at
    the position embedding's grid by the loaders (publish, export, attention) and by
    convert's load line, where timm's filter resampled it to 224 without a word."""
    name = "quest_vit_tiny_patch16_224"
    torch.manual_seed(6)
    source = timm.create_model(name, img_size=64, num_classes=10).eval()
    assert source.pretrained_cfg["input_size"] == (3, 64, 64)
    checkpoint = tmp_path / "quest64.pth"
    torch.save(source.state_dict(), checkpoint)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = source(x)
    loaded = hub.load_checkpoint_model(name, checkpoint)
    assert loaded.model_args == {"img_size": (64, 64)}
    assert loaded.model.pretrained_cfg["input_size"] == (3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), want)
    converted = tmp_path / "quest64.safetensors"
    assert cli.main(["convert", name, str(checkpoint), str(converted)]) == 0
    load = capsys.readouterr().out.strip().split("Load it with ", 1)[1]
    assert "img_size=(64, 64)" in load
    with torch.no_grad():
        assert torch.equal(eval(load, {"timm": timm}).eval()(x), want)
    assert cli.main(["export", name, str(tmp_path / "q.onnx"), "--checkpoint",
                     str(checkpoint)]) == 0
    assert f"exporting {name} at 64x64" in capsys.readouterr().out
    # wrapped as DeiT's files are ({'model': ...}), with DDP's prefixes: the same grid
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}}, wrapped)
    assert hub.load_checkpoint_model(name, wrapped).model_args == {"img_size": (64, 64)}
    # another patch size: resampled as timm does (its grid says nothing of our patch's size)
    patch32 = tmp_path / "patch32.pth"
    torch.save(timm.create_model(name, patch_size=32, depth=1).state_dict(), patch32)
    loaded = hub.load_checkpoint_model(name, patch32, model_kwargs=dict(depth=1))
    assert loaded.model_args == {"depth": 1}
    assert loaded.model.pretrained_cfg["input_size"] == (3, 224, 224)
    # a non-square size exports at that size
    assert cli.main(["export", name, str(tmp_path / "wide.onnx"), "--model-kwargs",
                     "img_size=(64, 96)", "depth=1"]) == 0
    assert f"exporting {name} at 64x96" in capsys.readouterr().out


def test_the_stem_s_channels_of_timm_models_with_several_stems_or_none_named():
    """timm's first_conv is a tuple for CrossViT and FastViT: their channels are read from
    the first (it raised AttributeError in bench, export and attention)."""
    for name in ("fastvit_t8", "crossvit_tiny_240"):
        model = timm.create_model(name, device="meta")
        assert hub.input_shape(model) == model.pretrained_cfg["input_size"]


def test_cli_convert_and_export_replace_an_existing_file_only_with_force(tmp_path, capsys):
    checkpoint, out = tmp_path / "quest.pth", tmp_path / "quest.safetensors"
    torch.save(timm.create_model("quest_vit_tiny_patch16_224").state_dict(), checkpoint)
    for existing, argv in ((out, ["convert", "quest_vit_tiny_patch16_224", str(checkpoint),
                                  str(out)]),
                           (tmp_path / "q.onnx", ["export", "quest_vit_tiny_patch16_224",
                                                  str(tmp_path / "q.onnx")])):
        existing.write_bytes(b"the user's earlier file")
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.strip() == (
            f"attnzoo {argv[0]}: error: {existing}: the file exists; pass --force to replace it")
        assert existing.read_bytes() == b"the user's earlier file"
        assert cli.main(argv + ["--force"]) == 0
        assert existing.read_bytes() != b"the user's earlier file"
    capsys.readouterr()


def test_cli_convert_says_in_one_line_that_it_cannot_write(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):  # as torch.save into a folder the user may not write
        raise RuntimeError("[enforce fail at inline_container.cc:747] . open file failed "
                           "because of errno 13 on fopen: Permission denied")

    checkpoint = tmp_path / "quest.pth"
    torch.save(timm.create_model("quest_vit_tiny_patch16_224").state_dict(), checkpoint)
    monkeypatch.setattr(torch, "save", refuse)
    out = tmp_path / "out.pth"
    out.write_bytes(b"the user's earlier file")
    with pytest.raises(SystemExit) as info:
        cli.main(["convert", "quest_vit_tiny_patch16_224", str(checkpoint), str(out), "--force"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"output '{out}': cannot write it: [enforce fail" in err and "Permission denied" in err
    assert out.read_bytes() == b"the user's earlier file"  # a failed write replaces nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pth", "quest.pth"]


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
    (["convert", "nat_mini", "/does/not/exist.pth", "out.safetensors"], "does not exist"),
    (["convert", "nat_mini", "x.pth", "out/missing/dir/x.safetensors"],
     "output 'out/missing/dir/x.safetensors': folder "),
    (["convert", "nat_mini", "x.pth", "out.onnx"],
     "output 'out.onnx': unknown extension; accepted: .safetensors, .pth, .pt, .bin"),
    (["convert", "nat_mini"], "the following arguments are required: CHECKPOINT, OUT"),
    (["timm", "/does/not/train.py"], "does not exist"),
    (["timm", "/"], "script '/' is a folder, not a file"),
    (["timm"], "the script to run is required, e.g. attnzoo timm "),
    (["convert", "nat_mini", "/", "out.safetensors"],
     "checkpoint '/' is a folder, not a checkpoint file"),
    (["configs", "nat_tiny", "-o", "/"], "-o /: a folder; give a new file's path"),
    (["check", "--backend", "auto"], "argument --backend: invalid choice: 'auto' (choose from "
                                     "'torch', 'natten', 'cuda')"),
    (["check", "--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
    (["list", "zzz*"], "no attnzoo model matches 'zzz*'; `attnzoo list` names them all"),
    (["list", "--pretrained", "nat_tny*"], "no attnzoo pretrained tag matches 'nat_tny*'"),
    (["list", "--pretrained", "qna*"], "no downloadable pretrained tag matches 'qna*'; not on "
                                       "the Hub yet, so not pretrained"),
    (["list", "nat_tny"], "no attnzoo model matches 'nat_tny'; did you mean nat_tiny"),
    (["list", "--family", "vit"], "argument --family: invalid choice: 'vit' (choose from "
                                  "'dinat', 'nat', 'qna_vit', 'quest_vit', 'san')"),
    (["list", "dinat_mini", "extra"], "unrecognized arguments: extra"),
    (["attention", "nat_mini", "x.png", "--layer", "0.0", "--query", "1,1", "-o", "m.jpgx"],
     "-o m.jpgx: the picture's format is its extension, one of "),
    (["bench", "nat_mini", "--model-kwargs", "oops"],
     "argument --model-kwargs: expected KEY=VALUE, got 'oops'"),
    (["bench", "nat_mini", "--model-kwargs", "num_classes=abc"],
     "--model-kwargs num_classes=abc: num_classes takes an int (default 1000), got the string "
     "'abc'"),
    (["export", "qna_vit_tiny", "q.onnx", "--model-kwargs", "drop_path_rate=high"],
     "--model-kwargs drop_path_rate=high: drop_path_rate takes a float (default 0.05), got the "
     "string 'high'"),
    (["bench", "nat_mini", "--model-kwargs", "bogus=1"],
     "cannot build nat_mini: NAT.__init__() got an unexpected keyword argument 'bogus'"),
    (["bench", "san10_pairwise", "--img-size", "32"],
     "--img-size 32: san10_pairwise cannot run a 32x32 input: input images must be at least "
     "128x128 pixels for this architecture, got 32x32; padding_mode='zeros'"),
    (["attention", "nat_mini", "/does/not/exist.png", "--layer", "0.0", "--query", "1,1"],
     "/does/not/exist.png: cannot read the image: "),
    (["attention", "nat_mini", "x.png", "--layer", "0.0", "--query", "1"],
     "argument --query: expected Y,X (pixels of the image), got '1'"),
    (["attention", "nat_mini", "x.png", "--layer", "0.0", "--query", "1,1", "--head", "x"],
     "argument --head: expected mean, all or a head index, got 'x'"),
    (["attention", "nat_mini", "x.png", "--layer", "0.0", "--query", "1,1", "--pretrained",
      "--checkpoint", "w.pth"], "--pretrained and --checkpoint: give one"),
    (["attention", "nat_mini", "x.png", "--query", "1,1"],
     "the following arguments are required: --layer"),
    (["configs", "nat_tny"], "no training recipe named 'nat_tny'; did you mean nat_tiny"),
    (["configs", "dinat_large"], "no training recipe for dinat_large: its ImageNet-22k "
                                 "pre-training recipe is unpublished"),
    (["configs", "-o", "x.yaml"], "-o/--out needs a recipe NAME"),
    (["configs", "nat_mini", "--short"], "--short needs --num-classes: the class count of your "
                                         "data"),
    (["configs", "nat_mini", "--num-classes", "3"], "--num-classes goes with --short"),
    (["configs", "--short"], "--short needs a recipe NAME"),
    (["configs", "nat_tiny", "-o", "/no/such/dir/x.yaml"],
     "folder '/no/such/dir' does not exist"),
])
def test_cli_user_errors_are_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"attnzoo {argv[0]}: error: ")


def test_cli_info_checks_the_device_before_printing_anything(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        cli.main(["info", "nat_mini", "--device", "cuda"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and err.startswith("attnzoo info: error: --device")


def _one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_bench_and_check_take_either_spelling_of_a_dtype():
    parser = cli.build_parser()
    for given, bench, check in (("bf16", "bfloat16", "bf16"), ("float16", "float16", "fp16")):
        assert parser.parse_args(["bench", "nat_mini", "--dtype", given]).dtype == bench
        assert parser.parse_args(["check", "--dtype", given]).dtype == check


def test_a_train_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    """NAT's and DiNAT's weights have the same shapes: a train.py checkpoint of one is refused
    as the other by convert as by the commands that load it (export, attention, publish)."""
    path = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 1, "arch": "nat_mini", "state_dict": {},
                "args": argparse.Namespace(model="nat_mini")}, path)
    refusal = ("model_best.pth.tar was trained as 'nat_mini' (its args.model), not "
               "'dinat_mini': name nat_mini as its model")
    err = _one_line_error(capsys, ["convert", "dinat_mini", str(path),
                                   str(tmp_path / "out.safetensors")])
    assert refusal in err and not (tmp_path / "out.safetensors").exists()
    with pytest.raises(ValueError, match=re.escape(refusal)):
        hub.load_checkpoint_model("dinat_mini", path)


def test_a_bad_backend_in_the_environment_is_named_before_any_work(capsys, monkeypatch):
    monkeypatch.setenv("ATTNZOO_BACKEND", "nonsense")
    err = _one_line_error(capsys, ["bench", "nat_mini", "--img-size", "32"])
    assert ("unknown backend 'nonsense' (environment variable ATTNZOO_BACKEND); accepted: "
            "torch, natten, cuda, auto") in err and "--img-size" not in err


def test_bench_and_export_run_whatever_backend_the_environment_asks(tmp_path, capsys,
                                                                    monkeypatch):
    """ATTNZOO_BACKEND=cuda on a CPU: bench's rows each run their own backend (cuda's says
    why it cannot), and export's graph takes the export formulas whatever the backend."""
    monkeypatch.setenv("ATTNZOO_BACKEND", "cuda")
    assert cli.main(["bench", "nat_mini", "--img-size", "32", "--batch-size", "1", "--steps",
                     "1", "--warmup", "0", "--backends", "torch,cuda"]) == 0
    rows = [line.strip() for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith("[")]
    assert "img/s" in rows[0] and "unavailable (backend 'cuda' cannot run" in rows[1], rows
    if importlib.util.find_spec("onnx") is None:
        pytest.skip("export needs onnx (installed by the dev extra)")
    assert cli.main(["export", "nat_mini", str(tmp_path / "n.onnx"), "--img-size", "32"]) == 0


def _convert_error(capsys, checkpoint, model="san10_pairwise") -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(["convert", model, str(checkpoint), str(checkpoint) + ".safetensors"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


class _NotATensor:
    pass


def test_cli_convert_refuses_unreadable_checkpoints_in_one_line(tmp_path, capsys):
    """A truncated safetensors file, a text file, a torch file holding Python objects: one line
    saying what the file is not, never torch's multi-line advice to load untrusted code."""
    st = tmp_path / "truncated.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(1000)}, st)
    st.write_bytes(st.read_bytes()[:50])
    assert "corrupted or truncated" in _convert_error(capsys, st)
    text = tmp_path / "hostname"
    text.write_text("myhost\n")
    err = _convert_error(capsys, text)
    assert "is not a torch or safetensors checkpoint: its first bytes are neither" in err
    assert "weights_only=False" not in err and "file an issue" not in err
    pickled = tmp_path / "objects.pth"
    torch.save({"model": _NotATensor()}, pickled)
    err = _convert_error(capsys, pickled)
    assert "cannot be read by torch.load(weights_only=True), which runs no code" in err
    assert "_NotATensor" in err and "holds Python objects besides tensors" in err
    assert "weights_only=False" not in err
    # the Flax reader of QnA-ViT says the same of a file that is not one
    assert "not a Flax msgpack checkpoint" in _convert_error(capsys, text, "qna_vit_tiny")


def test_cli_convert_summarises_a_checkpoint_of_another_model(tmp_path, capsys):
    """nat_mini's weights converted as qna_vit_tiny: every key mismatches; one line gives each
    kind's count and its first few names, not all of them (it took 10,260 characters)."""
    checkpoint = tmp_path / "nat_mini_sd.pth"
    torch.save(timm.create_model("nat_mini", device="meta").to_empty(device="cpu").state_dict(),
               checkpoint)
    err = _convert_error(capsys, checkpoint, "qna_vit_tiny")
    assert len(err) < 1500, len(err)
    counts = re.findall(r"(missing from the checkpoint|not in the model) \((\d+)\): ", err)
    assert {kind for kind, _ in counts} == {"missing from the checkpoint", "not in the model"}
    assert all(int(n) > 20 for _, n in counts) and err.count(" more") == 3, err  # shapes too
    assert "more; not in the model (" in err


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_cli_convert_writes_the_format_its_output_name_says(suffix, tmp_path, capsys):
    """`convert ... out.pth` writes a torch file (it used to write safetensors bytes under that
    name), and the load line it prints works."""
    source = timm.create_model("quest_vit_tiny_patch16_224")
    checkpoint, out = tmp_path / "official.pth", tmp_path / f"converted{suffix}"
    torch.save(source.state_dict(), checkpoint)
    assert cli.main(["convert", "quest_vit_tiny_patch16_224", str(checkpoint), str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert (out.read_bytes()[:2] == b"PK") == (suffix == ".pth")  # torch.save's zip archive
    load = line.split("Load it with ", 1)[1]
    model = eval(load, {"timm": timm})
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_cli_convert_load_line_fits_a_fine_tuned_head(tmp_path, capsys):
    """A train.py checkpoint of a 2-class nat_mini: the printed line builds that head."""
    source = timm.create_model("nat_mini", num_classes=2)
    checkpoint, out = tmp_path / "checkpoint-0.pth.tar", tmp_path / "nat2.safetensors"
    torch.save({"state_dict": source.state_dict(), "epoch": 0,
                "args": argparse.Namespace(model="nat_mini", num_classes=2)}, checkpoint)
    assert cli.main(["convert", "nat_mini", str(checkpoint), str(out)]) == 0
    load = capsys.readouterr().out.strip().split("Load it with ", 1)[1]
    assert "num_classes=2" in load
    model = eval(load, {"timm": timm})
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_cli_output_closed_early_stops_quietly_like_unix_tools(monkeypatch, capsys):
    """`attnzoo list | head -1`: the reader goes away; the command stops without a traceback,
    with the status of a process killed by SIGPIPE (it was a BrokenPipeError traceback)."""
    read, write = os.pipe()
    os.close(read)  # a pipe nobody reads: every write fails
    with open(write, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert cli.main(["list"]) == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""


def test_cli_timm_script_missing_a_package_is_one_line(tmp_path, capsys):
    """timm's inference.py imports pandas, which timm does not install: one line naming the
    package to install, exit 2 (it was a ModuleNotFoundError traceback)."""
    script = _write_script(tmp_path, "import attnzoo_no_such_package.sub\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["timm", script, "--model", "nat_mini"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("attnzoo timm: error: script.py needs the module 'attnzoo_no_such_package', "
                   "which is not installed here: pip install attnzoo_no_such_package\n")
    # a script's own import error of an installed package keeps its traceback
    script = _write_script(tmp_path, "import timm.no_such_module\n")
    with pytest.raises(ModuleNotFoundError):
        cli.main(["timm", script])


def _subcommands():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_cli_help_lists_every_choice_and_default(command):
    """Every option of every command: its help says its default (or what leaving it out does)
    and lists its choices."""
    p = _subcommands()[command]
    text = " ".join(p.format_help().split())
    for action in p._actions:
        if isinstance(action, argparse._HelpAction) or action.required or (
                not action.option_strings and action.nargs is None):
            continue  # -h, and arguments that must be given
        help_text = " ".join(p._get_formatter()._expand_help(action).split())
        assert "default" in help_text, (command, action.dest, help_text)
        if cli._has_default(action):
            default = action.default if not isinstance(action.default, list) else None
            assert f"(default: {default})" in help_text, (command, action.dest, help_text)
        for choice in action.choices or ():
            assert choice in text, (command, action.dest, choice)
    if command == "convert":  # what it converts: every attnzoo model, the formats
        assert all(name in text for name in list_attnzoo_models())
        assert ".safetensors, .pth, .pt, .bin" in text and "Flax" in text


def test_cli_bench_builds_a_fixed_size_model_for_the_size_asked(capsys):
    """QUEST's (timm ViT's) error tells the user to build the model with img_size: bench does
    it for --img-size (other create_model arguments go through --model-kwargs)."""
    argv = ["bench", "quest_vit_tiny_patch16_224", "--img-size", "32", "--batch-size", "1",
            "--steps", "1", "--warmup", "0", "--backends", "torch"]
    assert cli.main(argv) == 0
    assert "GMACs at 32x32" in capsys.readouterr().out


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


def test_cli_timm_script_with_a_syntax_error_is_one_line(tmp_path, capsys):
    script = _write_script(tmp_path, "import timm\nprint('unclosed'\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["timm", script])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"attnzoo timm: error: {script}, line 2: not valid Python: ")


def test_cli_timm_runner_exit_message(tmp_path, capsys):
    script = _write_script(tmp_path, "raise SystemExit('bad dataset path')\n")
    assert cli.main(["timm", script]) == 1
    assert "bad dataset path" in capsys.readouterr().err


@pytest.fixture
def picture(tmp_path):
    from PIL import Image
    path = tmp_path / "image.png"
    Image.radial_gradient("L").convert("RGB").resize((160, 120)).save(path)
    return path


@pytest.mark.parametrize("model,layer,head,panels", [
    ("dinat_mini", "0.1", "all", 2), ("quest_vit_tiny_patch16_224", "2", "mean", 1),
    ("san10_patchwise", "1.0", "3", 1)])
def test_cli_attention_draws_the_query(model, layer, head, panels, picture, tmp_path, capsys):
    from PIL import Image
    out = tmp_path / "map.png"
    assert cli.main(["attention", model, str(picture), "--layer", layer, "--query", "5,150",
                     "--head", head, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: " in printed and "random weights" in printed
    assert "learned queries" not in printed  # QnA's alone (QUEST's queries are its tokens)
    with Image.open(out) as drawn:  # one 400 px panel per head, up to four a row
        assert drawn.format == "PNG" and drawn.size[0] == 400 * panels


def test_cli_attention_loads_the_checkpoint_and_names_bad_layers(picture, tmp_path, capsys):
    model = timm.create_model("nat_mini")
    weights = tmp_path / "w.safetensors"
    safetensors.torch.save_file(model.state_dict(), weights)
    out = tmp_path / "map.png"
    assert cli.main(["attention", "nat_mini", str(picture), "--layer", "stages.3.blocks.0.attn",
                     "--query", "60,80", "--checkpoint", str(weights), "-o", str(out)]) == 0
    assert "random weights" not in capsys.readouterr().out and out.exists()
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"PK\x03\x04 not really a zip archive")
    for args, message in (
            (["--checkpoint", str(garbage)], f"--checkpoint {garbage}: '{garbage}' is not a "
                                             "readable torch or safetensors checkpoint"),
            (["--checkpoint", str(weights), "--model-kwargs", "num_classes=3"],
             f"--checkpoint {weights}: checkpoint does not match nat_mini: "),
            (["--layer", "9.0"], "--layer: '9.0' is not an attention layer of NAT; accepted: "),
            (["--layer", "0.0", "--head", "5"], "--head 5: head must be 'mean', 'all' or a head "
                                               "index below 2, got 5"),
            (["--query", "200,0"], "--query 200,0: outside the 120x160 (HxW) image"),
            (["--query", "-1,5"], "--query -1,5: outside the 120x160 (HxW) image"),
            (["--model", "resnet18"], "resnet18: ResNet has no attnzoo attention layer")):
        model = args[1] if args[0] == "--model" else "nat_mini"
        args = [] if args[0] == "--model" else args
        argv = ["attention", model, str(picture), "--layer", "0.0", "--query", "1,1",
                "-o", str(out)] + args
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_attention_without_matplotlib_says_what_to_install(picture, monkeypatch, capsys):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit) as info:
        cli.main(["attention", "nat_mini", str(picture), "--layer", "0.0", "--query", "1,1"])
    assert info.value.code == 2
    assert "drawing needs matplotlib, not installed: pip install matplotlib\n" in \
        capsys.readouterr().err


def test_a_torchvision_that_does_not_match_torch_is_one_line(tmp_path):
    """A CPU torch beside PyPI's (CUDA) torchvision stops ``import timm`` with torch's
    "operator torchvision::nms does not exist": the command line says what to install in one
    line, exit status 2; ``import attnzoo`` raises an ImportError saying the same."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    for argv in (["-m", "attnzoo", "list"], ["-c", "import attnzoo"]):
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        expected = ("does not match torch", "Install torchvision from the same index as torch: "
                    "pip install torchvision --index-url ")
        assert all(e in proc.stderr for e in expected), proc.stderr
        if argv[0] == "-m":
            assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
            assert proc.stderr.startswith("attnzoo: error: timm cannot be imported: ")
        else:
            assert "ImportError: timm cannot be imported" in proc.stderr
