"""Masks under torch.compile: the planar bit format (``_bitmask.pack_planar``), values and gradients of the
compiled mask-keeping Functions against stock eager, the forward's output not waiting for the pack (which
left the partitioner free to save the pack or rebuild it in backward), and the bytes the compiled step keeps.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from tests._util import assert_same
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import slimgrad
from slimgrad.kernels import bitmask as _bitmask


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 5, 7), (4, 8, 16, 16), (1, 2, 3, 4, 5), (0, 3), (2, 0, 4)])
def test_planar_round_trip(shape):
    torch.manual_seed(0)
    mask = torch.rand(shape) > 0.4
    packed = _bitmask.pack_planar(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == _bitmask.packed_numel(mask.numel())
    assert torch.equal(_bitmask.unpack_planar(packed, shape), mask)
    if mask.dim() == 4:  # a channels-last mask packs in logical order all the same
        cl = mask.to(torch.uint8).contiguous(memory_format=torch.channels_last).to(torch.bool)
        assert torch.equal(_bitmask.pack_planar(cl), packed)


def test_planar_in_memory_order():
    """A channels-last mask packs in its memory order (planes contiguous in memory) and unpacks to a
    channels-last mask with the same values; the bytes are those of the NHWC-flattened mask."""
    torch.manual_seed(0)
    mask = torch.rand(2, 3, 4, 5) > 0.5
    cl = mask.to(torch.uint8).contiguous(memory_format=torch.channels_last).to(torch.bool)
    order = _bitmask.memory_order(cl)
    assert order == (0, 2, 3, 1) and _bitmask.memory_order(mask) is None
    packed = _bitmask.pack_planar(cl, order)
    assert torch.equal(packed, _bitmask.pack_planar(mask.permute(0, 2, 3, 1).contiguous()))
    back = _bitmask.unpack_planar(packed, mask.shape, order)
    assert torch.equal(back, mask) and back.is_contiguous(memory_format=torch.channels_last)


def test_planar_layout_and_errors():
    """Element k * M + j is bit k of byte j (M = ceil(numel / 8)); a wrong byte count is refused."""
    mask = torch.zeros(17, dtype=torch.bool)  # M = 3
    mask[2 * 3 + 1] = True
    assert _bitmask.pack_planar(mask).tolist() == [0, 1 << 2, 0]
    with pytest.raises(ValueError, match="'packed' must hold 3 uint8 bytes"):
        _bitmask.unpack_planar(torch.zeros(4, dtype=torch.uint8), (17,))


@pytest.mark.parametrize("shape", [(4, 8, 16, 16), (2, 3, 4, 4), (8, 5, 7, 7), (2, 16, 2, 2, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_pixel_planes_round_trip(shape, channels_last):
    """Feature maps with a pixel count divisible by 8 pack in pixel planes ((pixels / 8, C) bytes), in either
    memory layout, and unpack to the same mask; planar_layout picks them for 4-D CPU maps only."""
    torch.manual_seed(0)
    mask = torch.rand(shape) > 0.4
    if channels_last:
        fmt = torch.channels_last if mask.dim() == 4 else torch.channels_last_3d
        mask = mask.to(torch.uint8).contiguous(memory_format=fmt).to(torch.bool)
    layout = _bitmask.PIXEL_PLANES
    assert _bitmask.planar_layout(mask) == (layout if mask.dim() == 4 else _bitmask.memory_order(mask))
    packed = _bitmask.pack_planar(mask, layout)
    pixels = mask.numel() // shape[1]
    assert packed.dtype == torch.uint8 and packed.shape == (pixels // 8, shape[1])
    assert torch.equal(_bitmask.unpack_planar(packed, mask.shape, layout), mask)


def test_pixel_planes_bit_placement():
    """Pixel p (channels-last order: n, then spatial positions) of channel c is bit p // (P / 8) of byte
    (p % (P / 8), c); maps whose pixel count is not a multiple of 8, other ranks and other devices than the
    CPU keep the flat planes."""
    mask = torch.zeros(2, 3, 2, 4, dtype=torch.bool)  # P = 16 pixels, 2 per plane
    mask[1, 2, 0, 3] = True  # pixel 1 * 8 + 0 * 4 + 3 = 11: plane 5, row 1
    packed = _bitmask.pack_planar(mask, _bitmask.planar_layout(mask))
    expected = torch.zeros(2, 3, dtype=torch.uint8)
    expected[1, 2] = 1 << 5
    assert torch.equal(packed, expected)
    assert _bitmask.planar_layout(torch.zeros(2, 3, 3, 3)) is None  # 18 pixels
    assert _bitmask.planar_layout(torch.zeros(8, 3, 8)) is None
    assert _bitmask.planar_layout(torch.zeros(0, 3, 4, 4)) is None
    assert _bitmask.planar_layout(torch.zeros(2, 3, 4, 4, device="meta")) is None


def _special(shape):
    """Values with the cases masks get wrong: NaN, +-0, the bounds themselves."""
    torch.manual_seed(1)
    x = torch.randn(shape) * 4
    flat = x.view(-1)
    flat[:6] = torch.tensor([float("nan"), 0.0, -0.0, 6.0, -1.0, 1.0])
    return x


MODULES = {
    "relu": lambda: nn.ReLU(),
    "relu-inplace": lambda: nn.ReLU(inplace=True),
    "leaky": lambda: nn.LeakyReLU(0.2),
    "leaky-inplace": lambda: nn.LeakyReLU(0.2, inplace=True),
    "relu6": lambda: nn.ReLU6(),
    "hardtanh-inplace": lambda: nn.Hardtanh(-1.0, 1.0, inplace=True),
    "threshold": lambda: nn.Threshold(0.5, -3.0),
    "hardsigmoid": lambda: nn.Hardsigmoid(),
}


class _Double(nn.Module):
    """x * 2: exact (NaN and signed zeros kept), and a non-leaf for in-place activations to write to."""

    def forward(self, x):
        return x * 2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_values_equal_stock(name, channels_last, dtype):
    """Compiled with Inductor, activation then a frozen conv: output and input gradient bitwise compiled
    stock's (the conv's kernel is Inductor's choice on both sides), NaN and signed zeros included."""
    torch.manual_seed(0)
    stock = nn.Sequential(_Double(), MODULES[name](), nn.Conv2d(3, 4, 1)).requires_grad_(False)
    slim = slimgrad.convert(copy.deepcopy(stock))
    if dtype != torch.float32 and (channels_last or name not in ("relu6", "leaky", "threshold")):
        pytest.skip("bf16: one case per mask rule")
    stock.to(dtype)
    slim.to(dtype)
    x = _special((2, 3, 6, 5)).to(dtype)
    if name in ("relu6", "hardtanh-inplace"):
        # NaN: slimgrad's hardtanh gradient is 0 in eager and compiled alike; stock's is 0 or the gradient
        # by the element's position in eager, and the gradient compiled (the documented NaN exception).
        x = x.nan_to_num(0.0)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    results = []
    for model in (stock, slim):
        torch._dynamo.reset()
        xi = x.clone().requires_grad_()
        out = torch.compile(model, fullgraph=True)(xi)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), xi.grad))
    torch._dynamo.reset()
    assert_same(results[1][0], results[0][0], what="output")
    assert_same(results[1][1], results[0][1], what="input grad")


