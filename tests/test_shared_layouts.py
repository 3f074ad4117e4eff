"""The layouts people write that hooks cannot attribute to examples (a position table shared by the batch, weight
tying by hand, sequence-first layers, one row of a shared buffer) are computed exactly: torch.func over the
smallest batch-first module around them, chosen at verification with one log line. Each is checked against one
backward per example in float64; a tiny nanoGPT trains through make_private and PrivateTrainer; what no
batch-first module can hold is refused, saying what to change."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt.algorithms import Privatizer
from dpopt.algorithms.base import PrivateStep
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.grad import ExampleMixingError, PerExampleEngine
from dpopt.loop import make_private
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger

D, V = 4, 7


class Positions(nn.Module):
    """nanoGPT: a position table looked up with torch.arange(T), shared by the batch."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(V, D), nn.Embedding(t, D), nn.Linear(D, 2)

    def forward(self, ids):
        return self.head(torch.tanh(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))).mean(1)


class SequenceFirst(nn.Module):
    """``layer`` on [T, B, d]; ``rows``: a Linear on [T*B, d] rows in sequence-major order instead."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.layer = layer
        self.seq = {"linear": nn.Linear(D, D), "rows": nn.Linear(D, D), "attention": nn.MultiheadAttention(D, 2),
                    "lstm": nn.LSTM(D, D)}[layer]
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = x.transpose(0, 1)
        if self.layer == "rows":
            h = self.seq(h.reshape(-1, D)).reshape(h.shape)
        elif self.layer == "attention":
            h = self.seq(h, h, h)[0]
        else:
            h = self.seq(h)[0] if self.layer == "lstm" else self.seq(h)
        return self.head(torch.tanh(h).mean(0))


class SharedBuffer(nn.Module):
    """A Linear fed a [1, T, d] buffer, of whose output [0] is added to every example."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.pos, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.register_buffer("table", torch.randn(1, t, D))

    def forward(self, x):
        return self.head(torch.tanh(x + self.pos(self.table)[0])).mean(1)


class HandTied(nn.Module):
    """Weight tying written by hand: the embedding table used through F.linear by a parameterless parent."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, ids):
        return F.linear(torch.tanh(self.lin(self.emb(ids))), self.emb.weight).mean(1)[:, :2]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT in miniature: wpe(torch.arange(T)) shared by the batch, causal scaled_dot_product_attention, and the
    head tied to the token embedding as nanoGPT does it (``registered``) or by hand (F.linear)."""

    def __init__(self, vocab: int = 11, block: int = 5, d: int = 8, heads: int = 2, layers: int = 1,
                 tie: str = "registered") -> None:
        super().__init__()
        self.tie = tie
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
                                              h=nn.ModuleList(Block(d, heads) for _ in range(layers)),
                                              ln_f=nn.LayerNorm(d)))
        if tie == "registered":
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, input_ids):
        t = input_ids.size(1)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(torch.arange(0, t, device=input_ids.device))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x) if self.tie == "registered" else F.linear(x, self.transformer.wte.weight)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token cross-entropy."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def mlp_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def data(model: nn.Module, n: int, t: int):
    if isinstance(model, GPT):
        return torch.randint(0, 11, (n, t + 1))
    x = torch.randint(0, V, (n, t)) if isinstance(model, (Positions, HandTied)) else torch.randn(n, t, D)
    return x, torch.randint(0, 2, (n,))


