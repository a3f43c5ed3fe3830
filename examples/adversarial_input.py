"""Input-only optimisation: an adversarial example (iterative FGSM / PGD) on a frozen in-repo CNN.

Only the image needs a gradient; every weight is frozen and the network is in eval mode (batch norm on
running statistics), MemSave's "Input (BN eval)" case. Stock PyTorch still keeps every conv's and batch
norm's input, every ReLU's output and max pool's input and indices; slimgrad keeps 1-bit ReLU masks and
1-byte pool positions. The same attack runs on the stock model and on ``slimgrad.convert(model)``; the
script checks that the two adversarial images are identical, bit for bit, and prints the memory figures.

    python examples/adversarial_input.py                          # ResNet-18-like, 8 x 3 x 224 x 224
    python examples/adversarial_input.py --tiny                   # what CI runs
    python examples/adversarial_input.py --model vgg11 --steps 5
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import slimgrad
from slimgrad.measure import SavedTensors, peak_bytes
from slimgrad.models import MODELS, build_model

MIB = 2**20


def pgd_step(model, image, adv, label, eps=8 / 255, alpha=2 / 255):
    """One PGD step in the L-infinity ball of radius ``eps`` around ``image``: a signed-gradient ascent step
    on the classification loss, projected back."""
    adv = adv.detach().requires_grad_(True)
    loss = F.cross_entropy(model(adv), label)
    (grad,) = torch.autograd.grad(loss, adv)
    with torch.no_grad():
        adv = adv + alpha * grad.sign()
        return (image + (adv - image).clamp(-eps, eps)).clamp(0, 1)


def attack(models, image, label, steps):
    """PGD on every model, interleaved step by step (machine noise hits all alike). Returns, per model,
    the adversarial image and the seconds per step."""
    adv = {name: image.clone() for name in models}
    times = {name: [] for name in models}
    for _ in range(steps):
        for name, model in models.items():
            t0 = time.perf_counter()
            adv[name] = pgd_step(model, image, adv[name], label)
            times[name].append(time.perf_counter() - t0)
    return adv, times


def measure(model, image, label):
    """(bytes kept for backward by one forward, peak bytes over forward + backward)."""
    x = image.clone().requires_grad_(True)
    with SavedTensors(exclude=[model]) as kept:
        loss = F.cross_entropy(model(x), label)
    torch.autograd.grad(loss, x)

    def step():
        xi = image.clone().requires_grad_(True)
        torch.autograd.grad(F.cross_entropy(model(xi), label), xi)

    return kept.bytes, peak_bytes(step)


def run(model_name="resnet18", tiny=False, steps=3, batch=8, size=224, seed=0):
    torch.manual_seed(seed)
    if tiny:
        batch, size = 2, 64
    stock = build_model(model_name, num_classes=10).eval()
    stock.requires_grad_(False)
    slim = slimgrad.convert(stock)
    gen = torch.Generator().manual_seed(seed)
    image = torch.rand(batch, 3, size, size, generator=gen)
    label = torch.randint(0, 10, (batch,), generator=gen)
    models = {"stock": stock, "slimgrad": slim}
    result = {}
    for name, model in models.items():
        measure(model, image, label)  # warm-up: producers learn what their consumers keep
        kept, peak = measure(model, image, label)
        result[name] = {"kept": kept, "peak": peak}
    adv, times = attack(models, image, label, steps)
    for name in models:
        result[name].update(adv=adv[name], times=times[name])
    result["image"] = image
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--tiny", action="store_true", help="batch 2 at 64 x 64 (CI)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args(argv)
    result = run(args.model, args.tiny, args.steps, args.batch, args.size)
    print(f"{'':10} {'MiB kept':>9} {'peak MiB':>9} {'s/step':>7}")
    for name in ("stock", "slimgrad"):
        r = result[name]
        step_s = sorted(r["times"])[len(r["times"]) // 2]
        print(f"{name:10} {r['kept'] / MIB:9.1f} {r['peak'] / MIB:9.1f} {step_s:7.2f}")
    s, g = result["stock"], result["slimgrad"]
    same = torch.equal(s["adv"], g["adv"])
    print(f"slimgrad/stock: kept {g['kept'] / s['kept']:.3f}, peak {g['peak'] / s['peak']:.3f}; "
          f"adversarial images identical: {same}")
    if not same:
        raise SystemExit("the adversarial images differ")


if __name__ == "__main__":
    main()
