"""Under torch.compile, a mask that backward can read from a tensor it keeps anyway is not packed at all.

A traced ReLU (or clamp-family activation) packs its mask, one bit per element, and its backward unpacks it:
what eager keeps. But where the next layer's backward reads the activation's output anyway (a conv whose
weight trains reads its input), stock's compiled graph reads the mask's sign from that very tensor, while
ours still builds the pack, in backward if the partitioner rebuilds it there: one more pass over the map.
Eager slimgrad learns the case from its first step (the producer/consumer rule of ``_common``); a model
compiled from its first step never runs one, and a Function's backward is traced before its consumer is.

The joint graph, which AOTAutograd hands Inductor before partitioning, sees both sides. The traced Functions
tag the nodes that make the mask (``sign``: the comparison, from its *sources*), pack it (``pack``) and unpack
it in backward (``unpack``), with ``torch.fx.traceback.annotate``; :func:`share_masks`, an Inductor joint-graph
pass, then reads the unpacked mask straight from the comparison wherever every source of the comparison is
read by some backward node anyway. The partitioner then keeps (or rebuilds) the source it had to keep, and
no pack: the bytes are never more than the pack's path (the source is needed in backward either way) and
the values are the same booleans. Where a source is read by nothing in backward (a frozen consumer, batch
norm in eval mode) the pack stays, as in eager.

The pass is added to ``torch._inductor.config.joint_custom_pre_pass`` whenever dynamo traces a tagged Function
(beside any pass already there; it leaves graphs without slimgrad's tags alone: not at import, which would
import Inductor, 1.5 s), and carries a ``uuid`` so that Inductor's FX graph cache still applies. Other
backends (``aot_eager``) run no joint passes: there the pack stays.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys

import torch

__all__ = ["tagged", "pack", "unpack", "share_masks", "install", "stats"]

_KEY = "slimgrad_mask"  # the key in a node's meta["custom"]
SIGN, PACK, UNPACK = "sign", "pack", "unpack"

# How many masks the pass shared and kept since the process started (read by the tests).
stats = {"shared": 0, "kept": 0}

_annotate = getattr(getattr(torch.fx, "traceback", None), "annotate", None)


def tagged(role: str):
    """Tags the nodes traced inside with ``role`` (a no-op outside torch.compile, or on a torch without
    ``torch.fx.traceback.annotate``: then the pass finds nothing and the pack stays)."""
    if _annotate is None or not torch.compiler.is_compiling() or not _installed():
        return contextlib.nullcontext()
    return _annotate({_KEY: role})


def pack(make_mask, source: torch.Tensor, order) -> torch.Tensor:
    """``_bitmask.pack_planar(make_mask(source), order)``, tagged so that :func:`share_masks` can read the mask
    from ``source`` instead where backward reads ``source`` anyway. ``make_mask`` must read nothing but
    ``source`` (and constants it makes)."""
    from slimgrad.functional import _bitmask

    with tagged(SIGN):
        mask = make_mask(source)
    with tagged(PACK):
        return _bitmask.pack_planar(mask, order)


def unpack(packed: torch.Tensor, shape, order) -> torch.Tensor:
    """``_bitmask.unpack_planar``, tagged (see :func:`pack`)."""
    from slimgrad.functional import _bitmask

    with tagged(UNPACK):
        return _bitmask.unpack_planar(packed, shape, order)


def _role(node) -> str | None:
    custom = node.meta.get("custom")
    return custom.get(_KEY) if isinstance(custom, dict) else None


def _regions(graph, role):
    """The connected groups of nodes tagged ``role`` (one per traced call: calls are separated by untagged
    nodes), each as (nodes, inputs from outside, nodes with users outside)."""
    nodes = [n for n in graph.nodes if _role(n) == role]
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for i in n.all_input_nodes:
            if i in parent:
                parent[find(i)] = find(n)
    groups: dict = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    regions = []
    for members in groups.values():
        inside = set(members)
        inputs = {i for n in members for i in n.all_input_nodes if i not in inside}
        outputs = [n for n in members if any(u not in inside for u in n.users)]
        regions.append((members, inputs, outputs))
    return regions


def _backward_nodes(graph) -> set:
    """The nodes that depend on a tangent: what the partitioner will place in backward (not the output node,
    which returns the forward's outputs beside the gradients)."""
    backward = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if "tangents" in str(n.target):
                backward.add(n)
        elif n.op != "output" and any(i in backward for i in n.all_input_nodes):
            backward.add(n)
    return backward


def _same_value_type(a, b) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dtype == vb.dtype and va.shape == vb.shape)


def share_masks(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` (a joint forward/backward graph) in place as the module doc says; returns how many
    masks it shared."""
    unpacks = _regions(graph, UNPACK)
    if not unpacks:
        return 0
    packs = {out: (members, inputs) for members, inputs, outs in _regions(graph, PACK) if len(outs) == 1
             for out in outs}
    signs = {out: inputs for _, inputs, outs in _regions(graph, SIGN) if len(outs) == 1 for out in outs}
    backward = _backward_nodes(graph)
    shared = 0
    for members, inputs, outs in unpacks:
        if len(inputs) != 1 or len(outs) != 1:
            continue
        (packed,) = inputs
        if packed not in packs:
            continue
        pack_members, pack_inputs = packs[packed]
        if len(pack_inputs) != 1:
            continue
        (mask,) = pack_inputs
        sources = signs.get(mask)
        unpacked = outs[0]
        if (not sources or mask in backward or not _same_value_type(mask, unpacked)
                or not all(any(u in backward for u in s.users) for s in sources)):
            stats["kept"] += 1
            continue
        unpacked.replace_all_uses_with(mask)
        for group in (members, pack_members):
            for n in reversed(group):
                if not n.users:
                    graph.erase_node(n)
        shared += 1
    stats["shared"] += shared
    return shared


def _uuid() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@functools.cache
def _pass():
    """The pass object: a ``CustomGraphPass``, made on first use (importing Inductor costs 1.5 s)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ShareMasks(CustomGraphPass):
        """The joint-graph pass of ``slimgrad.functional._shared_masks``; its ``uuid`` is that file's hash,
        for Inductor's caches."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            share_masks(graph)

        def uuid(self):
            return _UUID

    _UUID = _uuid()
    return ShareMasks()


def install() -> bool:
    """Add the pass to Inductor's joint pre-passes, beside any pass the user set (idempotent); False where
    this torch cannot take it (no Inductor, or one that takes a single joint pass only)."""
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import get_custom_graph_passes
    except ImportError:  # pragma: no cover
        return False
    ours = _pass()
    current = get_custom_graph_passes(config.joint_custom_pre_pass)
    if ours not in current:
        config.joint_custom_pre_pass = (*current, ours) if current else ours
    return True


def _installed() -> bool:
    """Run by dynamo while it traces (a constant to the graph), so the pass is in place before Inductor
    partitions the graph being traced."""
    return install()


if "torch._dynamo" in sys.modules:
    _installed = torch.compiler.assume_constant_result(_installed)
else:
    # What torch.compiler.assume_constant_result does, without importing dynamo at slimgrad's import (2 s);
    # tests/test_compile_masks.py checks that the API still sets this attribute.
    _installed._dynamo_marked_constant = True
