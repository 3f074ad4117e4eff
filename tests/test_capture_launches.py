"""The norm and book-keeping stages in few operations (on a GPU each aten operation is a kernel launch, and the
private step is host-bound): captures of one kind are normed and summed together, one-hot captures are merged
without host synchronisations, and every value is the per-capture value, never below the true norm."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpopt.grad import PerExampleEngine, captures
from dpopt.grad.captures import Combination, ConvOuter, Dense, Outer, coalesce, dense_sums, sq_norms_of
from helpers import Zoo, zoo_batch, zoo_loss
from test_host_syncs import counting_syncs


class Ops(TorchDispatchMode):
    """Counts the aten operations run inside it that compute (views launch nothing), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def exact(c) -> torch.Tensor:
    return c.materialize().double().flatten(1).square().sum(1)


def mixed(dtype: torch.dtype, b: int = 6) -> list:
    """Captures of every kind the norm stage batches: ghost-normed ``Outer`` ones of two step counts, one-hot
    ones, dense ones of two sizes (one of them in two shapes), a materialised ``Outer``, a convolution's and a
    ``Combination``."""
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    caps = [Outer(r(b, 5, 7), r(b, 5, 9), 7, (7, 9)) for _ in range(3)]
    caps += [Outer(r(b, 2, 4), r(b, 2, 3), 4, (4, 3)) for _ in range(2)]
    caps += [Outer(torch.randint(0, 6, (b, 5), generator=gen), r(b, 5, 3), 6, (6, 3))]
    caps += [Dense(r(b, 7), (7,)) for _ in range(3)] + [Dense(r(b, 2, 3), (2, 3)), Dense(r(b, 6), (6,))]
    caps += [Outer(r(b, 40, 3), r(b, 40, 2), 3, (3, 2))]
    assert captures.by_materializing(caps[-1])
    caps += [ConvOuter(r(b, 2, 5, 5), r(b, 3, 4, 4), (2, 2), (1, 1), (1, 1), (0, 0), 1, (3, 2, 2, 2))]
    return caps + [Combination([(0.86, Outer(r(b, 5, 7), r(b, 5, 9), 7, (7, 9))), (0.14, caps[0])])]


@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_batched_norms_are_each_captures_norm(dtype, tolerance, budget, monkeypatch):
    """In runs of one batched operation (the default budget) or a chunk of examples per capture (64 elements),
    every squared norm is the materialised one."""
    if budget:
        monkeypatch.setattr(captures, "chunk_elements", lambda device: budget)
    caps = mixed(dtype)
    for c, sq in zip(caps, sq_norms_of(caps)):
        want = exact(c)
        assert sq.shape == want.shape
        assert float(((sq.double() - want).abs() / want).max()) <= tolerance, type(c).__name__


def test_norm_operations_do_not_grow_with_the_captures_but_for_the_gram_products():
    """N Linear-shaped captures of equal steps and N biases: two Gram products per capture, every other
    operation once for all of them, and no concatenation for a single chunk."""

    def ops(n: int) -> Counter:
        caps = [Outer(torch.randn(4, 8, 16), torch.randn(4, 8, 12), 16, (16, 12)) for _ in range(n)]
        caps += [Dense(torch.randn(4, 16), (16,)) for _ in range(n)]
        with Ops() as counter:
            sq_norms_of(caps)
        return counter.counts

    few, many = ops(2), ops(8)
    assert few.pop("bmm") == 4 and many.pop("bmm") == 16
    assert few == many and "cat" not in many, (few, many)


def test_a_cancelling_capture_in_a_run_is_recomputed_alone_with_one_synchronisation():
    """Steps that cancel (l, r then about l, -r) in one capture of a run: its examples are recomputed from their
    materialised gradients, exactly; the others keep their ghost norms; one host synchronisation in all."""
    torch.manual_seed(0)
    left, right = torch.randn(64, 1, 32), torch.randn(64, 1, 48)
    cancelling = Outer(torch.cat([left, left * (1 + 1e-4), left], 1), torch.cat([right, -right, right * 0], 1), 32,
                       (32, 48))
    caps = [Outer(torch.randn(64, 3, 32), torch.randn(64, 3, 48), 32, (32, 48)), cancelling,
            Outer(torch.randn(64, 3, 32), torch.randn(64, 3, 48), 32, (32, 48))]
    with counting_syncs() as syncs:
        norms = sq_norms_of(caps)
    assert sum(syncs.values()) == 1
    _, cancelled = captures._ghost_sq_norms(caps)
    assert cancelled[1].all() and not cancelled[0].any() and not cancelled[2].any()
    for c, sq in zip(caps, norms):
        assert torch.allclose(sq.double(), exact(c), rtol=1e-6, atol=0)