# name -> (model, T, the parameters routed to the root); T a multiple of 3 makes the hooks regroup rows silently
# (found by the single-example check), T not a multiple of 3 is found by the probe forward
LAYOUTS = {
    "wpe(arange(T)), T = 6": (lambda: Positions(6), 6, {"wpe.weight"}),
    "wpe(arange(T)), T = 5": (lambda: Positions(5), 5, {"wpe.weight"}),
    "Linear on [T, B, d]": (lambda: SequenceFirst("linear"), 6, {"seq.weight", "seq.bias"}),
    "Linear on [T*B, d] rows": (lambda: SequenceFirst("rows"), 6, {"seq.weight", "seq.bias"}),
    "MultiheadAttention on [T, B, d]": (lambda: SequenceFirst("attention"), 6, None),
    "MultiheadAttention on [T, B, d], T = B": (lambda: SequenceFirst("attention"), 3, None),
    "LSTM on [T, B, d]": (lambda: SequenceFirst("lstm"), 5, None),
    "LSTM on [T, B, d], T = B": (lambda: SequenceFirst("lstm"), 3, None),
    "[1, T, d] buffer, output[0]": (lambda: SharedBuffer(6), 6, {"pos.weight", "pos.bias"}),
    "F.linear(h, self.emb.weight)": (lambda: HandTied(6), 6, {"emb.weight"}),
    "nanoGPT": (lambda: GPT(), 5, {"transformer.wpe.weight"}),
    "nanoGPT tied by hand": (lambda: GPT(tie="by hand"), 5, {"transformer.wte.weight", "transformer.wpe.weight"}),
}


def one_backward_per_example(model: nn.Module, loss_fn, batch, n: int) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    pick = (lambda k: batch[k:k + 1]) if isinstance(batch, torch.Tensor) else \
        (lambda k: tuple(t[k:k + 1] for t in batch))
    rows = [torch.autograd.grad(loss_fn(model, pick(k)).sum(), params) for k in range(n)]
    return [torch.stack(g) for g in zip(*rows)]


