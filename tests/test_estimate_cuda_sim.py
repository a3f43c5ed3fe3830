"""``slimgrad.estimate`` on CUDA simulates slimgrad's Triton kernels' allocations, not the torch reference's.

On fake tensors the registry hands out the Triton kernel a real tensor of that device and dtype would run
(``kernels.registry.choose``), and its wrapper runs with the launches skipped (``kernels.triton._jit``): the
wrapper's own ``torch.empty`` calls are what the allocator simulation counts. Before, fake tensors ran the torch
reference, which allocates other transients (max pooling's int64 indices in backward: the H200 estimate of a
ResNet step was 5 % high, docs/budget_gpu.md).

CPU checks (here): per family, one forward + backward on real tensors through the Triton kernels (the
interpreter, ``TRITON_INTERPRET=1``, preference "triton") against the same step on fake tensors of the same
device: the same storages, in the same order and of the same bytes, with kernels launched in the real step and
none in the simulated one. A fake *CUDA* tensor cannot run autograd in a CPU-only torch build (its engine asks
for an accelerator), so the device here is the CPU, where the same registry choice and the same wrappers run
under the interpreter. The interpreter must be on from the process start (tests/_triton_util.py): the ordinary
suite runs this file again in a subprocess with it set.

CUDA checks (skipped without a GPU): the same per-family comparison on CUDA tensors under the default
preference, and ``estimate`` against ``torch.cuda.max_memory_allocated`` within 1 % for the in-repo ResNet and a
tiny Llama with peft LoRA, stock and converted::

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/test_estimate_cuda_sim.py -k 'test_cuda'
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad import csrc, kernels
from slimgrad.kernels.registry import triton_interpreting

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


class NewStorages(TorchDispatchMode):
    """(op, bytes) of every storage an op brings into being, in order: what the estimate's allocator simulation
    counts as allocations. Storages alive before (``known``: the inputs) are not new; an empty storage is no
    allocation (the interpreter wraps each kernel argument in one, then points it at the argument's storage)."""

    def __init__(self, known=()):
        super().__init__()
        self.alive: dict = {}  # cdata -> weak reference (a freed storage's address may be reused)
        self.known = [t.untyped_storage() for t in known]  # held: their addresses stay theirs
        for s in self.known:
            self.alive[StorageWeakRef(s).cdata] = StorageWeakRef(s)
        self.log: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                seen = self.alive.get(ref.cdata)
                if seen is not None and not seen.expired():
                    continue
                self.alive[ref.cdata] = ref
                if t.untyped_storage().nbytes():
                    self.log.append((func.__name__, t.untyped_storage().nbytes()))
        return out


@contextlib.contextmanager
def counted_launches():
    """Counts the Triton launches that ran (a skipped launch, for fake arguments, returns without counting)."""
    pytest.importorskip("triton")
    from slimgrad.kernels.triton import _jit

    count = [0]
    original = _jit._Deferred.compiled

    def compiled(self):
        count[0] += 1
        return original(self)

    _jit._Deferred.compiled = compiled
    try:
        yield count
    finally:
        _jit._Deferred.compiled = original


# -- the families: a step is (inputs maker, forward) --------------------------------------------------------


def _pool2d(x):
    from slimgrad.functional.pooling import max_pool2d

    return max_pool2d(x, 3, 2, 1)


def _pool1d(x):
    from slimgrad.functional.pooling import max_pool1d

    return max_pool1d(x, 3, 2, 1)


def _relu(x):
    from slimgrad.functional.activation import relu

    return relu(x * 1)  # a non-leaf (relu's output is what the next layer sees; in-place needs a non-leaf)


def _leaky(x):
    from slimgrad.functional.activation import leaky_relu

    return leaky_relu(x * 1, 0.1)


def _gated(kind):
    def step(gate, up):
        from slimgrad.functional.gated import gated_activation

        return gated_activation(gate, up, kind)

    return step


def _rms_hf(style):
    def step(x, w):
        from slimgrad.functional.norms import rms_norm_hf

        return rms_norm_hf(x, w, 1e-6, style)

    return step


def _rms_torch(x, w):
    from slimgrad.functional.norms import rms_norm

    return rms_norm(x, (x.shape[-1],), w, 1e-6)


def _fused_add(x, r, w):
    from slimgrad.functional.norms import fused_add_rms_norm

    y, s = fused_add_rms_norm(x, r, w, 1e-6)
    return y * 1 + s


def _layer_norm(x, w, b):
    from slimgrad.functional.norms import layer_norm

    return layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _dropout_seed(x):
    from slimgrad.functional.dropout import dropout

    return dropout(x * 1, 0.25, True, policy="seed")


F32, BF16 = torch.float32, torch.bfloat16
# name -> (family, [(shape, dtype, requires_grad)], step)
CASES = {
    "max_pool2d": ("max_pool_positions", [((2, 3, 16, 16), F32, True)], _pool2d),
    "max_pool1d": ("max_pool_positions", [((2, 3, 33), BF16, True)], _pool1d),
    "relu": ("relu_mask", [((4, 37), F32, True)], _relu),
    "leaky_relu": ("relu_mask", [((4, 37), BF16, True)], _leaky),
    "gated_silu": ("gated_activation", [((3, 40), BF16, True), ((3, 40), BF16, True)], _gated("silu")),
    "gated_gelu_gate_only": ("gated_activation", [((3, 40), F32, True), ((3, 40), F32, False)], _gated("gelu")),
    "rms_llama": ("rms_norm_hf", [((2, 5, 48), BF16, True), ((48,), F32, True)], _rms_hf("llama")),
    "rms_t5_weight_only": ("rms_norm_hf", [((2, 5, 48), BF16, False), ((48,), BF16, True)], _rms_hf("t5")),
    "rms_gemma_x_only": ("rms_norm_hf", [((6, 40), F32, True), ((40,), F32, False)], _rms_hf("gemma")),
    "rms_torch": ("rms_norm", [((6, 40), F32, True), ((40,), F32, True)], _rms_torch),
    "fused_add_rms": ("fused_add_rms_norm", [((6, 40), BF16, True), ((6, 40), BF16, True), ((40,), BF16, True)],
                      _fused_add),
    "layer_norm": ("layer_norm", [((6, 40), F32, True), ((40,), F32, True), ((40,), F32, True)], _layer_norm),
    "dropout_seed": ("dropout_seed", [((4, 300), F32, True)], _dropout_seed),
}


def _inputs(specs, device):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)
            for shape, dtype, grad in specs]


