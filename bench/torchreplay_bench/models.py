"""The model zoo shared by the tests and the benchmark harness."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn


class DemoModel(nn.Module):
    """torchair's example model: a parameter, a buffer, a tensor input and a scalar input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(64))
        self.linear1 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor, scale_factor: int) -> torch.Tensor:
        x = self.linear1(x)
        x = x - self.running_mean
        return x * scale_factor


class MmAbsModel(nn.Module):
    """mm, abs, add, sub; two outputs (the model of the custom-pass and multi-stream examples)."""

    def forward(self, x: torch.Tensor):
        mm = torch.mm(x, x)
        abs_ = torch.abs(mm)
        add = torch.add(abs_, 1)
        sub = torch.sub(x, mm)
        return add, sub


class MLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256, layers: int = 3) -> None:
        super().__init__()
        dims = [d] + [hidden] * (layers - 1) + [d]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class CountingModel(nn.Module):
    """Mutates a buffer in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x * self.count


class ViewOfInput(nn.Module):
    """Returns a view of its input next to a computed value."""

    def forward(self, x: torch.Tensor):
        return x.t(), x.sum(0)


class DecodeAttention(nn.Module):
    """One decode step of a small attention block writing a static KV cache in place."""

    def __init__(self, d: int = 64, heads: int = 4, max_len: int = 32) -> None:
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.register_buffer("k_cache", torch.zeros(1, heads, max_len, self.dh))
        self.register_buffer("v_cache", torch.zeros(1, heads, max_len, self.dh))
        self.register_buffer("mask_base", torch.arange(max_len))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: (1, 1, d); pos: (1,) int64, the position written this step
        q, k, v = self.qkv(x).split(self.heads * self.dh, dim=-1)
        q = q.view(1, 1, self.heads, self.dh).transpose(1, 2)
        k = k.view(1, 1, self.heads, self.dh).transpose(1, 2)
        v = v.view(1, 1, self.heads, self.dh).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        scores = (q @ self.k_cache.transpose(-1, -2)) / (self.dh ** 0.5)
        scores = scores.masked_fill(self.mask_base > pos, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ self.v_cache
        return self.out(y.transpose(1, 2).reshape(1, 1, -1))


class OneAdd(nn.Module):
    """One add on 16 floats: a call's floor (argument checks, binding, hand-out), nearly no work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class ElementwiseChain(nn.Module):
    """64 elementwise ops on a small tensor: all host overhead."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n // 4):
            x = torch.sin(x)
            x = x * 1.01
            x = x + 0.1
            x = torch.relu(x)
        return x


class AudioConv1d(nn.Module):
    """A 1-d convolution audio stack (keyword spotting on a raw waveform, M5 style): four blocks
    of Conv1d, BatchNorm1d and ReLU (max pooling after the first two), global average pooling, a
    linear head. Input (1, 1, 4000): a quarter second at 16 kHz."""

    def __init__(self, channels: int = 32, classes: int = 12) -> None:
        super().__init__()
        c = channels
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv1d(1, c, 80, stride=16), nn.BatchNorm1d(c), nn.ReLU(), nn.MaxPool1d(4)),
            nn.Sequential(nn.Conv1d(c, c, 3), nn.BatchNorm1d(c), nn.ReLU(), nn.MaxPool1d(4)),
            nn.Sequential(nn.Conv1d(c, 2 * c, 3), nn.BatchNorm1d(2 * c), nn.ReLU()),
            nn.Sequential(nn.Conv1d(2 * c, 2 * c, 3), nn.BatchNorm1d(2 * c), nn.ReLU()),
        ])
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(-1))


class LSTMStep(nn.Module):
    """One step of a 2-layer LSTM (input 32, hidden 64), its state passed in and handed back:
    the call a streaming model makes per frame."""

    def __init__(self, d: int = 32, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        y, (h, c) = self.lstm(x, (h, c))
        return y, h, c


class GRUSequence(nn.Module):
    """A 1-layer GRU (input 32, hidden 64) over a sequence: every step's output and the last state."""

    def __init__(self, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.gru = nn.GRU(d, hidden, batch_first=True)

    def forward(self, x: torch.Tensor):
        y, h = self.gru(x)
        return y, h


class EmbeddingBagRecommender(nn.Module):
    """A small recommender (DLRM style): two nn.EmbeddingBag tables (sum) pool the sparse
    features of each sample, an MLP embeds the dense ones, an MLP over the three gives a score."""

    def __init__(self, rows: int = 1000, dim: int = 16, dense: int = 13) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(2))
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, idx0: torch.Tensor, off0: torch.Tensor, idx1: torch.Tensor,
                off1: torch.Tensor) -> torch.Tensor:
        pooled = [self.tables[0](idx0, off0), self.tables[1](idx1, off1)]
        return self.top(torch.cat([self.bottom(dense)] + pooled, dim=1))