@pytest.fixture
def float64():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_hooks_cannot_attribute_is_routed_to_torch_func_and_exact(layout, float64, caplog):
    build, t, routed = LAYOUTS[layout]
    model = build()
    loss_fn = lm_loss if isinstance(model, GPT) else mlp_loss
    batch = data(model, 5, t)
    engine = PerExampleEngine(model, loss_fn)
    with caplog.at_level(logging.INFO, logger="dpopt"):
        engine.verify(batch)
    lines = [r.getMessage() for r in caplog.records if "hooks cannot attribute" in r.getMessage()]
    assert len(lines) == 1 and "over '<root>'" in lines[0] and "values per example" in lines[0]
    expected = routed or {n for n in engine.names if n.startswith("seq.")}
    assert list(engine.routes) == [""] and {engine.names[i] for i in engine.routes[""]} == expected
    ref = one_backward_per_example(model, loss_fn, batch, 5)
    for name, got, want in zip(engine.names, engine.gradients(batch).materialize(), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    recording = engine.record(5)  # the plain loop's path: the caller's own backward of the mean loss
    loss_fn(model, batch).mean().backward()
    recording.remove()
    for name, got, want in zip(engine.names, recording.gradients(None).materialize(), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("layout", ["wpe(arange(T)), T = 6", "F.linear(h, self.emb.weight)", "nanoGPT"])
def test_a_routed_layout_clips_and_sums_as_one_backward_per_example(layout, float64):
    build, t, _ = LAYOUTS[layout]
    model = build()
    loss_fn = lm_loss if isinstance(model, GPT) else mlp_loss
    batch = data(model, 6, t)
    engine = PerExampleEngine(model, loss_fn)
    engine.verify(batch)
    ref = one_backward_per_example(model, loss_fn, batch, 6)
    norms = torch.cat([g.flatten(1) for g in ref], 1).norm(dim=1)
    clip = float(norms.median())  # half of the examples are clipped

    def weigh(sq):
        return (clip / sq.sum(1, keepdim=True).sqrt()).clamp(max=1.0).expand_as(sq)

    got = engine.gradients(batch).clipped_sum(weigh)
    scale = (clip / norms).clamp(max=1.0)
    for name, g, r in zip(engine.names, got, ref):
        torch.testing.assert_close(g, torch.einsum("b,b...->...", scale, r), rtol=1e-10, atol=1e-12, msg=name)


def test_a_tiny_nanogpt_trains_through_make_private():
    model = GPT(tie="by hand")
    tokens = data(model, 24, 5)
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer, batches = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), tokens, lm_loss,
                                             noise_multiplier=1.0, epochs=1, batch_size=8, physical_batch_size=4,
                                             secret_seed=0)
    for batch in batches:
        optimizer.zero_grad()
        lm_loss(model, batch).mean().backward()
        optimizer.step()
    assert optimizer.ledger.steps == len(batches)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_tiny_nanogpt_trains_through_the_private_trainer(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from dpopt.hf import PrivacyArguments, PrivateTrainer

    model = GPT()
    tokens = data(model, 12, 5)
    rows = [{"input_ids": s[:-1], "labels": s[1:]} for s in tokens]
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    before = model.transformer.wpe.weight.detach().clone()
    trainer = PrivateTrainer(model, args, train_dataset=rows,
                             privacy=PrivacyArguments(noise_multiplier=1.0, batch_size=6, secret_seed=0))
    trainer.train()
    assert trainer.ledger.steps == 1 and trainer.dp.engine.routes
    assert not torch.equal(before, model.transformer.wpe.weight)


class CalledSequenceFirst(nn.Module):
    """A model whose own input and output are [T, B, d]: no module around its layers has the batch first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, h):
        return self.head(torch.tanh(self.lin(h)))


def sequence_first_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x.transpose(0, 1)).mean(0), y, reduction="none")


def tied_in_the_loss(model, batch):
    ids, y = batch
    logits = F.linear(torch.tanh(model.lin(model.emb(ids))), model.emb.weight).mean(1)[:, :2]
    return F.cross_entropy(logits, y, reduction="none")


class Uneven(nn.Module):
    """[B, 4] -> rows of 3: rows straddle examples, which no module can take apart."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.lin(x.reshape(-1, 3)).reshape(x.shape[0], 4))


# name -> (model, loss, batch of n, the refusal)
REFUSED = {
    "a model called with [T, B, d]": (
        CalledSequenceFirst, sequence_first_loss, lambda n: (torch.randn(n, 5, D), torch.randint(0, 2, (n,))),
        r"layer 'lin' \(Linear\) received 5 rows for a batch of 3 examples, .* no module around it takes the batch as "
        r"dimension 0 .* Keep the batch as dimension 0 of the model's input and output"),
    "a model called with [T, B, d], T = B": (
        CalledSequenceFirst, sequence_first_loss, lambda n: (torch.randn(n, 3, D), torch.randint(0, 2, (n,))),
        r"did not match single-example backward passes .* even taken with torch.func over layer '<root>' "
        r"\(CalledSequenceFirst\): the model's own input or output does not have the batch as dimension 0"),
    "F.linear(h, model.emb.weight) in the loss": (
        lambda: HandTied(6), tied_in_the_loss, lambda n: (torch.randint(0, V, (n, 6)), torch.randint(0, 2, (n,))),
        r"the loss function uses 'emb.weight' outside the layer that holds it, .* Use the parameter inside the "
        r"model's forward"),
    "rows that straddle examples": (
        Uneven, mlp_loss, lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,))),
        r"torch.func could not take them per example over '<root>' .* Keep the batch as dimension 0"),
}


@pytest.mark.parametrize("layout", REFUSED)
def test_what_no_batch_first_module_can_hold_is_refused_saying_what_to_change(layout):
    build, loss_fn, batch, error = REFUSED[layout]
    with pytest.raises(ExampleMixingError, match=error):
        PerExampleEngine(build(), loss_fn).verify(batch(3))


@pytest.mark.parametrize("layout", REFUSED)
def test_nothing_is_released_before_a_refusal(layout):
    """Through a PrivateStep, whose first Poisson batch holds 1 example: verified on 3 of its own choosing."""
    build, loss_fn, batch, error = REFUSED[layout]
    model = build()
    sampler = PoissonSampler(12, 0.1, SecretStream(0, "sampling"))
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")), sampler,
                            PrivacyLedger())
    opt = PrivateStep(PerExampleEngine(model, loss_fn), privatizer, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ExampleMixingError, match=error):
        opt.step(batch(12))
    assert opt.privatizer.ledger.steps == 0 and not opt.verified
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_genuine_mix_is_still_refused_not_routed():
    model = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, 2))
    with pytest.raises(ExampleMixingError, match=r"BatchNorm1d"):
        PerExampleEngine(model, mlp_loss).verify((torch.randn(4, D), torch.randint(0, 2, (4,))))
