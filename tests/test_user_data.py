"""A user's own data through ``datasets.load_dataset`` (the loader flwr-datasets' federated
datasets use), given as its path: a folder of images (one subfolder per class) and a parquet
file with its own column names, both written here from scikit-learn's real 8x8 digits. Read,
they equal the digits; partitioned by flwr-datasets' Dirichlet and pathological
partitioners, they run in a real simulation. Hub ids (``org/name``) are told from paths."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from common.config import ConfigError
from fldata import dataset_shape, is_hub_id, is_local_path, load_client_data
from fldata.sources import load_column, load_local, normalise_images
from strategies.registry import load_settings
from tests.conftest import ROOT, app_config, check_results_schema, read_results

# the first 300 digits: enough for 3 clients, quick to write and read
DIGITS = 300


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """The digits as 8-bit grey images (N, 8, 8) and their labels."""
    bunch = load_digits()
    images = np.round(bunch.images[:DIGITS] * 255 / 16).astype(np.uint8)
    return images, bunch.target[:DIGITS]


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def write_image_folder(root: Path) -> Path:
    """``root/<class name>/<n>.png``, the layout of ``datasets``' image folders."""
    images, labels = digit_images()
    for n, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / f"class-{label}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{n:04d}.png").write_bytes(png(image))
    return root


WRITERS = 3


def write_parquet(path: Path) -> Path:
    """A parquet file as another tool writes it: PNG bytes in ``picture``, class names in
    ``digit``, who wrote each digit in ``writer`` (``WRITERS`` of them, in turn), no
    ``datasets`` metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images, labels = digit_images()
    pictures = pa.array([{"bytes": png(image), "path": None} for image in images],
                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"picture": pictures,
                             "digit": [f"digit {label}" for label in labels],
                             "writer": [f"writer-{n % WRITERS}" for n in range(len(labels))]}),
                   path)
    return path


@pytest.fixture(scope="module")
def user_data(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The two datasets as run-config overrides."""
    root = tmp_path_factory.mktemp("user-data")
    return {"image-folder": {"dataset": str(write_image_folder(root / "digits"))},
            "parquet": {"dataset": str(write_parquet(root / "digits.parquet")),
                        "image-column": "picture", "label-column": "digit"}}


@pytest.mark.parametrize("kind", ["image-folder", "parquet"])
def test_a_local_dataset_reads_as_the_images_it_holds(user_data, kind):
    config = user_data[kind]
    x, y = load_local(config["dataset"], config.get("label-column", "label"),
                      config.get("image-column", ""))
    images, labels = digit_images()
    # an image folder lists its images class by class, a parquet file in its own order
    order = (np.argsort(labels, kind="stable") if kind == "image-folder"
             else np.arange(len(labels)))
    assert np.array_equal(x, normalise_images(images[order]))
    assert y.tolist() == labels[order].tolist()  # "class-3" and "digit 3" sort as 3 does
    settings = load_settings(app_config(**config))
    assert dataset_shape(settings) == ((1, 8, 8), 10)


@pytest.mark.parametrize("partitioner", ["dirichlet", "pathological"])
@pytest.mark.parametrize("kind", ["image-folder", "parquet"])
def test_a_local_dataset_is_partitioned_by_the_run_partitioner(user_data, kind, partitioner):
    settings = load_settings(app_config(**user_data[kind], partitioner=partitioner,
                                        **{"classes-per-client": 2, "min-partition-size": 5}))
    parts = [load_client_data(settings, pid, 3) for pid in range(3)]
    assert all(len(p.y_train) >= 5 and len(p.y_test) > 0 for p in parts)
    assert sum(len(p.y_train) + len(p.y_test) for p in parts) <= DIGITS
    classes = [len(np.unique(np.concatenate([p.y_train, p.y_test]))) for p in parts]
    if partitioner == "pathological":  # classes-per-client, exactly
        assert classes == [2, 2, 2], classes
    else:  # Dirichlet over the ten classes: not two-class slices
        assert max(classes) > 2, classes


def test_local_data_is_read_without_download_progress_bars(tmp_path, capfd):
    """``datasets`` calls reading local files "Downloading data" and shows a bar for it (and
    for "Generating train split"): local data is read quietly. Fresh copies, so that
    ``datasets`` builds them here rather than finding them in its cache."""
    from datasets.utils import are_progress_bars_disabled

    if are_progress_bars_disabled():
        pytest.skip("datasets' progress bars are off in this environment")
    folder = write_image_folder(tmp_path / "digits")
    table = write_parquet(tmp_path / "digits.parquet")
    capfd.readouterr()
    assert len(load_local(folder)[1]) == DIGITS
    assert len(load_local(table, "digit", "picture")[1]) == DIGITS
    assert load_column(table, "writer")[0] == "writer-0"
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == "", printed
    assert not are_progress_bars_disabled()  # on again for a hub download's bar


