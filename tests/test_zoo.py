"""The darknet parser and model zoo: published shapes, parameter counts, clear errors."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from swarm.errors import SwarmError
from swarm.zoo import BUILTIN, build_model, describe_model, summarise_sizes
from swarm.zoo.darknet import parse_cfg


def test_yolov2_published_shape():
    desc = describe_model("yolov2", 416)
    assert desc.layers[-1].out_shape == (425, 13, 13)
    assert len(desc.layers) == 31
    # the passthrough: layer 25 routes layer 16 (26x26x512), 27 reorgs 64x26x26 into 256x13x13
    assert desc.layers[25].inputs == (16,) and desc.layers[25].out_shape == (512, 26, 26)
    assert desc.layers[27].out_shape == (256, 13, 13)
    assert desc.layers[28].inputs == (27, 24) and desc.layers[28].out_shape == (1280, 13, 13)
    assert desc.params == 50_962_889


def test_yolov2_tiny_published_shape():
    desc = describe_model("yolov2-tiny", 416)
    assert desc.layers[-1].out_shape == (425, 13, 13)
    assert desc.layers[11].kind == "maxpool" and desc.layers[11].stride == 1
    assert desc.layers[11].out_shape == (512, 13, 13)  # darknet pads the far side: size kept


def test_yolov2_16_layers():
    desc = describe_model("yolov2-16", 416, classes=20)
    body = desc.layers[:16]
    assert [l.kind for l in body].count("conv") == 12 and [l.kind for l in body].count("maxpool") == 4
    assert all(l.batch_normalize and l.activation == "leaky" for l in body if l.kind == "conv")
    assert body[-1].out_shape == (256, 26, 26)
    assert 3.3e6 < sum(l.params for l in body) < 3.5e6  # "3.4 M parameters"
    assert desc.extra["stride"] == 16 and desc.extra["grid"] == (26, 26)
    assert desc.layers[-1].out_shape == (125, 26, 26)


@pytest.mark.parametrize("name,params", [("vgg16", 138_357_544), ("alexnet", 62_378_344), ("lenet5", 61_706)])
def test_classifier_parameter_counts(name, params):
    desc = describe_model(name)
    assert desc.params == params
    assert desc.loss == "softmax"


def test_alexnet_shapes():
    desc = describe_model("alexnet", 227)
    assert [l.out_shape[1] for l in desc.layers if l.kind in ("conv", "maxpool")] == [55, 27, 27, 13, 13, 13, 13, 6]


def test_layer_description_fields():
    conv = describe_model("yolov2-16", 416).layers[0]
    assert conv.kind == "conv" and conv.kernel == 3 and conv.stride == 1 and conv.padding == (1, 1, 1, 1)
    assert conv.in_shape == (3, 416, 416) and conv.out_shape == (32, 416, 416)
    assert conv.params == 3 * 9 * 32 + 2 * 32 and conv.param_bytes == 4 * conv.params
    assert conv.out_bytes == 32 * 416 * 416 * 4
    assert conv.flops >= 2 * 3 * 9 * 32 * 416 * 416


@pytest.mark.parametrize("name", BUILTIN)
def test_torch_model_matches_description(name):
    desc0 = describe_model(name)
    size = {"vgg16": 32, "alexnet": 67, "lenet5": 32}.get(name, 64)
    net, desc, _ = build_model(name, size, classes=7 if name != "lenet5" else None, seed=0)
    net.eval()
    x = torch.rand(2, desc.in_channels, size, size)
    live = {-1: x}
    for layer in desc.layers:  # every layer's output has the described shape
        live = net.forward_range(layer.index, layer.index + 1, live)
        for k, t in live.items():
            shape = desc.layers[k].out_shape if k >= 0 else (desc.in_channels, size, size)
            expect = shape[:1] if desc.layers[k].kind in ("connected",) or t.dim() == 2 else shape
            assert tuple(t.shape[1:]) == tuple(expect), (k, t.shape, shape)
    n_params = sum(p.numel() for p in net.parameters())
    assert n_params == desc.params
    assert desc0.name == name


def test_forward_range_composes():
    net, desc, _ = build_model("yolov2", 64, classes=3, seed=0)
    net.eval()
    x = torch.rand(1, 3, 64, 64)
    full = net(x)
    live = {-1: x}
    for lo, hi in [(0, 10), (10, 20), (20, 26), (26, 31)]:
        assert set(live) == set(desc.live_after(lo)) or lo == 0
        live = net.forward_range(lo, hi, live)
    assert torch.equal(live[30], full)
    assert set(desc.live_after(20)) == {16, 19}  # the passthrough crosses the cut


def test_bad_image_size_names_valid_sizes():
    with pytest.raises(SwarmError, match="multiples of 32"):
        describe_model("yolov2", 400)
    with pytest.raises(SwarmError, match="multiples of 16"):
        describe_model("yolov2-16", 100)
    with pytest.raises(SwarmError, match="any size from 32"):
        describe_model("lenet5", 20)


def test_summarise_sizes():
    assert summarise_sizes([32]) == "only 32"
    assert summarise_sizes(list(range(16, 2049, 16))) == "multiples of 16 from 16 to 2048"
    assert summarise_sizes(list(range(5, 100))) == "any size from 5 to 99"


def test_unknown_model():
    with pytest.raises(SwarmError, match="unknown model 'yolov9'.*yolov2-16"):
        describe_model("yolov9")


def test_missing_cfg_file(tmp_path):
    with pytest.raises(SwarmError, match="does not exist"):
        describe_model(str(tmp_path / "nope.cfg"))


def test_custom_cfg_file(tmp_path):
    cfg = tmp_path / "tiny.cfg"
    cfg.write_text("[net]\nwidth=32\nheight=32\nchannels=3\n\n[convolutional]\nfilters=8\nsize=3\nstride=2\npad=1\n"
                   "activation=relu\nbatch_normalize=1\n\n[maxpool]\nsize=2\nstride=2\n\n[connected]\noutput=4\n"
                   "activation=linear\n\n[softmax]\n")
    desc = describe_model(str(cfg))
    assert desc.name == "tiny" and desc.layers[-1].out_shape == (4, 1, 1)
    assert desc.layers[1].out_shape == (8, 8, 8)


@pytest.mark.parametrize("text,message", [
    ("[convolutional]\nfilters=3\n", "must start with a \\[net\\]"),
    ("[net]\nwidth=32\n", "not followed by any layer"),
    ("[net]\n[bogus]\n", "unknown section \\[bogus\\]"),
    ("[net]\n[convolutional]\nfilters=abc\n", ":2 \\[convolutional\\]: 'filters=abc' is not an integer"),
    ("[net]\n[convolutional]\nfilters=4\nactivation=plse\n", "activation 'plse' is not supported"),
    ("[net]\n[convolutional]\nfilters=4\n[shortcut]\nfrom=1\n", ":4 \\[shortcut\\]: from=1 refers to layer 1, which is not an earlier"),
    ("[net]\n[convolutional]\nfilters=4\n[convolutional]\nfilters=4\n[shortcut]\nfrom=-5\n", "from=-5 refers to layer -3"),
    ("[net]\nchannels=3\n[convolutional]\nfilters=4\ngroups=2\n", "groups=2 must divide the 3 input channels"),
    ("[net]\n[convolutional]\nfilters=6\n[route]\nlayers=-1\ngroups=4\ngroup_id=1\n", "groups=4 does not divide layer 0's 6"),
    ("[net]\n[convolutional]\nfilters=6\n[route]\nlayers=-1\ngroups=2\ngroup_id=2\n", "group_id=2 must be from 0"),
    ("[net]\nwidth=30\nheight=30\n[convolutional]\nfilters=4\n[maxpool]\nsize=3\nstride=3\n[convolutional]\nfilters=4\n"
     "size=3\nstride=3\n[shortcut]\nfrom=-2\n", "cannot take --img-size 30: it takes sizes such as 7, 8, 9"),
    ("[net]\n[convolutional]\nfilters=4\n[shortcut]\nfrom=-1\nweights_type=per_feature\n", "weights_type=per_feature is not supported"),
    ("[net]\nwidth=32\n[convolutional]\nfilters=12\n[yolo]\nmask=0,3\nanchors=1,1,2,2\nnum=2\nclasses=1\n", "mask index 3 is beyond num=2"),
    ("[net]\nwidth=32\n[convolutional]\nfilters=12\n[yolo]\nmask=0\nanchors=1,1\nnum=1\nclasses=1\n", "needs 6"),
    ("[net]\n[convolutional]\nfilters=4\n[upsample]\nstride=-2\n", "a positive stride"),
    ("[net]\n[convolutional]\nfilters=4\n[sam]\nfrom=3\n", "from=3 refers to layer 3"),
    ("[net]\n[convolutional]\nfilters=4\n[convolutional]\nfilters=4\n[sam]\nfrom=-1,-2\n",
     "from= names 2 layers; \\[sam\\] multiplies by one"),
    ("[net]\n[convolutional]\nfilters=4\nfoo=1\n", "option\\(s\\) foo not understood"),
    ("[net]\nmosaic=1\nfoo=1\n[convolutional]\nfilters=4\n", ":1 \\[net\\]: option\\(s\\) foo not understood"),
    ("[net]\n[convolutional]\nfilters=4\n[route]\nlayers=5\n", "not an earlier layer"),
    ("[net]\nwidth=32\n[convolutional]\nfilters=4\n[region]\nanchors=1,1\nnum=1\nclasses=2\n", "needs 7"),
    ("[net]\nwidth\n", "expected 'key=value'"),
])
def test_cfg_errors(tmp_path, text, message):
    path = tmp_path / "bad.cfg"
    path.write_text(text)
    with pytest.raises(SwarmError, match=message):
        describe_model(str(path))


def test_comments_and_aliases():
    sections = parse_cfg("# hello\n[net] \nwidth=8 ; trailing\n[conv]\nfilters=2\n[max]\nsize=2\nstride=2\n")
    assert [s.name for s in sections] == ["net", "convolutional", "maxpool"]
    assert sections[0].options["width"] == "8"


def test_same_seed_same_weights_different_seed_different():
    a, _, _ = build_model("yolov2-16", 64, seed=3)
    b, _, _ = build_model("yolov2-16", 64, seed=3)
    c, _, _ = build_model("yolov2-16", 64, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.conv.weight"], sc["layers.0.conv.weight"])
    assert "layers.0.bn.running_mean" in sa and "layers.16.conv.bias" in sa


@pytest.mark.parametrize("kernel,stride", [(2, 2), (2, 1), (3, 2), (3, 1)])
def test_max_pool_matches_torch_with_ties_nan_and_inf(kernel, stride):
    """The zoo's max-pool (channels-last kernel) gives nn.MaxPool2d's values and gradients."""
    from torch import nn

    from swarm.zoo.layers import MaxPool2d

    g = torch.Generator().manual_seed(kernel * 10 + stride)
    x = torch.randint(0, 3, (3, 5, 11, 14), generator=g).float()  # many ties
    r = torch.rand(x.shape, generator=g)
    x[r < 0.05] = float("nan")
    x[(r > 0.05) & (r < 0.3)] = float("-inf")
    x[0, :, :kernel, :] = float("-inf")  # windows of nothing but -inf
    dy = torch.randn(3, 5, (11 - kernel) // stride + 1, (14 - kernel) // stride + 1, generator=g)
    results = []
    for pool in (nn.MaxPool2d(kernel, stride), MaxPool2d(kernel, stride)):
        leaf = x.clone().requires_grad_(True)
        y = pool(leaf)
        y.backward(dy)
        with torch.no_grad():
            y_eval = pool(x)
        results.append((y.detach(), leaf.grad, y_eval))
    for want, got in zip(*results):
        assert want.shape == got.shape and got.is_contiguous()
        assert torch.equal(want.isnan(), got.isnan())
        assert torch.equal(torch.nan_to_num(want), torch.nan_to_num(got))


@pytest.mark.parametrize("model,size", [("yolov2-16", 64), ("yolov2", 128)])
def test_a_whole_forward_keeps_what_the_planner_estimates(model, size):
    """What autograd keeps over one whole forward (each storage once, parameters excluded)
    is the estimate the planner uses: in-place activations share their result with the next
    layer's input, and max-pools keep a byte per output. (BatchNorm's per-channel statistics,
    which the estimate leaves out, are under 1% at these sizes.)"""
    from planner.memory import estimate_activation_bytes

    net, desc, _ = build_model(model, size, seed=1)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t.detach()  # (the tensor itself would keep the graph alive in a cycle: see the profiler)

    x = torch.rand(2, *desc.layers[0].in_shape)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x)
    assert sum(seen.values()) / 2 == pytest.approx(sum(estimate_activation_bytes(desc)), rel=0.02)


def test_in_place_activations_give_the_gradients_of_out_of_place_ones():
    from torch import nn

    from swarm.zoo.layers import MaxPool2d

    grads = []
    for in_place in (True, False):
        net, desc, _ = build_model("yolov2-16", 64, seed=5)
        net.double()
        for module in net.modules():
            if isinstance(module, (nn.LeakyReLU, nn.ReLU)):
                assert module.inplace
                module.inplace = in_place
            if isinstance(module, MaxPool2d) and not in_place:
                module.forward = nn.MaxPool2d.forward.__get__(module)  # torch's own, int64 indices
        x = torch.rand(3, *desc.layers[0].in_shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        net(x).square().sum().backward()
        grads.append([p.grad for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_darknets_own_training_options_are_accepted_and_named_once():
    from swarm.zoo import darknet_only_options

    path = str(Path(__file__).resolve().parent / "cfg" / "darknet" / "yolov4-tiny.cfg")
    options = darknet_only_options(path)
    assert {"net.burn_in", "net.policy", "yolo.nms_kind"} <= set(options)
    assert not {"net.hue", "net.saturation", "yolo.jitter"} & set(options)  # the augmentation reads them
    assert len(options) == len(set(options)) and not {"net.width", "net.height", "net.channels"} & set(options)
    describe_model(path, 64)  # accepted


# The built-in graph networks: each head's output at darknet's own size (416 for the
# detectors, 224 for the classifiers, darknet53's 256), and parameters where a published
# count exists for the same layers (MobileNetV2 as torchvision builds it; YOLOv4-tiny).
PUBLISHED = {
    "yolov3-tiny": (416, [(255, 13, 13), (255, 26, 26)], None),
    "yolov4-tiny": (416, [(255, 13, 13), (255, 26, 26)], 6_056_606),
    "yolov7-tiny": (416, [(255, 52, 52), (255, 26, 26), (255, 13, 13)], None),
    "darknet53": (256, [(1000, 1, 1)], None),
    "resnet18": (224, [(1000, 1, 1)], None),
    "resnet50": (224, [(1000, 1, 1)], None),
    "mobilenetv2": (224, [(1000, 1, 1)], 3_504_872),
    "efficientnet-b0": (224, [(1000, 1, 1)], None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_built_in_graph_networks_have_their_published_shapes(name):
    size, outs, params = PUBLISHED[name]
    desc = describe_model(name, size)
    assert [desc.layers[o].out_shape for o in desc.outputs] == outs
    assert params is None or desc.params == params


@pytest.mark.parametrize("name", BUILTIN)
def test_every_built_in_model_trains_two_steps_and_evaluates(name):
    """At its default size, on the built-in shapes with their classes, as `swarm train
    --model NAME` runs it: two real optimizer steps that change the weights, then the
    held-out metric of its head (mAP for a detector, accuracy for a classifier)."""
    from swarm.data.shapes import SyntheticShapes
    from swarm.local.evaluate import evaluate
    from swarm.local.trainer import TrainConfig, train

    summary = train(TrainConfig(model=name, batch_size=2, steps=2, seed=1), threads=1, evaluate_at_end=False,
                    log=lambda s: None)
    assert summary["steps"] == 2 and math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    trainer = summary["trainer"]
    fresh, desc, _ = build_model(name, trainer.cfg.img_size, trainer.cfg.classes, seed=1)
    assert any(not torch.equal(v, trainer.net.state_dict()[k]) for k, v in fresh.state_dict().items()
               if v.is_floating_point())
    result = evaluate(trainer.net, desc, SyntheticShapes("heldout", desc.img_size, desc.in_channels, size=4))
    assert result.metric == ("mAP@0.5" if desc.detects else "top-1 accuracy")
    assert 0.0 <= result.value <= 1.0 and result.samples == 4


def test_train_help_names_every_built_in_model():
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-m", "swarm", "train", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60).stdout
    words = " ".join(out.split())
    listed = set(re.findall(r"[\w.-]+", words[words.index("--model MODEL"):words.index("--img-size N|WxH ")]))
    assert set(BUILTIN) <= listed, words