def _forward_graph(model, x):
    """The forward graph AOTAutograd's min-cut partitioner (Inductor's) produces for one step."""
    graphs = {}

    def fw(gm, _):
        graphs["fw"] = gm
        return gm

    backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: gm,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    torch._dynamo.reset()
    return graphs["fw"]


def _kept_eager_and_compiled(model, x):
    """Bytes one step keeps for backward, eager and under torch.compile (Inductor), after a warm-up step each."""
    from slimgrad.measure import SavedTensors

    kept = {}
    for name, run in (("eager", model), ("compiled", torch.compile(model, fullgraph=True))):
        run(x.clone().requires_grad_()).sum().backward()
        with SavedTensors(exclude=[model]) as counter:
            out = run(x.clone().requires_grad_())
        out.sum().backward()
        kept[name] = counter.bytes
    torch._dynamo.reset()
    return kept


def _ancestors(node):
    seen, todo = set(), [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("act", [nn.ReLU, nn.ReLU6, nn.LeakyReLU])
def test_forward_output_does_not_wait_for_the_pack(act):
    """The output is stock's op on the input, not read back through the pack: forcing the pack into the forward
    that way cost a pass over the map each way (VGG-11 'input' 1.07x compiled stock's step, 1.02-1.05x
    without). Nothing in the forward reads the pack, so the partitioner chooses between saving it and
    rebuilding it in backward from what batch norm keeps; either way the step keeps at most what eager
    slimgrad keeps, values and gradients as stock's."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.BatchNorm2d(8), act(inplace=True), nn.Conv2d(8, 8, 3, padding=1)).requires_grad_(False)
    model = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(4, 3, 16, 16)
    graph = _forward_graph(model, x.clone().requires_grad_()).graph
    end = graph.output_node()
    (user_output,) = [n for n in end.all_input_nodes  # the last conv: read by nothing else in the forward
                      if str(n.target) == "aten.convolution.default" and set(n.users) == {end}]
    shifts = [n for n in _ancestors(user_output) if str(n.target) == "aten.__lshift__.Tensor"]
    assert not shifts, shifts
    kept = _kept_eager_and_compiled(model, x)
    assert kept["compiled"] <= kept["eager"], kept
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = stock(a), torch.compile(model, fullgraph=True)(b)
    ya.sum().backward()
    yb.sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(yb, ya)
    torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.slow
@pytest.mark.parametrize("act", [nn.ReLU, nn.ReLU6, nn.LeakyReLU])
def test_compiled_keeps_the_packed_bits(act):
    """Frozen conv, batch norm in eval and the activation, x needing grad: compiled, the step keeps the packed
    mask (1 bit per element) and the frozen weights' nothing, as eager slimgrad does (nothing here can
    rebuild the mask in backward, so the partitioner must save the pack, not a bool mask or the input)."""
    torch.manual_seed(0)
    model = slimgrad.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act(),
                                           nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), act(),
                                           nn.Conv2d(8, 4, 3, padding=1)).eval().requires_grad_(False))
    x = torch.randn(2, 3, 8, 8)
    kept = _kept_eager_and_compiled(model, x)
    assert kept["eager"] == 2 * (2 * 8 * 8 * 8 // 8)  # the activations' bits; nothing else is needed
    assert kept["compiled"] == kept["eager"], kept


@pytest.mark.slow
@pytest.mark.parametrize("channels_last", [False, True])
def test_dynamic_shapes(channels_last):
    """``torch.compile(dynamic=True)``: the planar formats trace with symbolic shapes and strides (pixel planes
    and the memory-order fallback for pixel counts not divisible by 8; sorting symbolic strides was a graph
    break), one graph serving every batch and map size, values and gradients within rounding of stock."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                          nn.Conv2d(16, 16, 3, padding=1), nn.LeakyReLU(0.1), nn.Dropout(0.0))
    compiled = torch.compile(slimgrad.convert(copy.deepcopy(stock)), dynamic=True, fullgraph=True,
                             backend="aot_eager")
    for shape in ((4, 3, 8, 8), (2, 3, 6, 6), (3, 3, 5, 7)):
        x = torch.randn(shape)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = stock(a), compiled(b)
        ya.sum().backward()
        yb.sum().backward()
        torch.testing.assert_close(yb, ya)
        torch.testing.assert_close(b.grad, a.grad)


