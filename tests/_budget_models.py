"""Small models for the memory estimate and the budget planner, and the measured peak of one real step.

Every builder returns ``(model, example)``: a model in train mode with fixed random weights (seeded here), and
one batch as :func:`slimgrad.estimate.split_example` takes it (a tensor, a tuple of positional inputs, or a
dict of keyword inputs). The loss is :func:`slimgrad.audit.default_loss` of the output (``.loss`` when the
batch has labels, else the sum of the outputs), the same one ``estimate`` and ``plan`` use by default.

The configs are small (a step takes milliseconds) but keep each family's structure: several blocks, the
layer types the real model has, LoRA adapters where the real workload has them.
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn

import slimgrad
from slimgrad.audit import default_loss
from slimgrad.estimate import split_example


def cnn(name: str = "resnet18", batch: int = 2, size: int = 32, width_scale: float = 0.25):
    """An in-repo CNN (``slimgrad.models.cnn``: resnet18, vgg11, convnext, vit), 10 classes, one image batch;
    ``width_scale`` scales the channel widths (0.25: a quarter of the standard ones)."""
    from slimgrad.models.cnn import build_model

    torch.manual_seed(0)
    model = build_model(name, num_classes=10, width_scale=width_scale).train()
    return model, torch.randn(batch, 3, size, size)


def hf_resnet(batch: int = 2, size: int = 32):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], layer_type="basic",
                       num_labels=10)
    return ResNetForImageClassification(cfg).train(), {"pixel_values": torch.randn(batch, 3, size, size)}


def hf_mobilenet(batch: int = 2, size: int = 32):
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    cfg = MobileNetV2Config(image_size=size, depth_multiplier=0.35, num_labels=10)
    return MobileNetV2ForImageClassification(cfg).train(), {"pixel_values": torch.randn(batch, 3, size, size)}


def hf_vit(batch: int = 2, size: int = 32):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    image_size=size, patch_size=8, num_labels=10)
    return ViTForImageClassification(cfg).train(), {"pixel_values": torch.randn(batch, 3, size, size)}


def _lora(model, targets, dropout=0.0, r=4):
    import peft

    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=dropout,
                          init_lora_weights=False)
    return peft.get_peft_model(model, cfg).train()


def llama_lora(batch: int = 2, seq: int = 32, dtype=torch.bfloat16, dropout: float = 0.0):
    """A 2-layer Llama-like causal LM with peft LoRA on q/k/v/o; the batch has labels (``.loss``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = _lora(LlamaForCausalLM(cfg).to(dtype), ["q_proj", "k_proj", "v_proj", "o_proj"], dropout)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": ids}


def t5_lora(batch: int = 2, seq: int = 32, dtype=torch.bfloat16):
    """A 2+2-layer T5 with peft LoRA on q/v; the batch has labels (``.loss``)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=256, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    model = _lora(T5ForConditionalGeneration(cfg).to(dtype), ["q", "v"])
    ids = torch.randint(1, 256, (batch, seq), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": ids}


def qlora_llama(batch: int = 2, seq: int = 32, bits: int = 4, targets="all-linear", bias: bool = False):
    """A 2-layer Llama-like model loaded in 4 bits (bitsandbytes nf4, double quantization, bf16 compute; or
    ``bits=8``: LLM.int8) on CPU, prepared for k-bit training, with peft LoRA on every linear layer (what a
    QLoRA recipe builds) or on ``targets`` (peft's default for Llama: q_proj and v_proj, the MLP plain 4-bit);
    ``bias``: projections with biases (as Qwen2's q/k/v, GPT-NeoX's and Falcon's layers have)."""
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attention_bias=bias, mlp_bias=bias)
    quant = (transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
             if bits == 4 else transformers.BitsAndBytesConfig(load_in_8bit=True))
    with tempfile.TemporaryDirectory() as path:
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = _lora(model, targets)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": ids}


def unet_lora(batch: int = 2, size: int = 8):
    """A diffusers UNet2DConditionModel (cross-attention down/up blocks), frozen, with peft LoRA on the
    attention projections."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=8)
    unet.requires_grad_(False)
    model = _lora(unet, ["to_q", "to_k", "to_v", "to_out.0"])
    return model, {"sample": torch.randn(batch, 4, size, size), "timestep": torch.tensor([10] * batch),
                   "encoder_hidden_states": torch.randn(batch, 4, 16)}


#: name -> builder, every family the estimate's target names (the QLoRA one needs bitsandbytes)
BUILDERS = {
    "resnet18": lambda **kw: cnn("resnet18", **kw),
    "vgg11": lambda **kw: cnn("vgg11", **kw),
    "convnext": lambda **kw: cnn("convnext", **kw),
    "vit": lambda **kw: cnn("vit", **kw),
    "hf_resnet": hf_resnet,
    "hf_mobilenet": hf_mobilenet,
    "hf_vit": hf_vit,
    "llama_lora": llama_lora,
    "t5_lora": t5_lora,
    "qlora_llama": qlora_llama,
    "unet_lora": unet_lora,
}


def step_fn(model: nn.Module, example, optimizer: torch.optim.Optimizer | None = None):
    """One training step as ``estimate`` simulates it: (zero_grad,) forward, ``default_loss``, backward
    (, optimizer step)."""
    args, kwargs = split_example(example)

    def step():
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        default_loss(model(*args, **kwargs)).backward()
        if optimizer is not None:
            optimizer.step()

    return step


def _no_grads(model, optimizer):
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None


def measured_step_peak(model: nn.Module, example, optimizer: torch.optim.Optimizer | None = None,
                       warm: int | None = None) -> int:
    """The allocator's peak above the step's start (``slimgrad.peak_bytes``) of one real step, in the state
    ``estimate`` describes: no gradients before the step; with an optimizer, its state already made by ``warm``
    earlier steps (default 2); without one, ``warm`` steps first (default 0; a converted model's first step may
    build caches). Gradients are dropped again afterwards. The model's weights change when an optimizer steps."""
    step = step_fn(model, example, optimizer)
    for _ in range(warm if warm is not None else (2 if optimizer is not None else 0)):
        step()
    _no_grads(model, optimizer)
    peak = slimgrad.peak_bytes(step)
    _no_grads(model, optimizer)
    return peak


def relative_error(estimated: int, measured: int) -> float:
    return (estimated - measured) / measured
