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
the values are the same booleans.

Where no backward node reads a source but elementwise ops make it from tensors backward needs anyway (a
training-mode batch norm's input, its mean and rstd, parameters; the ReLU then feeds a max pool or a frozen
conv), the mask is read from the comparison too, and the comparison and that chain are marked
``MUST_RECOMPUTE`` for the partitioner (as selective checkpointing marks nodes): backward rebuilds the mask
from what it keeps anyway, as compiled stock rebuilds the ReLU's output there, and no pack is made or kept.
Unmarked, the partitioner's heuristics saved the boolean comparison instead, 8x the pack's bits. Where the
sources need anything else (a frozen consumer after batch norm in eval mode) the pack stays, as in eager.

Where the partitioner still rebuilds a pack in backward on its own (from tensors it saved for other reasons),
:func:`skip_rebuilt_packs`, a post-grad pass on the partitioned backward graph, reads the rebuilt mask
without packing and unpacking it; the bytes are the partitioner's either way.

The passes are added to ``torch._inductor.config.joint_custom_pre_pass`` and ``post_grad_custom_pre_pass``
whenever dynamo traces a tagged Function (beside any pass already there; they leave graphs without slimgrad's
tags alone: not at import, which would import Inductor, 1.5 s), and carry a ``uuid`` so that Inductor's FX
graph cache still applies. Other backends (``aot_eager``) run no such passes: there the pack stays.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys

import torch

__all__ = ["tagged", "pack", "unpack", "share_masks", "skip_rebuilt_packs", "install", "stats"]

_KEY = "slimgrad_mask"  # the key in a node's meta["custom"]
SIGN, PACK, UNPACK = "sign", "pack", "unpack"

# How many masks the passes shared, had recomputed, kept, and read unpacked after a rebuild since the process
# started (read by the tests).
stats = {"shared": 0, "recomputed": 0, "kept": 0, "rebuilt": 0}

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
    from slimgrad.kernels import bitmask as _bitmask

    with tagged(SIGN):
        mask = make_mask(source)
    with tagged(PACK):
        return _bitmask.pack_planar(mask, order)


def unpack(packed: torch.Tensor, shape, order) -> torch.Tensor:
    """``_bitmask.unpack_planar``, tagged (see :func:`pack`)."""
    from slimgrad.kernels import bitmask as _bitmask

    with tagged(UNPACK):
        return _bitmask.unpack_planar(packed, shape, order)


def _role(node) -> str | None:
    custom = node.meta.get("custom")
    return custom.get(_KEY) if isinstance(custom, dict) else None


def _variable_nodes(graph) -> set:
    """The nodes that depend on a graph input (the rest are constants: iota, full, their views)."""
    variable = set()
    for n in graph.nodes:
        if n.op == "placeholder" or any(i in variable for i in n.all_input_nodes):
            variable.add(n)
    return variable


def _walk_up(node, role, variable):
    """The nodes tagged ``role`` that ``node`` (tagged so) is computed from, itself included, and the tensor
    inputs of that group from outside it that depend on graph inputs (left out: constants shared with other
    groups, as CSE makes them, and sizes, symbolic under dynamic shapes)."""
    members, frontier, todo = {node}, set(), [node]
    while todo:
        for i in todo.pop().all_input_nodes:
            if i in members:
                continue
            if _role(i) == role and i.op != "placeholder":
                members.add(i)
                todo.append(i)
            elif i in variable and isinstance(i.meta.get("val"), torch.Tensor):
                frontier.add(i)
    return members, frontier


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


def _masks(graph):
    """Each traced pack/unpack pair in ``graph`` whose pack is made in it: (unpacked mask, the mask that was
    packed, the sources of that mask, the nodes of the pack and unpack)."""
    variable = _variable_nodes(graph)
    for unpacked in list(graph.nodes):
        if _role(unpacked) != UNPACK or not any(_role(u) != UNPACK for u in unpacked.users):
            continue
        unpack_nodes, packed = _walk_up(unpacked, UNPACK, variable)
        if len(packed) != 1:
            continue
        (packed,) = packed
        if _role(packed) != PACK or packed.op == "placeholder":  # saved by the forward: nothing to read it from
            continue
        pack_nodes, mask = _walk_up(packed, PACK, variable)
        if len(mask) != 1:
            continue
        (mask,) = mask
        if _role(mask) != SIGN or not _same_value_type(mask, unpacked):
            continue
        _, sources = _walk_up(mask, SIGN, variable)
        yield unpacked, mask, sources, unpack_nodes | pack_nodes


def _erase_unused(graph, nodes) -> None:
    for n in reversed(list(graph.nodes)):
        if n in nodes and not n.users:
            graph.erase_node(n)


_ELEMENTWISE_EXTRA = ("aten.copy.default", "aten._to_copy.default")  # elementwise, but not tagged pointwise


