"""The examples in examples/ run on tiny sizes and show what they claim: the same results as stock with
less kept for backward."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))


@pytest.mark.slow
def test_dreambooth_lora_step_same_losses_less_kept():
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    import dreambooth_lora

    result = dreambooth_lora.run(tiny=True, steps=2)
    stock, slim = result["stock"], result["slimgrad"]
    assert slim["losses"] == stock["losses"]  # the same kernels run: bitwise the same losses
    assert slim["kept"] < stock["kept"] and slim["peak"] < stock["peak"]
    dreambooth_lora.main(["--tiny", "--steps", "1"])  # the command line runs too


@pytest.mark.slow
def test_dreambooth_conv_lora_with_dropout_same_losses():
    """peft lora.Conv2d on the ResNet convs, dropout 0.1: slimgrad's dropout draws peft's own masks (the
    CPU default 'bits' policy), so the losses are the same step for step."""
    pytest.importorskip("diffusers")
    import dreambooth_lora

    result = dreambooth_lora.run(tiny=True, steps=3, conv_lora=True, dropout=0.1)
    stock, slim = result["stock"], result["slimgrad"]
    # equal to the last bit in this run; 1e-6 leaves room for the LoRA-linear Function's documented
    # summation order of several gradient paths
    assert slim["losses"] == pytest.approx(stock["losses"], rel=1e-6, abs=0)
    assert slim["losses"][1] != slim["losses"][0]  # the adapters moved
    assert slim["kept"] < 0.7 * stock["kept"]


@pytest.mark.slow
def test_adversarial_input_identical_image_less_kept():
    import adversarial_input

    result = adversarial_input.run(tiny=True, steps=2)
    stock, slim = result["stock"], result["slimgrad"]
    assert torch.equal(slim["adv"], stock["adv"])
    assert not torch.equal(stock["adv"], result["image"])  # the attack moved the image
    # frozen weights, batch norm in eval: 1-bit ReLU masks and 1-byte pool positions instead of
    # float activations; well under a tenth of stock
    assert slim["kept"] < 0.1 * stock["kept"]
    adversarial_input.main(["--tiny", "--steps", "1"])