class _Bounded(nn.Module):
    """Three clamp-family layers, one on each slice of the input (no gradient sums, whose rounding Inductor may
    change), bounds that fp32/bf16 cannot hold exactly among them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Hardtanh(-0.1, 0.3), nn.ReLU6(), nn.Threshold(0.1, 2.0)])

    def forward(self, x):
        return torch.stack([layer(part) for layer, part in zip(self.layers, x)])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_bounds(backend, dtype):
    """``torch.compile(dynamic=True)`` makes the clamp family's float bounds symbolic: rounding them in Python
    was an unbacked ``.item()`` that stopped dynamo. Values and gradients are stock's bit for bit, inputs on
    and beside the rounded bounds included (the rounding now happens in the graph)."""
    torch._dynamo.reset()
    stock = _Bounded()
    compiled = torch.compile(slimgrad.convert(copy.deepcopy(stock)), dynamic=True, fullgraph=True, backend=backend)
    edges = []
    for v in (-0.1, 0.3, 0.1, 6.0, 0.0):
        r = torch.tensor(v, dtype=dtype)
        below, above = torch.tensor(-9.0, dtype=dtype), torch.tensor(9.0, dtype=dtype)
        edges += [r, torch.nextafter(r, below), torch.nextafter(r, above)]
        edges.append(torch.tensor(v, dtype=torch.float32).to(dtype))
    edge = torch.stack(edges)
    for n in (64, 40):
        x = torch.cat([edge, torch.randn(n, dtype=dtype) * 4]).reshape(1, -1, 4).repeat(3, 1, 1)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = stock(a), compiled(b)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        assert_same(yb, ya)
        assert_same(b.grad, a.grad)
    torch._dynamo.reset()


SHARING = {
    "relu": lambda: nn.ReLU(),
    "relu-inplace": lambda: nn.ReLU(inplace=True),
    "leaky": lambda: nn.LeakyReLU(0.2),
    "relu6": lambda: nn.ReLU6(),
    "threshold": lambda: nn.Threshold(0.5, -3.0),
}


def _compiled_step(model, x, dynamic=False):
    """Output, input and parameter gradients, and the bytes kept, of the second compiled step (Inductor)."""
    from slimgrad.measure import SavedTensors

    torch._dynamo.reset()
    run = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with SavedTensors(exclude=[model]) as counter:
            out = run(xi)
        out.square().sum().backward()
    torch._dynamo.reset()
    grads = [p.grad for p in model.parameters()]
    return out.detach(), xi.grad, grads, counter.bytes


def _without_caches():
    """Inductor's FX graph cache and AOTAutograd's cache off: a compile with a pass patched out must not reuse
    the graph compiled with it (the passes' uuid does not change when a test patches them)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    stack = contextlib.ExitStack()
    stack.enter_context(config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def _assert_same_step(actual, expected):
    for what, a, e in zip(("output", "input grad"), actual[:2], expected[:2]):
        assert_same(a, e, what=what)
    for i, (a, e) in enumerate(zip(actual[2], expected[2])):
        assert_same(a, e, what=f"parameter {i} grad")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dynamic", "size"), [*((name, False, 8) for name in SHARING), ("relu", True, 8),
                                                      ("relu6", True, 8), ("relu", False, 7), ("relu6", False, 7)])
