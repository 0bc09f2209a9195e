import pytest
import torch

from src.models.vision.cnn import CNN
from src.models.vision.simplenet import SimpleNet


def test_simplenet_is_the_classic_784_128_10_mlp_on_mnist_shapes():
    net = SimpleNet(input_shape=[1, 28, 28], num_classes=10)
    assert (net.fc1.in_features, net.fc1.out_features) == (784, 128)
    assert (net.fc2.in_features, net.fc2.out_features) == (128, 10)
    assert net(torch.randn(5, 1, 28, 28)).shape == (5, 10)


@pytest.mark.parametrize(
    ("input_shape", "flattened"),
    [([1, 28, 28], 64 * 12 * 12), ([1, 8, 8], 64 * 2 * 2), ([3, 32, 20], 64 * 14 * 8)],
)
def test_cnn_derives_its_linear_input_size_from_the_image_shape(input_shape, flattened):
    net = CNN(input_shape=input_shape, num_classes=7)
    assert net.fc1.in_features == flattened
    assert net(torch.randn(3, *input_shape)).shape == (3, 7)


def test_cnn_has_two_3x3_convolutions_with_32_and_64_channels():
    net = CNN(input_shape=[1, 28, 28], num_classes=10)
    assert (net.conv1.out_channels, net.conv2.out_channels) == (32, 64)
    assert net.conv1.kernel_size == net.conv2.kernel_size == (3, 3)


def test_cnn_refuses_images_too_small_for_its_convolutions():
    with pytest.raises(ValueError, match="at least 6x6"):
        CNN(input_shape=[1, 4, 4], num_classes=10)
