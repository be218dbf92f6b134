"""pFedC: masked aggregation (eq. 7), min-norm solver, per-client downlinks, tasks = 1."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, MetricRecord, RecordDict

from client_app.runtime import Client
from common.protocol import ClientReply
from models.pfedc import BranchHead, branch_of_key, task_groups
from strategies.engine import RoundEngine
from strategies.pfedc.client import mgda_ub_weights, min_norm_weights, train_pfedc
from strategies.pfedc.server import PFedCRule, masked_branch_average
from strategies.registry import build_model, initial_state, load_settings, wire_spec
from strategies.training import LocalTraining, sgd
from tests.conftest import app_config, read_results

ROOT = Path(__file__).resolve().parents[1]


def test_task_groups():
    assert task_groups(4, 0) == [[0], [1], [2], [3]]
    assert task_groups(10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert task_groups(5, 1) == [[0, 1, 2, 3, 4]]


def test_branch_head_targets_and_prediction():
    head = BranchHead(4, task_groups(5, 2))          # groups [0,1,2] and [3,4]
    y = torch.tensor([0, 2, 3, 4])
    t0, t1 = head.task_targets(y).T
    assert t0.tolist() == [0, 2, 3, 3]                # slot 3 = "other"
    assert t1.tolist() == [2, 2, 0, 1]                # slot 2 = "other"
    # prediction: each class scores its own branch's log-probability; a branch sure of
    # "other" gives its classes nothing, whatever their raw logits
    for branch in head.branches:
        torch.nn.init.zeros_(branch.weight)
    with torch.no_grad():
        head.branches[0].bias.copy_(torch.tensor([5.0, 0.0, 0.0, 9.0]))  # sure: not 0-2
        head.branches[1].bias.copy_(torch.tensor([0.0, 3.0, 0.0]))       # likely: class 4
        scores = head(torch.randn(4, 4))
        assert scores.shape == (4, 5) and scores.argmax(1).tolist() == [4] * 4
        head.branches[0].bias.copy_(torch.tensor([6.0, 0.0, 0.0, 0.0]))  # sure: class 0
        assert head(torch.randn(4, 4)).argmax(1).tolist() == [0] * 4
    single = BranchHead(4, task_groups(5, 1))         # one task: an ordinary classifier
    assert single.branches[0].out_features == 5


@pytest.mark.parametrize("tasks", [0, 1, 3])
def test_branch_head_computes_each_branch_on_its_own(tasks):
    """The one-matmul layout equals running every branch Linear separately."""
    torch.manual_seed(tasks)
    head = BranchHead(6, task_groups(10, tasks))
    z, y = torch.randn(16, 6), torch.randint(0, 10, (16,))
    targets = head.task_targets(y)
    expected = torch.stack([torch.nn.functional.cross_entropy(branch(z), targets[:, t])
                            for t, branch in enumerate(head.branches)])
    torch.testing.assert_close(head.task_losses(z, y), expected)
    scores = head(z)
    for group, branch in zip(head.groups, head.branches, strict=True):
        own = torch.log_softmax(branch(z), dim=1)[:, :len(group)]
        torch.testing.assert_close(scores[:, group], own)


HAND_KEYS = {0: ["head.branches.0.weight"], 1: ["head.branches.1.weight"],
             2: ["head.branches.2.weight"]}
HAND_BRANCHES = {"a": {"head.branches.0.weight": np.array([1.0]),
                       "head.branches.1.weight": np.array([10.0])},
                 "b": {"head.branches.0.weight": np.array([3.0]),
                       "head.branches.2.weight": np.array([7.0])},
                 "c": {"head.branches.1.weight": np.array([20.0])}}


def test_eq7_is_the_plain_mean_over_the_holders_of_each_branch():
    """Eq. 7 (the default, ``uniform``): presence vectors; each holder counts once."""
    presence = {"a": [1.0, 1.0, 0.0], "b": [1.0, 0.0, 1.0], "c": [0.0, 1.0, 0.0]}
    averaged = masked_branch_average(HAND_BRANCHES, presence, HAND_KEYS)
    assert averaged["head.branches.0.weight"] == pytest.approx((1 + 3) / 2)
    assert averaged["head.branches.1.weight"] == pytest.approx((10 + 20) / 2)
    assert averaged["head.branches.2.weight"] == pytest.approx(7.0)  # its only holder


def test_counts_option_weights_each_holder_by_its_examples_of_the_task():
    counts = {"a": [1.0, 3.0, 0.0], "b": [3.0, 0.0, 2.0], "c": [0.0, 1.0, 0.0]}
    averaged = masked_branch_average(HAND_BRANCHES, counts, HAND_KEYS)
    assert averaged["head.branches.0.weight"] == pytest.approx((1 * 1 + 3 * 3) / 4)
    assert averaged["head.branches.1.weight"] == pytest.approx((10 * 3 + 20 * 1) / 4)
    assert averaged["head.branches.2.weight"] == pytest.approx(7.0)


@pytest.mark.parametrize("weighting", ["uniform", "counts"])
def test_clients_disclose_presence_by_default_and_counts_only_as_the_option(weighting):
    overrides = {} if weighting == "uniform" else {"pfedc.weighting": "counts"}
    client = _client(0, partitioner="dirichlet", **{"dirichlet-alpha": 0.1}, **overrides)
    counts = np.bincount(client.data().y_train, minlength=10).astype(float)
    sent = client.identity()["pfedc.task-weights"]
    expected = (counts > 0).astype(float) if weighting == "uniform" else counts
    assert sent == expected.tolist()


def _rule(**overrides) -> PFedCRule:
    settings = load_settings(app_config(method="pfedc", **overrides))
    return RoundEngine(settings, wire_spec(settings), PFedCRule).rule


def test_downlink_carries_only_held_branches_and_their_holders_average():
    rule = _rule()
    assert len(rule.keys_of_task) == 10
    rule.task_weights = {"0": [5.0, 5.0] + [0.0] * 8, "1": [0.0, 4.0, 4.0] + [0.0] * 7}
    arrays = initial_state(rule.settings).arrays
    down0 = rule.downlink(1, "0", arrays)
    down1 = rule.downlink(1, "1", arrays)
    held = lambda rec: sorted({int(k.split(".")[2]) for k in rec if k.startswith("head.")})  # noqa: E731
    assert held(down0) == [0, 1] and held(down1) == [1, 2]
    assert held(rule.downlink(1, None, arrays)) == list(range(10))  # not seen yet: all


def test_min_norm_two_gradients_closed_form():
    g1, g2 = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    gram = np.array([[g1 @ g1, g1 @ g2], [g2 @ g1, g2 @ g2]])
    w = min_norm_weights(gram)
    expected = (g2 @ g2 - g1 @ g2) / ((g1 - g2) @ (g1 - g2))
    assert w[0] == pytest.approx(expected) and w.sum() == pytest.approx(1)
    # one gradient inside the other's direction: all weight on the shorter one
    w = min_norm_weights(np.array([[1.0, 2.0], [2.0, 4.0]]))
    assert w.tolist() == pytest.approx([1.0, 0.0])


def _brute_force_min_norm(grads: np.ndarray, steps: int = 60) -> float:
    best = np.inf
    for a, b in itertools.product(np.linspace(0, 1, steps + 1), repeat=2):
        if a + b <= 1:
            w = np.array([a, b, 1 - a - b])
            best = min(best, float(np.linalg.norm(w @ grads)))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_norm_several_gradients_reaches_the_convex_hull_minimum(seed):
    grads = np.random.default_rng(seed).normal(size=(3, 5))
    w = min_norm_weights(grads @ grads.T)
    assert (w >= 0).all() and w.sum() == pytest.approx(1)
    assert np.linalg.norm(w @ grads) <= _brute_force_min_norm(grads) + 1e-6


def test_mgda_weights_from_representation_gradients():
    torch.manual_seed(0)
    z = torch.randn(8, 4, requires_grad=True)
    head = BranchHead(4, task_groups(3, 0))
    losses = head.task_losses(z, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    w = mgda_ub_weights(losses, z)
    assert w.shape == (3,) and torch.all(w >= 0) and float(w.sum()) == pytest.approx(1)
    # the batched backward gives the same weights as one backward per task
    grads = torch.stack([torch.autograd.grad(loss, z, retain_graph=True)[0].flatten()
                         for loss in losses])
    grads = grads / (losses.detach() * grads.norm(dim=1)).unsqueeze(1)
    expected = min_norm_weights((grads @ grads.T).double().numpy())
    np.testing.assert_allclose(w.numpy(), expected, atol=1e-5)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One batch holding three of the ten classes, mostly class 0: the task losses differ
    widely, so MGDA-UB's weights are far from uniform."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16, 1, 8, 8, generator=generator)
    return x, torch.tensor([0] * 10 + [1] * 4 + [7] * 2)


def _step(mgda: bool, objective, tasks: int = 0) -> dict[str, torch.Tensor]:
    """The model after one SGD step from the same start on ``_batch`` with the loss
    ``objective(model, x, y)``, or with ``train_pfedc`` when ``objective`` is None."""
    settings = load_settings(app_config(method="pfedc", **{"pfedc.mgda": mgda,
                                                            "pfedc.tasks": tasks,
                                                            "local-epochs": 1}))
    model = build_model(settings)
    x, y = _batch()
    if objective is None:
        train_pfedc(LocalTraining(model, [(x, y)], settings, torch.device("cpu"), 1))
    else:
        model.train()
        optimizer = sgd(model.parameters(), settings)
        objective(model, x, y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _weighted_task_losses(model, x, y) -> torch.Tensor:
    z = model.features(x)
    losses = model.head.task_losses(z, y)
    return mgda_ub_weights(losses, z) @ losses


def _mean_task_loss(model, x, y) -> torch.Tensor:
    return model.head.task_losses(model.features(x), y).mean()


def _c_way_cross_entropy(model, x, y) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.mark.parametrize("mgda", [True, False])
@pytest.mark.parametrize("tasks", [0, 2])
def test_local_rule_descends_the_weighted_sum_of_the_task_losses(mgda, tasks):
    """One step of pFedC's local rule is one step on ``sum_t lambda_t L_t``: MGDA-UB's
    weights when ``pfedc.mgda`` is on (not merely computed), ``1/T`` when off; never the
    plain C-way cross-entropy of the combined scores. With two tasks as well (the smallest
    ``T`` where MGDA weighs anything: its closed form)."""
    trained = _step(mgda, None, tasks)
    expected = _step(mgda, _weighted_task_losses if mgda else _mean_task_loss, tasks)
    assert _same(trained, expected)
    # the three objectives move the model apart, so the check above tells them apart
    other = _step(mgda, _mean_task_loss if mgda else _weighted_task_losses, tasks)
    assert not _same(trained, other)
    assert not _same(trained, _step(mgda, _c_way_cross_entropy, tasks))
    model = build_model(load_settings(app_config(method="pfedc", **{"pfedc.tasks": tasks})))
    x, y = _batch()
    z = model.features(x)
    weights = mgda_ub_weights(model.head.task_losses(z, y), z)
    # far from 1/T each (two tasks on this batch: 0.48 / 0.52, still apart at rtol 1e-5)
    assert float(weights.max() / weights.min()) > (2 if tasks == 0 else 1.05)


def test_the_shared_extractor_is_averaged_by_examples_eq6():
    """``phi <- sum_i (D_i / D) phi_i``: a client with three times the examples weighs three
    times as much."""
    rule = _rule()
    arrays = initial_state(rule.settings).arrays
    replies = []
    for pid, (value, examples) in enumerate(((1.0, 10), (5.0, 30))):
        client = _client(pid)
        sent = client.shared_arrays(client.model(arrays), arrays)
        phi = {k: Array(np.full_like(sent[k].numpy(), value)) for k in rule.wire.phi_keys}
        branches = {k: sent[k] for k in sent if k not in phi}
        replies.append(ClientReply(pid, client.client_id, ArrayRecord({**phi, **branches}),
                                   MetricRecord({"num-examples": examples}), client.identity()))
    merged = rule.merge_updates(1, replies, arrays)
    for key in rule.wire.phi_keys:
        np.testing.assert_allclose(merged[key].numpy(), (1.0 * 10 + 5.0 * 30) / 40, rtol=1e-6)


def _client(pid: int, **overrides) -> Client:
    return Client.from_context(Context(
        run_id=1, node_id=pid, node_config={"partition-id": pid, "num-partitions": 4},
        state=RecordDict(), run_config=app_config(**{"method": "pfedc", **overrides})))


def test_client_sends_only_branches_it_holds():
    client = _client(0, partitioner="pathological", **{"classes-per-client": 2})
    model = client.model(initial_state(client.settings).arrays)
    sent = client.shared_arrays(model, ArrayRecord())
    branches = sorted({int(k.split(".")[2]) for k in sent if k.startswith("head.")})
    assert branches == sorted(np.unique(client.data().y_train).tolist())
    assert all(k.startswith("body.") for k in sent if not k.startswith("head."))


def test_one_task_is_fedavg_with_one_shared_head():
    fedavg, pfedc = _client(1, method="fedavg"), _client(1, **{"pfedc.tasks": 1})
    results = []
    for client in (fedavg, pfedc):
        model = client.model(initial_state(client.settings).arrays)
        torch.manual_seed(3)
        client.method.local_train(LocalTraining(model, client.loader(True, 1),
                                                client.settings, client.device, 1))
        results.append(client.shared_arrays(model, ArrayRecord()))
    renamed = {k.replace("head.branches.0.", "head."): v for k, v in results[1].items()}
    assert set(renamed) == set(results[0])
    for key, value in renamed.items():
        np.testing.assert_allclose(value.numpy(), results[0][key].numpy(), rtol=1e-5,
                                   atol=1e-6)
    # counts as task weights (pfedc.weighting = "counts"): the head's mean is FedAvg's
    rule = _rule(**{"pfedc.tasks": 1, "pfedc.weighting": "counts"})
    rule.task_weights = {"0": [10.0], "1": [30.0]}
    rule.branches = {c: {"head.branches.0.bias": np.full(10, v, np.float32)}
                     for c, v in (("0", 1.0), ("1", 2.0))}
    averaged = masked_branch_average(rule.branches, rule.task_weights,
                                     {0: ["head.branches.0.bias"]})
    assert averaged["head.branches.0.bias"] == pytest.approx(np.full(10, 1.75))  # FedAvg mean
    assert Array(averaged["head.branches.0.bias"]).dtype == "float32"


def _branch_keys(keys, held: bool, weights: list[float]) -> list[str]:
    return [k for k in keys if (t := branch_of_key(k)) is not None and (weights[t] > 0) == held]


def test_rounds_average_held_branches_uniformly_and_never_touch_unheld_ones():
    """Three rounds through the client runtime and the rule (round 2 without client 3):
    every client's branch of a task it does not hold is exactly what its own training left,
    round after round (never sent, never received); every held branch the server sends is the
    plain mean of its holders' latest uploads (eq. 7), not the count-weighted one."""
    clients = [_client(pid, partitioner="dirichlet", **{"dirichlet-alpha": 0.1,
                                                         "local-epochs": 1})
               for pid in range(4)]
    settings = clients[0].settings
    assert settings.method_settings.weighting == "uniform"  # the default
    arrays = initial_state(settings).arrays
    rule = RoundEngine(settings, wire_spec(settings), PFedCRule).rule
    presence = {c.client_id: c.identity()["pfedc.task-weights"] for c in clients}
    assert sum(0.0 in w for w in presence.values()) >= 3  # most clients lack some class
    left_by_training: dict[str, dict[str, torch.Tensor]] = {}
    latest: dict[str, dict[str, np.ndarray]] = {}
    for server_round, present in ((1, clients), (2, clients[:3]), (3, clients)):
        replies = []
        for client in present:
            cid = client.client_id
            down = rule.downlink(server_round, cid, arrays)
            assert not _branch_keys(down, False, presence[cid]) or server_round == 1
            model = client.model(down)
            state = model.state_dict()
            for key, value in left_by_training.get(cid, {}).items():
                torch.testing.assert_close(state[key], value, rtol=0, atol=0)
            for key in _branch_keys(down, True, presence[cid]) if server_round > 1 else []:
                np.testing.assert_array_equal(state[key].numpy(), arrays[key].numpy())
            torch.manual_seed(server_round)
            client.method.local_train(LocalTraining(model, client.loader(True, server_round),
                                                    settings, client.device, server_round))
            identity = client.identity()
            sent = client.shared_arrays(model, down, identity)
            assert not _branch_keys(sent, False, presence[cid])
            client.keep_personal(model, down, sent)
            left_by_training[cid] = {k: v.clone() for k, v in model.state_dict().items()
                                     if k in _branch_keys(state, False, presence[cid])}
            latest[cid] = {k: v.numpy() for k, v in sent.items()}
            replies.append(ClientReply(client.partition_id, cid, sent, MetricRecord(
                {"num-examples": len(client.data().y_train)}), identity))
        arrays = rule.merge_updates(server_round, replies, arrays)
        for task, keys in rule.keys_of_task.items():
            holders = [c for c, w in presence.items() if w[task] > 0]
            for key in keys:
                if not holders:
                    continue
                mean = np.mean([latest[c][key] for c in holders], axis=0)
                np.testing.assert_allclose(arrays[key].numpy(), mean, rtol=1e-5, atol=1e-6)
    counts = {c.client_id: np.bincount(c.data().y_train, minlength=10) for c in clients}
    weighted = masked_branch_average(latest, {c: n.astype(float).tolist()
                                              for c, n in counts.items()},
                                     rule.keys_of_task)
    assert any(not np.allclose(weighted[k], arrays[k].numpy(), atol=1e-4) for k in weighted)