@pytest.mark.parametrize("consumer_trains", [True, False])
def test_mask_read_from_what_backward_keeps(name, dynamic, size, consumer_trains, monkeypatch):
    """Batch norm (training), the activation, then a conv. Where the conv's weight trains, its backward reads
    the activation's output anyway: the joint-graph pass (``_shared_masks``) reads the mask from that output,
    no pack is made (it cost a pass over the map: VGG-11 'all' 1.04-1.05x compiled stock's step, 0.99-1.02x
    without), and the step keeps at most what compiled stock keeps. Where the conv is frozen, nothing in
    backward reads the output, but batch norm's backward needs its input: the mask is rebuilt in backward from
    it (the pass marks the chain for recomputation), no pack is kept, and the step keeps no more than with the
    pack (the pass patched out) and less than stock. Values and every gradient bitwise compiled stock's. Under
    dynamic shapes too (the unpack then reads symbolic sizes, which are not inputs to match), and in the flat
    planes (7x7 maps: a pixel count that is not a multiple of 8; the format CUDA uses)."""
    from slimgrad.functional import _shared_masks

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), SHARING[name](),
                          nn.Conv2d(8, 8, 3, padding=1))
    stock[3].requires_grad_(consumer_trains)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, size, size)
    expected = _compiled_step(stock, x, dynamic)
    before = dict(_shared_masks.stats)
    with _without_caches():
        actual = _compiled_step(copy.deepcopy(slim), x, dynamic)
        counts = {k: _shared_masks.stats[k] - before[k] for k in before}
        if consumer_trains and name == "relu-inplace" and not dynamic:
            # traced in place runs out of place and copies in (test_inplace_on_a_graph_input_under_compile): the
            # joint pass then marks the chain for recomputation, whose output the conv reads too, so nothing of it
            # is kept (resnet18 'all', compiled: 0.646 MiB kept against 0.849 shared, the same step time)
            assert counts == {"shared": 0, "recomputed": 1, "kept": 0, "rebuilt": 0}, counts
            assert actual[3] <= expected[3], (actual[3], expected[3])
        elif consumer_trains:
            assert counts == {"shared": 1, "recomputed": 0, "kept": 0, "rebuilt": 0}, counts
            assert actual[3] <= expected[3], (actual[3], expected[3])
        else:
            # symbolic sizes: not marked (Inductor failed on a recomputed chain there); the partitioner then
            # rebuilds the pack in backward on its own, and the post-grad pass reads it unpacked
            expected_counts = {"shared": 0, "recomputed": 0 if dynamic else 1, "kept": 1 if dynamic else 0,
                               "rebuilt": 1 if dynamic else 0}
            assert counts == expected_counts, counts
            monkeypatch.setattr(_shared_masks, "share_masks", lambda graph: 0)
            packed = _compiled_step(copy.deepcopy(slim), x, dynamic)
            assert actual[3] <= packed[3] < expected[3] - 2 * 8 * size * size * 3, (actual[3], packed[3],
                                                                                    expected[3])
            _assert_same_step(packed, expected)
    _assert_same_step(actual, expected)


