"""Unit tests: data sources, backbones, reply validation, personal state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from client_app.runtime import Client, select_device
from common.config import ConfigError
from common.protocol import ReplyError, check_arrays, spec_of
from common.record import personalized_stats
from fldata import DATASETS, dataset_shape, load_client_data
from fldata.sources import SyntheticFedFac, arrays_from_hf, load_local
from models import BACKBONES, build_backbone
from strategies.baselines import body_keys, non_batchnorm_keys
from strategies.registry import build_model, load_settings
from tests.conftest import app_config


def test_arrays_from_an_in_memory_hub_style_dataset():
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rng = np.random.default_rng(0)
    grey = [Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)) for _ in range(6)]
    colour = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))
              for _ in range(6)]
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(num_classes=3)})
    ds = datasets.Dataset.from_dict({"image": grey, "label": [0, 1, 2, 0, 1, 2]}, features)
    x, y = arrays_from_hf(ds)
    assert x.shape == (6, 1, 28, 28) and x.dtype == np.float32 and -1 <= x.min() <= x.max() <= 1
    assert y.tolist() == [0, 1, 2, 0, 1, 2]
    cds = datasets.Dataset.from_dict({"img": colour, "fine_label": [5] * 6},
                                     datasets.Features({"img": datasets.Image(),
                                                        "fine_label": datasets.Value("int64")}))
    x, y = arrays_from_hf(cds, "fine_label")
    assert x.shape == (6, 3, 32, 32) and set(y) == {5}


def test_local_directory_and_npz_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 1, 8, 8)).astype(np.float32)
    y = np.arange(200) % 4
    np.savez(tmp_path / "pool.npz", x=x, y=y)
    s = load_settings({**app_config(), "dataset": str(tmp_path / "pool.npz"),
                                     "partitioner": "iid"})
    assert dataset_shape(s) == ((1, 8, 8), 4)
    parts = [load_client_data(s, pid, 4) for pid in range(4)]
    assert sum(len(p.y_train) + len(p.y_test) for p in parts) == 200
    build_model(s)  # a default backbone fits the local data's shape
    images = (rng.random((10, 8, 8)) * 255).astype(np.uint8)
    datasets.Dataset.from_dict({"image": list(images), "label": list(range(10))}).save_to_disk(
        str(tmp_path / "device-data"))
    x_dir, y_dir = load_local(tmp_path / "device-data")
    assert x_dir.shape == (10, 1, 8, 8) and y_dir.tolist() == list(range(10))
    with pytest.raises(FileNotFoundError, match="dataset: no such file"):
        load_local(tmp_path / "missing")


def test_a_data_folder_holding_one_dataset_is_that_dataset(tmp_path):
    """A SuperNode's data-dir is a mounted folder: an .npz or a saved dataset inside it is
    found; a folder holding none or several is refused with what it holds."""
    datasets = pytest.importorskip("datasets")
    x = np.zeros((6, 1, 8, 8), np.float32)
    site = tmp_path / "site"
    site.mkdir()
    with pytest.raises(FileNotFoundError, match="holds 0 datasets"):
        load_local(site)
    np.savez(site / "train.npz", x=x, y=np.arange(6) % 2)
    (site / ".hidden.npz").write_bytes(b"")  # dot files are ignored
    assert load_local(site)[1].tolist() == [0, 1, 0, 1, 0, 1]
    saved = tmp_path / "saved"
    saved.mkdir()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"image": list(np.zeros((3, 8, 8), np.uint8)), "label": [2, 1, 0]})}).save_to_disk(
        str(saved / "device-data"))
    assert load_local(saved)[1].tolist() == [2, 1, 0]
    datasets.Dataset.from_dict({"image": list(np.zeros((2, 8, 8), np.uint8)),
                                "label": [1, 1]}).save_to_disk(str(saved / "other"))
    with pytest.raises(FileNotFoundError, match="holds 2 datasets"):
        load_local(saved)


def test_hub_datasets_are_declared_with_their_shapes():
    assert {"mnist", "fashion-mnist", "cifar10", "cifar100", "svhn"} <= set(DATASETS)
    assert all(info.hub_id for name, info in DATASETS.items()
               if name not in ("digits", "synthetic-fedfac"))


def test_synthetic_fedfac_generator():
    gen = SyntheticFedFac(dim=20, hidden=10, shared_param_fraction=0.3,
                          shared_covariate_fraction=0.5, noise=0.1)
    assert gen.true_shared_units().tolist() == [True] * 3 + [False] * 7
    x0, y0 = gen.client(seed=1, client=0, num_samples=400)
    x0b, y0b = gen.client(seed=1, client=0, num_samples=400)
    x1, _ = gen.client(seed=1, client=1, num_samples=400)
    np.testing.assert_array_equal(x0, x0b)
    np.testing.assert_array_equal(y0, y0b)
    assert x0.shape == (400, 20) and set(np.unique(y0)) == {0, 1}
    assert 0.35 < y0.mean() < 0.65  # standardised per client: balanced classes
    # personal covariates have a client mean, shared ones do not
    assert np.abs(x0[:, :10].mean(0) - x1[:, :10].mean(0)).mean() > 0.3
    s = load_settings({**app_config(), "dataset": "synthetic-fedfac", "synthetic.dim": 20,
                                     "synthetic.hidden": 10, "synthetic.num-samples": 50,
                                     "synthetic.shared-param-fraction": 0.3,
                                     "synthetic.shared-covariate-fraction": 0.5,
                                     "synthetic.noise": 0.1})
    data = load_client_data(s, 0, 3)
    assert data.x_train.shape[1] == 20 and len(data.y_train) + len(data.y_test) == 50


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_backbones_have_body_and_head(name):
    shape = (3, 32, 32) if name != "mlp" else (20,)
    model = build_backbone(name, shape, 7, mlp_hidden=16)
    out = model(torch.zeros(2, *shape))
    assert out.shape == (2, 7)
    assert isinstance(model.head, torch.nn.Linear)
    assert all(k.startswith(("body.", "head.")) for k in model.state_dict())


def test_cnn_runs_on_digits_shape():
    assert build_backbone("cnn", (1, 8, 8), 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_shared_key_rules():
    model = build_backbone("cnn", (1, 8, 8), 10)
    s = load_settings(app_config())
    assert not any(k.startswith("head.") for k in body_keys(model, s))
    assert not any("running" in k for k in non_batchnorm_keys(model, s))
    assert "body.1.weight" not in non_batchnorm_keys(model, s)  # BatchNorm affine
    assert "body.0.weight" in non_batchnorm_keys(model, s)       # conv


def _expected_spec() -> dict:
    """What the server expects of a reply carrying one (2, 3) float32 array ``w``."""
    return spec_of(ArrayRecord({"w": Array(np.zeros((2, 3), np.float32))}))


@pytest.mark.parametrize(("value", "reason"), [
    (np.zeros((3, 2), np.float32), "shape"),
    (np.zeros((2, 3), np.float64), "dtype"),
    (np.full((2, 3), np.inf, np.float32), "values that are not finite"),
])
def test_reply_validation_rejects(value, reason):
    expected = _expected_spec()
    with pytest.raises(ReplyError, match=reason):
        check_arrays(ArrayRecord({"w": Array(value)}), expected)
    with pytest.raises(ReplyError, match="unknown"):
        check_arrays(ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)),
                                            "extra": Array(np.zeros(1))}),
                     expected)
    check_arrays(ArrayRecord({"w": Array(np.ones((2, 3), np.float32))}),
                           spec_of(ArrayRecord({"w": Array(np.ones((2, 3), np.float32))})))


def test_personalized_stats():
    stats = personalized_stats({"0": (1.0, 30), "1": (0.5, 10), "2": (0.0, 10)})
    assert stats["accuracy_weighted"] == pytest.approx((30 + 5) / 50)
    assert stats["accuracy_mean"] == pytest.approx(0.5)
    assert stats["accuracy_min"] == 0.0
    assert stats["accuracy_std"] == pytest.approx(np.std([1.0, 0.5, 0.0]))
    assert list(stats["per_client"]) == ["0", "1", "2"]


def _context(run_id: int, state_dir, method: str = "fedper") -> Context:
    return Context(run_id=run_id, node_id=123, node_config={
        "partition-id": 1, "num-partitions": 4, "client-id": "site-b",
        "state-dir": str(state_dir)}, state=RecordDict(), run_config=app_config(method=method))


def test_personal_state_survives_rounds_and_restarts(tmp_path):
    context = _context(7, tmp_path)
    client = Client.from_context(context)
    assert client.client_id == "site-b"
    received = ArrayRecord({})
    model = client.model(received)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    client.keep_personal(model, received, client.shared_arrays(model, received))
    assert (tmp_path / "site-b.pt").exists()
    head = model.head.weight.detach().clone()
    # next round, same process: from context.state
    torch.testing.assert_close(client.model(received).head.weight, head)
    # SuperNode restart: new Context, empty state, same run -> from state-dir
    restarted = Client.from_context(_context(7, tmp_path))
    torch.testing.assert_close(restarted.model(received).head.weight, head)
    # a different run does not pick up this run's personalization
    other_run = Client.from_context(_context(8, tmp_path))
    assert not torch.equal(other_run.model(received).head.weight, head)


def test_a_resumed_run_takes_the_state_of_its_checkpoint_round(tmp_path):
    """Run 7 stopped during round 3 (its clients already saved their round-3 state); run 8
    resumes from run 7's round-2 checkpoint and trains round 3 again from the round-2 state."""
    client = Client.from_context(_context(7, tmp_path))
    received = ArrayRecord({})
    heads = {}
    for server_round in (1, 2, 3):
        model = client.model(received, up_to_round=server_round - 1)
        with torch.no_grad():
            model.head.weight.add_(1.0)
        client.keep_personal(model, received, client.shared_arrays(model, received),
                             server_round)
        heads[server_round] = model.head.weight.detach().clone()
    # round 3 saved again (its train message delivered twice): round 2's file stays the
    # previous one
    client.keep_personal(model, received, client.shared_arrays(model, received), 3)
    assert torch.load(tmp_path / "site-b.prev.pt", weights_only=True)["round"] == 2
    # run 7's own SuperNode restarted (no state in memory): the newer of its two files
    restarted = Client.from_context(_context(7, tmp_path))
    torch.testing.assert_close(restarted.model(received).head.weight, heads[3])
    resumed = Client.from_context(_context(8, tmp_path))
    lineage = ConfigRecord({"resume-runs": ["7"], "resume-round": 2})
    for up_to_round in (2, 3, None):  # train round 3, evaluate round 3, a report
        torch.testing.assert_close(
            resumed.model(received, up_to_round, lineage).head.weight, heads[2])
    assert resumed.personal_state(1, lineage) == {}  # only the last two rounds are kept
    # without the lineage (a fresh run, or one resumed from elsewhere) nothing is taken
    assert resumed.personal_state(3) == {}
    other = ConfigRecord({"resume-runs": ["5"], "resume-round": 2})
    assert resumed.personal_state(3, other) == {}
    # a crash between the two renames leaves only the previous round's file: still found
    (tmp_path / "site-b.pt").unlink()
    torch.testing.assert_close(resumed.model(received, 3, lineage).head.weight, heads[2])