def _step(step, inputs):
    out = step(*inputs)
    out.backward(torch.ones_like(out))


def _recorded(step, inputs) -> list[tuple[str, int]]:
    rec = NewStorages(known=inputs)
    with rec:
        _step(step, inputs)
    return rec.log


def _real_and_simulated(name, device):
    """(real step's storages, simulated step's storages, launches in the real step, launches simulated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    family, specs, step = CASES[name]
    real = _inputs(specs, device)
    with counted_launches() as launches:
        log_real = _recorded(step, real)
        ran = launches[0]
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in real]
        with mode:
            log_fake = _recorded(step, fakes)
        simulated = launches[0] - ran
    # only the bytes and the order are the allocator's business (the real run's ops are empty_strided where the
    # fake run's are empty: the same allocation)
    return [n for _, n in log_real], [n for _, n in log_fake], ran, simulated, log_real, log_fake


# -- CPU, under the interpreter -----------------------------------------------------------------------------

interpreted = pytest.mark.skipif(not triton_interpreting(),
                                 reason="needs TRITON_INTERPRET=1 from the process start "
                                        "(test_simulation_under_interpreter runs this file so)")


@interpreted
@pytest.mark.parametrize("name", sorted(CASES))
def test_simulated_step_allocates_what_the_interpreted_triton_step_allocates(name):
    pytest.importorskip("triton")
    with kernels.preference("triton"), csrc.disabled():  # the Python Functions, where the Triton kernels run
        real, fake, ran, simulated = _real_and_simulated(name, "cpu")[:4]
    assert ran > 0, f"{name}: no Triton kernel ran in the real step (the case does not test the Triton path)"
    assert simulated == 0, f"{name}: {simulated} Triton launch(es) ran on fake tensors"
    assert fake == real, f"{name}: simulated storages (bytes, in order) {fake} != the real Triton step's {real}"


@interpreted
def test_reference_path_allocates_differently_where_the_simulation_matters():
    """The test above can fail: the torch reference (what fake tensors ran before) allocates other bytes than the
    Triton kernels for max pooling (int64 indices) and the seed policy's dropout (a float noise tensor)."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in ("max_pool2d", "dropout_seed", "relu"):
        _, specs, step = CASES[name]
        with kernels.preference("triton"), csrc.disabled():
            real = [n for _, n in _recorded(step, _inputs(specs, "cpu"))]
        with kernels.preference("torch"), csrc.disabled():
            mode = FakeTensorMode()
            fakes = [mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in _inputs(specs, "cpu")]
            with mode:
                reference = [n for _, n in _recorded(step, fakes)]
        assert reference != real, name


