"""BatchNorm over a 1x1 map: the rule for the micro-batches a network can train on, and `swarm train`'s refusal."""
from __future__ import annotations

from swarm.local.batchnorm_check import fewest_samples, microbatch_refusal, single_value_batchnorms
from swarm.zoo import describe_model
from tests.conftest import run_swarm

# a classifier whose BatchNorm normalises a [connected] layer's outputs: (N, 1, 1) at any input size
CONNECTED_BN = """
[net]
width=8
height=8
channels=3

[convolutional]
filters=4
size=3
stride=1
pad=1
activation=leaky

[maxpool]
size=2
stride=2

[connected]
output=10
batch_normalize=1
activation=leaky

[connected]
output=5
activation=linear

[softmax]
"""


def test_the_layers_whose_batchnorm_sees_a_1x1_map():
    """yolov2-tiny's last three convolutions see a 1x1 map at 32 (their input shrunk 32 times),
    2x2 at 64; a [connected] layer's BatchNorm sees one value per output at any size."""
    tiny32, tiny64 = describe_model("yolov2-tiny", 32), describe_model("yolov2-tiny", 64)
    assert [d.index for d in single_value_batchnorms(tiny32)] == [10, 12, 13]
    assert (fewest_samples(tiny32), fewest_samples(tiny64)) == (2, 1)
    assert single_value_batchnorms(tiny64) == [] and fewest_samples(describe_model("yolov2-16", 32)) == 1
    connected = describe_model("bn-connected", None, None, CONNECTED_BN)
    assert [d.kind for d in single_value_batchnorms(connected)] == ["connected"]
    assert fewest_samples(connected) == 2


def test_micro_batches_of_one_sample_are_refused_with_the_layer_and_what_to_do():
    tiny32 = describe_model("yolov2-tiny", 32)
    assert microbatch_refusal(tiny32, 1, 1) == (
        "yolov2-tiny at 32x32: layer 10's BatchNorm sees a 1x1 map (as do those of layers 12 and 13), so a "
        "micro-batch of one sample gives it one value per channel, and --batch-size 1 in 1 micro-batch makes "
        "micro-batches of one sample; use micro-batches of at least 2 samples (--batch-size at least 2 x "
        "--microbatches) or a larger --img-size")
    assert "--batch-size 3 in 2 micro-batches makes a micro-batch of one sample" in microbatch_refusal(tiny32, 3, 2)
    assert "--batch-size 5 in 4 micro-batches makes 3 micro-batches of one sample" in microbatch_refusal(tiny32, 5, 4)
    assert "--batch-size 8 in 8 micro-batches makes micro-batches of one sample" in microbatch_refusal(tiny32, 8, 8)
    for batch, microbatches in ((2, 1), (4, 2), (5, 2), (16, 8)):
        assert microbatch_refusal(tiny32, batch, microbatches) is None
    assert microbatch_refusal(tiny32, 2, 3) is None  # more micro-batches than samples: refused elsewhere, as that
    assert microbatch_refusal(describe_model("yolov2-tiny", 64), 1, 1) is None
    connected = microbatch_refusal(describe_model("bn-connected", None, None, CONNECTED_BN), 4, 4)
    assert connected.startswith("bn-connected at 8x8: layer 2's BatchNorm follows a [connected] layer (10 values, "
                                "one per output), so a micro-batch of one sample gives it one value per channel")
    assert "--img-size" not in connected  # a larger input leaves it one value per output


def test_swarm_train_refuses_micro_batches_a_batchnorm_cannot_train_on_before_it_runs(tmp_path):
    r = run_swarm("train", "--model", "yolov2-tiny", "--img-size", "32", "--batch-size", "1", "--steps", "1",
                  "--no-eval", "--save", tmp_path / "tiny.pt", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "ValueError" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "swarm train: error: " + microbatch_refusal(
        describe_model("yolov2-tiny", 32), 1, 1)
    assert not (tmp_path / "tiny.pt").exists() and "model yolov2-tiny:" not in r.stderr  # nothing ran


def test_yolov2_tiny_at_32_trains_on_micro_batches_of_two(tmp_path):
    r = run_swarm("train", "--model", "yolov2-tiny", "--img-size", "32", "--batch-size", "2", "--steps", "1",
                  "--no-eval", "--strategy", "local", "--threads", "1", "--save", tmp_path / "tiny.pt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "trained yolov2-tiny for 1 steps" in r.stdout and (tmp_path / "tiny.pt").exists()