def test_dense_sums_are_each_captures_weighted_sum_in_one_product_per_size():
    torch.manual_seed(0)
    caps = [Dense(torch.randn(7, 5, dtype=torch.float64), (5,)) for _ in range(3)]
    caps += [Dense(torch.randn(7, 2, 3, dtype=torch.float64), (2, 3)), Dense(torch.randn(7, 4, dtype=torch.float64),
                                                                              (4,))]
    weights = torch.rand(7, len(caps), dtype=torch.float64)
    caps[0].g[2] = float("nan")  # weight 0 below: contributes nothing
    weights[2] = 0.0
    keep = torch.tensor([0, 1, 3, 4, 5, 6])
    with Ops() as counter, counting_syncs() as syncs:
        sums = dense_sums(caps, [weights[:, k] for k in range(len(caps))])
    assert counter.counts["bmm"] == 3 and not syncs  # sizes 5, 6 and 4
    for c, w, got in zip(caps, weights.T, sums):
        want = torch.einsum("b,b...->...", w[keep], c.g[keep])
        assert got.shape == c.shape and torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.allclose(dense_sums(caps[1:2], [weights[:, 1]])[0], caps[1].weighted_sum(weights[:, 1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_linear_sums_are_each_captures_weighted_sum_in_one_product_per_run(dtype):
    """Linear-shaped captures of equal factor shapes summed in one batched product per run (``outer_runs``: runs in
    the order of their first capture, cut by the budget), each sum the capture's own; an example of weight 0 with
    non-finite factors contributes nothing, without a host synchronisation."""
    torch.manual_seed(0)
    factors = [(torch.randn(6, 3, 5, dtype=dtype), torch.randn(6, 3, 4, dtype=dtype)) for _ in range(3)]
    factors.insert(1, (torch.randn(6, 3, 4, dtype=dtype), torch.randn(6, 3, 5, dtype=dtype)))  # another shape between
    factors.append((torch.randn(6, 3, 4, dtype=dtype), torch.randn(6, 3, 5, dtype=dtype)))
    factors[0][0][4, 1, 2] = float("nan")
    factors[3][1][4, 0, 0] = float("inf")
    caps = [Outer(left, right, left.shape[-1], (left.shape[-1], right.shape[-1])) for left, right in factors]
    weights = [torch.rand(6, dtype=torch.float64).index_fill_(0, torch.tensor([4]), 0.0) for _ in caps]
    assert captures.outer_runs(caps) == [[0, 2, 3], [1, 4]]
    keep = torch.tensor([0, 1, 2, 3, 5])
    with Ops() as counter, counting_syncs() as syncs:
        sums = [s for run in captures.outer_runs(caps)
                for s in captures.outer_sums([caps[k] for k in run], [weights[k] for k in run])]
    assert counter.counts["bmm"] == 2 and not syncs
    for c, w, got in zip([caps[k] for k in (0, 2, 3, 1, 4)], [weights[k] for k in (0, 2, 3, 1, 4)], sums):
        want = torch.einsum("b,bti,btj->ij", w[keep], c.left[keep].double(), c.right[keep].double())
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5
        assert got.shape == c.shape and torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance)
    budget = 6 * 3 * 9 + 20  # one capture's factors and sum: runs of one
    with pytest.MonkeyPatch.context() as m:
        m.setattr(captures, "chunk_elements", lambda device: budget)
        assert captures.outer_runs(caps) == [[0], [1], [2], [3], [4]]


def test_one_hot_captures_merge_with_static_shapes_and_no_host_synchronisation():
    """The merged capture has the terms' steps (merged rows first, then zero padding), its rows distinct within
    each example, its gradients, norms and sums those of the combination."""
    torch.manual_seed(0)
    one = Outer(torch.randint(0, 5, (3, 6)), torch.randn(3, 6, 4, dtype=torch.float64), 5, (5, 4))
    two = Outer(torch.randint(0, 5, (3, 4)), torch.randn(3, 4, 4, dtype=torch.float64), 5, (5, 4))
    with counting_syncs() as syncs:
        merged = coalesce([(43.0, one), (-42.0, two)])
    assert sum(syncs.values()) == 0 and merged.left.shape == (3, 10) and merged.right.shape == (3, 10, 4)
    combination = 43.0 * one.materialize() - 42.0 * two.materialize()
    assert torch.allclose(merged.materialize(), combination, rtol=0, atol=1e-12)
    for i in range(3):
        real = merged.left[i][merged.right[i].abs().sum(1) > 0]
        assert real.unique().numel() == real.numel()
    want = combination.flatten(1).square().sum(1)
    assert torch.allclose(sq_norms_of([merged])[0], want, rtol=1e-12, atol=0)
    w = torch.rand(3, dtype=torch.float64)
    assert torch.allclose(merged.weighted_sum(w), torch.einsum("b,bij->ij", w, combination), rtol=1e-12, atol=0)


def widened(c):
    """The capture of the same per-example gradients held in float32."""
    if isinstance(c, Combination):
        return Combination([(k, widened(t)) for k, t in c.terms])
    if isinstance(c, ConvOuter):
        return ConvOuter(c.x.float(), c.g.float(), c.kernel, c.stride, c.dilation, c.padding, c.groups, c.shape)
    if isinstance(c, Outer):
        return Outer(c.left if c.indexed else c.left.float(), c.right.float(), c.rows, c.shape)
    return Dense(c.g.float(), c.shape)


def test_low_precision_captures_are_normed_and_summed_as_their_float32_values():
    """bf16 captures give the float32 computation on their exact float32 values (casts fused or done once). Those
    normed from materialised gradients too: rounded to bf16 these could be normed up to 2^-9 below the gradients
    that the book-keeping sum adds up, and an example's clipped share would exceed the bound."""
    caps = mixed(torch.bfloat16)
    wide = [widened(c) for c in caps]
    for a, b in zip(sq_norms_of(caps), sq_norms_of(wide)):
        assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-6, atol=0)
    w = torch.rand(6)
    for a, b in zip(caps[:-1], wide[:-1]):
        assert torch.allclose(a.weighted_sum(w), b.weighted_sum(w), rtol=1e-6, atol=1e-7)


class Tied(nn.Module):
    """An embedding table used twice (merged by ``coalesce``) and as the output layer, with a padding row."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, padding_idx=1)
        self.lin = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)

    def forward(self, tokens):
        h = self.emb(tokens) + self.emb(tokens.flip(1) % 7)
        return (self.ln(torch.tanh(self.lin(h))) @ self.emb.weight.T).mean(1)


def tied_case():
    torch.manual_seed(1)
    tokens = torch.randint(0, 30, (5, 7))
    tokens[0, :3] = 1
    return Tied(), (tokens, torch.randint(0, 30, (5,))), lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")


def bert_case():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(2)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 50, (4, 9))
    ids[1, 2:5] = 7  # a token repeated within an example

    def loss(m, b):
        return F.cross_entropy(m(input_ids=b[0]).logits, b[1], reduction="none")

    return transformers.BertForSequenceClassification(config), (ids, torch.randint(0, 3, (4,))), loss


@pytest.mark.parametrize("case", [lambda: (Zoo(), zoo_batch(6), zoo_loss), tied_case, bert_case],
                         ids=["zoo", "tied", "bert"])
def test_model_norms_and_sums_are_the_per_example_gradients(case):
    """float64 models, one point and a two-point statistic: the squared norms and weighted sums from the
    batched stages equal those of the materialised per-example gradients to 1e-9."""
    model, batch, loss = case()
    model = model.double()
    batch = tuple(b.double() if b.is_floating_point() else b for b in batch)
    engine = PerExampleEngine(model, loss)
    near = [p.detach() + 1e-2 * torch.randn_like(p) for p in engine.params]
    for stat in (engine.gradients(batch), 43.0 * engine.gradients(batch, at=near) - 42.0 * engine.gradients(batch)):
        grads = stat.materialize()
        want = torch.stack([g.flatten(1).square().sum(1) for g in grads], 1)
        assert torch.allclose(stat.sq_norms(), want, rtol=1e-9, atol=1e-300)
        w = torch.rand(len(batch[-1]), dtype=torch.float64)
        for got, g in zip(stat.weighted_sum(w), grads):
            assert torch.allclose(got, torch.tensordot(w, g, dims=1), rtol=1e-9, atol=1e-12)



def test_a_tied_table_is_normed_and_summed_without_its_per_example_gradients(monkeypatch):
    """An embedding table that is also the output layer (GPT-2's and OPT's tied ``wte``/``lm_head``): its squared
    norms (the two uses' Gram products and their cross term) and its weighted sum come from the captured factors;
    no [B, vocabulary, width] per-example gradient is built."""
    model, batch, loss = tied_case()
    engine = PerExampleEngine(model, loss)
    tied = next(j for j, p in enumerate(engine.params) if p is model.emb.weight)
    stat = engine.gradients(batch)
    assert len(stat.terms[tied]) > 1  # the lookups and the output layer: one parameter of several terms
    want_sq = stat.materialize()[tied].flatten(1).square().sum(1)
    w = torch.rand(len(batch[-1]))
    want_sum = torch.tensordot(w, stat.materialize()[tied], dims=1)

    def refuse(self, s=slice(None)):
        raise AssertionError("a per-example gradient was materialised")

    monkeypatch.setattr(Outer, "materialize", refuse)
    monkeypatch.setattr(Outer, "flat", refuse)
    assert torch.allclose(stat.sq_norms()[:, tied], want_sq, rtol=1e-4)
    assert torch.allclose(stat.weighted_sum(w)[tied], want_sum, rtol=1e-4, atol=1e-6)

def test_a_bert_shaped_norm_stage_grows_by_gram_products_alone_with_depth():
    """From 2 to 4 BERT layers the norm stage's operations grow by the two Gram products of each Linear weight
    (6 a layer), nothing else: biases and norm layers are normed together, whatever their count."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def ops(layers: int) -> Counter:
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                                         num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                                         num_labels=3)
        model = transformers.BertForSequenceClassification(config)
        engine = PerExampleEngine(model, bert_case()[2], strategy="ghost")
        stat = engine.gradients((torch.randint(0, 50, (4, 9)), torch.randint(0, 3, (4,))))
        stat._settle()
        with Ops() as counter:
            sq_norms_of([t for ts in stat.terms for _, t in ts])
        return counter.counts

    shallow, deep = ops(2), ops(4)
    assert deep.pop("bmm") - shallow.pop("bmm") == 2 * 6 * 2
    assert deep == shallow, (shallow, deep)
