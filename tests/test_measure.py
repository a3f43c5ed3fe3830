"""The accounting every memory claim rests on: counted independently of slimgrad's own layers."""

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.measure import SavedTensors, peak_bytes, saved_bytes


def test_counts_each_storage_once_and_reports_records():
    a = torch.randn(100, requires_grad=True)
    b = torch.randn(100, requires_grad=True)
    with SavedTensors() as counter:
        y = a * b  # mul keeps both operands
        z = y * y  # keeps y (twice, one storage)
    assert counter.bytes == 3 * 100 * 4
    assert sorted(r.shape for r in counter.records) == [(100,)] * 3
    z.sum().backward()


def test_views_count_their_whole_storage():
    base = torch.randn(10, 10, requires_grad=True)
    with SavedTensors() as counter:
        (base[:2] * 1).exp()  # exp keeps its result (a new 2x10 storage)
    assert counter.bytes == 2 * 10 * 4


def test_module_parameters_and_buffers_are_excluded():
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    # Linear keeps its input (for dW) and its weight (for dx): the weight is a parameter.
    assert saved_bytes(lin, x) == 5 * 4 * 4
    bn = nn.BatchNorm1d(4)
    bn.eval()
    # stock eval batch norm keeps x, running stats (buffers, excluded), and tiny per-channel stats
    kept = saved_bytes(bn, x)
    assert 5 * 4 * 4 <= kept <= 5 * 4 * 4 + 2 * 4 * 4



def test_views_of_parameters_are_not_counted_in_either_form():
    """A matmul over a 3-d input keeps ``weight.t()``: a plain tensor viewing the parameter. The module form
    excluded it (the module's storages); the function form counted the whole weight, so ``saved_bytes(lambda:
    model(x))`` read a frozen model's weights as kept (found by a sweep: a Qwen2 LoRA read twice its kept bytes).
    A parameter is never counted, nor a view of one; a tensor computed from one (a cast) is new memory and is."""
    lin = nn.Linear(64, 32, bias=False).requires_grad_(False)
    x = torch.randn(2, 3, 64, requires_grad=True)
    assert saved_bytes(lin, x) == saved_bytes(lambda: lin(x)) == saved_bytes(lambda: lin(x), exclude=[lin]) == 0
    w = nn.Parameter(torch.randn(64, 32))
    assert saved_bytes(lambda: x @ w.t().t()[:, :16]) == x.numel() * 4  # x, for dW; the views of w: not
    assert saved_bytes(lambda: x @ w.double().float()) == 64 * 32 * 4 + x.numel() * 4  # the cast: new memory


