"""The model zoo: tiny models built from `transformers` configs (random init, float64, no downloads) and two
small vision nets, each as an `engine.testing.ModelCase` made by `engine.functionalize`.

Every family trains the way its users train it: GPT-2 and T5 take their loss from `labels`
(`outputs.loss`; transformers computes GPT-2's in float32, so its check has float32's tolerance), Llama,
Mistral and Qwen2 a float64 next-token loss on `outputs.logits`, BERT and ViT classify with the model's own loss, BERT with an attention mask and its
integer `token_type_ids` / `position_ids` buffers. `FAMILIES` maps a name to its builder; `dropout=True`
builds the model in train mode with its configured dropout (0.1), keyed by `ir.row_keys`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import ir
from engine.testing import ModelCase

BATCH, SEQ, VOCAB = 8, 8, 64
_LM = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=VOCAB, max_position_embeddings=32, use_cache=False)


def _quiet_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def case(name: str, model: nn.Module, inputs: tuple[str, ...], batch: tuple[torch.Tensor, ...], *,
         dropout: bool = False, loss: Callable | None = None, output: str | None = None,
         closed_buffers: bool = True) -> ModelCase:
    """`model` (float64, train mode with keyed dropout or eval mode) as a ModelCase. With `closed_buffers`
    the params are the leaves and the buffers constants of the function (the documented reference form)."""
    torch.manual_seed(0)
    model = model.double().train(dropout)
    fn, variables = engine.functionalize(model, loss=loss, inputs=inputs, output=output, rng=dropout)
    batch = (*batch, ir.row_keys(7, BATCH)) if dropout else batch
    description = f"{name} ({type(model).__name__}{', train mode, keyed dropout' if dropout else ', eval'})"
    if not closed_buffers:
        return ModelCase(fn, variables, batch, description, torch.float64)
    buffers = variables["buffers"]

    def of_params(params: dict, *b: Any) -> torch.Tensor:
        return fn({"params": params, "buffers": buffers}, *b)

    of_params.__signature__ = fn.__signature__  # type: ignore[attr-defined]  # batch leaf names
    return ModelCase(of_params, variables["params"], batch, description, torch.float64)


def _ids(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def causal_lm(kind: str, *, dropout: bool = False) -> ModelCase:
    """Llama / Mistral / Qwen2 (RoPE under no_grad, GQA, SwiGLU, RMSNorm): a user loss on `outputs.logits`."""
    T = _quiet_transformers()
    config_class, model_class = {"llama": (T.LlamaConfig, T.LlamaForCausalLM),
                                 "mistral": (T.MistralConfig, T.MistralForCausalLM),
                                 "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(0)
    extra = {"attention_dropout": 0.1} if dropout else {}
    model = model_class(config_class(**_LM, **extra))
    ids = _ids(1)
    return case(kind, model, ("input_ids",), (ids, ids), dropout=dropout, loss=next_token_loss, output="logits")


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Causal LM cross-entropy in the logits' dtype (transformers' own `labels` loss upcasts to float32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def gpt2(*, dropout: bool = False) -> ModelCase:
    """The model's own loss from `labels` (`outputs.loss`, computed in float32 by transformers)."""
    T = _quiet_transformers()
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False,
                          bos_token_id=0, eos_token_id=0)
    ids = _ids(2)
    return case("gpt2", T.GPT2LMHeadModel(config), ("input_ids", "labels"), (ids, ids), dropout=dropout)


def bert(*, dropout: bool = False, closed_buffers: bool = False) -> ModelCase:
    """Sequence classification with a padding mask (rows of different lengths); the integer buffers are
    leaves of the checked tree unless `closed_buffers`."""
    T = _quiet_transformers()
    torch.manual_seed(0)
    config = T.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                          vocab_size=VOCAB, max_position_embeddings=32, num_labels=3)
    ids = _ids(3)
    lengths = torch.tensor([8, 5, 8, 3, 6, 8, 2, 7])
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    labels = torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(4))
    return case("bert", T.BertForSequenceClassification(config), ("input_ids", "attention_mask", "labels"),
                (ids, mask, labels), dropout=dropout, closed_buffers=closed_buffers)


def t5(*, dropout: bool = False) -> ModelCase:
    """Encoder-decoder; the decoder's inputs come from `labels` (`_shift_right`), the loss too."""
    T = _quiet_transformers()
    torch.manual_seed(0)
    config = T.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                        num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                        use_cache=False, dropout_rate=0.1)
    return case("t5", T.T5ForConditionalGeneration(config), ("input_ids", "labels"), (_ids(5), _ids(6)),
                dropout=dropout)


def vit(*, dropout: bool = False) -> ModelCase:
    T = _quiet_transformers()
    torch.manual_seed(0)
    config = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=32, num_labels=5,
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    images = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    labels = torch.randint(0, 5, (BATCH,), generator=torch.Generator().manual_seed(8))
    return case("vit", T.ViTForImageClassification(config), ("pixel_values", "labels"), (images, labels),
                dropout=dropout)


class ConvNet(nn.Module):
    """A small ResNet: conv-BN-relu stem, two residual conv-BN blocks, global pooling, dropout, linear head."""

    def __init__(self, classes: int = 5, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
            for _ in range(2))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)
        for block in self.blocks:
            h = F.relu(h + block(h))
        return self.head(self.drop(h.mean(dim=(2, 3))))


def cnn(*, dropout: bool = False) -> ModelCase:
    """BatchNorm in eval mode (non-trivial running statistics, integer num_batches_tracked)."""
    torch.manual_seed(0)
    model = ConvNet()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    images = torch.randn(BATCH, 3, 6, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    labels = torch.randint(0, 5, (BATCH,), generator=torch.Generator().manual_seed(10))
    made = case("cnn", model, ("images",), (images, labels), loss=F.cross_entropy)
    if dropout:
        raise ValueError("the CNN's BatchNorm is in eval mode: build it without dropout")
    return made


#: families whose loss transformers computes in float32 (logits upcast): checked at float32's tolerance
FLOAT32_LOSS = ("gpt2",)

FAMILIES: dict[str, Callable[..., ModelCase]] = {
    "gpt2": gpt2, "llama": lambda **kw: causal_lm("llama", **kw), "mistral": lambda **kw: causal_lm("mistral", **kw),
    "qwen2": lambda **kw: causal_lm("qwen2", **kw), "bert": bert, "t5": t5, "vit": vit, "cnn": cnn,
}