@contextlib.contextmanager
def launches_free_as_compiled():
    """The interpreter leaves each launch's argument storages in reference cycles, alive until the garbage
    collector runs (a compiled launch holds none): collect after each launch, so that the real step's lifetimes
    are those of a compiled one."""
    import gc

    from slimgrad.kernels.triton import _jit

    original = _jit._Launch.__call__

    def call(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        gc.collect()
        return result

    _jit._Launch.__call__ = call
    try:
        yield
    finally:
        _jit._Launch.__call__ = original


def _pool_net():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 1, bias=False), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
    return model, (torch.randn(2, 3, 24, 24),), {}, None


def _llama_hidden():
    from tests._budget_models import llama_lora

    model, batch = llama_lora(batch=2, seq=32, dropout=0.1)
    return model, (), {"input_ids": batch["input_ids"], "output_hidden_states": True}, \
        lambda out: out.hidden_states[-1].sum()


@interpreted
@pytest.mark.parametrize("which", ["pool_net", "llama_hidden"])
def test_interpreted_triton_step_peak_is_estimated_exactly(which):
    """The whole estimate against the allocator's records of a real step whose families run Triton (interpreted):
    a conv/ReLU/max-pool net (peak in max pooling's backward: the torch reference's int64 indices put the
    estimate 12 % high) and a Llama with LoRA, seed-policy dropout, RMSNorm and gated MLPs, loss on its hidden
    states (peak in the gated MLP: 2.7 % high before), converted."""
    pytest.importorskip("triton")
    import slimgrad

    model, args, kwargs, loss_fn = _pool_net() if which == "pool_net" else _llama_hidden()
    with kernels.preference("triton"), csrc.disabled(), launches_free_as_compiled(), counted_launches() as n:
        model = slimgrad.convert(model, dropout="seed")

        def step():
            loss_fn_ = loss_fn or (lambda out: out.sum())
            loss_fn_(model(*args, **kwargs)).backward()

        step()
        model.zero_grad(set_to_none=True)
        ran = n[0]
        measured = slimgrad.peak_bytes(step)
        assert n[0] > ran, "no Triton kernel ran in the measured step"
        model.zero_grad(set_to_none=True)
        est = slimgrad.estimate(model, *args, loss_fn=loss_fn or (lambda out: out.sum()), **kwargs)
    assert est.step_peak_bytes == measured, (f"{which}: estimated {est.step_peak_bytes}, measured {measured} "
                                             f"({est.peak_where})")


@pytest.mark.slow
def test_simulation_under_interpreter():
    """Runs this file's interpreted cases in a subprocess started with TRITON_INTERPRET=1."""
    if triton_interpreting():
        pytest.skip("this process runs under the interpreter: the cases run here directly")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", SLIMGRAD_KERNELS="auto")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__, "-k",
           "interpreted_triton or reference_path"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (result.stdout[-6000:] + "\n" + result.stderr[-3000:]).strip()
    assert result.returncode == 0, tail
    assert f"{len(CASES) + 3} passed" in result.stdout, tail


# -- CUDA ---------------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


#: one case per family the registry gives Triton on CUDA under the default preference (each kernel variant costs a
#: compilation on a fresh GPU machine); torch-style RMSNorm and layer norm run aten's fused kernels there
CUDA_CASES = ["max_pool2d", "relu", "gated_silu", "rms_llama", "fused_add_rms", "dropout_seed"]


@cuda_only
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cuda_simulated_step_allocates_what_the_triton_step_allocates(name):
    pytest.importorskip("triton")
    with csrc.disabled():  # the Python Functions and their Triton kernels (small ReLUs run the core's aten route)
        real, fake, ran, simulated, log_real, log_fake = _real_and_simulated(name, "cuda")
    assert ran > 0, f"{name}: no Triton kernel ran in the real CUDA step"
    assert simulated == 0, f"{name}: {simulated} Triton launch(es) ran on fake tensors"
    assert fake == real, f"{name}: simulated {log_fake} != real {log_real}"