class _ReplacesItsWeight(nn.Module):
    """Replaces its weight's storage in forward, as bitsandbytes' Linear4bit does on a first eval-mode CPU forward
    (weight.data = the weight repacked for its CPU kernel), then saves a tensor of the freed storage's size."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n), requires_grad=False)

    def forward(self, x):
        self.weight.data = self.weight.data.clone()
        y = x * 2.0
        return y * y  # keeps y


@pytest.mark.parametrize("freed", ["parameter", "dropped_branch"])
def test_count_does_not_depend_on_reused_addresses(freed):
    """Storages are told apart by address; the allocator often hands a storage freed during the block (a
    parameter's replaced one, or one a dropped graph branch had saved) to the next tensor of its size, which
    was then taken for it: excluded as a parameter, or merged with the dropped one. test_bnb's QLoRA Llama
    counted 48 or 49 stock storages between identical runs. 64 KiB: reused in ~45 of 50 tries here."""
    n = 16384
    for _ in range(20):
        x = torch.randn(n, requires_grad=True)
        if freed == "parameter":
            layer = _ReplacesItsWeight(n)
            with SavedTensors(exclude=[layer]) as counter:
                layer(x)
            expected = [(n,)]  # y; not the weight
        else:
            with SavedTensors() as counter:
                (x * 3.0).sin()  # sin keeps its input; the branch is dropped at once, that storage freed
                y = x * 2.0
                z = y * y
            expected = [(n,), (n,)]  # sin's input and y: two storages, however the allocator placed them
            del z
        assert [r.shape for r in counter.records] == expected
        assert counter.bytes == len(expected) * n * 4

def test_explicit_exclude_of_tensors():
    x = torch.randn(8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    assert saved_bytes(lambda: x * w) == 64
    assert saved_bytes(lambda: x * w, exclude=[w]) == 32


def test_peak_bytes_sees_temporaries_inside_a_call():
    def make_and_drop():
        t = torch.empty(1 << 20, dtype=torch.uint8)
        u = torch.empty(1 << 21, dtype=torch.uint8)
        del t, u
        return None

    peak = peak_bytes(make_and_drop)
    assert (1 << 20) + (1 << 21) <= peak < (1 << 20) + (1 << 21) + 4096


def test_package_exports():
    assert slimgrad.saved_bytes is saved_bytes and slimgrad.peak_bytes is peak_bytes


def test_wrapper_subclasses_count_their_inner_storages():
    pytest = __import__("pytest")
    pytest.importorskip("torchao")
    try:
        from torchao.dtypes.nf4tensor import to_nf4
    except ImportError:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    weight = to_nf4(torch.randn(512, 512, dtype=torch.bfloat16))
    with SavedTensors() as counter:
        counter._pack(weight)
    # 4 bits per element plus the block scales: more than the packed bytes, far less than bf16
    assert 512 * 512 // 2 <= counter.bytes < 512 * 512 * 2 // 3


def test_saved_bytes_of_a_result_says_how_to_call_it():
    import pytest

    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(TypeError, match=r"saved_bytes\(model, x\)"):
        saved_bytes(lin(x))
    # a lambda hides the module: its weight, saved as a transposed view, is still a parameter's storage
    assert saved_bytes(lambda: lin(x)) == 5 * 4 * 4
    assert saved_bytes(lambda: lin(x), exclude=[lin]) == 5 * 4 * 4
    assert saved_bytes(lin, input=x) == 5 * 4 * 4  # keyword inputs pass through


def _cnn(device):
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Dropout(0.1), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


def test_saved_bytes_on_meta_counts_from_shapes_as_on_cpu():
    # meta storages have no address: they once all looked like the excluded parameters (count 0)
    x = torch.randn(2, 3, 8, 8)
    for convert in (False, True):
        on_cpu, on_meta = _cnn("cpu"), _cnn("meta")
        if convert:  # dropout's default policy "auto" is CPU's on meta too (it kept an 8-byte seed there, not bits)
            on_cpu, on_meta = slimgrad.convert(on_cpu), slimgrad.convert(on_meta)
        expected = saved_bytes(on_cpu, x.clone().requires_grad_())
        assert expected > 0 and saved_bytes(on_meta, x.to("meta").requires_grad_()) == expected
    # storages still count once, views included, on meta as anywhere
    a = torch.empty(10, 10, device="meta", requires_grad=True)
    with SavedTensors() as counter:
        y = a[:2] * 1
        y * y
    assert counter.bytes == 2 * 10 * 4 and len(counter.records) == 1


def test_peak_bytes_on_meta_says_it_cannot_measure():
    model = _cnn("meta")
    x = torch.randn(2, 3, 8, 8, device="meta")
    with pytest.raises(ValueError, match="peak_bytes: .*meta device, which allocates no memory"):
        peak_bytes(lambda t: model(t).sum().backward(), x)
    # the closure form (the README's): the meta tensors are in its closure; it read 16 bytes
    with pytest.raises(ValueError, match="peak_bytes: .*meta device"):
        peak_bytes(lambda: model(x).sum().backward())


def test_bad_arguments_are_named():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="peak_bytes: 'fn' must be the callable"):
        peak_bytes(5)
    with pytest.raises(TypeError, match="SavedTensors: 'exclude' must be modules or tensors"):
        SavedTensors(exclude=5)
    with pytest.raises(TypeError, match="'exclude' must hold modules or tensors, got a str"):
        saved_bytes(lambda: x * 1, exclude=["weight"])
    from slimgrad.measure import graph_saved_bytes, saved_in_graph

    with pytest.raises(TypeError, match="saved_in_graph: the outputs must be tensors"):
        graph_saved_bytes("x")
    with pytest.raises(TypeError, match="saved_in_graph: the outputs must be tensors"):
        saved_in_graph(3.0)
    # one module or tensor alone is taken as the one to exclude
    lin = nn.Linear(3, 3)
    assert saved_bytes(lambda: lin(x.requires_grad_()), exclude=lin) == saved_bytes(lin, x)


def test_peak_bytes_on_cpu_does_not_count_frees_of_memory_made_before_it():
    """The documented CPU rule: only blocks the call allocates are counted. Memory made before the call and freed
    inside it reads as still held, whether it was made outside any measurement or inside an earlier one (the
    profiler knows only the latter's size), so the reading does not depend on what ran before."""
    n = 1 << 18  # 1 MiB of fp32
    box = [torch.ones(n)]  # made outside any measurement

    def replace():
        box[0] = None  # frees the 1 MiB made before the call
        box[0] = torch.ones(n)  # and makes another

    assert peak_bytes(replace) == 4 * n
    assert peak_bytes(replace) == 4 * n  # the freed block was made inside the last measurement: the same

    def make_and_free():
        t = torch.ones(n)
        del t
        u = torch.ones(2 * n)
        del u

    assert peak_bytes(make_and_free) == 8 * n  # blocks made and freed inside are counted and let go
