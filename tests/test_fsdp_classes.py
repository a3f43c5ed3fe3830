"""FSDP2's ``fully_shard`` re-classes each module it shards as ``FSDP<cls>(FSDPModule, cls)``. Converted first (the
README's order), a sharded module keeps its replacement's forward, and the forwards that look their stock class up
(``ORIGINALS[type(self)]``: the gated MLPs, the chunked loss) find it: they raised KeyError. ``revert`` rebuilds that
class on the stock one, so the module stays sharded (it was left converted, silently). Sharded first, a module is
left stock with a reason that says to convert first. One gloo process in a subprocess (a process group would
outlive the test in pytest's process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

_SCRIPT = textwrap.dedent("""
    import copy, json, os, sys
    import torch, torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import FSDPModule, fully_shard
    import slimgrad

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(sys.argv[1], "store"), rank=0, world_size=1)
    try:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

        def shard(m):
            for layer in m.model.layers:
                fully_shard(layer.mlp)
                fully_shard(layer)
            fully_shard(m)
            return m

        def step(m):
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            return out.loss.item(), {n: p.grad.full_tensor().tolist() for n, p in m.named_parameters()}

        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(cfg)
        stock = step(shard(copy.deepcopy(base)))
        converted = shard(slimgrad.convert(copy.deepcopy(base), chunked_loss=True))
        mlp = converted.model.layers[0].mlp
        result = dict(
            same=step(converted) == stock,
            converted_mlp=type(mlp).__mro__[2].__qualname__,
            converted_head=type(converted).__mro__[2].__qualname__)
        slimgrad.revert(converted)
        result.update(reverted_mlp=type(mlp).__mro__[2].__qualname__, still_sharded=isinstance(mlp, FSDPModule),
                      same_after_revert=step(converted)[0] == stock[0])
        late = shard(copy.deepcopy(base))
        try:
            slimgrad.convert(late)  # a deep copy: FSDP2 refuses it
        except ValueError as e:
            result["copy_refused"] = str(e)
        late, report = slimgrad.convert(late, inplace=True, report=True)
        result["late_reasons"] = sorted({s.reason.split(" (")[0] for s in report.skipped})
        late = slimgrad.convert(shard(copy.deepcopy(base)), inplace=True, report=True, chunked_loss=True)[1]
        result["late_chunked_gaps"] = [(g.subject, g.reason.split(" (")[0]) for g in late.gaps
                                       if g.family == "chunked_loss"]
        print(json.dumps(result))
    finally:
        dist.destroy_process_group()
""")


def test_fully_shard_after_convert_and_revert(tmp_path):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["same"]  # loss and every gradient bitwise stock's, chunked loss and gated MLP converted
    assert result["converted_mlp"] == "SlimLlamaMLP" and result["converted_head"].startswith("Slim")
    assert result["reverted_mlp"] == "LlamaMLP" and result["still_sharded"] and result["same_after_revert"]
    assert result["late_reasons"] == ["sharded by FSDP2's fully_shard before convert"]
    # chunked_loss asked for on a head sharded first: the gap names the head's own class and why (it said "engaged
    # on nothing: no causal-LM head" before)
    assert result["late_chunked_gaps"] == [["transformers.models.llama.modeling_llama.LlamaForCausalLM",
                                            "sharded by FSDP2's fully_shard before convert"]]
    assert "sharded by FSDP2's fully_shard" in result["copy_refused"] and "inplace=True" in result["copy_refused"]