def test_the_natural_partitioner_gives_each_writer_its_own_client(user_data):
    """One client per distinct value of ``partition-column``: here each writer's digits,
    train and test, and nobody else's."""
    settings = load_settings(app_config(**user_data["parquet"], partitioner="natural",
                                        **{"partition-column": "writer"}))
    images, _ = digit_images()
    for pid in range(WRITERS):  # writers sort as writer-0, writer-1, writer-2
        part = load_client_data(settings, pid, WRITERS)
        held = np.concatenate([part.x_train, part.x_test])
        mine = normalise_images(images[pid::WRITERS])
        assert len(held) == len(mine)
        assert {x.tobytes() for x in held} == {x.tobytes() for x in mine}
    # another number of clients than writers: one line naming the key
    with pytest.raises(ConfigError, match=r"^partition-column: 'writer' holds 3 distinct "
                                          r"values, one client each, but the run has 4 "
                                          r"clients") as error:
        load_client_data(settings, 0, 4)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="partition-column: the natural partitioner needs"):
        load_settings(app_config(**user_data["parquet"], partitioner="natural"))
    with pytest.raises(ConfigError, match="partition-column: no column 'author'"):
        load_client_data(load_settings(app_config(
            **user_data["parquet"], partitioner="natural", **{"partition-column": "author"})),
            0, WRITERS)


def test_a_missing_column_is_named_in_one_line(user_data):
    with pytest.raises(ConfigError, match="label-column: no column 'label'; the dataset has "
                                          "picture, digit"):
        load_settings(app_config(dataset=user_data["parquet"]["dataset"],
                                 **{"image-column": "picture"}))


def test_hub_ids_are_told_from_local_paths(tmp_path):
    assert is_hub_id("uoft-cs/cifar10") and not is_local_path("uoft-cs/cifar10")
    for path in (str(tmp_path), "data/train.parquet", "./images", "pool.npz"):
        assert is_local_path(path) and not is_hub_id(path), path
    with pytest.raises(ConfigError, match=r"^dataset: someone/their-images is no file or folder "
                       r"in .*, so it is read as a Hugging Face hub id, .*set num-classes and "
                       "input-shape"):
        load_settings(app_config(dataset="someone/their-images"))
    settings = load_settings(app_config(dataset="someone/their-images", **{
        "num-classes": 4, "input-shape": "3,32,32"}))
    assert dataset_shape(settings) == ((3, 32, 32), 4)


# each format and each partitioner in one real run (both partitioners split both formats in
# test_a_local_dataset_is_partitioned_by_the_run_partitioner)
@pytest.mark.integration
@pytest.mark.parametrize(("kind", "partitioner"), [("image-folder", "dirichlet"),
                                                   ("parquet", "pathological"),
                                                   ("parquet", "natural")])
def test_a_users_dataset_runs_two_rounds(federation, tmp_path, user_data, kind, partitioner):
    run = federation.run(ROOT, {**user_data[kind], "partitioner": partitioner,
                                "partition-column": "writer" if partitioner == "natural" else "",
                                "classes-per-client": 4, "min-partition-size": 5,
                                "num-server-rounds": 2, "local-epochs": 1, "plot": False,
                                "output-dir": str(tmp_path)}, num_supernodes=3)
    assert run.ok, run.output[-3000:]
    check_results_schema(read_results(tmp_path), "fedavg", 2, 3)


@pytest.mark.parametrize("class_folders", [0, 1])
def test_an_image_folder_with_fewer_than_two_class_folders_says_so(tmp_path, class_folders):
    """Its labels come from its class folders: with one, ``datasets`` would make no label
    column, and the error would be about a missing ``label`` column."""
    images, _ = digit_images()
    folder = tmp_path / "images"
    inside = folder / "cats" if class_folders else folder
    inside.mkdir(parents=True)
    for i in range(4):
        (inside / f"{i}.png").write_bytes(png(images[i]))
    held = "one ('cats')" if class_folders else "none"
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"dataset: the image folder {folder} has {held} of the class folders that give its "
            "labels; put each")):
        load_local(folder)
