"""``slimgrad.audit``: where backward memory goes, per module: stock PyTorch, the minimum, slimgrad.

One forward and backward runs on a stock copy of the model and one on a converted copy, on the same inputs;
saved-tensor hooks see every tensor autograd keeps. Tensors that custom autograd Functions hide as ctx
attributes (bitsandbytes does this) are found by walking the graph and shown separately.

Attribution, the same for all three columns so that a row compares like with like:

* A module with a minimum rule (:mod:`slimgrad.minimum`) is a **unit**: everything kept while it or any of
  its children runs is its row (a peft LoRA layer's ``lora_A``/``lora_B``, a gated MLP's projections).
* A tensor a rule needs (a layer's input, say) belongs to the first unit in forward order that needs it,
  whichever module happened to save it: stock's ReLU saves its output, slimgrad's next conv does, and both
  show on the conv's row, where the minimum puts it. Tensors are matched across the two runs by where they
  first appear (module path, call, input/output position), not by address.
* Anything else belongs to the innermost module running when it was saved. Modules without a rule
  (attention code, containers, unknown layers) get as their minimum the smaller of what stock and slimgrad
  keep there ("as kept": marked ``~`` in the table), so the total stays a bound slimgrad is measured against.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils import _pytree

from ._forwards import forwards_wrapped
from .cases import CASES, apply_case
from .convert import convert, revert
from .measure import _storage_key, peak_bytes
from .minimum import Need, minimum_needs, rule_for

__all__ = ["AUDIT_CASES", "AuditReport", "ModuleRow", "audit", "default_loss", "prepare"]

#: the training cases the audit knows: MemSave's, plus "lora" (peft LoRA adapters, rank 8, on every linear
#: layer of a Hugging Face model, or on every Linear and ungrouped Conv2d of another model; everything else
#: frozen)
AUDIT_CASES = (*CASES, "lora")


def _with_lora(model: nn.Module) -> nn.Module:
    """``model`` with rank-8 adapters on its linear layers, everything else frozen; a model that has peft LoRA
    adapters already is audited with its own (wrapping it again stacked a second PeftModel and adapter on it)."""
    try:
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import LoraLayer
    except ImportError:
        raise ImportError("audit: the 'lora' case needs peft: pip install 'slimgrad[hf]'") from None
    if any(isinstance(m, LoraLayer) for m in model.modules()):
        return model  # its own adapters, as peft set them up (what trains is peft's choice: adapters only)
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        targets = "all-linear"  # a transformers model: every linear layer but the output head
    else:
        targets = [name for name, m in model.named_modules()  # peft's conv LoRA needs groups == 1
                   if type(m) is nn.Linear or (type(m) is nn.Conv2d and m.groups == 1)]
        if not targets:
            raise ValueError("audit: case 'lora' found no nn.Linear or (ungrouped) nn.Conv2d to put adapters on")
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))


# -- outputs and losses -------------------------------------------------------------------------------------


def _tensors_in(obj, depth: int = 0) -> list[torch.Tensor]:
    """Tensors in a model output: a tensor, tuple/list, dict, ``ModelOutput`` / diffusers ``BaseOutput``
    (both mappings) or dataclass, nested."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 8:
        return []
    if isinstance(obj, Mapping):
        items = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (tuple, list)):
        items = list(obj)
    else:
        return []
    return [t for item in items for t in _tensors_in(item, depth + 1)]


