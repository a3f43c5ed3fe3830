"""``slimgrad.audit``: where backward memory goes, per module, for stock PyTorch and for slimgrad.

One forward and backward is run on a stock copy of the model and one on a converted copy, on the same
inputs. Every tensor autograd keeps is attributed to the innermost module running when it was saved
(a storage kept by two modules counts once, for the first). Tensors that custom autograd Functions hide
as ctx attributes, out of reach of saved-tensor hooks (bitsandbytes does this), are found by walking
the graph after forward and shown separately, so the stock side is not flattered.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable

import torch
from torch import nn

from .cases import CASES, apply_case
from .convert import convert, revert
from .measure import _storage_key, peak_bytes
from .minimum import minimum_parts

#: the training cases the audit knows: MemSave's, plus "lora" (peft LoRA adapters, rank 8, on every linear
#: layer of a Hugging Face model, or on every Linear/Conv2d of another model; everything else frozen)
AUDIT_CASES = (*CASES, "lora")


def _with_lora(model: nn.Module) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("the 'lora' case needs peft: pip install 'slimgrad[hf]'") from None
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        targets = "all-linear"  # a transformers model: every linear layer but the output head
    else:
        targets = [name for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Conv2d)]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))


__all__ = ["AUDIT_CASES", "AuditReport", "ModuleRow", "audit"]


@dataclasses.dataclass
class ModuleRow:
    path: str
    type_name: str
    params: str  # "trainable", "frozen", "mixed" or "-"
    stock_bytes: int = 0
    slim_bytes: int = 0
    min_bytes: int | None = None
    stock_hidden_bytes: int = 0  # ctx-attribute tensors invisible to saved-tensor hooks
    stock_unread_bytes: int = 0  # kept by stock but never unpacked by backward
    stock_kinds: list[str] = dataclasses.field(default_factory=list)
    slim_kinds: list[str] = dataclasses.field(default_factory=list)

    @property
    def waste(self) -> int:
        floor = self.min_bytes if self.min_bytes is not None else self.slim_bytes
        return self.stock_bytes + self.stock_hidden_bytes - floor


@dataclasses.dataclass
class AuditReport:
    rows: list[ModuleRow]
    stock_total: int
    slim_total: int
    min_total: int
    stock_hidden_total: int
    stock_peak: int
    slim_peak: int
    case: str | None = None

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> AuditReport:
        data = json.loads(text)
        data["rows"] = [ModuleRow(**r) for r in data["rows"]]
        return cls(**data)

    def table(self, limit: int | None = 25) -> str:
        def mib(n):
            return "-" if n is None else f"{n / 2**20:.2f}"

        rows = sorted(self.rows, key=lambda r: r.waste, reverse=True)
        rows = [r for r in rows if r.stock_bytes or r.slim_bytes or r.stock_hidden_bytes]
        header = f"{'module':<32} {'type':<18} {'params':<9} {'stock':>8} {'minimum':>8} {'slimgrad':>8}  kept by stock"
        lines = [f"case: {self.case or 'as given'}  (MiB kept for backward, largest waste first)", header,
                 "-" * len(header)]
        for r in rows[:limit]:
            stock = r.stock_bytes + r.stock_hidden_bytes
            lines.append(f"{r.path[:32]:<32} {r.type_name[:18]:<18} {r.params:<9} {mib(stock):>8} "
                         f"{mib(r.min_bytes):>8} {mib(r.slim_bytes):>8}  {', '.join(r.stock_kinds)}")
        if limit is not None and len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more modules")
        lines.append("-" * len(header))
        lines.append(f"{'total':<61} {mib(self.stock_total + self.stock_hidden_total):>8} "
                     f"{mib(self.min_total):>8} {mib(self.slim_total):>8}")
        lines.append(f"{'peak over forward+backward':<61} {mib(self.stock_peak):>8} {'':>8} "
                     f"{mib(self.slim_peak):>8}")
        if self.stock_hidden_total:
            lines.append(f"(stock includes {mib(self.stock_hidden_total)} MiB hidden in ctx attributes)")
        unread = sum(r.stock_unread_bytes for r in self.rows)
        if unread:
            lines.append(f"(stock keeps {mib(unread)} MiB that its backward never unpacks)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path, limit: int = 20) -> None:
        """Bar chart of bytes kept per module, stock vs slimgrad (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("AuditReport.plot needs matplotlib: pip install 'slimgrad[plot]'") from e
        rows = sorted(self.rows, key=lambda r: r.stock_bytes + r.stock_hidden_bytes, reverse=True)[:limit]
        rows = [r for r in rows if r.stock_bytes or r.slim_bytes]
        labels = [r.path or "<root>" for r in rows]
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [(r.stock_bytes + r.stock_hidden_bytes) / 2**20 for r in rows], 0.4,
                label="stock PyTorch")
        ax.barh([y - 0.2 for y in ys], [r.slim_bytes / 2**20 for r in rows], 0.4, label="slimgrad")
        ax.set_yticks(list(ys), labels)
        ax.invert_yaxis()
        ax.set_xlabel("MiB kept for backward")
        ax.set_title(f"Bytes kept for backward per module (case: {self.case or 'as given'})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


class _Tracker:
    """Attributes saved tensors to the innermost running module; records layer minima and ctx stashes."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.stack: list[str] = []
        self.bytes: dict[str, int] = {}
        self.kinds: dict[str, list[str]] = {}
        self.minimum: dict[str, int | None] = {}
        self.hidden: dict[str, int] = {}
        self.seen: set = set()
        self.exclude: set = set()
        for t in list(model.parameters()) + list(model.buffers()):
            key, _ = _storage_key(t)
            self.exclude.add(key)
        self.nodes_seen: set = set()
        self.largest: dict[str, int] = {}
        self.owner: dict = {}  # storage key -> (path, nbytes) of each packed storage
        self.min_storages: dict = {}  # storages the layer minima need, once each (shared inputs)
        self.min_extra: dict[str, int] = {}  # derived bytes (masks, stats, positions) per module
        self.unpacked: set = set()

    def _pre(self, module, args):
        self.stack.append(self.paths[id(module)])

    def _post(self, module, args, output):
        path = self.stack.pop()
        if not any(True for _ in module.children()):
            parts = minimum_parts(module, args, output)
            if parts is None:
                self.minimum[path] = None
            else:
                tensors, extra = parts
                keys = []
                for t in tensors:
                    key, _ = _storage_key(t)
                    keys.append(key)
                    self.min_storages.setdefault(key, t.untyped_storage().nbytes())
                self.minimum[path] = sum(t.numel() * t.element_size() for t in tensors) + extra
                self.min_extra[path] = extra
        self._find_hidden(path, output)

    def _find_hidden(self, path, output):
        """Tensors stored as attributes on custom Function nodes created by this module's forward."""
        outs = output if isinstance(output, (tuple, list)) else (output,)
        todo = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self.nodes_seen:
                continue
            self.nodes_seen.add(node)
            for value in getattr(node, "__dict__", {}).values():
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        key, nbytes = _storage_key(t)
                        if key is not None and key not in self.seen and key not in self.exclude:
                            self.seen.add(key)
                            self.hidden[path] = self.hidden.get(path, 0) + nbytes
            todo.extend(f for f, _ in node.next_functions)

    def _classify(self, t: torch.Tensor, path: str) -> str:
        if t.dtype in (torch.bool, torch.uint8, torch.int8) and t.dim() <= 1:
            return "mask"
        if t.dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
            return "indices" if t.numel() > 16 else "seed/ints"
        if t.dim() <= 1 or t.numel() * 64 < max(1, self._largest(path)):
            return "stats"
        return "activation"

    def _largest(self, path):
        return self.largest.get(path, 0)

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return None, t
        key, nbytes = _storage_key(t)
        if key is None or key in self.exclude:
            return None, t
        if key in self.seen:
            return key, t
        self.seen.add(key)
        path = self.stack[-1] if self.stack else ""
        self.owner[key] = (path, nbytes)
        self.bytes[path] = self.bytes.get(path, 0) + nbytes
        self.largest[path] = max(self.largest.get(path, 0), t.numel())
        kinds = self.kinds.setdefault(path, [])
        kind = f"{self._classify(t, path)} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        if kind not in kinds:
            kinds.append(kind)
        return key, t

    def unpack(self, packed):
        key, t = packed
        self.unpacked.add(key)
        return t

    def unread(self) -> dict[str, int]:
        """Bytes per module path of storages that backward never unpacked."""
        result: dict[str, int] = {}
        for key, (path, nbytes) in self.owner.items():
            if key not in self.unpacked:
                result[path] = result.get(path, 0) + nbytes
        return result

    def _wrap(self, module: nn.Module):
        """Attribute by wrapping the instance's ``forward``, not with hooks: slimgrad's replacements (and
        other libraries) fall back to stock code when they see hooks, which would change what is measured."""
        inner = module.forward

        def forward(*args, **kwargs):
            self._pre(module, args)
            try:
                out = inner(*args, **kwargs)
            except BaseException:
                self.stack.pop()
                raise
            self._post(module, args, out)
            return out

        return forward

    def run(self, step: Callable[[], torch.Tensor]):
        wrapped = []
        for m in self.model.modules():
            had_own = "forward" in m.__dict__
            wrapped.append((m, had_own, m.__dict__.get("forward")))
            m.forward = self._wrap(m)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                loss = step()
        finally:
            for m, had_own, own in wrapped:
                if had_own:
                    m.forward = own
                else:
                    del m.forward
        loss.backward()


def _trainable(module: nn.Module) -> str:
    flags = [p.requires_grad for p in module.parameters(recurse=False)]
    if not flags:
        return "-"
    return "trainable" if all(flags) else "frozen" if not any(flags) else "mixed"


def audit(model: nn.Module, *example_inputs, loss_fn: Callable | None = None, case: str | None = None,
          measure_peak: bool = True) -> AuditReport:
    """Run one forward+backward of a stock and a converted copy of ``model`` and compare what is kept.

    ``case`` (one of :data:`AUDIT_CASES`) sets ``requires_grad`` flags and modes on the copies (and whether
    the inputs need grad; ``"lora"`` wraps the copy with peft LoRA adapters); without it, the model's flags
    and the inputs' ``requires_grad`` are used as they are. ``loss_fn(output) -> scalar`` defaults to summing
    the (first) output. The user's model is not modified. The converted copy runs one warm-up step first,
    as in training, so its activations know whether their consumers keep their outputs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"audit: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    if not example_inputs:
        raise ValueError("audit: give at least one example input: audit(model, x)")
    if case is not None and case not in AUDIT_CASES:
        raise ValueError(f"audit: unknown case {case!r}; cases: {', '.join(AUDIT_CASES)}")
    stock = revert(copy.deepcopy(model))
    input_grads = [getattr(a, "requires_grad", False) for a in example_inputs]
    if case == "lora":
        stock = _with_lora(stock)
        input_grads = [False] * len(example_inputs)
    elif case is not None:
        wants_input_grad = apply_case(stock, case)
        input_grads = [wants_input_grad and isinstance(a, torch.Tensor) and a.is_floating_point()
                       for a in example_inputs]
    slim = convert(stock)

    def loss_of(out):
        if loss_fn is not None:
            return loss_fn(out)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if hasattr(first, "logits"):
            first = first.logits
        return first.float().sum()

    def inputs():
        return [a.detach().requires_grad_(g) if isinstance(a, torch.Tensor) else a
                for a, g in zip(example_inputs, input_grads)]

    def step(m):
        return lambda: loss_of(m(*inputs()))

    step(slim)().backward()  # warm-up
    trackers = {}
    for name, m in (("stock", stock), ("slim", slim)):
        trackers[name] = _Tracker(m)
        trackers[name].run(step(m))
    peaks = {name: (peak_bytes(lambda m=m: step(m)().backward()) if measure_peak else 0)
             for name, m in (("stock", stock), ("slim", slim))}

    t_stock, t_slim = trackers["stock"], trackers["slim"]
    unread = t_stock.unread()
    rows: list[ModuleRow] = []
    slim_modules = dict(slim.named_modules())
    for path, module in stock.named_modules():
        rows.append(ModuleRow(
            path=path, type_name=type(module).__name__, params=_trainable(module),
            stock_bytes=t_stock.bytes.get(path, 0),
            slim_bytes=t_slim.bytes.get(path, 0) + t_slim.hidden.get(path, 0),
            min_bytes=t_stock.minimum.get(path) if path in slim_modules else None,
            stock_hidden_bytes=t_stock.hidden.get(path, 0), stock_unread_bytes=unread.get(path, 0),
            stock_kinds=t_stock.kinds.get(path, []), slim_kinds=t_slim.kinds.get(path, []),
        ))
    # Modules with no rule (containers' own saves, unknown layers): what stock keeps there (storages a rule
    # already needs excluded) or what slimgrad keeps, whichever is smaller, since either is achievable.
    no_rule = {r.path: r for r in rows if r.min_bytes is None}
    stock_unknown: dict[str, int] = {}
    for key, (path, nbytes) in t_stock.owner.items():
        if path in no_rule and key not in t_stock.min_storages:
            stock_unknown[path] = stock_unknown.get(path, 0) + nbytes
    unknown_stock = sum(min(stock_unknown.get(p, 0), r.slim_bytes) for p, r in no_rule.items())
    min_total = sum(t_stock.min_storages.values()) + sum(t_stock.min_extra.values()) + unknown_stock
    return AuditReport(
        rows=rows,
        stock_total=sum(t_stock.bytes.values()),
        slim_total=sum(t_slim.bytes.values()) + sum(t_slim.hidden.values()),
        min_total=min_total,
        stock_hidden_total=sum(t_stock.hidden.values()),
        stock_peak=peaks["stock"], slim_peak=peaks["slim"], case=case,
    )
