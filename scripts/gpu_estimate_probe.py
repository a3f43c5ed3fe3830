"""Where slimgrad.estimate fails or is off on CUDA (issue 23's GPU check): the budget benchmark's Llama, QLoRA
and ResNet on the GPU, stock and converted; full tracebacks for failures, estimate vs measured peak otherwise.

    python scripts/gpu_estimate_probe.py
"""

import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import budget  # noqa: E402

import slimgrad  # noqa: E402

device = torch.device("cuda")
for work in (budget.Llama(True), budget.QLoRA(True), budget.ResNet(True)):
    for convert in (False, True):
        what = f"{work.key} {'converted' if convert else 'stock'}"
        try:
            torch.manual_seed(0)
            model = work.build(device)
            if convert:
                model = slimgrad.convert(model)
            batch = work.batch(work.ref, device)
            args, kwargs = ((), batch) if isinstance(batch, dict) else ((batch,), {})
            work.step(model, batch)
            model.zero_grad(set_to_none=True)
            gc.collect()
            measured = slimgrad.peak_bytes(lambda w=work, m=model, b=batch: w.step(m, b))
            model.zero_grad(set_to_none=True)
            e = slimgrad.estimate(model, *args, **kwargs)
            print(f"{what}: estimate {e.step_peak_bytes} measured {measured} "
                  f"{100 * (e.step_peak_bytes - measured) / measured:+.2f} % at {e.peak_where}", flush=True)
            print("   at peak:", {k: v for k, v in e.at_peak.items()}, flush=True)
        except Exception:
            print(f"{what}: FAILED", flush=True)
            traceback.print_exc(limit=-12)
