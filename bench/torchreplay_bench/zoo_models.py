"""The zoo's models: tiny random-weight transformers architectures and torchvision CNNs, as
(model, make_inputs) builders. Used by the zoo benchmark (zoo.py) and the harness's models
(models.py). transformers and torchvision are needed.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch


def _transformer(name: str) -> Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]:
    """A tiny config of one transformers architecture, eval mode, and a make_inputs(i)."""
    def build() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
        import transformers as tf
        common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128)
        decoders = {
            "llama": (tf.LlamaConfig, tf.LlamaModel, dict(num_key_value_heads=2)),
            "mistral": (tf.MistralConfig, tf.MistralModel, dict(num_key_value_heads=2, sliding_window=None)),
            "qwen2": (tf.Qwen2Config, tf.Qwen2Model, dict(num_key_value_heads=2)),
            "qwen3": (tf.Qwen3Config, tf.Qwen3Model, dict(num_key_value_heads=2, head_dim=16)),
            "gemma": (tf.GemmaConfig, tf.GemmaModel, dict(num_key_value_heads=2, head_dim=16)),
            "gemma2": (tf.Gemma2Config, tf.Gemma2Model, dict(num_key_value_heads=2, head_dim=16)),
            "phi": (tf.PhiConfig, tf.PhiModel, {}),
            "phi3": (tf.Phi3Config, tf.Phi3Model, dict(num_key_value_heads=2, pad_token_id=0)),
            "mixtral": (tf.MixtralConfig, tf.MixtralModel, dict(num_key_value_heads=2, num_local_experts=4,
                                                                 num_experts_per_tok=2)),
            "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXModel, {}),
        }
        if name in decoders:
            cfg_cls, model_cls, extra = decoders[name]
            model = model_cls(cfg_cls(**common, **extra))
        elif name == "gpt2":
            model = tf.GPT2Model(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128))
        elif name == "opt":
            model = tf.OPTModel(tf.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=128,
                                             word_embed_proj_dim=64))
        elif name in ("bert", "roberta"):
            cfg_cls, model_cls = (tf.BertConfig, tf.BertModel) if name == "bert" else (tf.RobertaConfig, tf.RobertaModel)
            model = model_cls(cfg_cls(**common, pad_token_id=1))
        elif name == "distilbert":
            model = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=256, dim=64, hidden_dim=128, n_layers=2,
                                                           n_heads=4, max_position_embeddings=128))
        elif name == "t5":
            model = tf.T5EncoderModel(tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                  num_heads=4))
        elif name == "vit":
            model = tf.ViTModel(tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, image_size=32, patch_size=8))
            return _Outputs(model.eval(), "pixel_values"), lambda i: (
                torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)),)
        else:
            raise KeyError(name)
        return _Outputs(model.eval()), lambda i: (torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(i)),)
    return build


def _cnn(name: str, size: int = 64) -> Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]:
    """A torchvision CNN with random weights, eval mode, on one image of size x size."""
    def build() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
        import torchvision
        model = getattr(torchvision.models, name)(weights=None).eval()
        return model, lambda i: (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(i)),)
    return build


class _Outputs(torch.nn.Module):
    """A transformers model called on one tensor (`key`), returning its last hidden state only (a
    tensor, not a ModelOutput), with no KV cache."""

    def __init__(self, model: torch.nn.Module, key: str = "input_ids") -> None:
        super().__init__()
        import inspect
        self.model, self.key = model, key
        self.no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {self.key: x, "use_cache": False} if self.no_cache else {self.key: x}
        return self.model(**kwargs).last_hidden_state


TRANSFORMERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "mixtral", "gpt2",
                "gpt_neox", "opt", "bert", "roberta", "distilbert", "t5", "vit"]
CNNS = ["resnet18", "mobilenet_v2", "mobilenet_v3_small", "squeezenet1_0", "shufflenet_v2_x0_5",
        "efficientnet_b0", "regnet_y_400mf", "mnasnet0_5"]
MODELS: Dict[str, Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]] = {
    **{n: _transformer(n) for n in TRANSFORMERS}, **{n: _cnn(n) for n in CNNS}}


def build(name: str, size: Optional[int] = None) -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
    """(model, make_inputs) of a zoo model; `size`: a CNN's image size instead of 64."""
    if size is not None:
        if name not in CNNS:
            raise ValueError(f"size is for the CNNs, not {name}")
        return _cnn(name, size)()
    return MODELS[name]()
