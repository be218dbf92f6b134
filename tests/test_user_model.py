"""A user's own model, ``model = "module:factory"`` (``models/user.py``): the classifier is the
Linear whose output ``forward`` returns, whatever the layer order; the adopted model computes
what the user's model computes; every method runs on it in a real simulation, a torchvision
ResNet too (the README's factory); a model the rule cannot serve stops the launcher with one
line. The user's module is ``tests/user_code/user_models.py``."""

from __future__ import annotations

import pytest
import torch
import user_models
from torch import nn

from common.config import ConfigError
from strategies.registry import REGISTRY, build_model, load_settings
from tests.conftest import (
    REFERENCE,
    REFERENCE_CLIENTS,
    ROOT,
    USER_CODE,
    USER_MODEL,
    app_config,
    check_results_schema,
    read_results,
)
from tests.test_fail_fast import demo

CLASSIFIER_FIRST = USER_MODEL
RESNET = "user_models:resnet18"


def _settings(model: str, method: str = "fedavg"):
    return load_settings(app_config(method=method, model=model))


@pytest.mark.parametrize(("model", "classifier"), [(CLASSIFIER_FIRST, "classifier"),
                                                   (RESNET, "fc")])
def test_the_adopted_model_computes_what_the_users_model_computes(model, classifier):
    settings = _settings(model)
    adopted = build_model(settings).eval()
    torch.manual_seed(settings.seed)  # as build_model seeds it
    factory = getattr(user_models, model.partition(":")[2])
    original = factory((1, 8, 8), 10).eval()
    assert adopted.head is not None and torch.equal(
        adopted.head.weight, original.get_submodule(classifier).weight)
    assert isinstance(adopted.body.get_submodule(classifier), nn.Identity)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(adopted(x), original(x), atol=1e-6)
    assert not any(key.startswith(f"body.{classifier}.") for key in adopted.state_dict())


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_builds_on_a_torchvision_resnet(method):
    """The README's two-line factory: each method's transform and checks accept it, and
    the transformed model still maps images to one logit per class."""
    model = build_model(_settings(RESNET, method)).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(("model", "line"), [
    ("user_models:softmax_at_the_end", "does not return an nn.Linear's output"),
    ("user_models:not_a_module", "returned a str, not a torch.nn.Module"),
    ("user_models:missing", "'user_models' has no 'missing'"),
    ("no_such_module:factory", "cannot import 'no_such_module'"),
    ("user_models:", "is not of the form 'package.module:factory'"),
])
def test_a_model_the_rule_cannot_serve_gets_one_line(model, line):
    with pytest.raises(ConfigError) as error:
        _settings(model)
    assert line in str(error.value) and "\n" not in str(error.value)


def test_a_layer_a_transform_cannot_serve_is_named(monkeypatch):
    def grouped(input_shape, num_classes):
        return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), nn.Conv2d(4, 4, 3, groups=2),
                             nn.Flatten(), nn.Linear(4 * 4 * 4, num_classes))

    monkeypatch.setattr(user_models, "grouped", grouped, raising=False)
    for method, line in (("feddecomp", "FedDecomp decomposes square, ungrouped Conv2d"),
                         ("factorized-fl", "Factorized-FL factorizes ungrouped")):
        with pytest.raises(ConfigError, match=line) as error:
            _settings("user_models:grouped", method)
        assert "body.1" in str(error.value)
    _settings("user_models:grouped", "fedavg")  # the others take it


def test_the_launcher_stops_an_unusable_model_with_one_line(tmp_path):
    done, _, _ = demo("model=user_models:softmax_at_the_end", f"output-dir={tmp_path}",
                      env={"PYTHONPATH": str(USER_CODE)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "does not return an nn.Linear's output" in done.stderr


@pytest.mark.integration
@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_runs_on_a_users_model(shared_runs, method):
    """Each method's reference run (tests/conftest.py) is on the user's model."""
    _, results = shared_runs.reference(method)
    assert results["config"]["model"] == CLASSIFIER_FIRST == REFERENCE["model"]
    check_results_schema(results, method, REFERENCE["num-server-rounds"], REFERENCE_CLIENTS)


# the fewest rounds and clients that carry one round's state into the next (and evaluate
# round 1 inside round 2's messages)
USER_RUN = {"num-server-rounds": 2, "local-epochs": 1, "plot": False}


@pytest.mark.integration
def test_a_torchvision_resnet_runs_through_the_readme_factory(federation, tmp_path):
    """11 M parameters: one method (each method's transform of it is built above)."""
    run = federation.run(ROOT, {**USER_RUN, "model": RESNET, "output-dir": str(tmp_path)},
                         num_supernodes=2)
    assert run.ok, run.output[-3000:]
    check_results_schema(read_results(tmp_path), "fedavg", 2, 2)
