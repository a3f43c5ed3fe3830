"""QLoRA (bitsandbytes 4-bit / 8-bit base + peft LoRA) on a Llama-like model: bytes kept for backward and
peak bytes over a step, stock vs slimgrad, a per-module audit of one decoder layer, and what a dequantized
weight per layer (bitsandbytes PR #1935's claim) would cost next to what is kept.

Bytes kept: saved-tensor hooks (parameters excluded, storages once) plus, on the stock side, tensors that
bitsandbytes hides as ctx attributes (found by walking the graph). Peak: allocator records over
forward+backward (CPU).

    python benchmarks/qlora.py                    # LlamaConfig(512, 1408, 4 layers, 8 heads, vocab 8192), 2x256
    python benchmarks/qlora.py --model gpt_neox   # GPTNeoXConfig(512, 2048, 4 layers, 8 heads, vocab 8192),
                                                  # LoRA on query_key_value (peft's default for GPT-NeoX/Pythia)
"""

from __future__ import annotations

import argparse
import logging
import platform
import tempfile

import torch

import slimgrad
from slimgrad.audit import audit
from slimgrad.measure import _storage_key, peak_bytes

MiB = 2**20
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: --model: (config class, causal-LM class, config kwargs, LoRA targets)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                   vocab_size=8192), PROJ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                      vocab_size=8192), ["query_key_value"]),
}


def hidden_bytes(root, seen: set, exclude: set) -> int:
    """Bytes of tensors stored as attributes on custom-Function nodes, not already counted."""
    total, todo, nodes = 0, [root], set()
    while todo:
        node = todo.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        for value in getattr(node, "__dict__", {}).values():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    key, n = _storage_key(t)
                    if key is not None and key not in seen and key not in exclude:
                        seen.add(key)
                        total += n
        todo.extend(f for f, _ in node.next_functions)
    return total


def kept(model, ids):
    """(bytes kept visibly through save_for_backward, bytes hidden as ctx attributes) for one training step."""
    exclude = {_storage_key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    seen: dict = {}

    def pack(t):
        key, n = _storage_key(t)
        if key is not None and key not in exclude and not isinstance(t, torch.nn.Parameter):
            seen[key] = n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    visible = sum(seen.values())
    hidden = hidden_bytes(loss.grad_fn, set(seen), exclude)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return visible, hidden


def build(path, quant, rank, recipe="kbit", targets=PROJ):
    """``recipe="kbit"``: peft's ``prepare_model_for_kbit_training`` (upcasts every non-quantized parameter
    to fp32, so hidden states are fp32); ``recipe="bf16"``: the quantized model kept in bf16 (hidden states
    bf16, as in the plain bf16 LoRA model it is compared with)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if quant == "bf16":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        q = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16) if quant == "nf4"
             else BitsAndBytesConfig(load_in_8bit=True))
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu",
                                                     dtype=torch.bfloat16)
        if recipe == "kbit":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        else:
            model.enable_input_require_grads()
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    model.train()
    return model


def main():
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    args = parser.parse_args()
    import transformers

    config_cls, model_cls, config_kwargs, targets = MODELS[args.model]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**config_kwargs)
    path = tempfile.mkdtemp()
    getattr(transformers, model_cls)(cfg).save_pretrained(path)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(2))
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads; "
          f"{args.model}, batch {args.batch_size}x{args.seq_len}, LoRA r={args.rank} on {', '.join(targets)}")
    lora_peft = None
    rows = []
    for quant, recipe in (("nf4", "kbit"), ("int8", "kbit"), ("nf4", "bf16"), ("int8", "bf16"), ("bf16", "bf16")):
        stock = build(path, quant, args.rank, recipe, targets)
        if quant != "bf16" and lora_peft is None:
            import slimgrad.integrations.bnb as ib

            lora_peft = hasattr(ib, "SlimLoraLinear4bit")
        res = {}
        for name, m in (("stock", stock), ("slimgrad", slimgrad.convert(stock)),
                        ("slimgrad+chunked", slimgrad.convert(stock, chunked_loss=True))):
            kept(m, ids)  # warm-up, as in training
            visible, hidden = kept(m, ids)
            peak = peak_bytes(lambda m=m: m(input_ids=ids, labels=ids).loss.backward())
            m.zero_grad(set_to_none=True)
            res[name] = (visible, hidden, peak)
        label = "bf16 LoRA" if quant == "bf16" else f"{quant} ({'kbit-prep, fp32' if recipe == 'kbit' else 'bf16'})"
        rows.append((label, res))
        if quant != "bf16" and recipe == "kbit":
            import bitsandbytes as bnb

            layer_weights = sum(mod.out_features * mod.in_features for n, mod in stock.named_modules()
                                if ".layers.0." in n and isinstance(mod, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)))
            print(f"\n[{quant}] PR #1935: a dequantized bf16 weight per projection would keep "
                  f"{layer_weights * 2 / MiB:.2f} MiB per decoder layer, "
                  f"{layer_weights * 2 * cfg.num_hidden_layers / MiB:.2f} MiB for the model")
            small = ids[:, :64]
            rep = audit(stock, small, loss_fn=lambda out: out.logits.float().sum(), measure_peak=False)
            print(f"[{quant}] audit of decoder layer 0 (batch {args.batch_size}x64), MiB kept for backward:")
            print(f"  {'module':<44} {'stock+hidden':>12} {'slimgrad':>9}")
            for r in rep.rows:
                if ".layers.0." in r.path + "." and (r.stock_bytes or r.stock_hidden_bytes or r.slim_bytes):
                    print(f"  {r.path.split('layers.0.')[-1]:<44} "
                          f"{(r.stock_bytes + r.stock_hidden_bytes) / MiB:>12.3f} {r.slim_bytes / MiB:>9.3f}")
        del stock
    print(f"\npeft bnb LoRA wrappers converted: {lora_peft}")
    print("\n| model | side | kept (hooks) | hidden in ctx | kept total | ratio | peak over the step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, res in rows:
        base = sum(res["stock"][:2])
        for name, (visible, hidden, peak) in res.items():
            print(f"| {label} | {name} | {visible / MiB:.2f} | {hidden / MiB:.2f} | {(visible + hidden) / MiB:.2f} | "
                  f"{(visible + hidden) / base:.3f} | {peak / MiB:.2f} |")

if __name__ == "__main__":
    main()
