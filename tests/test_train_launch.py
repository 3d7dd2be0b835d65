"""Launching training: DDP over two CPU processes, the launches docs/training.md documents from
inside a timm clone (one machine, and two nodes started on this one), and the timm floor checked at
``import attnzoo``.

The clone is faked: a folder whose ``timm/`` is not the installed timm (one that raises when
imported, or an old version), which is what Python puts first on sys.path when a script runs
from a real clone. torchrun is started as ``python -m torch.distributed.run`` (the ``torchrun``
command is that module), ``--standalone`` (a local rendezvous on a free port).
"""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import attnzoo

TESTS = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _clone(tmp_path, timm_init: str) -> Path:
    clone = tmp_path / "pytorch-image-models"
    (clone / "timm").mkdir(parents=True)
    (clone / "timm" / "__init__.py").write_text(timm_init)
    return clone


def _run(cmd, cwd, timeout=300, **env):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_ddp_on_two_cpu_processes_averages_gradients_like_one_process_on_the_combined_batch(
        tmp_path):
    clone = _clone(tmp_path, "raise ImportError('the clone was imported')\n")
    out = tmp_path / "ddp"
    # docs/training.md's launch from a clone: torchrun --nproc_per_node=N -m attnzoo timm SCRIPT ...
    proc = _run([*TORCHRUN, "-m", "attnzoo", "timm", str(TESTS / "ddp_worker.py"), str(out)],
                cwd=clone)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert (result["world_size"], result["backend"]) == (2, "gloo")
        assert str(clone) not in result["timm"]
    names = ["nat_mini", "qna_vit_tiny", "san10_pairwise", "quest_vit_tiny_patch16_224"]
    for name in names:
        for result in ranks:
            case = result[name]
            assert case["steps"] == 3 and case["all_grads"], (name, case)
            assert case["ranks_apart"] == 0.0, (name, case)  # the ranks' parameters identical
        case = ranks[0][name]  # float rounding apart, not a fraction of a step (e.g. not summed)
        assert case["from_one_process"] <= 1e-3 * case["moved"] and case["moved"] > 0, (name, case)
    sync = ranks[0]["san10_pairwise+sync_bn"]
    assert sync == dict(batchnorms=sync["batchnorms"], converted=sync["batchnorms"],
                        same_weights=True, same_outputs=True) and sync["batchnorms"] > 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python >= 3.11's")
def test_train_py_in_a_clone_under_torchrun_imports_the_installed_timm_with_pythonsafepath(
        tmp_path):
    """``PYTHONSAFEPATH=1 ./distributed_train.sh 2 ...``: that script is ``torchrun
    --nproc_per_node=2 train.py ...``; train.py imports attnzoo through --device-modules."""
    clone = _clone(tmp_path, "raise ImportError('the clone was imported')\n")
    (clone / "train.py").write_text(
        "import importlib, torch, timm\n"
        "from timm.utils import init_distributed_device\n"
        "class Args: device = 'cpu'\n"
        "init_distributed_device(Args)\n"
        "importlib.import_module('attnzoo')\n"
        "total = torch.ones(1)\n"
        "torch.distributed.all_reduce(total)\n"
        # one file per rank: the ranks' prints share torchrun's stdout and can interleave
        "open(f'rank{Args.rank}.txt', 'w').write("
        "f'rank {Args.rank} of {int(total.item())} timm {timm.__file__}')\n"
        "torch.distributed.destroy_process_group()\n")
    proc = _run([*TORCHRUN, "train.py"], cwd=clone, PYTHONSAFEPATH="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank (\d) of (\d) timm (\S+)", "\n".join(
        f.read_text() for f in clone.glob("rank*.txt"))))
    assert [line[:2] for line in lines] == [("0", "2"), ("1", "2")]
    assert all(str(clone) not in line[2] for line in lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("rendezvous", ["node-rank", "c10d"])
def test_two_nodes_launched_as_the_readme_does_form_one_job(tmp_path, rendezvous):
    """docs/training.md's multi-node lines (``torchrun --nnodes=2 ... -m attnzoo timm train.py``,
    with ``--node_rank`` and a master address, or with a c10d rendezvous), two nodes of one
    process each started on this machine: one job of world size 2, a rank per node."""
    clone = _clone(tmp_path, "raise ImportError('the clone was imported')\n")
    (clone / "train.py").write_text(
        "import os, torch, timm\n"
        "from timm.utils import init_distributed_device\n"
        "class Args: device = 'cpu'\n"
        "init_distributed_device(Args)\n"
        "total = torch.ones(1)\n"
        "torch.distributed.all_reduce(total)\n"
        "open(f'rank{Args.rank}.txt', 'w').write("
        "f\"{Args.rank} {int(total.item())} {os.environ['GROUP_RANK']} {timm.__file__}\")\n"
        "torch.distributed.destroy_process_group()\n")
    port = _free_port()
    nodes = []
    for node in (0, 1):
        if rendezvous == "node-rank":
            where = [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        else:
            where = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                     "--rdzv_id=attnzoo-test"]
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             *where, "-m", "attnzoo", "timm", "train.py"], cwd=clone, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    results = sorted((clone / f"rank{r}.txt").read_text().split() for r in (0, 1))
    assert [r[:2] for r in results] == [["0", "2"], ["1", "2"]]  # one job: ranks 0, 1 of 2
    assert sorted(r[2] for r in results) == ["0", "1"]  # a rank on each node
    assert all(str(clone) not in r[3] for r in results)


def test_import_with_a_timm_below_the_floor_fails_at_once_naming_it_its_path_and_the_floor(
        tmp_path):
    clone = _clone(tmp_path, "__version__ = '1.0.20'\n")
    # `python -c` puts the current folder first on sys.path, as `python train.py` puts the
    # script's: the clone's old timm is found first
    proc = _run([sys.executable, "-c", "import attnzoo"], cwd=clone, timeout=120)
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"ImportError: attnzoo {attnzoo.__version__} needs timm >= "
                              f"{attnzoo.TIMM_FLOOR}, found timm 1.0.20 at {clone / 'timm'}.")
    assert "PYTHONSAFEPATH=1" in message and "python -m attnzoo timm SCRIPT" in message
    # the command line leaves the current folder out while it imports timm
    proc = _run([sys.executable, "-m", "attnzoo", "--version"], cwd=clone, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"attnzoo {attnzoo.__version__}")


def test_timm_floor_is_the_one_pyproject_declares():
    pyproject = (TESTS.parent / "pyproject.toml").read_text()
    assert re.search(r'"timm>=([0-9.]+)"', pyproject).group(1) == attnzoo.TIMM_FLOOR
