"""examples/port_torchvision_resnet.py: torchvision's ResNet-18 ported to Equinox +
eqx_state agrees with PyTorch (eval logits, five SGD steps in train mode, BatchNorm
statistics), at a tiny size."""

import re

import pytest
import torch
from _scripts import cached_script


TINY = ["--image-size", "32", "--batch", "8", "--width", "8"]


@pytest.fixture(scope="module")
def port():
    return cached_script("examples", "port_torchvision_resnet", "port_resnet_example")


@pytest.fixture
def one_torch_thread():
    # Two shared cores: torch's OpenMP threads spin against each other (a tiny
    # forward takes ~1 s instead of ~10 ms).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_torchvision_imports_through_the_helper(port):
    tv = port.import_torchvision()
    net = tv.models.resnet18(num_classes=3)
    assert net.fc.out_features == 3 and net.layer4[1].bn2.num_features == 512


def test_state_dict_names_match_torchvision(port):
    import equinox as eqx
    import jax

    import eqx_state as es

    for width in (64, 8):
        model = eqx.filter_eval_shape(port.ResNet18, width, 10, key=jax.random.key(0))
        tnet = port.torch_resnet18(width, 10)
        t_sd = tnet.state_dict()
        model = es.load_state_dict(model, t_sd)  # strict: every name matches
        sd = es.state_dict(model)
        assert list(sd) == list(t_sd)
        assert all(sd[k].shape == tuple(t_sd[k].shape) for k in sd)
    assert isinstance(
        model.layer2.layers[0].downsample.layers[1].running_var, es.BatchStat
    )


@pytest.mark.slow
def test_port_matches_torch_float32(port, capsys, one_torch_thread):
    assert port.main(TINY + ["--strict-float32"]) == 0
    out = capsys.readouterr().out
    assert "OK: the Equinox port matches torchvision within 0.0001" in out
    assert out.count("step ") == 5 and "float64" not in out


def _errors(out):
    return [float(e) for e in re.findall(r"max error (\S+)", out)]


@pytest.mark.slow
def test_float32_drift_is_confirmed_in_float64(port, capsys, one_torch_thread):
    # At a large learning rate float32 training drifts (rounding, amplified by
    # training); the script then repeats the check in float64, where the port agrees
    # with PyTorch to ~1e-12.
    assert port.main(TINY + ["--lr", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "float32 training drift" in out
    f64 = out.split("--- float64")[1]
    errors = _errors(f64)
    assert len(errors) == 4 and max(errors) < 1e-9, f64


def test_check_fails_on_a_wrong_weight(port, capsys, one_torch_thread):
    assert port.main(TINY + ["--steps", "0", "--perturb"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