def default_loss(output) -> torch.Tensor:
    """The loss the audit backpropagates when no ``loss_fn`` is given.

    ``output.loss`` (attribute or key) when it is a tensor that requires grad: a Hugging Face model called
    with ``labels``. Otherwise the sum, in fp32, of every floating-point tensor in the output that requires
    grad (a tensor, tuple, list, dict, ``ModelOutput``, diffusers output or dataclass, nested): every output
    gets a gradient, so every part of the graph that produced one runs its backward.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float().sum()
    tensors = [t for t in _tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        kind = "a tensor" if isinstance(output, torch.Tensor) else type(output).__name__  # (not FakeTensor)
        raise ValueError(f"slimgrad: no floating-point tensor in the model's output ({kind}) requires grad: "
                         f"nothing trains in this case and no input needs a gradient")
    total = tensors[0].float().sum()
    for t in tensors[1:]:
        total = total + t.float().sum()
    return total


# -- report -------------------------------------------------------------------------------------------------


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


@dataclasses.dataclass
class ModuleRow:
    path: str
    type_name: str  # class name for torch.nn types, qualified name otherwise
    params: str  # "trainable", "frozen", "mixed" or "-" (a unit: all parameters under it)
    stock_bytes: int = 0
    slim_bytes: int = 0
    min_bytes: int = 0
    rule: bool = False  # the minimum comes from a rule; False: "as kept" (smaller of stock and slimgrad)
    stock_hidden_bytes: int = 0  # ctx-attribute tensors invisible to saved-tensor hooks
    slim_hidden_bytes: int = 0
    stock_unread_bytes: int = 0  # kept by stock but never unpacked by backward
    stock_kinds: list[str] = dataclasses.field(default_factory=list)
    slim_kinds: list[str] = dataclasses.field(default_factory=list)
    min_kinds: list[str] = dataclasses.field(default_factory=list)

    @property
    def stock(self) -> int:
        return self.stock_bytes + self.stock_hidden_bytes

    @property
    def slim(self) -> int:
        return self.slim_bytes + self.slim_hidden_bytes

    @property
    def waste(self) -> int:
        """What stock keeps above the minimum."""
        return self.stock - self.min_bytes

    @property
    def todo(self) -> int:
        """What slimgrad keeps above the minimum: work left for slimgrad."""
        return max(0, self.slim - self.min_bytes)


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if len(parts) < 2 or len(parts) != len(paths):
        return ""
    prefix = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        prefix.append(names[0])
    if any(len(p) == len(prefix) for p in parts):  # a row's whole path would vanish
        prefix = prefix[:-1]
    return ".".join(prefix) + "." if prefix else ""


def _elide_middle(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    keep = width - 1
    return text[: keep // 3] + "…" + text[len(text) - (keep - keep // 3):]


@dataclasses.dataclass
class AuditReport:
    rows: list[ModuleRow]
    stock_total: int  # what saved-tensor hooks see on the stock copy
    slim_total: int  # ... on the converted copy
    min_total: int
    stock_hidden_total: int
    stock_peak: int | None  # None: not measured (measure_peak=False, or the meta device, which allocates nothing)
    slim_peak: int | None
    case: str | None = None
    slim_hidden_total: int = 0
    min_as_kept_total: int = 0  # part of min_total in code without a rule (smaller of stock and slimgrad)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> AuditReport:
        data = json.loads(text)
        data["rows"] = [ModuleRow(**r) for r in data["rows"]]
        return cls(**data)

    @property
    def todo_total(self) -> int:
        return sum(r.todo for r in self.rows if r.rule)

    def _shown(self, limit):
        rows = sorted((r for r in self.rows if r.stock or r.slim or r.min_bytes), key=lambda r: r.waste,
                      reverse=True)
        return rows if limit is None else rows[:limit], len(rows)

    def _type_labels(self, rows) -> dict[str, str]:
        """Class names where they are unambiguous (in the report and against torch.nn's own names); qualified
        names otherwise, so peft's LoRA ``Linear`` never reads as ``nn.Linear``."""
        by_short: dict[str, set[str]] = {}
        for r in self.rows:
            by_short.setdefault(r.type_name.rsplit(".", 1)[-1], set()).add(r.type_name)

        def label(name):
            short = name.rsplit(".", 1)[-1]
            clash = len(by_short[short]) > 1 or (short != name and hasattr(nn, short))
            return name if clash else short

        return {r.type_name: label(r.type_name) for r in rows}

    def by_type(self) -> list[tuple[str, int, int, int, int]]:
        """(type, modules, stock, minimum, slimgrad) per module type, largest stock first."""
        totals: dict[str, list[int]] = {}
        for r in self.rows:
            if r.stock or r.slim or r.min_bytes:
                t = totals.setdefault(r.type_name, [0, 0, 0, 0])
                t[0] += 1
                t[1] += r.stock
                t[2] += r.min_bytes
                t[3] += r.slim
        return sorted(((k, *v) for k, v in totals.items()), key=lambda t: t[2], reverse=True)

    def table(self, limit: int | None = 25, path_width: int = 56) -> str:
        """The report as text: one row per module, largest waste (stock above the minimum) first.

        Paths are whole: a prefix every row shares is printed once in the header, and a path longer than
        ``path_width`` gets a line of its own above its figures. The minimum of a module without a rule is
        what the better of stock and slimgrad keeps there, marked ``~``; ``to-do`` is what slimgrad keeps
        above a rule's minimum."""
        rows, count = self._shown(limit)
        prefix = _common_prefix([r.path for r in rows])
        names = {id(r): (r.path[len(prefix):] if prefix else r.path) or "<model>" for r in rows}
        width = max([6] + [len(n) for n in names.values() if len(n) <= path_width])
        types = self._type_labels(rows)
        type_width = max([4] + [len(t) for t in types.values()])
        header = (f"{'module':<{width}}  {'type':<{type_width}}  {'params':<9} {'stock':>8} {'minimum':>9} "
                  f"{'slimgrad':>8} {'to-do':>7}  kept by stock")
        rule = "-" * len(header)
        title = f"case: {self.case or 'as given'}  (MiB kept for backward, largest waste first)"
        lines = [title] + ([f"module paths below start with '{prefix}'"] if prefix else []) + [header, rule]
        for r in rows:
            name = names[id(r)]
            if len(name) > width:
                lines.append(name)
                name = ""
            minimum = ("" if r.rule else "~") + _mib(r.min_bytes)
            todo = _mib(r.todo) if r.rule and r.todo else ""
            kinds = ", ".join(r.stock_kinds[:2]) + (", …" if len(r.stock_kinds) > 2 else "")
            lines.append(f"{name:<{width}}  {types[r.type_name]:<{type_width}}  {r.params:<9} {_mib(r.stock):>8} "
                         f"{minimum:>9} {_mib(r.slim):>8} {todo:>7}  {kinds}")
        if limit is not None and count > limit:
            lines.append(f"... {count - limit} more modules (table(limit=None) shows all)")
        lines.append(rule)
        pad = width + type_width + 14
        lines.append(f"{'total':<{pad}} {_mib(self.stock_total + self.stock_hidden_total):>8} "
                     f"{_mib(self.min_total):>9} {_mib(self.slim_total + self.slim_hidden_total):>8} "
                     f"{_mib(self.todo_total) if self.todo_total else '':>7}")
        lines.append(f"{'peak over forward+backward':<{pad}} {_mib(self.stock_peak):>8} {'':>9} "
                     f"{_mib(self.slim_peak):>8}")
        if self.min_as_kept_total:
            lines.append(f"(~: no rule; {_mib(self.min_as_kept_total)} MiB of the minimum is what the better of "
                         f"stock and slimgrad keeps there)")
        if self.stock_hidden_total:
            lines.append(f"(stock includes {_mib(self.stock_hidden_total)} MiB hidden in ctx attributes)")
        unread = sum(r.stock_unread_bytes for r in self.rows)
        if unread:
            lines.append(f"(stock keeps {_mib(unread)} MiB that its backward never unpacks)")
        kinds = self.by_type()
        if len(kinds) > 1:
            labels = self._type_labels(self.rows)
            lines.append("by type (stock / minimum / slimgrad MiB): " + "; ".join(
                f"{labels[name]} ×{n} {_mib(st)} / {_mib(mn)} / {_mib(sl)}" for name, n, st, mn, sl in kinds[:5]))
        todo = sorted((r for r in self.rows if r.rule and r.todo), key=lambda r: r.todo, reverse=True)
        if todo:
            top = ", ".join(f"{r.path or '<model>'} +{_mib(r.todo)}" for r in todo[:3])
            lines.append(f"to-do: slimgrad keeps {_mib(self.todo_total)} MiB above the minimum in {len(todo)} "
                         f"module(s); largest: {top}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path, limit: int = 20) -> None:
        """Bar charts of MiB kept for backward: per module type (top), then per module, largest waste first
        (stock, slimgrad, minimum; needs matplotlib). Labels are whole paths under the common prefix (in the
        title); very long ones lose their middle, never their end."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("AuditReport.plot needs matplotlib: pip install 'slimgrad[plot]'") from e
        rows, _ = self._shown(limit)
        kinds = self.by_type()[:6]
        labels_by_type = self._type_labels(self.rows)
        prefix = _common_prefix([r.path for r in rows])
        labels = [_elide_middle((r.path[len(prefix):] if prefix else r.path) or "<model>", 48) for r in rows]
        fig, (top, ax) = plt.subplots(2, 1, figsize=(10, 0.42 * (len(rows) + len(kinds)) + 3.2),
                                      gridspec_kw={"height_ratios": [max(1, len(kinds)), max(1, len(rows))]})

        def bars(axis, names, stock, slim, minimum):
            ys = range(len(names))
            axis.barh([y - 0.27 for y in ys], [b / 2**20 for b in stock], 0.27, label="stock PyTorch")
            axis.barh(list(ys), [b / 2**20 for b in slim], 0.27, label="slimgrad")
            axis.barh([y + 0.27 for y in ys], [b / 2**20 for b in minimum], 0.27, label="minimum", color="0.6")
            axis.set_yticks(list(ys), names, fontsize=8)
            axis.invert_yaxis()

        bars(top, [f"{labels_by_type[k[0]]} ×{k[1]}" for k in kinds], [k[2] for k in kinds], [k[4] for k in kinds],
             [k[3] for k in kinds])
        top.set_title(f"Kept for backward, by module type (case: {self.case or 'as given'}; total stock "
                      f"{_mib(self.stock_total + self.stock_hidden_total)}, minimum {_mib(self.min_total)}, "
                      f"slimgrad {_mib(self.slim_total + self.slim_hidden_total)} MiB)", fontsize=9)
        top.legend(loc="lower right", fontsize=8)
        bars(ax, labels, [r.stock for r in rows], [r.slim for r in rows], [r.min_bytes for r in rows])
        where = f" under '{prefix}'" if prefix else ""
        ax.set_title(f"per module{where}, largest waste first", fontsize=9)
        ax.set_xlabel("MiB kept for backward")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


# -- the tracker --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pack:
    sid: str  # where the storage first appeared: "path#call:in0", "path#call:out1", "path#internal3"
    packer: str
    nbytes: int
    kind: str


class _Run:
    """One tracked forward of one model copy: labels storages by where they first appear, records what is
    packed and by whom, and (on the stock copy) what each unit's rule needs."""

    def __init__(self, model: nn.Module, units: set[str], with_rules: bool):
        self.model = model
        self.units = units
        self.with_rules = with_rules
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.exclude = {_storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self.labels: dict = {}
        self.alive: list[torch.Tensor] = []  # boundary tensors held during forward: no address is reused
        self.calls: Counter = Counter()
        self.stack: list[tuple[str, int]] = []
        self.packs: dict = {}
        self.hidden: dict = {}  # key -> (path, nbytes)
        self.needs: list[tuple[str, Need, str | None, tuple]] = []
        self.unpacked: set = set()
        self.nodes_seen: set = set()

    def _label(self, t: torch.Tensor, sid: str) -> str:
        key, _ = _storage_key(t)
        if key is None:
            return sid
        if key not in self.labels:
            self.labels[key] = sid
            self.alive.append(t)
        return self.labels[key]

    def sid(self, t: torch.Tensor) -> str:
        key, _ = _storage_key(t)
        return self.labels.get(key, f"unlabelled:{key}")

    def _pre(self, module, args, kwargs):
        path = self.paths[id(module)]
        call = self.calls[path]
        self.calls[path] += 1
        for i, t in enumerate(_pytree.tree_leaves((args, kwargs))):
            if isinstance(t, torch.Tensor):
                self._label(t, f"{path}#{call}:in{i}")
        self.stack.append((path, call))

    def _post(self, module, args, kwargs, output):
        path, call = self.stack.pop()
        for i, t in enumerate(_tensors_in(output)):
            self._label(t, f"{path}#{call}:out{i}")
        if self.with_rules and path in self.units:
            needs = minimum_needs(module, tuple(args) + tuple(kwargs.values()), output) or []
            for need in needs:
                if need.tensor is not None:
                    key, storage_bytes = _storage_key(need.tensor)
                    if key in self.exclude:
                        continue  # a parameter or buffer (position ids): exists anyway
                    need.nbytes = min(need.nbytes, storage_bytes)  # an expanded view needs its storage only
                tensor_sid = self.sid(need.tensor) if need.tensor is not None else None
                derive = tuple(tuple(self.sid(t) for t in alt) for alt in need.derive)
                self.needs.append((path, need, tensor_sid, derive))
                need.tensor, need.derive = None, ()  # hold no tensors past the run
        self._find_hidden(path, output)

    def _find_hidden(self, path, output):
        """Tensors stored as attributes on custom Function nodes created by this module's forward."""
        todo = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self.nodes_seen:
                continue
            self.nodes_seen.add(node)
            for value in getattr(node, "__dict__", {}).values():
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        key, nbytes = _storage_key(t)
                        if (key is not None and key not in self.packs and key not in self.hidden
                                and key not in self.exclude):
                            self.hidden[key] = (path, nbytes)
            todo.extend(f for f, _ in node.next_functions)

    def _describe(self, t: torch.Tensor, packer: str) -> str:
        if t.dtype in (torch.bool, torch.uint8, torch.int8) and t.dim() <= 1:
            kind = "mask"
        elif not t.is_floating_point():
            kind = "indices" if t.numel() > 16 else "seed/ints"
        elif t.dim() <= 1:
            kind = "stats"
        else:
            kind = "activation"
        return f"{kind} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return None, t
        key, nbytes = _storage_key(t)
        if key is None or key in self.exclude:
            return None, t
        if key not in self.packs:
            packer = self.stack[-1][0] if self.stack else ""
            self.packs[key] = _Pack("", packer, nbytes, self._describe(t, packer))  # sid: after forward
        return key, t

    def _resolve(self) -> None:
        """Name each packed storage by where it first appeared at a module boundary (a module saves its own
        output before returning it, so this waits for the end of forward); storages that never crossed a
        boundary are internal to the module that saved them."""
        for i, (key, p) in enumerate(self.packs.items()):
            p.sid = self.labels.get(key) or f"{p.packer}#internal{i}"

    def unpack(self, packed):
        key, t = packed
        self.unpacked.add(key)
        return t

    def _wrap(self, module: nn.Module):
        """Attribute by wrapping the instance's ``forward``, not with hooks: slimgrad's replacements (and
        other libraries) fall back to stock code when they see hooks, which would change what is measured."""
        inner = module.forward

        def forward(*args, **kwargs):
            self._pre(module, args, kwargs)
            try:
                out = inner(*args, **kwargs)
            except BaseException:
                self.stack.pop()
                raise
            self._post(module, args, kwargs, out)
            return out

        return forward

    def run(self, step: Callable[[], torch.Tensor]) -> None:
        try:
            with forwards_wrapped(self.model, self._wrap):
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    loss = step()
                self._resolve()
        finally:
            self.alive.clear()
        loss.backward()


# -- the audit ----------------------------------------------------------------------------------------------


def _type_name(module: nn.Module) -> str:
    from .convert import qualified_name

    return qualified_name(type(module))


def _params(module: nn.Module, recurse: bool) -> str:
    flags = [p.requires_grad for p in module.parameters(recurse=recurse)]
    if not flags:
        return "-"
    return "trainable" if all(flags) else "frozen" if not any(flags) else "mixed"


def _units(model: nn.Module) -> tuple[dict[str, str], set[str]]:
    """(path -> the path of its row, the units): a module's row is the outermost module with a minimum rule
    containing it (a unit), or the module itself."""
    fold: dict[str, str] = {}
    units: set[str] = set()
    for path, module in model.named_modules():
        parent = path.rpartition(".")[0] if path else None
        if parent is not None and fold.get(parent) in units:
            fold[path] = fold[parent]
        else:
            fold[path] = path
            if rule_for(module) is not None:
                units.add(path)
    return fold, units


def prepare(model: nn.Module, case: str | None):
    """``(stock, slim, input_grad)``: the two copies an audit measures, with ``case`` applied (``input_grad``
    is whether floating-point inputs need a gradient; None: as the user's inputs say). The user's model is
    not modified."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"audit: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    if case is not None and case not in AUDIT_CASES:
        raise ValueError(f"audit: unknown case {case!r}; cases: {', '.join(AUDIT_CASES)}")
    stock = revert(copy.deepcopy(model))
    input_grad = None
    if case == "lora":
        stock = _with_lora(stock)
        input_grad = False
    elif case is not None:
        try:
            input_grad = apply_case(stock, case)
        except ValueError as e:
            raise ValueError(f"audit: {e}") from None
    return stock, convert(stock), input_grad


def _inputs(args, kwargs, input_grad):
    def fresh(t: torch.Tensor):
        grad = t.requires_grad if input_grad is None else input_grad and t.is_floating_point()
        return t.detach().requires_grad_(grad)

    return _pytree.tree_map_only(torch.Tensor, fresh, (args, kwargs))


def audit(model: nn.Module, *args, loss_fn: Callable | None = None, case: str | None = None,
          measure_peak: bool = True, **forward_kwargs) -> AuditReport:
    """Run one forward+backward of a stock and a converted copy of ``model`` and compare what is kept.

    ``model(*args, **forward_kwargs)`` is called as you would call it (``input_ids=..., labels=...``).
    ``case`` (one of :data:`AUDIT_CASES`) sets ``requires_grad`` flags and modes on the copies, and whether
    floating-point inputs need grad (``"lora"`` wraps the copy with peft LoRA adapters); without it, the
    model's flags and the inputs' ``requires_grad`` are used as they are. ``loss_fn(output) -> scalar``
    defaults to :func:`default_loss` (``output.loss`` when present, else the sum of every output tensor).
    The user's model is not modified. The converted copy runs one warm-up step first, as in training, so its
    activations know whether their consumers keep their outputs.
    """
    if not args and not forward_kwargs:
        raise ValueError("audit: give the model's inputs: audit(model, x) or audit(model, input_ids=ids)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"audit: 'loss_fn' must be a callable output -> scalar, got {type(loss_fn).__name__}")
    from .estimate import misspelt_option

    misspelt_option(model, forward_kwargs, ("loss_fn", "case", "measure_peak"), "audit")
    stock, slim, input_grad = prepare(model, case)
    if input_grad and not any(t.is_floating_point() for t in _pytree.tree_leaves((args, forward_kwargs))
                              if isinstance(t, torch.Tensor)):
        raise ValueError(f"audit: case {case!r} needs a floating-point input to differentiate, but every input "
                         f"is an integer tensor (token ids?); pass inputs_embeds= instead")
    loss_of = loss_fn or default_loss

    def step(m):
        def run():
            a, kw = _inputs(args, forward_kwargs, input_grad)
            loss = loss_of(m(*a, **kw))
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ValueError("audit: the loss must be a one-element tensor that requires grad, got "
                                 f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            return loss

        return run

    step(slim)().backward()  # warm-up
    fold, units = _units(stock)
    runs = {"stock": _Run(stock, units, True), "slim": _Run(slim, units, False)}
    for name, m in (("stock", stock), ("slim", slim)):
        runs[name].run(step(m))
    # peak_bytes picks CPU or CUDA accounting from its tensor arguments: hand it the first input tensor
    where = next((t for t in _pytree.tree_leaves((args, forward_kwargs)) if isinstance(t, torch.Tensor)), None)
    if where is not None and where.device.type == "meta":  # nothing allocated: no peak to show ("-"), kept bytes
        measure_peak = False                                # come from the shapes
    peaks = {name: (_step_peak(m, step(m), where) if measure_peak else None) for name, m in (("stock", stock),
                                                                                                ("slim", slim))}
    return _assemble(stock, fold, units, runs["stock"], runs["slim"], peaks, case)


def _step_peak(model: nn.Module, run, where) -> int:
    """A training step's peak as it runs after ``zero_grad()``: the gradients are allocated inside it (the copies
    held the gradients of their earlier runs, and the peak left them out: half a real all-trainable step's)."""
    for p in model.parameters():
        p.grad = None
    try:
        return peak_bytes(lambda _device: run().backward(), where)
    finally:
        for p in model.parameters():
            p.grad = None


def _assemble(stock: nn.Module, fold, units, r_stock: _Run, r_slim: _Run, peaks, case) -> AuditReport:
    def row_of(path: str) -> str:
        return fold.get(path, path)

    minimum: Counter = Counter()
    min_kinds: dict[str, list[str]] = {}

    def add_min(row, nbytes, what):
        minimum[row] += nbytes
        if nbytes:
            min_kinds.setdefault(row, [])
            if what not in min_kinds[row]:
                min_kinds[row].append(what)

    # 1. plain needs: each tensor once, on the first unit that needs it
    needer: dict[str, str] = {}
    for unit, need, sid, _ in r_stock.needs:
        if sid is not None and sid not in needer:
            needer[sid] = unit
            add_min(unit, need.nbytes, need.what)
    available = set(needer)

    def attribute(run: _Run):
        bytes_, kinds, as_kept, as_kept_sids = Counter(), {}, Counter(), {}
        for p in run.packs.values():
            row = needer.get(p.sid) or row_of(p.packer)
            bytes_[row] += p.nbytes
            kinds.setdefault(row, [])
            if p.kind not in kinds[row]:
                kinds[row].append(p.kind)
            if row not in units:
                as_kept[row] += p.nbytes
                as_kept_sids.setdefault(row, set()).add(p.sid)
        hidden = Counter()
        for path, nbytes in run.hidden.values():
            hidden[row_of(path)] += nbytes
        return bytes_, kinds, as_kept, as_kept_sids, hidden

    s_bytes, s_kinds, s_kept, s_sids, s_hidden = attribute(r_stock)
    g_bytes, g_kinds, g_kept, g_sids, g_hidden = attribute(r_slim)
    # 2. code without a rule: the smaller of what stock and slimgrad keep there
    as_kept_total = 0
    for row in set(s_kept) | set(g_kept):
        side = "stock" if s_kept[row] <= g_kept[row] else "slim"
        nbytes, sids = (s_kept[row], s_sids) if side == "stock" else (g_kept[row], g_sids)
        sids = sids.get(row, set())
        add_min(row, nbytes, f"as {side} keeps")
        as_kept_total += nbytes
        available |= sids
    # 3. derivable and internal needs, now that what is kept anyway is known
    for unit, need, sid, derive in r_stock.needs:
        if sid is not None:
            continue
        free = any(all(s in available for s in alt) for alt in derive)
        add_min(unit, need.derived if free else need.nbytes, need.what)

    unread = Counter()
    for key, p in r_stock.packs.items():
        if key not in r_stock.unpacked:
            unread[needer.get(p.sid) or row_of(p.packer)] += p.nbytes
    rows = []
    for path, module in stock.named_modules():
        if row_of(path) != path:
            continue
        rows.append(ModuleRow(
            path=path, type_name=_type_name(module), params=_params(module, recurse=path in units),
            stock_bytes=s_bytes[path], slim_bytes=g_bytes[path], min_bytes=minimum[path], rule=path in units,
            stock_hidden_bytes=s_hidden[path], slim_hidden_bytes=g_hidden[path],
            stock_unread_bytes=unread[path], stock_kinds=s_kinds.get(path, []), slim_kinds=g_kinds.get(path, []),
            min_kinds=min_kinds.get(path, []),
        ))
    return AuditReport(
        rows=rows,
        stock_total=sum(p.nbytes for p in r_stock.packs.values()),
        slim_total=sum(p.nbytes for p in r_slim.packs.values()),
        min_total=sum(minimum.values()),
        stock_hidden_total=sum(s_hidden.values()), slim_hidden_total=sum(g_hidden.values()),
        stock_peak=peaks["stock"], slim_peak=peaks["slim"], case=case, min_as_kept_total=as_kept_total,
    )