def _elementwise(node) -> bool:
    """A node the partitioner can recompute in backward at no cost in bytes: a pointwise op or a view."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.is_view or str(target) in _ELEMENTWISE_EXTRA


def _read_in_backward(node, backward, variable, avoid) -> bool:
    """Whether backward needs ``node``'s value anyway: a backward node reads it, or reads something computed
    from it by elementwise forward nodes alone (batch norm's backward reads ``x - mean``, made from its input
    in the forward graph), other than through ``avoid`` (the chain that makes the mask's sources: a
    consumer's saved copy of the activation's output, a dropout's output say, does not give back its input)
    and slimgrad's tagged mask nodes."""
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user in backward:
                return True
            if (user not in seen and user not in avoid and user in variable and _role(user) is None
                    and _elementwise(user)):
                seen.add(user)
                todo.append(user)
    return False


def _nbytes(node) -> int:
    """Bytes of ``node``'s tensor value; ``sys.maxsize`` where its size is symbolic (never counted as small;
    ``int()`` of a symbolic size would specialise it)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    numel = value.numel()
    if isinstance(numel, torch.SymInt):
        return sys.maxsize
    return int(numel) * value.element_size()


def _rebuildable_chain(sources, mask, backward, variable):
    """The elementwise nodes that make the mask's sources from tensors backward needs anyway, from constants
    and from small tensors (batch norm's mean and rstd, parameters) whose bytes together do not exceed the
    pack's; None where the sources need anything else (a frozen consumer's input, batch norm's output in
    eval mode). Rebuilding the mask in backward through that chain keeps no more than the pack would."""
    if _nbytes(mask) == sys.maxsize:
        # Symbolic sizes (dynamic=True, or dynamo's automatic dynamic recompile after a batch-size change):
        # Inductor failed to generate the recomputed chain there ("Cannot convert expression to float" for a
        # batch norm -> ReLU -> ceil-mode max pool), so the pack stays.
        return None
    chain, leaves, todo = set(), set(), list(sources)
    while todo:
        n = todo.pop()
        if n in chain or n in leaves or n not in variable:
            continue
        if _elementwise(n) and _role(n) is None:
            chain.add(n)
            todo.extend(n.all_input_nodes)
        else:
            leaves.add(n)
    budget, small = _nbytes(mask) // 8, 0  # the pack: one bit per element
    for leaf in leaves:
        if not _read_in_backward(leaf, backward, variable, chain):
            small += _nbytes(leaf)
            if small > budget:
                return None
    return chain


def _must_recompute(nodes) -> None:
    """Mark ``nodes`` for the partitioner as selective checkpointing marks them: rebuilt in backward, never
    saved. Left alone, its min-cut heuristics save the mask's boolean comparison instead (8 bits per element
    against the pack's one: VGG-11 'all' 1.92 -> 2.02 MiB, measured)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for n in nodes:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def share_masks(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``, the joint forward/backward graph, in place as the module doc says; returns how many
    masks backward now reads without a pack (``stats``: "shared" where it reads the sources anyway,
    "recomputed" where it rebuilds them, "kept" where the pack stays)."""
    if not any(_role(n) == UNPACK for n in graph.nodes):
        return 0
    backward = _backward_nodes(graph)
    variable = _variable_nodes(graph)
    done = 0
    for unpacked, mask, sources, nodes in list(_masks(graph)):
        if mask in backward or not sources:
            stats["kept"] += 1
            continue
        if all(any(u in backward for u in s.users) for s in sources):
            stats["shared"] += 1
        else:
            chain = _rebuildable_chain(sources, mask, backward, variable)
            if chain is None:
                stats["kept"] += 1
                continue
            sign_nodes, _ = _walk_up(mask, SIGN, variable)
            _must_recompute(chain | sign_nodes)
            stats["recomputed"] += 1
        unpacked.replace_all_uses_with(mask)
        _erase_unused(graph, nodes)
        done += 1
    return done


def skip_rebuilt_packs(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``, a partitioned backward graph, in place: where the partitioner chose to rebuild a pack
    in backward (from what the forward saved anyway, batch norm's input say) rather than to save it, read the
    rebuilt mask directly instead of packing and unpacking it (the pack round trip took the VGG-11 'all'
    step's largest fused kernel from 0.46 to 0.71 ms). No bytes change: the partitioner has decided them."""
    shared = 0
    for unpacked, mask, _, nodes in list(_masks(graph)):
        unpacked.replace_all_uses_with(mask)
        _erase_unused(graph, nodes)
        shared += 1
    stats["rebuilt"] += shared
    return shared


def _uuid() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@functools.cache
def _passes():
    """The Inductor config slots and the ``CustomGraphPass`` objects that go in them, made on first use
    (importing Inductor costs 1.5 s); each ``uuid`` is this file's hash, for Inductor's caches."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    uuid = _uuid()

    class ShareMasks(CustomGraphPass):
        """Joint graph: :func:`share_masks`."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            share_masks(graph)

        def uuid(self):
            return uuid

    class SkipRebuiltPacks(CustomGraphPass):
        """Partitioned graphs: :func:`skip_rebuilt_packs`."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            skip_rebuilt_packs(graph)

        def uuid(self):
            return uuid

    return {"joint_custom_pre_pass": ShareMasks(), "post_grad_custom_pre_pass": SkipRebuiltPacks()}


def install() -> bool:
    """Add the passes to Inductor's joint and post-grad pre-passes, beside any pass the user set (idempotent);
    False where this torch cannot take them (no Inductor, or one that takes a single pass per slot only)."""
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import get_custom_graph_passes
    except ImportError:  # pragma: no cover
        return False
    for slot, ours in _passes().items():
        current = get_custom_graph_passes(getattr(config, slot))
        if ours not in current:
            setattr(config, slot, (*current, ours) if current else ours)
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