class DLRM(nn.Module):
    """A DLRM-style recommender at a serving size: 8 EmbeddingBag tables (sum) of 10,000 rows by
    64, a bottom MLP 13-512-256-64 over the dense features, the pairwise dot products of the nine
    vectors (a batched matmul, the upper triangle), a top MLP 100-512-256-1."""

    def __init__(self, tables: int = 8, rows: int = 10000, dim: int = 64, dense: int = 13) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                    nn.Linear(256, dim), nn.ReLU())
        n = tables + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.stack([x] + [t(indices[k], offsets[k]) for k, t in enumerate(self.tables)], dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))
        return self.top(torch.cat([x, dots[:, self.pairs[0], self.pairs[1]]], dim=1))


class Wav2VecFrontEnd(nn.Module):
    """wav2vec 2.0's convolution feature encoder (the base model's): seven Conv1d layers of 512
    channels without bias (kernel 10 stride 5, then kernel 3 stride 2 four times, kernel 2 stride
    2 twice), a group norm per channel after the first, GELU after each. Input (1, 1, 4000): a
    quarter second at 16 kHz (the base model reads whole utterances)."""

    def __init__(self, c: int = 512) -> None:
        super().__init__()
        layers = [nn.Conv1d(1, c, 10, stride=5, bias=False), nn.GroupNorm(c, c), nn.GELU()]
        for k in [3, 3, 3, 3, 2, 2]:
            layers += [nn.Conv1d(c, c, k, stride=2, bias=False), nn.GELU()]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _seeded(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(i)


def _recommender_inputs(i: int) -> tuple:
    """A batch of 4: dense features, and per table 10 indices in bags of 2, 3, 1 and 4."""
    g = _seeded(i)
    offsets = torch.tensor([0, 2, 5, 6])
    return (torch.randn(4, 13, generator=g), torch.randint(0, 1000, (10,), generator=g), offsets,
            torch.randint(0, 1000, (10,), generator=g), offsets.clone())


def _lstm_inputs(i: int) -> tuple:
    g = _seeded(i)
    return (torch.randn(1, 1, 32, generator=g), torch.randn(2, 1, 64, generator=g), torch.randn(2, 1, 64, generator=g))


def _zoo(name: str, calibrate: bool = False, **kwargs):
    """A model of the zoo benchmark (bench/zoo.py: torchvision CNNs, tiny transformers models).
    `calibrate`: its batch norms' running statistics taken from a few random batches (random
    weights with the initial statistics leave a deep CNN's outputs near zero, where any output
    passes a check with an absolute tolerance)."""
    def build():
        from torchreplay_bench import zoo_models
        model, make_inputs = zoo_models.build(name, **kwargs)
        if calibrate:
            model.train()
            with torch.no_grad():
                for i in range(3):
                    model(torch.cat([make_inputs(1000 + 4 * i + j)[0] for j in range(4)]))
            model.eval()
        return model, make_inputs
    return build


def _dlrm_inputs(batch: int) -> Callable[[int], tuple]:
    """A batch of `batch`: dense features, and per table two indices a bag."""
    def make(i: int) -> tuple:
        g = _seeded(i)
        return (torch.randn(batch, 13, generator=g), torch.randint(0, 10000, (8, 2 * batch), generator=g),
                (torch.arange(batch) * 2).repeat(8, 1))
    return make


def _bert_base_width(batch: int = 1):
    """An encoder of BERT-base width (hidden 768, 12 heads, feed-forward 3072) with 2 layers
    (base has 12), random weights, on `batch` sequences of 128 tokens; the last hidden state."""
    from transformers import BertConfig, BertModel  # noqa: WPS433
    from torchreplay_bench.zoo_models import _Outputs
    model = BertModel(BertConfig(vocab_size=1000, hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
                                 intermediate_size=3072, max_position_embeddings=512)).eval()
    return _Outputs(model), lambda i: (torch.randint(0, 1000, (batch, 128), generator=_seeded(i)),)


def _batched(factory: Callable[[], tuple], batch: int) -> Callable[[], tuple]:
    """`factory`'s model on `batch` of its samples stacked along dimension 0 (inputs of batch 1)."""
    def build() -> tuple:
        model, make = factory()
        return model, lambda i: tuple(torch.cat(ts) for ts in zip(*(make(i * batch + k) for k in range(batch))))
    return build


def _llama_decode(shard: Optional[Callable[[nn.Module], None]] = None):
    """A tiny randomly initialised Llama decode step with a static cache (needs transformers).
    `shard(model)`, if given, parallelizes the model before its cache is made (the cache takes the
    sizes of the first step's keys and values: a rank's heads, under tensor parallelism)."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: WPS433

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    if shard is not None:
        shard(model)
    cache = StaticCache(config=cfg, max_batch_size=1, max_cache_len=64)

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.cache = cache  # an attribute, so that a copy of the step has its own cache

        def forward(self, ids, pos):
            # The cache's tensors are this module's buffers (so that torch.export sees the writes
            # into them as buffer mutations): the cache reads them back from here.
            for i, (layer, names) in enumerate(zip(getattr(self.cache, "layers", []), self.cache_tensors)):
                for name in names:
                    setattr(layer, name, getattr(self, f"cache{i}_{name}"))
            # Newer transformers keep the write position in the cache (a 0-dim tensor per layer,
            # advanced by every step): set it, so that step i writes at pos[0] and the benchmark
            # can run any number of steps.
            for layer in getattr(self.cache, "layers", []):
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.copy_(pos[0])
            return self.model(input_ids=ids, cache_position=pos, past_key_values=self.cache,
                              use_cache=True).logits

    step = Step()
    step.cache_tensors = []
    with torch.no_grad():  # allocates the cache's tensors (lazily created on the first step)
        step(torch.tensor([[0]]), torch.tensor([0]))
    for i, layer in enumerate(getattr(cache, "layers", [])):
        names = [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]
        for name in names:
            step.register_buffer(f"cache{i}_{name}", getattr(layer, name), persistent=False)
        step.cache_tensors.append(names)
    return step, lambda i: (torch.tensor([[i % 256]]), torch.tensor([i % 64]))


def out_by_hand(model: nn.Module):
    """The model written by hand as out= ATen calls into buffers allocated once, called from Python:
    a dispatcher-path baseline (the same kernels through ATen's out= API and the dispatcher, which
    replay's prepared steps skip), not a floor. None for models without one."""
    if isinstance(model, MLP):
        layers = [(l.weight.t(), l.bias) for l in model.layers]
        bufs = [torch.empty(1, w.shape[1]) for w, _ in layers]

        def mlp(x):
            for i, ((w, b), out) in enumerate(zip(layers, bufs)):
                torch.addmm(b, x, w, out=out)
                if i + 1 < len(layers):
                    torch.relu_(out)
                x = out
            return x
        return mlp
    if isinstance(model, DemoModel):
        w, b, mean = model.linear1.weight.t(), model.linear1.bias, model.running_mean
        h, out = torch.empty(100, 64), torch.empty(100, 64)

        def demo(x, scale_factor):
            torch.addmm(b, x, w, out=h)
            torch.sub(h, mean, out=h)
            return torch.mul(h, scale_factor, out=out)
        return demo
    return None


# name -> (factory returning (model, make_inputs(i)), description)
MODELS = {
    "mlp": (lambda: (MLP().eval(), lambda i: (torch.randn(1, 64),)), "3-layer MLP, batch 1"),
    "demo": (lambda: (DemoModel().eval(), lambda i: (torch.randn(100, 128), 100)), "torchair's example model"),
    "attention_decode": (lambda: (DecodeAttention().eval(), lambda i: (torch.randn(1, 1, 64), torch.tensor([i % 32]))),
                         "decode step, static KV cache"),
    "convnet": (lambda: (ConvBN().eval(), lambda i: (torch.randn(1, 3, 16, 16),)), "small conv net + BN"),
    "chain64": (lambda: (ElementwiseChain(), lambda i: (torch.randn(16),)), "64 elementwise ops, 16 elems"),
    "llama_decode": (_llama_decode, "tiny Llama decode step (transformers)"),
    "one_add": (lambda: (OneAdd(), lambda i: (torch.randn(16),)), "one add, 16 elems: the call floor"),
    # Models of the CPU-runtime comparison (python -m torchreplay_bench.runtimes): not in the
    # harness's default run.
    "mobilenet_v3_small_96": (_zoo("mobilenet_v3_small", calibrate=True, size=96),
                              "torchvision mobilenet_v3_small, 96x96, batch 1, batch norms calibrated"),
    "audio_conv1d": (lambda: (AudioConv1d().eval(), lambda i: (torch.randn(1, 1, 4000, generator=_seeded(i)),)),
                     "1-d convolution audio stack, 4000 samples"),
    "lstm_step": (lambda: (LSTMStep().eval(), _lstm_inputs), "2-layer LSTM, one step, state in and out"),
    "gru_seq16": (lambda: (GRUSequence().eval(), lambda i: (torch.randn(1, 16, 32, generator=_seeded(i)),)),
                  "GRU over 16 steps"),
    "bert_encoder": (_zoo("bert"), "tiny BERT encoder (transformers BertModel), 16 tokens"),
    "embedding_bag": (lambda: (EmbeddingBagRecommender().eval(), _recommender_inputs),
                      "EmbeddingBag recommender, batch 4"),
    # The wider zoo (torchvision's CNNs at 224x224 with batch norms calibrated, BERT-base width,
    # a wav2vec front end, a DLRM-style recommender), at batch 1 and the serving sizes 8 and 32.
    **{f"{name}{suffix}": entry for batch, suffix in [(1, ""), (8, "_b8"), (32, "_b32")] for name, entry in {
        f"{cnn}_224": (_batched(_zoo(cnn, calibrate=True, size=224), batch),
                       f"torchvision {cnn}, 224x224, batch {batch}, batch norms calibrated")
        for cnn in ("resnet18", "efficientnet_b0", "squeezenet1_0")}.items()},
    **{f"bert_base_128{suffix}": (lambda b=batch: _bert_base_width(b),
                                  f"encoder of BERT-base width, 2 layers, 128 tokens, batch {batch}")
       for batch, suffix in [(1, ""), (8, "_b8"), (32, "_b32")]},
    **{f"wav2vec_frontend{suffix}": (_batched(lambda: (Wav2VecFrontEnd().eval(),
                                                       lambda i: (torch.randn(1, 1, 4000, generator=_seeded(i)),)),
                                              batch),
                                     f"wav2vec 2.0 convolution front end, 4000 samples, batch {batch}")
       for batch, suffix in [(1, ""), (8, "_b8"), (32, "_b32")]},
    **{f"dlrm{suffix}": (lambda b=batch: (DLRM().eval(), _dlrm_inputs(b)),
                         f"DLRM-style recommender, 8 tables, batch {batch}")
       for batch, suffix in [(1, ""), (8, "_b8"), (32, "_b32")]},
}
# The wider zoo's models at batch 1 (python -m torchreplay_bench.runtimes --models ...).
WIDER_ZOO = ["resnet18_224", "efficientnet_b0_224", "squeezenet1_0_224", "bert_base_128", "wav2vec_frontend", "dlrm"]
# The harness's own models (python -m torchreplay_bench runs these unless --models says otherwise).
HARNESS_MODELS = ["mlp", "demo", "attention_decode", "convnet", "chain64", "llama_decode"]