def test_received_arrays_must_fit_the_model(tmp_path):
    client = Client.from_context(_context(1, tmp_path))
    with pytest.raises(ValueError, match="does not fit"):
        client.model(ArrayRecord({"head.weight": Array(np.zeros((3, 3), np.float32))}))


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.5, 1e-3)])
def test_our_sgd_steps_exactly_as_torch_optim_sgd(momentum, weight_decay):
    """``strategies.training.SGD`` (written out to spare a fresh ClientApp process the 2 s
    import that constructing a ``torch.optim`` optimizer costs) moves a CNN's parameters
    bitwise as ``torch.optim.SGD`` does, over several steps with momentum and weight decay,
    including a parameter that has no gradient in one step."""
    from strategies.training import SGD

    settings = load_settings(app_config())
    ours, theirs = build_model(settings), build_model(settings)
    opt_ours = SGD(ours.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum,
                                 weight_decay=weight_decay)
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(16) % 10
    for step in range(4):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step == 2:  # a parameter without a gradient this step is left alone
                next(model.parameters()).grad = None
            opt.step()
        for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_reported_losses_are_the_mean_batch_loss_and_the_mean_example_loss():
    """The ``train-loss`` a client reports is the mean over every batch of every epoch (each
    batch counts once, whatever its size), and its evaluation ``loss`` the mean over
    examples. A learning rate too small to move a plain linear model keeps every batch's loss
    what ``cross_entropy`` gives on it; the loader hands out other, unequal batches in its
    second epoch, so neither the last epoch alone nor an example-weighted mean passes."""
    from strategies.training import LocalTraining, evaluate_model, train_epochs

    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 5, generator=generator), torch.arange(12) % 3
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)

    def loss_of(batch: slice) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x[batch]), y[batch]))

    assert evaluate_model(model, [(x[:9], y[:9]), (x[9:], y[9:])],
                          torch.device("cpu")).loss == pytest.approx(loss_of(slice(None)),
                                                                     rel=1e-6)
    epochs = [[slice(0, 2), slice(2, 12)], [slice(0, 9), slice(9, 12)]]
    expected = np.mean([loss_of(batch) for epoch in epochs for batch in epoch])

    class TwoEpochs:
        """A loader whose batches differ between its first and second pass."""

        def __init__(self) -> None:
            self.passes = iter(epochs)

        def __iter__(self):
            return iter([(x[batch], y[batch]) for batch in next(self.passes)])

    settings = load_settings(app_config(lr=1e-12))
    loss = train_epochs(LocalTraining(model, TwoEpochs(), settings, torch.device("cpu"), 1),
                        model.parameters(), 2)
    assert loss == pytest.approx(expected, rel=1e-6)


