"""Census: on how many transformers causal-LM heads does ``convert(model, chunked_loss=True)`` engage?

Imports every ``transformers.models.*.modeling_*`` module, builds a tiny random instance of every
``*ForCausalLM`` / ``*LMHeadModel`` class from its config class with shrunk sizes, converts it with
``chunked_loss=True`` (which runs slimgrad's behavioural check against the stock forward) and counts: engaged
(converted, check passed), left as stock with a reason (grouped by reason), not buildable (with why). Prints a
table; ``--write`` also writes docs/chunked_loss.md's census section.

    OMP_NUM_THREADS=1 python benchmarks/chunked_census.py            # print only
    OMP_NUM_THREADS=1 python benchmarks/chunked_census.py --write    # and update docs/chunked_loss.md

No required arguments: the transformers installed is the one counted (its version is printed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import pkgutil
import re
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import torch

MAX_PARAMETERS = 30_000_000  # a tiny model has well under 1M; more means the shrinking missed a size

#: config attribute -> tiny value (set only where the default config has the attribute, as an int)
TINY = {
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "num_decoder_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64, "n_embed": 64, "model_dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "ffn_hidden_size": 128,
    "decoder_ffn_dim": 128, "hidden_dim": 128,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "d_kv": 16, "attention_head_size": 16,
    "vocab_size": 128, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "top_k": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
    "sliding_window": 64, "attention_window": 16, "rotary_dim": 8, "partial_rotary_factor": None,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "conv_kernel": 4, "state_size": 16, "ssm_state_size": 16, "mamba_d_state": 16, "mamba_n_heads": 4,
    "mamba_d_head": 16, "mamba_expand": 2, "num_memory_blocks": 1, "chunk_size": 16,
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "emb_dim": 64, "n_groups": 1,
}
#: sizes set even where the default config leaves them None (derived values some models need)
SET_IF_NONE = ("head_dim", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size", "n_shared_experts",
               "num_key_value_heads")


def _heads(transformers):
    """Import every modeling module; returns (head classes, {module: import error})."""
    failed = {}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        if not info.ispkg:
            continue
        package = f"transformers.models.{info.name}"
        try:
            pkg = importlib.import_module(package)
        except Exception as e:  # noqa: BLE001 - an optional dependency missing
            failed[package] = f"{type(e).__name__}"
            continue
        for sub in pkgutil.iter_modules(pkg.__path__):
            if sub.name.startswith("modeling_") and not sub.name.startswith(("modeling_tf_", "modeling_flax_")):
                try:
                    importlib.import_module(f"{package}.{sub.name}")
                except Exception as e:  # noqa: BLE001
                    failed[f"{package}.{sub.name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    from slimgrad.integrations import _hf_classes, hf_loss

    heads = sorted({cls for _, cls in _hf_classes.loaded_transformers_classes() if hf_loss._is_head(cls)},
                   key=lambda c: (c.__module__, c.__name__))
    return heads, failed


#: the sizes every level shrinks (levels past 0 keep the config's own values for the others)
CORE = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "vocab_size")
#: what the head does to its logits, set away from the identity where the config has it, so that the census
#: checks the scale / soft cap the chunked path applies, not a no-op
MODIFIERS = {"final_logit_softcapping": 5.0, "logits_soft_cap": 5.0, "logit_scale": 0.25, "logits_scaling": 4.0,
             "output_multiplier": 0.5, "lm_head_multiplier": 0.5}


def _overrides(defaults: dict, level: int) -> dict:
    """Tiny values for the sizes ``defaults`` has: level 0 all of TINY, 1 without MoE and MLA sizes, 2 only
    layers and vocabulary, 3 only the vocabulary (configs whose layer lists fix the depth)."""
    keys = list(TINY) if level == 0 else [k for k in TINY if k in CORE or k.endswith("token_id")] if level == 2 \
        else [k for k in TINY if k == "vocab_size" or k.endswith("token_id")] if level == 3 \
        else [k for k in TINY if k in CORE or k.endswith("token_id") or k in (
            "hidden_size", "n_embd", "d_model", "intermediate_size", "num_attention_heads", "n_head",
            "num_key_value_heads", "head_dim")]
    overrides = {}
    for name in keys:
        value = TINY[name]
        have = defaults.get(name, 0)
        if name in defaults and ((isinstance(have, int) and not isinstance(have, bool))
                                 or (have is None and name in SET_IF_NONE)):
            if value is not None:
                overrides[name] = value
    if level == 0 and "qk_rope_head_dim" in overrides and "head_dim" in overrides:
        overrides["head_dim"] = overrides["qk_rope_head_dim"]  # MLA configs tie the two
    if level == 0 and "kv_lora_rank" in overrides and "num_key_value_heads" in overrides:
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", 4)  # MLA: one KV head per head
    if "attention_types" in defaults and "num_layers" in overrides:  # GPT-Neo: the layer pattern fixes the depth
        overrides["attention_types"] = [[["global", "local"], overrides["num_layers"] // 2]]
    if isinstance(defaults.get("expand"), int) and "num_heads" in overrides and "hidden_size" in overrides:
        overrides["head_dim"] = overrides["hidden_size"] * defaults["expand"] // overrides["num_heads"]  # Mamba-2
    for name, value in defaults.items():  # token ids beyond the tiny vocabulary
        if name.endswith("token_id") and isinstance(value, int) and value >= TINY["vocab_size"]:
            overrides[name] = 3
    for name, value in MODIFIERS.items():
        if isinstance(defaults.get(name), (int, float)) and not isinstance(defaults.get(name), bool):
            overrides[name] = value
    return overrides


def _tiny_config(cls, level=0):
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise RuntimeError("no config_class")
    defaults = config_class().to_dict()
    overrides = _overrides(defaults, level)
    for name, value in defaults.items():  # a composite config: shrink its sub-models too (text, vision, audio)
        if isinstance(value, dict) and "model_type" in value:
            overrides[name] = {**value, **_overrides(value, level)}
    if "layer_types" in defaults:
        overrides["layer_types"] = None
    try:
        config = config_class(**overrides)
    except Exception:  # noqa: BLE001 - some configs refuse a None layer_types (or a modifier)
        layers = next((overrides[n] for n in CORE if n in overrides and n != "vocab_size"), None)
        if isinstance(defaults.get("layer_types"), list) and layers is not None:
            overrides["layer_types"] = defaults["layer_types"][:layers]  # the first layers of the default pattern
        for name in MODIFIERS:
            overrides.pop(name, None)
        try:
            config = config_class(**overrides)
        except Exception:  # noqa: BLE001 - keep the config's own pattern
            overrides.pop("layer_types", None)
            config = config_class(**overrides)
    for name, value in MODIFIERS.items():  # properties the constructor does not take
        if name in defaults and getattr(config, name, None) != value and name not in overrides:
            try:
                setattr(config, name, value)
            except Exception:  # noqa: BLE001 - a read-only property: its own value stays
                pass
    layer_types = getattr(config, "layer_types", None)
    layers = next((getattr(config, n) for n in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, n)),
                  None)
    if layer_types is None and isinstance(defaults.get("layer_types"), list):  # not derived: keep the pattern
        layer_types = list(defaults["layer_types"])
        config.layer_types = layer_types
    if isinstance(layer_types, list) and isinstance(layers, int) and len(layer_types) != layers:
        config.layer_types = layer_types[:layers]
    return config


def _build(cls):
    """A tiny instance whose stock forward runs on a tiny batch (the first shrink level that gives one), or
    (None, why not)."""
    error = None
    for level in range(4):
        try:
            config = _tiny_config(cls, level)
            with torch.device("meta"):  # count first: a config the shrinking missed could need gigabytes
                size = sum(p.numel() for p in cls(config).parameters())
            if size > MAX_PARAMETERS:
                raise MemoryError(f"{size / 1e6:.0f}M parameters after shrinking (census limit "
                                  f"{MAX_PARAMETERS / 1e6:.0f}M)")
            torch.manual_seed(0)
            model = cls(config)
            vocab = getattr(model.get_output_embeddings(), "out_features", TINY["vocab_size"])
            ids = torch.randint(3, min(TINY["vocab_size"], vocab), (1, 8))
            with torch.no_grad():
                model(input_ids=ids, labels=ids, use_cache=False)  # stock itself must run on the tiny config
            return model, None
        except Exception as e:  # noqa: BLE001
            text = str(e).splitlines()[0] if str(e) else ""
            error = error or f"{type(e).__name__}: {_norm(text)[:90]}"
    return None, error


def census(transformers, progress=True):
    import slimgrad
    from slimgrad import _notices
    from slimgrad._registry import REPLACEMENTS
    from slimgrad.integrations import hf_loss

    heads, failed_imports = _heads(transformers)
    slimgrad.integrations.load_available()
    engaged, left, unbuildable, recipes = [], defaultdict(list), defaultdict(list), defaultdict(list)
    iterator = heads
    if progress:
        from tqdm import tqdm

        iterator = tqdm(heads, desc="heads", file=sys.stderr)
    for cls in iterator:
        name = cls.__name__
        if cls not in REPLACEMENTS:
            gap = _notices.class_gap(cls)
            left[gap.reason if gap else "not registered"].append(name)
            continue
        if progress:
            iterator.set_postfix_str(name)
        model, error = _build(cls)
        if model is None:
            unbuildable[error].append(name)
            continue
        _, report = slimgrad.convert(model, chunked_loss=True, include=[cls], report=True, inplace=True)
        if type(model) is not cls:
            engaged.append(name)
            verified = hf_loss._MODULES.get(model)
            how = verified.recipe.describe() if hasattr(verified, "recipe") else "?"
            if hf_loss._pre_head(model, model.get_output_embeddings()) is not None:
                how = f"{how}, through a head module (transform before the output embedding)"
            recipes[how].append(name)
        else:
            reasons = [g.reason for g in report.gaps if g.subject.endswith(f".{cls.__qualname__}")]
            left[reasons[0] if reasons else "not converted"].append(name)
    return heads, failed_imports, engaged, left, unbuildable, recipes


def _norm(text: str) -> str:
    """A reason without its numbers, so that heads failing the same way group together."""
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", text)


def _group(left):
    groups = defaultdict(list)
    for reason, names in left.items():
        groups[_norm(reason)].extend(names)
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))


def render(transformers, heads, failed_imports, engaged, left, unbuildable, recipes) -> str:
    n_left = sum(len(v) for v in left.values())
    n_unbuilt = sum(len(v) for v in unbuildable.values())
    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}, "
             f"{datetime.date.today().isoformat()}: {len(heads)} head classes "
             f"({len(failed_imports)} modeling modules could not be imported)", "",
             "| outcome | heads |", "|---|---|",
             f"| engaged (converted, check passed) | {len(engaged)} |",
             f"| left as stock, with a reason | {n_left} |",
             f"| not buildable tiny (not counted against slimgrad) | {n_unbuilt} |", ""]
    if recipes:
        lines += ["Engaged, by what the check found the head does besides its linear layer:", ""]
        for how, names in sorted(recipes.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(sorted(names)) if len(names) <= 12 else f"{', '.join(sorted(names)[:12])}, ..."
            lines.append(f"- {len(names)}: {how} ({shown})")
        lines.append("")
    if left:
        lines += ["Left as stock, by reason:", ""]
        for reason, names in _group(left):
            lines.append(f"- {len(names)}: {reason} ({', '.join(sorted(names))})")
        lines.append("")
    if unbuildable:
        lines += ["Not buildable as a tiny model by the census (its shrunk config):", ""]
        for reason, names in _group(unbuildable):
            lines.append(f"- {len(names)}: {reason} ({', '.join(sorted(names))})")
        lines.append("")
    if failed_imports:
        lines += ["Modeling modules that failed to import: " + ", ".join(sorted(failed_imports)), ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update docs/chunked_loss.md's census section")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    logging.getLogger("slimgrad").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = census(transformers, progress=not args.no_progress)
    text = render(transformers, *result)
    print(text)
    if args.write:
        _write(text, transformers.__version__)


BEGIN, END = "<!-- census:{} -->", "<!-- /census:{} -->"


def _write(text: str, version: str) -> None:
    """Replace (or append) this version's block in docs/chunked_loss.md."""
    path = Path(__file__).resolve().parent.parent / "docs" / "chunked_loss.md"
    doc = path.read_text() if path.exists() else "# Chunked loss\n"
    begin, end = BEGIN.format(version), END.format(version)
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
