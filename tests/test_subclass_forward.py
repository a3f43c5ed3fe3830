"""Subclasses of a torch.nn layer slimgrad replaces that define a forward of their own reaching the layer through
``super().forward`` (the video VAEs' causal Conv3d, a streaming audio encoder's causal Conv1d): a twin placed between
the subclass and the stock class makes that call slimgrad's, and everything else the forward does stays its own."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad._registry import ORIGINALS, delegating_stock


class _CausalConv3d(nn.Conv3d):
    """As diffusers' WanCausalConv3d: time padding on the past side only, then the base forward."""

    def __init__(self, cin, cout, k):
        super().__init__(cin, cout, k, padding=k // 2)
        self._pad = (self.padding[2], self.padding[2], self.padding[1], self.padding[1], 2 * self.padding[0], 0)
        self.padding = (0, 0, 0)

    def forward(self, x, cache_x=None):
        if cache_x is not None:
            x = torch.cat([cache_x, x], dim=2)
        return super().forward(F.pad(x, self._pad))


class _ChunkedConv3d(nn.Conv3d):
    """As CogVideoX's safe Conv3d: the base forward on time chunks, concatenated."""

    def forward(self, x):
        chunks = x.chunk(2, dim=2)
        k = self.kernel_size[0]
        parts = [chunks[0]] + [torch.cat((chunks[i - 1][:, :, -k + 1:], chunks[i]), 2) for i in range(1, len(chunks))]
        out = []
        for part in parts:
            out.append(super().forward(part))
        return torch.cat(out, dim=2)


class _OwnConv(nn.Conv2d):
    def forward(self, x):  # never reaches the base forward: nothing of slimgrad's would run
        return F.conv2d(x, self.weight * 2, self.bias)


class _Middle(nn.Conv3d):
    def forward(self, x):
        return super().forward(x) * 2


class _BelowMiddle(_Middle):
    def forward(self, x):
        return super().forward(x) + 1


def _video_model():
    torch.manual_seed(0)
    return nn.Sequential(_CausalConv3d(3, 8, 3), nn.GroupNorm(2, 8), nn.SiLU(), _ChunkedConv3d(8, 8, 1),
                         nn.ReLU(), _CausalConv3d(8, 4, 3))


@pytest.mark.parametrize("case", ["input", "norm", "all"])
def test_subclass_forwards_reaching_the_base_are_converted_bitwise_and_keep_less(case):
    """Left as stock before ("defines forward (it may compute something else)"): a Wan VAE with an input gradient kept
    0.96 of stock's bytes, 0.39 now (measured on a tiny config)."""
    model = _video_model()
    for name, p in model.named_parameters():
        p.requires_grad_(case == "all" or (case == "norm" and name.startswith("1.")))
    slim, report = slimgrad.convert(model, report=True)
    assert not report.skipped, report.skipped
    for i, kind in ((0, _CausalConv3d), (3, _ChunkedConv3d), (5, _CausalConv3d)):
        assert type(slim[i]) is not kind and isinstance(slim[i], kind) and isinstance(slim[i], slimgrad.nn.Conv3d)
        assert ORIGINALS[type(slim[i])] is kind and type(model[i]) is kind
    assert repr(slim) == repr(model) and slim.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 3, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(case == "input"), x.clone().requires_grad_(case == "input")
    slim(xb).sum().backward()  # (the ReLU learns its consumer in a first step)
    xb.grad = None
    slim.zero_grad(set_to_none=True)
    kept_a = slimgrad.saved_bytes(lambda: model(xa), exclude=[model])
    kept_b = slimgrad.saved_bytes(lambda: slim(xb), exclude=[slim])
    assert kept_b <= kept_a and (case == "all" or kept_b < kept_a), (kept_a, kept_b)
    ya, yb = model(xa), slim(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    if case == "input":
        assert torch.equal(xa.grad, xb.grad)
    for pa, pb in zip(model.parameters(), slim.parameters()):
        assert (pa.grad is None) == (pb.grad is None) and (pa.grad is None or torch.equal(pa.grad, pb.grad))
    cache = torch.randn(2, 3, 2, 6, 6)  # the subclass's own extra argument still reaches its forward
    assert torch.equal(model[0](x, cache), slim[0](x, cache))
    again = pickle.loads(pickle.dumps(slim))
    assert torch.equal(again(x), model(x)) and type(again[0]) is type(slim[0])
    assert torch.equal(copy.deepcopy(slim)(x), model(x))
    slimgrad.revert(slim)
    assert [type(m) for m in slim] == [type(m) for m in model]


def test_a_type_named_in_include_selects_its_delegating_subclasses():
    model = _video_model()
    only = slimgrad.convert(model, include=[nn.Conv3d])
    assert ORIGINALS.get(type(only[0])) is _CausalConv3d and type(only[1]) is nn.GroupNorm
    kept = slimgrad.convert(model, exclude=[nn.Conv3d])
    assert type(kept[0]) is _CausalConv3d and type(kept[3]) is _ChunkedConv3d


def test_forwards_that_do_not_reach_the_base_or_sit_below_another_subclass_are_left_alone():
    assert delegating_stock(_CausalConv3d) is nn.Conv3d
    assert delegating_stock(_OwnConv) is None  # (its forward computes something else with the weight)
    assert delegating_stock(_BelowMiddle) is None  # a forward in between, which slimgrad has not seen
    torch.manual_seed(0)
    model = nn.Sequential(_OwnConv(3, 4, 1), _BelowMiddle(4, 4, 1))
    slim, report = slimgrad.convert(model, report=True)
    assert [type(m) for m in slim] == [_OwnConv, _BelowMiddle]
    assert len(report.skipped) == 2 and all("defines forward" in s.reason for s in report.skipped), report.skipped


def test_video_vaes_causal_convs_are_converted():
    diffusers = pytest.importorskip("diffusers")
    from slimgrad.measure import SavedTensors

    torch.manual_seed(0)
    stock = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                       temperal_downsample=[False]).requires_grad_(False)
    slim = slimgrad.convert(stock)
    x = torch.randn(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with SavedTensors(exclude=[stock]) as a:
        ya = stock(xa).sample
    with SavedTensors(exclude=[slim]) as b:
        yb = slim(xb).sample
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert b.bytes < 0.5 * a.bytes, (a.bytes, b.bytes)  # 0.96 of stock's before (its convs left stock)


def _library_norms():
    """transformers' and diffusers' LayerNorm subclasses reaching ``super().forward`` that the channels-first
    fingerprints do not register: converted through the twin."""
    made = []
    try:
        from transformers.models.esmc.modeling_esmc import EsmcLayerNorm
        from transformers.models.lw_detr.modeling_lw_detr import LwDetrLayerNorm

        made += [("esmc", lambda: EsmcLayerNorm(8), (2, 5, 8)),
                 ("lwdetr-cf", lambda: LwDetrLayerNorm(8, data_format="channels_first"), (2, 8, 5, 5)),
                 ("lwdetr-cl", lambda: LwDetrLayerNorm(8), (2, 5, 5, 8))]
    except ImportError:
        pass
    try:
        from diffusers.models.unets.unet_stable_cascade import SDCascadeLayerNorm

        made.append(("sdcascade", lambda: SDCascadeLayerNorm(8, elementwise_affine=True), (2, 8, 5, 5)))
    except ImportError:
        pass
    return made


@pytest.mark.parametrize("name,make,shape", _library_norms(), ids=[m[0] for m in _library_norms()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_grad,input_grad", [(True, False), (False, True), (True, True)])
def test_library_layer_norm_subclasses_convert_bitwise(name, make, shape, dtype, weight_grad, input_grad):
    from slimgrad.measure import SavedTensors

    torch.manual_seed(0)
    stock = nn.Sequential(make()).to(dtype)
    with torch.no_grad():
        stock[0].weight.normal_()
        stock[0].bias.normal_()
    stock.requires_grad_(weight_grad)
    slim = slimgrad.convert(stock)
    assert ORIGINALS.get(type(slim[0])) is type(stock[0])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    xa, xb = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    with SavedTensors(exclude=[stock]) as kept_a:
        ya = stock(xa)
    with SavedTensors(exclude=[slim]) as kept_b:
        yb = slim(xb)
    assert torch.equal(ya, yb) and kept_b.bytes <= kept_a.bytes
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    if input_grad:
        assert torch.equal(xa.grad, xb.grad)
    for pa, pb in zip(stock.parameters(), slim.parameters()):
        assert (pa.grad is None) == (pb.grad is None) and (pa.grad is None or torch.equal(pa.grad, pb.grad))
