import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from src.data.image.digits import DigitsDataModule, load_digits
from src.data.image.imagefolder import ImageFolderDataModule
from src.data.image.mnist import MNISTDataModule
from src.data.image.tensors import TensorDataModule
from tests.helpers import learnable_images, write_image_folder, write_mnist


class CountingTransform:
    """A deterministic transform that counts how often it runs and on how many images."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images):
        self.calls += 1
        return images * 2.0


def split_sizes(dm):
    return {split: len(dataset) for split, dataset in dm.datasets.items()}


def test_digits_splits_are_disjoint_complete_and_fixed_by_seed():
    first = DigitsDataModule(num_classes=10, input_shape=[1, 8, 8])
    first.setup()
    assert sum(split_sizes(first).values()) == 1797
    again = DigitsDataModule(num_classes=10, input_shape=[1, 8, 8])
    again.setup()
    assert torch.equal(first.datasets["test"].tensors[0], again.datasets["test"].tensors[0])
    other = DigitsDataModule(num_classes=10, input_shape=[1, 8, 8], split_seed=1)
    other.setup()
    assert not torch.equal(first.datasets["test"].tensors[0], other.datasets["test"].tensors[0])
    train = {tuple(x.flatten().tolist()) for x in first.datasets["train"].tensors[0]}
    test = [tuple(x.flatten().tolist()) for x in first.datasets["test"].tensors[0]]
    # The digits set holds a few exact duplicate images; almost no test image may be in train.
    assert sum(image in train for image in test) < 0.02 * len(test)


def test_digits_are_scikit_learns_read_without_importing_it():
    from sklearn import datasets

    images, labels = load_digits()
    reference = datasets.load_digits()
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(labels, reference.target)


def test_deterministic_transform_runs_once_per_split_not_per_sample():
    transform = CountingTransform()
    dm = DigitsDataModule(num_classes=10, input_shape=[1, 8, 8], transform=transform)
    dm.setup()
    for _ in range(2):  # two epochs
        for _ in dm.train_dataloader():
            pass
    assert transform.calls == 3


def test_train_transform_runs_per_sample_every_epoch_and_only_for_training():
    transform, train_transform = CountingTransform(), CountingTransform()
    dm = DigitsDataModule(
        num_classes=10, input_shape=[1, 8, 8], transform=transform, train_transform=train_transform
    )
    dm.setup()
    train_transform.calls = 0  # set-up reads one sample to check its shape
    for _ in range(2):
        for _ in dm.train_dataloader():
            pass
    assert train_transform.calls == 2 * len(dm.datasets["train"])
    assert transform.calls == 2  # val and test, once each


def test_mnist_reads_plain_and_gzipped_idx_files_without_network(tmp_path):
    for gz, root in ((False, tmp_path / "plain"), (True, tmp_path / "gz")):
        write_mnist(root, n_train=100, n_test=40, gz=gz)
        dm = MNISTDataModule(
            data_dir=str(root),
            download=False,
            num_classes=10,
            input_shape=[1, 28, 28],
            val_fraction=0.2,
        )
        dm.setup()
        assert split_sizes(dm) == {"train": 80, "val": 20, "test": 40}
        image, label = dm.datasets["test"][0]
        _, written_labels = learnable_images(40, 28, 10, seed=1)  # write_mnist's test labels
        assert image.shape == (1, 28, 28)
        assert int(label) == written_labels[0]


def test_mnist_without_files_says_where_to_put_them(tmp_path):
    dm = MNISTDataModule(
        data_dir=str(tmp_path), download=False, num_classes=10, input_shape=[1, 28, 28]
    )
    with pytest.raises(FileNotFoundError) as error:
        dm.setup()
    message = str(error.value)
    assert str(tmp_path / "MNIST" / "raw") in message
    assert "train-images-idx3-ubyte" in message
    assert "data.data_dir" in message


def test_mnist_rejects_a_dataset_that_is_not_mnist_format():
    with pytest.raises(ValueError, match="FashionMNIST"):
        MNISTDataModule(data_dir=".", dataset="CIFAR10", num_classes=10, input_shape=[3, 32, 32])


def test_wrong_input_shape_or_class_count_fails_with_the_fix(mnist_root):
    dm = MNISTDataModule(
        data_dir=str(mnist_root), download=False, num_classes=10, input_shape=[1, 32, 32]
    )
    with pytest.raises(ValueError, match=r"data.input_shape=\[1, 28, 28\]"):
        dm.setup()
    dm = MNISTDataModule(
        data_dir=str(mnist_root), download=False, num_classes=5, input_shape=[1, 28, 28]
    )
    with pytest.raises(ValueError, match=r"data\.num_classes=10"):
        dm.setup()


def small_rgb_transform():
    return v2.Compose(
        [v2.Resize(16), v2.CenterCrop(16), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    )


def test_image_folder_splits_a_flat_folder_of_classes(image_folder):
    dm = ImageFolderDataModule(
        data_dir=str(image_folder),
        num_classes=3,
        input_shape=[3, 16, 16],
        transform=small_rgb_transform(),
        val_fraction=0.25,
    )
    dm.setup()
    assert sum(split_sizes(dm).values()) == 36
    # Class folders in sorted order, and the folder of class i brightens colour channel i.
    for image, label in dm.datasets["train"]:
        assert image.shape == (3, 16, 16)
        brightest = int(image.mean(dim=(1, 2)).argmax())
        assert label == brightest, f"label {label} on an image brightest in channel {brightest}"


def test_image_folder_uses_train_and_val_folders_and_checks_their_classes(tmp_path):
    write_image_folder(tmp_path / "train", per_class=4)
    write_image_folder(tmp_path / "val", per_class=2)
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path),
        num_classes=3,
        input_shape=[3, 16, 16],
        transform=small_rgb_transform(),
    )
    dm.setup()
    assert split_sizes(dm) == {"train": 12, "val": 6, "test": 6}

    write_image_folder(tmp_path / "test", per_class=2, classes=("ant", "bee", "dog"))
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path),
        num_classes=3,
        input_shape=[3, 16, 16],
        transform=small_rgb_transform(),
    )
    with pytest.raises(ValueError, match="same class sub-folders"):
        dm.setup()


def test_image_folder_that_does_not_exist_is_named(tmp_path):
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path / "nope"), num_classes=3, input_shape=[3, 16, 16]
    )
    with pytest.raises(FileNotFoundError, match="nope"):
        dm.setup()


def test_tensor_datamodule_reads_arrays_from_npz_and_pt(tmp_path):
    x = np.random.default_rng(0).random((50, 1, 4, 4)).astype(np.float32)
    y = np.arange(50) % 3
    np.savez(tmp_path / "arrays.npz", x=x, y=y, x_test=x[:10], y_test=y[:10])
    torch.save({"x": torch.from_numpy(x), "y": torch.from_numpy(y)}, tmp_path / "arrays.pt")
    for name, expected_test in (("arrays.npz", 10), ("arrays.pt", 5)):
        dm = TensorDataModule(
            path=str(tmp_path / name),
            num_classes=3,
            input_shape=[1, 4, 4],
            val_fraction=0.2,
            test_fraction=0.1,
        )
        dm.setup()
        assert len(dm.datasets["test"]) == expected_test
        assert sum(split_sizes(dm).values()) == 50 + (10 if name.endswith("npz") else 0)


def test_tensor_datamodule_never_unpickles_objects(tmp_path):
    objects = np.array([{"payload": 1}], dtype=object)
    np.savez(tmp_path / "arrays.npz", x=objects, y=np.array([0]))
    dm = TensorDataModule(path=str(tmp_path / "arrays.npz"), num_classes=1, input_shape=[1])
    with pytest.raises(ValueError, match="allow_pickle"):
        dm.setup()


def test_tensor_datamodule_takes_in_memory_arrays():
    x, y = torch.randn(40, 2, 3, 3), torch.arange(40) % 4
    dm = TensorDataModule(x=x, y=y, num_classes=4, input_shape=[2, 3, 3])
    dm.setup()
    batch_x, batch_y = next(iter(dm.train_dataloader()))
    assert batch_x.shape[1:] == (2, 3, 3)
    assert batch_y.dtype == torch.long
