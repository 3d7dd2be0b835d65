"""One rank of the DDP check: tests/test_train_launch.py starts two of them with torchrun
(``torchrun --nproc_per_node=2 -m attnzoo timm tests/ddp_worker.py OUT``), on CPU with gloo.

Per family, a tiny model (timm_train.TINY, no drop path) trains a few steps as timm's train.py
trains: the process group from timm's ``init_distributed_device``, DistributedDataParallel with
its defaults (no ``find_unused_parameters``: a parameter without a gradient would fail the next
step), a DistributedSampler, timm's optimizer (SGD with momentum: its update is linear in the
gradient, so float noise is not amplified as Adam's would be near zero). Rank 0 also trains
the same initial model in this one process on the ranks' batches put together: one forward on
the combined batch, or for SAN, whose BatchNorm statistics stay per rank (the config's dist_bn
''), one forward per rank's part. It writes, for the test to check: how far the ranks'
parameters are apart (0: identical), how far DDP's are from that single-process run against how
far training moved them, and whether every parameter had a gradient.

With CUDA devices (``--device cuda``, nccl) it also trains SAN with timm's SyncBatchNorm
conversion (``--sync-bn``) against one forward on the combined batch. torch runs SyncBatchNorm
on GPUs only (DistributedDataParallel refuses it on CPU modules, the layer refuses CPU inputs in
training), so on CPU it checks the conversion itself: every BatchNorm synchronised, the same
weights, the same eval outputs.
"""
import argparse
import json
import sys
from pathlib import Path

import timm
import torch
import torch.distributed as dist
from timm.layers import convert_sync_batchnorm
from timm.optim import create_optimizer_v2
from timm.utils import init_distributed_device
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

import attnzoo  # noqa: F401  (already imported by `python -m attnzoo timm`; explicit if run alone)
import timm_train

SAMPLES, BATCH, CLASSES = 24, 4, 4  # 24 samples over 2 ranks in batches of 4: 3 steps


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=CLASSES, drop_path_rate=0.,
                             **timm_train.TINY[name])


def _optimizer(model):
    return create_optimizer_v2(model, opt="momentum", lr=0.05, weight_decay=1e-4)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _train_case(name, dataset, device, rank, world, sync_bn=False):
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    batches = [list(sampler)[i:i + BATCH] for i in range(0, SAMPLES // world, BATCH)]
    model = _model(name)
    if sync_bn:
        model = convert_sync_batchnorm(model)
    ddp = DistributedDataParallel(model.to(device))
    initial = _flat(ddp.module)
    optimizer = _optimizer(ddp)
    all_grads = True
    for idx in batches:
        x, y = dataset[idx]
        optimizer.zero_grad()
        _loss(ddp, x.to(device), y.to(device)).backward()
        all_grads &= all(p.grad is not None for p in ddp.parameters())
        optimizer.step()
    params = _flat(ddp.module)
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    result = dict(steps=len(batches), all_grads=all_grads,
                  moved=(params - initial).abs().max().item(),
                  ranks_apart=max((g - gathered[0]).abs().max().item() for g in gathered))
    if rank == 0:  # the same steps in one process, on the ranks' batches put together
        per_rank = [list(DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True,
                                            seed=0)) for r in range(world)]
        reference = _model(name).to(device)
        optimizer = _optimizer(reference)
        has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                     for m in reference.modules())
        for step in range(len(batches)):
            parts = [dataset[p[step * BATCH:(step + 1) * BATCH]] for p in per_rank]
            optimizer.zero_grad()
            if has_bn and not sync_bn:  # BatchNorm statistics per rank's part
                loss = sum(_loss(reference, x.to(device), y.to(device)) for x, y in parts) / world
            else:
                x, y = (torch.cat(t) for t in zip(*parts))
                loss = _loss(reference, x.to(device), y.to(device))
            loss.backward()
            optimizer.step()
        result["from_one_process"] = (params - _flat(reference)).abs().max().item()
    return result


def _sync_bn_conversion(name, dataset):
    """timm's --sync-bn conversion of SAN, checked where SyncBatchNorm cannot train (CPU)."""
    model = _model(name).eval()
    synced = convert_sync_batchnorm(_model(name)).eval()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    converted = [m for m in synced.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    same_weights = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                         synced.state_dict().values()))
    x = dataset[:BATCH][0]
    with torch.no_grad():
        same_outputs = torch.equal(synced(x), model(x))
    return dict(batchnorms=len(norms), converted=len(converted), same_weights=same_weights,
                same_outputs=same_outputs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for rank<N>.json")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two processes on a small machine, tiny models
    device = init_distributed_device(args)  # train.py's: env:// from torchrun, gloo on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(SAMPLES, 3, 32, 32, generator=generator),
                            torch.randint(0, CLASSES, (SAMPLES,), generator=generator))
    results = {"world_size": world, "backend": dist.get_backend(),
               "timm": timm.__file__, "attnzoo": attnzoo.__file__}
    for name in timm_train.TINY:
        results[name] = _train_case(name, dataset, device, rank, world)
    if device.type == "cuda":
        results["san10_pairwise+sync_bn"] = _train_case("san10_pairwise", dataset, device, rank,
                                                        world, sync_bn=True)
    else:
        results["san10_pairwise+sync_bn"] = _sync_bn_conversion("san10_pairwise", dataset)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