def _aten_route_logs(name, device):
    """(real step's storages, simulated step's) for a ReLU case whose real step runs the core's aten route."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, specs, step = CASES[name]
    _step(step, _inputs(specs, device))  # the route's bit values, made once per device
    real = _inputs(specs, device)
    log_real = _recorded(step, real)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in real]
    with mode:
        log_fake = _recorded(step, fakes)
    return log_real, log_fake


@pytest.mark.skipif(csrc.core() is None, reason="needs the compiled core")
@pytest.mark.parametrize("name", ["relu", "leaky_relu"])
def test_simulated_step_allocates_what_the_core_aten_route_allocates(name):
    """The core's aten route (what small CUDA ReLUs run, here on CPU tensors) and the estimate's simulation of it
    (``relu_mask.CORE_ATEN_SIMULATION``): the same storages, of the same bytes, in the same order. The route's 0/1
    bytes are there (the CPU kernels allocate none), so the comparison can fail."""
    from slimgrad.kernels import relu_mask

    with relu_mask.aten_route_on_cpu():
        log_real, log_fake = _aten_route_logs(name, "cpu")
    numel = CASES[name][1][0][0][0] * CASES[name][1][0][0][1]
    assert sum(1 for _, n in log_real if n == (numel + 7) // 8 * 8) >= 2, log_real
    assert [n for _, n in log_fake] == [n for _, n in log_real], (log_fake, log_real)


@cuda_only
@pytest.mark.skipif(CUDA and csrc.core() is None, reason="needs the compiled core")
@pytest.mark.parametrize("name", ["relu", "leaky_relu"])
def test_cuda_simulated_step_allocates_what_the_core_aten_route_allocates(name):
    log_real, log_fake = _aten_route_logs(name, "cuda")
    assert [n for _, n in log_fake] == [n for _, n in log_real], (log_fake, log_real)


def _resnet(converted):
    """The budget benchmark's ResNet (in-repo resnet18, width x 0.25, batch norm training, 96x96, batch 16)."""
    from tests._budget_models import cnn

    model, x = cnn("resnet18", batch=16, size=96)
    model = model.cuda()
    if converted:
        import slimgrad

        model = slimgrad.convert(model)
    return model, (x.cuda(),), {}


def _llama_lora(converted):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    if converted:
        import slimgrad

        model = slimgrad.convert(model)
    ids = torch.randint(0, 512, (4, 128), device="cuda")
    return model, (), {"input_ids": ids, "labels": ids}


def _measured_step_peak(model, args, kwargs) -> tuple[int, int]:
    """(peak during one forward + backward, bytes allocated at its start), from the caching allocator's records."""
    import gc

    from slimgrad.audit import default_loss

    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = default_loss(model(*args, **kwargs))
    loss.backward()
    del loss
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), start


@cuda_only
@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
@pytest.mark.parametrize("which", ["resnet", "llama_lora"])
def test_cuda_estimate_matches_measured_peak(which, converted):
    import slimgrad

    model, args, kwargs = (_resnet if which == "resnet" else _llama_lora)(converted)
    _measured_step_peak(model, args, kwargs)  # a first step: cuBLAS/cuDNN workspaces, lazy state
    peak, start = _measured_step_peak(model, args, kwargs)
    for p in model.parameters():
        p.grad = None
    est = slimgrad.estimate(model, *args, **kwargs)
    measured = peak - start
    error = (est.step_peak_bytes - measured) / measured
    print(f"{which} {'converted' if converted else 'stock'}: estimated {est.step_peak_bytes / 2**20:.2f} MiB, "
          f"measured {measured / 2**20:.2f} MiB, error {100 * error:+.2f} % ({est.peak_where})")
    assert abs(error) <= 0.01, f"{which}: estimate {est.step_peak_bytes} vs measured {measured} ({error:+.2%})"


# -- the CPU estimate: Python numbers autograd saves --------------------------------------------------------


def test_saved_python_numbers_are_estimated_on_cpu():
    """``x * 0.5`` and ``x / 3``: the number becomes an 8-byte CPU tensor before the op (no dispatch mode sees it
    made) that MulBackward0/DivBackward0 keep until they run. A diffusers UNet keeps 47 at its peak: its CPU
    estimate was 376 B low; here 16 are alive at the peak (128 B low before), none after their nodes ran."""
    from tests._budget_models import measured_step_peak
    from torch import nn

    import slimgrad

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.out = nn.Linear(8, 4096)  # the peak: its output, the numbers alive (the ops with a number are
                                           # not at the peak, where a 4-byte cast of the number lives inside them)

        def forward(self, x):
            h = self.lin(x)
            for i in range(8):
                h = (h * 0.5) / (i + 2)
            return self.out(h)

    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 8)
    measured = measured_step_peak(model, x)
    est = slimgrad.estimate(model, x)
    assert est.step_peak_bytes == measured, (est.step_peak_bytes, measured, est.peak_where)
