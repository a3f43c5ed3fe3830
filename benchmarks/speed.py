"""Speed parity: slimgrad vs stock eager step time on the models users run, with bytes kept and peak.

    OMP_NUM_THREADS=2 python benchmarks/speed.py [--device cpu|cuda] [--pairs 12] [--only resnet,t5]
                                                [--write]

For every model (small configs, random weights) and case: forward + backward of stock and of
``slimgrad.convert(model)`` on independent copies, interleaved (the order rotates), after warm-up; the
converted model runs twice per round, once with the compiled core (``slimgrad.csrc``, the default) and once
with it disabled (the Python path, what runs where the core cannot be built). Reported: median step time of
each, the median of the round-by-round ratios slimgrad / stock, bytes kept for backward (saved-tensor hooks,
parameters excluded) and the peak over a step (allocator records on CPU, ``max_memory_allocated`` on CUDA). A
``noise`` row times stock against an identical copy of itself: ratios inside its band are indistinguishable
from 1.00 on that machine and load. ``--write`` puts the table into docs/benchmarks.md (its own section) with
the command, torch version and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import statistics
import sys
import time

import torch
from _docs import write_section

import slimgrad
from slimgrad import csrc
from slimgrad.cases import apply_case
from slimgrad.measure import SavedTensors, peak_bytes

MiB = 2**20


# ---------------------------------------------------------------------------------------------- models
# Each builder returns (model, make_batch, loss_fn, input_grad). make_batch() -> inputs dict or tensor.


def _image_case(model, case, batch, size, channels=3, logits=True):
    input_grad = apply_case(model, case)
    x = torch.randn(batch, channels, size, size)

    def loss(m, x):
        out = m(pixel_values=x) if logits else m(x)
        out = out.logits if hasattr(out, "logits") else out
        return out.float().sum()

    return model, x, loss, input_grad


def cnn(name, case):
    from slimgrad.models import build_model

    return _image_case(build_model(name, num_classes=10), case, 8, 64, logits=False)


def hf_resnet(case):
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic",
                       num_labels=10)
    return _image_case(ResNetForImageClassification(cfg), case, 8, 64)


def hf_mobilenet(case):
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    cfg = MobileNetV2Config(image_size=64, num_labels=10)
    return _image_case(MobileNetV2ForImageClassification(cfg), case, 8, 64)


def hf_convnext(case):
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(hidden_sizes=[48, 96, 192, 384], depths=[1, 1, 3, 1], num_labels=10, image_size=64)
    return _image_case(ConvNextForImageClassification(cfg), case, 8, 64)


def hf_vit(case):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=192, num_hidden_layers=6, num_attention_heads=3, intermediate_size=768,
                    image_size=64, patch_size=8, num_labels=10)
    return _image_case(ViTForImageClassification(cfg), case, 8, 64)


def _lora(model, targets, dropout):
    import peft

    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), lora_dropout=dropout,
                          init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def unet_lora(case):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    for p in unet.parameters():
        p.requires_grad_(False)
    model = _lora(unet, ("to_q", "to_k", "to_v", "to_out.0"), 0.0)
    model.train()
    batch = {"sample": torch.randn(4, 4, 16, 16), "timestep": torch.tensor([10] * 4),
             "encoder_hidden_states": torch.randn(4, 8, 32)}

    def loss(m, b):
        return m(**b).sample.float().sum()

    return model, batch, loss, False


def vae_latent(case):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8, sample_size=64)
    for p in vae.parameters():
        p.requires_grad_(False)
    vae.train()
    z = torch.randn(2, 4, 32, 32)

    def loss(m, z):
        return m.decode(z).sample.float().sum()

    return vae, z, loss, True


def t5_lora(case):
    from transformers import T5Config, T5ForConditionalGeneration

    dropout = 0.1 if case == "lora+dropout" else 0.0
    cfg = T5Config(vocab_size=512, d_model=128, d_ff=256, d_kv=32, num_layers=2, num_heads=4,
                   dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0)
    model = _lora(T5ForConditionalGeneration(cfg).to(torch.bfloat16), ("q", "v"), 0.05 if dropout else 0.0)
    model.train()
    ids = torch.randint(0, 512, (4, 64))

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss.float()

    return model, ids, loss, False


def llama_lora(case):
    from transformers import LlamaConfig, LlamaForCausalLM

    dropout = 0.05 if case == "lora+dropout" else 0.0
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = _lora(LlamaForCausalLM(cfg).to(torch.bfloat16), ("q_proj", "k_proj", "v_proj", "o_proj"), dropout)
    model.train()
    ids = torch.randint(0, 512, (4, 64))

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss.float()

    return model, ids, loss, False


ROWS = [
    ("noise: stock vs stock (resnet18)", "all", lambda c: cnn("resnet18", c), "noise"),
    *[("resnet18 (in-repo)", c, lambda c: cnn("resnet18", c), "cnn")
      for c in ("all", "input", "input-bn-eval", "norm", "surgical")],
    *[("transformers ResNet (basic)", c, hf_resnet, "resnet") for c in ("all", "input")],
    *[("transformers MobileNetV2", c, hf_mobilenet, "mobilenet") for c in ("all", "input")],
    *[("transformers ConvNeXt", c, hf_convnext, "convnext") for c in ("all", "input")],
    *[("transformers ViT", c, hf_vit, "vit") for c in ("all", "input")],
    ("diffusers UNet2DConditionModel + LoRA (to_q/k/v/out)", "lora", unet_lora, "unet"),
    ("diffusers AutoencoderKL decode, latent grad only", "input", vae_latent, "vae"),
    *[("T5 bf16 + peft LoRA (q, v)", c, t5_lora, "t5") for c in ("lora", "lora+dropout")],
    *[("Llama-like bf16 + peft LoRA (q/k/v/o)", c, llama_lora, "llama") for c in ("lora", "lora+dropout")],
]


# ---------------------------------------------------------------------------------------------- timing


def _to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return batch.to(device)


def _inputs(batch, input_grad):
    if isinstance(batch, dict) or not input_grad:
        return batch
    return batch.detach().requires_grad_()


def _step(model, batch, loss, input_grad):
    l = loss(model, _inputs(batch, input_grad))  # noqa: E741
    l.backward()


def _timed(model, batch, loss, input_grad, device, core=True):
    """(wall seconds, this process's CPU seconds) of one step. On a shared CPU the CPU time is the steadier
    measure (other processes' load does not enter it, except through caches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    switch = contextlib.nullcontext() if core else csrc.disabled()
    with switch:
        t, c = time.perf_counter(), time.process_time()
        _step(model, batch, loss, input_grad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, time.process_time() - c


def _kept(model, batch, loss, input_grad):
    with SavedTensors(exclude=[model]) as counter:
        l = loss(model, _inputs(batch, input_grad))  # noqa: E741
    l.backward()
    return counter.bytes


def measure_row(build, case, kind, pairs, device):
    torch.manual_seed(0)
    model, batch, loss, input_grad = build(case)
    model = model.to(device)
    batch = _to(batch, device)
    other = copy.deepcopy(model) if kind == "noise" else slimgrad.convert(model)
    for m in (model, other):
        for _ in range(2):  # warm-up (and slimgrad's producer/consumer bookkeeping, the core's build or load)
            _step(m, batch, loss, input_grad)
            m.zero_grad(set_to_none=True)
    ts, tg, tp, ratios, cpu_ratios, py_ratios = [], [], [], [], [], []
    providers = [(model, ts, True), (other, tg, True)] + ([(other, tp, False)] if kind != "noise" else [])
    for i in range(pairs):
        order = providers[i % len(providers):] + providers[: i % len(providers)]
        for m, out, core in order:
            m.zero_grad(set_to_none=True)
            out.append(_timed(m, batch, loss, input_grad, device, core))
        ratios.append(tg[-1][0] / ts[-1][0])
        cpu_ratios.append(tg[-1][1] / max(ts[-1][1], 1e-9))
        if tp:
            py_ratios.append(tp[-1][0] / ts[-1][0])
    kept = [_kept(m, batch, loss, input_grad) for m in (model, other)]
    peaks = []
    for m in (model, other):
        m.zero_grad(set_to_none=True)
        peaks.append(peak_bytes(lambda m=m: _step(m, batch, loss, input_grad)))
    return {
        "stock_ms": statistics.median(t for t, _ in ts) * 1e3, "slim_ms": statistics.median(t for t, _ in tg) * 1e3,
        "ratio": statistics.median(ratios), "ratio_lo": min(ratios), "ratio_hi": max(ratios),
        "cpu_ratio": statistics.median(cpu_ratios),
        "py_ratio": statistics.median(py_ratios) if py_ratios else None,
        "kept": kept, "peak": peaks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pairs", type=int, default=12)
    keys = ",".join(sorted({r[3] for r in ROWS}))
    parser.add_argument("--only", default="", help=f"comma-separated row keys: {keys}")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    only = {k for k in args.only.split(",") if k}
    rows = [r for r in ROWS if not only or r[3] in only]
    results = []
    started = time.perf_counter()
    for n, (name, case, build, kind) in enumerate(rows, 1):
        done = int(30 * (n - 1) / len(rows))
        print(f"\r[{'#' * done}{'.' * (30 - done)}] {n}/{len(rows)} {name} / {case} "
              f"({time.perf_counter() - started:.0f} s)" + " " * 20, end="", file=sys.stderr, flush=True)
        try:
            results.append((name, case, measure_row(build, case, kind, args.pairs, device)))
        except Exception as exc:  # noqa: BLE001 - report the row and go on
            results.append((name, case, {"error": f"{type(exc).__name__}: {exc}"}))
    print(f"\r[{'#' * 30}] done in {time.perf_counter() - started:.0f} s" + " " * 60, file=sys.stderr)

    cmd = "python benchmarks/speed.py " + " ".join(sys.argv[1:])
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    core = csrc.status()
    core_note = ("compiled core on" if core["loaded"] else f"compiled core unavailable ({core['reason']})")
    if device.type == "cuda" and core["loaded"]:  # (it serves CUDA tensors for its aten-only families)
        core_note += (" (on CUDA tensors: conv, average pooling, LoRA without dropout, batch norm, small ReLUs)"
                      if core["cuda"] else " (CPU tensors only: SLIMGRAD_CORE_CUDA=0)")
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    lines = [
        f"## Speed parity ({device.type}, {threads} thread{'s' if threads != '1' else ''})",
        "",
        f"`OMP_NUM_THREADS={threads} {cmd.strip()}` — torch {torch.__version__}, {machine}; "
        f"slimgrad kernels: {slimgrad.kernels.get_preference()}, {core_note}. Median of {args.pairs} "
        f"interleaved forward+backward steps per provider; ratio = median of the round-by-round slimgrad/stock "
        f"ratios (min–max over rounds in brackets); CPU ratio = the same with this process's CPU time (steadier "
        f"on a shared machine); Python path = slimgrad with the compiled core disabled (`SLIMGRAD_CORE=0`), "
        f"timed in the same rounds. Kept = bytes saved for backward (parameters excluded); peak = peak bytes "
        f"over one step.",
        "",
        "| model | case | stock ms | slimgrad ms | ratio [min–max] | CPU ratio | Python path ratio | "
        "kept MiB stock → slimgrad | peak MiB stock → slimgrad |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, case, r in results:
        if "error" in r:
            lines.append(f"| {name} | {case} | – | – | error: {r['error'][:80]} | | | | |")
            continue
        py = f"{r['py_ratio']:.2f}" if r["py_ratio"] is not None else "–"
        lines.append(
            f"| {name} | {case} | {r['stock_ms']:.1f} | {r['slim_ms']:.1f} | {r['ratio']:.2f} "
            f"[{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}] | {r['cpu_ratio']:.2f} | {py} | "
            f"{r['kept'][0] / MiB:.1f} → {r['kept'][1] / MiB:.1f} | "
            f"{r['peak'][0] / MiB:.1f} → {r['peak'][1] / MiB:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(f"speed-{device.type}-{threads}t", text)


if __name__ == "__main__":
    main()