@pytest.mark.integration
def test_real_round_sends_different_downlinks_to_different_label_sets(federation, tmp_path):
    run = federation.run(ROOT, {"method": "pfedc", "partitioner": "pathological",
                                "classes-per-client": 2, "num-server-rounds": 2,
                                "local-epochs": 1, "output-dir": str(tmp_path),
                                "plot": False}, num_supernodes=4)
    assert run.ok, run.output[-3000:]
    results = read_results(tmp_path)
    rounds = results["rounds"]
    assert all("dropped" not in r for r in rounds)
    weights = results["server_state"]["pfedc"]["task_weights"]
    held = {cid: [t for t, w in enumerate(ws) if w > 0] for cid, ws in weights.items()}
    assert held == {"0": [0, 1], "1": [1, 2], "2": [2, 3], "3": [3, 4]}
    # round 2's train downlink: phi + the two held branches per client, fewer bytes than all
    assert rounds[1]["bytes_down_train"] < rounds[0]["bytes_down_train"]
    assert rounds[1]["bytes_up"] == rounds[1]["bytes_down_train"]


def test_personal_branches_ablation_sends_each_client_its_own_branches_back():
    """``pfedc.branches = "personal"``: phi is still averaged (eq. 6), no branch is (eq. 7
    off): a class both clients hold comes back to each as it sent it."""
    personal = {"pfedc.branches": "personal"}
    rule = _rule(**personal)
    arrays = initial_state(rule.settings).arrays
    replies, sent_by = [], {}
    for pid, value in ((0, 1.0), (1, 5.0)):
        client = _client(pid, **personal)
        sent = client.shared_arrays(client.model(arrays), arrays)
        filled = ArrayRecord({k: Array(np.full_like(sent[k].numpy(), value)) for k in sent})
        sent_by[client.client_id] = filled
        replies.append(ClientReply(pid, client.client_id, filled,
                                   MetricRecord({"num-examples": 10}), client.identity()))
    shared_branches = set.intersection(*({k for k in s if k not in rule.wire.phi_keys}
                                         for s in sent_by.values()))
    assert shared_branches  # a class both hold: averaged, it would come back as 3.0
    merged = rule.merge_updates(1, replies, arrays)
    for key in shared_branches:  # what a client not seen yet receives: the initial branch
        np.testing.assert_array_equal(merged[key].numpy(), arrays[key].numpy())
    for cid, sent in sent_by.items():
        down = rule.downlink(2, cid, merged)
        for key in rule.wire.phi_keys:
            np.testing.assert_allclose(down[key].numpy(), 3.0, rtol=1e-6)
        for key in shared_branches:
            np.testing.assert_array_equal(down[key].numpy(), sent[key].numpy())