def test_lenet5_is_lenet_on_28x28_and_runs_from_8x8():
    model = build_backbone("lenet5", (1, 28, 28), 10)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # LeNet-5's 16 maps of 5x5 after the second pooling, then 120, 84 and the classifier
    assert [(m.in_features, m.out_features) for m in linears] == [
        (400, 120), (120, 84), (84, 10)]
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # FedBN's part
    assert build_backbone("lenet5", (1, 8, 8), 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("method", ["fedavg", "feddecomp", "factorized-fl"])
def test_building_the_model_leaves_the_callers_random_state_as_it_was(method):
    """Every build gives the same weights (seeded init), and a draw after it is the draw the
    caller's own seed gives, as if no model had been built."""
    settings = load_settings(app_config(method=method))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = build_model(settings).state_dict()
    assert torch.equal(torch.rand(3), expected)
    second = build_model(settings).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_cuda_asked_for_without_a_visible_device_says_why(monkeypatch):
    """``cuda`` without a visible device stops the client; where the variable that Ray empties
    for a client given no GPU share is empty, the message names the share."""
    plain = "device: 'cuda' asked for, but no CUDA device is visible"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as hidden:
        select_device("cuda")
    assert str(hidden.value) == (plain + " (CUDA_VISIBLE_DEVICES is empty: Ray gives a simulated "
                                 "client a GPU only with client-resources-num-gpus above 0, on a "
                                 "machine that has one; else use device auto or cpu)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError) as absent:
        select_device("cuda")
    assert str(absent.value) == plain
    assert select_device("auto") == torch.device("cpu")
