"""A DreamBooth-style LoRA training step on a diffusers ``UNet2DConditionModel``, stock vs slimgrad.

As diffusers' ``train_dreambooth_lora.py`` does: the UNet is frozen, peft LoRA adapters go on the
attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) through ``unet.add_adapter``, and each
step predicts the noise added to latents at a random timestep (MSE loss, AdamW on the adapters). The
UNet is built from a small config with random weights (no download); latents and text embeddings are
random tensors of the shapes the pipeline would feed. The same steps run on a stock copy and on a copy
converted with ``slimgrad.convert(unet, inplace=True)``; the script prints the losses, the MiB kept for
backward by one forward, the peak MiB over a whole step and the step time.

    python examples/dreambooth_lora.py                 # 32x32 latents, batch 2, 3 steps
    python examples/dreambooth_lora.py --tiny --steps 2  # what CI runs
    python examples/dreambooth_lora.py --conv-lora --lora-dropout 0.1  # LoRA on the convs too, with dropout
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from peft import LoraConfig

import slimgrad
from slimgrad.measure import SavedTensors, peak_bytes

MIB = 2**20
TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]  # as train_dreambooth_lora.py
CONV_TARGETS = ["conv1", "conv2"]  # the ResNet blocks' 3x3 convs (peft lora.Conv2d), with --conv-lora


def build_unet(tiny: bool) -> UNet2DConditionModel:
    """A Stable-Diffusion-shaped UNet (cross-attention blocks, GEGLU feed-forwards), scaled down."""
    if tiny:
        channels, sample, cross, heads = (32, 64), 16, 32, 4
    else:
        channels, sample, cross, heads = (64, 128, 256), 32, 256, 8
    n = len(channels)
    return UNet2DConditionModel(
        sample_size=sample, in_channels=4, out_channels=4, layers_per_block=1 if tiny else 2,
        block_out_channels=channels, norm_num_groups=16 if tiny else 32, cross_attention_dim=cross,
        attention_head_dim=heads,
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
    )


def make_batches(unet, steps, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cfg = unet.config
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    out = []
    for _ in range(steps):
        latents = torch.randn(batch, 4, cfg.sample_size, cfg.sample_size, generator=gen)
        noise = torch.randn(latents.shape, generator=gen)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=gen)
        text = torch.randn(batch, 8, cfg.cross_attention_dim, generator=gen)
        out.append((scheduler.add_noise(latents, noise, t), t, text, noise))
    return out


def loss_of(unet, batch, dtype):
    noisy, t, text, noise = batch
    pred = unet(noisy.to(dtype), t, text.to(dtype)).sample
    return F.mse_loss(pred.float(), noise.float())


def train(models, batches, dtype, lr=1e-3):
    """The same steps on every model, interleaved step by step (so machine noise hits all alike)."""
    opts = {n: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for n, m in models.items()}
    losses = {n: [] for n in models}
    times = {n: [] for n in models}
    for step, batch in enumerate(batches):
        for name, unet in models.items():
            torch.manual_seed(step)  # the same dropout masks for every model (LoRA dropout draws from it)
            t0 = time.perf_counter()
            loss = loss_of(unet, batch, dtype)
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss.item())
    return losses, times


def measure(unet, batch, dtype):
    """(bytes kept for backward by one forward, peak bytes over forward + backward)."""
    with SavedTensors(exclude=[unet]) as kept:
        loss = loss_of(unet, batch, dtype)
    loss.backward()
    unet.zero_grad(set_to_none=True)

    def step():
        loss_of(unet, batch, dtype).backward()

    peak = peak_bytes(step)
    unet.zero_grad(set_to_none=True)
    return kept.bytes, peak


def run(tiny=False, steps=3, batch=2, dtype=torch.float32, seed=0, conv_lora=False, dropout=0.0):
    torch.manual_seed(seed)
    unet = build_unet(tiny)
    if dtype != torch.float32:
        unet = unet.to(dtype)
    unet.requires_grad_(False)
    targets = TARGETS + (CONV_TARGETS if conv_lora else [])
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets,
                                lora_dropout=dropout))
    models = {"stock": unet, "slimgrad": slimgrad.convert(copy.deepcopy(unet), inplace=True)}
    batches = make_batches(unet, steps, batch, seed)
    result = {}
    for name, model in models.items():
        kept, peak = measure(model, batches[0], dtype)  # before training: both start from the same weights
        result[name] = {"kept": kept, "peak": peak}
    losses, times = train(models, batches, dtype)
    for name in models:
        result[name].update(losses=losses[name], times=times[name])
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny UNet (CI)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--conv-lora", action="store_true", help="LoRA on the ResNet blocks' convs too")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    result = run(args.tiny, args.steps, args.batch, getattr(torch, args.dtype), conv_lora=args.conv_lora,
                 dropout=args.lora_dropout)
    print(f"{'':10} {'MiB kept':>9} {'peak MiB':>9} {'s/step':>7}  losses")
    for name, r in result.items():
        step_s = sorted(r["times"])[len(r["times"]) // 2]
        print(f"{name:10} {r['kept'] / MIB:9.1f} {r['peak'] / MIB:9.1f} {step_s:7.2f}  "
              + " ".join(f"{v:.6f}" for v in r["losses"]))
    s, g = result["stock"], result["slimgrad"]
    print(f"slimgrad/stock: kept {g['kept'] / s['kept']:.3f}, peak {g['peak'] / s['peak']:.3f}")


if __name__ == "__main__":
    main()
