"""Models memopt cannot plan yet are told so in one line that names the cause and what would work, never a
misleading "the model's step fails" or a traceback from the tracker: sparse gradients, sparse batch tensors, and a
batch whose first dimension is not samples (a whole graph)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memopt
from memopt.profile.profile import VariantFailed


class SparseEmbeddings(nn.Module):
    """A recommender's bag of ids: nn.Embedding(sparse=True) gives a sparse gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 16, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).mean(1)).squeeze(-1)


class GraphConv(nn.Module):
    """Full-graph training: the batch is every node's features, the adjacency and every node's label."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.out(adj @ F.relu(self.inp(x)))


def _graph(adj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = adj.shape[0]
    return torch.randn(n, 8), adj, torch.randint(0, 3, (n,))


def _graph_loss(out, batch):
    return F.cross_entropy(out, batch[2])


def test_sparse_gradients_are_named_with_the_module():
    batch = (torch.randint(0, 1000, (8, 5)), torch.randn(8))
    with pytest.raises(ValueError) as err:
        memopt.plan(SparseEmbeddings(), batch, budget="8GB", hardware="h200", use_cache=False,
                    loss_fn=lambda out, b: F.mse_loss(out, b[1]), optimizer="sgd")
    message = str(err.value)
    assert not isinstance(err.value, VariantFailed)
    assert "sparse_coo" in message and " in emb " in message and "sparse=False" in message


@pytest.mark.parametrize("entry", ["plan", "wrap"])
def test_a_sparse_batch_tensor_is_refused_by_its_path(entry):
    batch = _graph(torch.eye(10).to_sparse())
    with pytest.raises(ValueError, match=r"the batch's \[1\] is a sparse_coo tensor.*\.to_dense\(\)"):
        if entry == "plan":
            memopt.plan(GraphConv(), batch, budget="8GB", hardware="h200", use_cache=False, loss_fn=_graph_loss)
        else:
            memopt.wrap(GraphConv(), budget="8GB", sample=batch, hardware="h200", device="cpu", use_cache=False,
                        loss_fn=_graph_loss, guard=False)


def test_a_whole_graph_batch_says_its_first_dimension_is_not_samples():
    adj = torch.eye(10) + torch.diag(torch.ones(9), 1)
    batch = _graph(adj)
    _graph_loss(GraphConv()(batch[0], batch[1]), batch).backward()  # the model itself trains on the whole batch
    with pytest.raises(ValueError) as err:
        memopt.plan(GraphConv(), batch, budget="8GB", hardware="h200", use_cache=False, loss_fn=_graph_loss)
    message = str(err.value)
    assert "GraphConv trains on the whole batch of 10 but not on one sample of it" in message
    assert "first dimension is independent samples" in message


class Broken(nn.Module):
    """Fails at any batch size: its own error stands."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x.reshape(x.shape[0], 4, 2))


def test_a_model_that_fails_at_every_size_keeps_its_own_error():
    with pytest.raises(VariantFailed, match="the model's step fails as fp32"):
        memopt.plan(Broken(), (torch.randn(6, 8), torch.randn(6)), budget="8GB", hardware="h200", use_cache=False,
                    loss_fn=lambda out, b: out.sum())


def test_integer_inputs_into_a_float_layer_fail_the_plan_as_eager_would():
    """Token ids fed to an nn.Linear: eager refuses the matmul, the fake trace's meta function did not, so the plan
    said it fit and the first real step raised. The plan fails now, naming the dtypes; float inputs still plan."""
    model = nn.Sequential(nn.Linear(8, 4))
    loss = lambda out, b: F.cross_entropy(out, b[1])  # noqa: E731
    with pytest.raises(VariantFailed, match=r"same dtype, but got torch.int64 and torch.float32"):
        memopt.plan(model, (torch.randint(0, 5, (4, 8)), torch.randint(0, 4, (4,))), budget="4GB",
                    hardware="h100_80gb", loss_fn=loss, use_cache=False)
    with pytest.raises(RuntimeError, match="same dtype"):  # eager says the same
        model(torch.randint(0, 5, (4, 8)))
    assert memopt.plan(model, (torch.randn(4, 8), torch.randint(0, 4, (4,))), budget="4GB", hardware="h100_80gb",
                       loss_fn=loss, use_cache=False).fits