@pytest.mark.slow
def test_batch_size_change_recompiles_with_dynamic_shapes():
    """A smaller last batch makes dynamo recompile with a symbolic batch size (automatic dynamic, the default
    dynamic=None): that graph compiles and gives compiled stock's numbers. Inductor failed there ("Cannot
    convert expression to float") on the batch norm -> ReLU -> ceil-mode max pool chain the joint pass had
    marked for recomputation."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.AvgPool2d(2), nn.Flatten(),
                          nn.Linear(32, 3))
    stock[0].requires_grad_(False)
    slim = slimgrad.convert(copy.deepcopy(stock))
    runs = {}
    for name, model in (("stock", stock), ("slim", slim)):
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True)
        runs[name] = []
        for batch in (4, 3, 2):
            torch.manual_seed(batch)
            x = torch.randn(batch, 3, 9, 9, requires_grad=True)
            out = run(x)
            out.square().sum().backward()
            runs[name].append((out.detach(), x.grad, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
            model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    for actual, expected in zip(runs["slim"], runs["stock"]):
        _assert_same_step(actual, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["relu", "leaky", "relu6"])
def test_mask_kept_where_backward_needs_nothing_it_comes_from(name):
    """Batch norm in eval mode with frozen parameters, the activation, a frozen conv: backward needs neither the
    activation's output nor batch norm's input (only the input's gradient is asked for), so the pack stays,
    as in eager, and the step keeps far less than compiled stock; values bitwise compiled stock's."""
    from slimgrad.functional import _shared_masks

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), SHARING[name](),
                          nn.Conv2d(8, 8, 3, padding=1)).requires_grad_(False)
    stock[1].eval()
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 8, 8)
    expected = _compiled_step(stock, x)
    before = dict(_shared_masks.stats)
    with _without_caches():
        actual = _compiled_step(slim, x)
    counts = {k: _shared_masks.stats[k] - before[k] for k in before}
    assert counts == {"shared": 0, "recomputed": 0, "kept": 1, "rebuilt": 0}, counts
    assert actual[3] < expected[3] - 2 * 8 * 8 * 8 * 3, (actual[3], expected[3])
    _assert_same_step(actual, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["relu", "relu-inplace", "relu6"])
def test_mask_rebuilt_in_backward_is_read_unpacked(name, monkeypatch):
    """Batch norm, the activation, then a max pool (which reads its window positions, not the activation's
    output). The joint-graph pass has the mask recomputed from batch norm's input; with it patched out, the
    partitioner rebuilds the pack in backward on its own, and the post-grad pass reads the rebuilt mask
    without packing and unpacking it. The bytes are the partitioner's with and without the post-grad pass,
    and no more with the joint pass than without; values and gradients bitwise compiled stock's."""
    from slimgrad.functional import _shared_masks

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), SHARING[name](), nn.MaxPool2d(2),
                          nn.Conv2d(8, 4, 3, padding=1))
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 16, 16)
    expected = _compiled_step(stock, x)
    with _without_caches():
        before = dict(_shared_masks.stats)
        recomputed = _compiled_step(copy.deepcopy(slim), x)
        assert _shared_masks.stats["recomputed"] == before["recomputed"] + 1
        monkeypatch.setattr(_shared_masks, "share_masks", lambda graph: 0)
        actual = _compiled_step(copy.deepcopy(slim), x)
        assert _shared_masks.stats["rebuilt"] == before["rebuilt"] + 1
        monkeypatch.setattr(_shared_masks, "skip_rebuilt_packs", lambda graph: 0)
        without = _compiled_step(copy.deepcopy(slim), x)
        assert _shared_masks.stats["rebuilt"] == before["rebuilt"] + 1
    assert recomputed[3] <= actual[3] == without[3] < expected[3], (recomputed[3], actual[3], without[3],
                                                                     expected[3])
    for step in (recomputed, actual, without):
        _assert_same_step(step, expected)


