"""Train a converted CNN data-parallel with torchrun: DDP by default, FSDP2 with ``--fsdp``.

    torchrun --nproc-per-node=2 examples/distributed_train.py --steps 3 [--fsdp] [--bf16] [--check]

The same file runs on CUDA with NCCL (one GPU per process, picked by LOCAL_RANK) and on CPU with gloo.
``--check`` also trains the stock model the same way and exits non-zero unless slimgrad's parameters
match it (rounding only), which is what the test suite runs.

Batch norms are in eval mode (fine-tuning from pretrained statistics): each rank sees only its part of the
batch, so training-mode statistics would depend on the world size.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import slimgrad
from slimgrad.models.cnn import resnet18


def setup() -> torch.device:
    """Device and process group from torchrun's environment: NCCL on the local GPU, else gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build(device: torch.device, slim: bool) -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    model = resnet18(base_width=8, num_classes=5)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    model.conv1.requires_grad_(False)
    model.layer1.requires_grad_(False)  # a frozen stem and first stage: what slimgrad saves memory on
    model = model.to(device)
    return slimgrad.convert(model, inplace=True) if slim else model


def wrap(model: nn.Module, fsdp: bool, bf16: bool) -> nn.Module:
    if not fsdp:
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    if bf16:
        # Batch norms stay fp32 like their running statistics (stock refuses bf16 weights with fp32 stats).
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                fully_shard(m)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(stage, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def train(model: nn.Module, fsdp: bool, bf16: bool, steps: int, device: torch.device) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped = wrap(model, fsdp, bf16)
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)  # the same global batches on every rank; each takes its slice
    for step in range(steps):
        x = torch.randn(4 * world, 3, 32, 32, generator=g)[rank::world].to(device)
        y = torch.randint(0, 5, (4 * world,), generator=g)[rank::world].to(device)
        loss = nn.functional.cross_entropy(wrapped(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f}", flush=True)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
            for k, v in wrapped.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--bf16", action="store_true", help="FSDP2 with bf16 parameters, fp32 reduction")
    parser.add_argument("--check", action="store_true", help="also train stock and compare parameters")
    args = parser.parse_args()
    if args.bf16 and not args.fsdp:
        parser.error("--bf16 needs --fsdp")
    device = setup()
    try:
        slim = train(build(device, slim=True), args.fsdp, args.bf16, args.steps, device)
        if args.check:
            stock = train(build(device, slim=False), args.fsdp, args.bf16, args.steps, device)
            worst = max((slim[k] - v).abs().max().item() for k, v in stock.items())
            ok = all(torch.allclose(slim[k], v, rtol=1e-5, atol=1e-6) for k, v in stock.items())
            if dist.get_rank() == 0:
                print(f"slimgrad {'matches' if ok else 'DIFFERS FROM'} stock (max abs diff {worst:.3g})")
            if not ok:
                raise SystemExit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