@pytest.mark.slow
def test_mask_sharing_beside_a_users_joint_pass():
    """The passes are added beside a joint pre-pass the user set, not instead of it: both run."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes

    from slimgrad.functional import _shared_masks

    class Counting(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Counting.calls += 1

        def uuid(self):
            return "slimgrad-test-counting-pass"

    users = Counting()
    model = slimgrad.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)))
    with config.patch(joint_custom_pre_pass=users):
        before = _shared_masks.stats["shared"]
        torch._dynamo.reset()
        torch.compile(model, fullgraph=True)(torch.randn(2, 3, 8, 8, requires_grad=True)).sum().backward()
        torch._dynamo.reset()
        passes = get_custom_graph_passes(config.joint_custom_pre_pass)
        assert passes[0] is users and len(passes) == 2
    assert Counting.calls == 1 and _shared_masks.stats["shared"] == before + 1


def test_installed_is_a_dynamo_constant():
    """``_shared_masks`` marks its installer as torch.compiler.assume_constant_result does, without importing
    dynamo: this checks that the API still marks functions that way (else dynamo would trace the installer)."""
    from slimgrad.functional import _shared_masks

    assert getattr(torch.compiler.assume_constant_result(lambda: True), "_dynamo_marked_constant", False)
    assert _shared_masks._installed._dynamo_marked_constant


def _eager_step(model, x):
    """Output and input/parameter gradients of the second eager step (as ``_compiled_step``)."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.square().sum().backward()
    return out.detach(), xi.grad, [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("act", [nn.ReLU, lambda: nn.LeakyReLU(0.1), nn.ReLU6])
def test_bf16_compiled_batch_norm_then_activation(act):
    """Documented exception (README, Exactness): bf16, batch norm in training then an activation, compiled.
    Compiled stock applies the activation to batch norm's unrounded fp32 output (Inductor drops the bf16
    rounding between them), slimgrad to the rounded one, as eager does: outputs within 1 ulp of compiled
    stock's, and the output and every gradient as close to an fp64 reference as eager or compiled stock's
    (within 1.5x the larger of their errors; batch norm's backward amplifies the 1-ulp difference, so the
    gradients are not within bf16's elementwise tolerance of compiled stock's)."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act()).bfloat16()
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)
    compiled_stock, actual = _compiled_step(copy.deepcopy(stock), x), _compiled_step(slim, x)
    eager_stock = _eager_step(copy.deepcopy(stock), x)
    reference = _eager_step(copy.deepcopy(stock).double(), x.double())
    ulp = torch.finfo(torch.bfloat16).eps * compiled_stock[0].abs().float()
    assert ((actual[0] - compiled_stock[0]).abs().float() <= ulp).all()

    def errors(result):
        values = [result[0], result[1], *result[2]]
        refs = [reference[0], reference[1], *reference[2]]
        return [((v.double() - r).abs().max() / r.abs().max()).item() for v, r in zip(values, refs)]

    for i, (mine, eager, compiled) in enumerate(zip(errors(actual), errors(eager_stock), errors(compiled_stock))):
        assert mine <= 1.5 * max(eager, compiled), (i, mine, eager, compiled)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("make", [lambda: nn.ReLU(inplace=True), lambda: nn.LeakyReLU(0.1, inplace=True),
                                  lambda: nn.ReLU6(inplace=True), lambda: nn.Hardtanh(-0.5, 0.5, inplace=True),
                                  lambda: nn.Hardsigmoid(inplace=True), lambda: nn.Dropout(0.5, inplace=True)],
                         ids=["relu", "leaky_relu", "relu6", "hardtanh", "hardsigmoid", "dropout"])
def test_inplace_on_a_graph_input_under_compile(make, backend):
    """An in-place activation compiled alone (or after a graph break) modifies a graph input: its input gradient
    had passed through unmasked (ReLU on [-1, -0.5, 0.5, 1]: [1, 1, 1, 1]); now every traced in-place call runs out
    of place and copies in. Against compiled stock, the same dropout draw (fallback_random)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    base = torch.linspace(-8, 8, 26).view(2, 13)
    grads = []
    for module in (make(), slimgrad.convert(nn.Sequential(make()))[0]):
        torch._dynamo.reset()
        compiled = torch.compile(module, backend=backend, fullgraph=True)
        h = base.clone().requires_grad_()
        torch.manual_seed(0)
        with inductor_config.patch(fallback_random=True):
            out = compiled(h * 1.0)
        out.backward(torch.linspace(1, 2, 26).view(2, 13))
        grads.append(h.grad)
    assert_same(grads[1], grads[0], what="input gradient")
