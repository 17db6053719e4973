"""``tabby train``: end-to-end training of a transformers or torchtitan MoE model, Tabby's experts
against the framework's own (``grouped_mm``: both call ``torch._grouped_mm``), on one GPU (or the
CPU with a tiny model).

Every run trains the same model from the same seed on the same batches of a generated corpus
(:func:`make_corpus`: a fixed random order-2 Markov language, learnable, with a known best
possible loss), AdamW, gradients clipped to norm 1. A run is (model, experts backend, step mode,
init seed); its record holds every step's loss and gradient norm, the steady-state tokens/s,
MFU, peak memory and the MoE blocks' share of the step. The suite of one model:

  * each (backend, mode) at seed 0: the speed and the loss curves;
  * Tabby eager at seed 0 twice more with ``torch.use_deterministic_algorithms(True)`` (the
    rest of the model deterministic too: attention's backward, the embedding's): the two runs
    must agree bit for bit in every step's loss and gradient norm;
  * the baseline eager at seed 0 once more and at seed 1: the spread between two honest runs
    (the baseline's own run-to-run noise, and a second seed's), which Tabby's distance from the
    baseline is compared with.

Step modes: ``eager``; ``compile`` (``torch.compile`` of the model); ``graph`` (the whole step:
forward, backward, clipping and the optimizer, captured once as a CUDA graph and replayed).

Output (``--out``): ``train-*.json`` (machine, date, commit, every run and step), ``.md`` (the
table) and ``-loss.png`` (the curves).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from .records import default_out_dir, file_stem, machine_info, markdown_table
from .timing import release_implementation

# Dense bf16 tensor-core peak by GPU (vendor figures, no sparsity), for MFU.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H20": 148.0, "A100": 312.0, "B200": 2250.0}


@dataclass(frozen=True)
class ModelSpec:
    """An MoE model: its framework, family and config fields (transformers: the config class's
    fields; torchtitan: ``torchtitan_qwen3_config``'s arguments)."""
    name: str
    family: str  # "qwen3_moe", "deepseek_v3", "deepseek_v4" or "gpt_oss"
    fields: dict
    about: str
    framework: str = "transformers"  # or "torchtitan" (0.3.0, or 0.2.x; its experts' default is torch._grouped_mm)
    seq_len: int | None = None  # the model's sequence length (None: the run's ``TrainConfig.seq_len``)

    def seq(self, cfg: "TrainConfig") -> int:
        """Tokens per sequence of this model's batches (at most the step's tokens)."""
        return min(self.seq_len or cfg.seq_len, cfg.tokens)


MODELS = {
    "qwen3-moe": ModelSpec("qwen3-moe", "qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=2048,
        tie_word_embeddings=False, max_position_embeddings=8192),
        "Qwen3-30B-A3B layers (H 2048, E 128, k 8, I 768, 32 heads), 4 layers, vocabulary 2048"),
    "deepseek-v3-16b": ModelSpec("deepseek-v3-16b", "deepseek_v3", dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
        intermediate_size=10944, first_k_dense_replace=0, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        vocab_size=2048, tie_word_embeddings=False, max_position_embeddings=8192),
        "DeepSeek-V3-16B layers (H 2048, E 64, k 6, I 1408, 2 shared experts, MLA, sigmoid router with "
        "expert bias), 4 layers, vocabulary 2048"),
    "deepseek-v4": ModelSpec("deepseek-v4", "deepseek_v4", dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=1, head_dim=128,
        q_lora_rank=512, o_lora_rank=512, o_groups=4, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1024, n_shared_experts=1, layer_types=["compressed_sparse_attention"] * 4,
        mlp_layer_types=["moe"] * 4, index_n_heads=16, index_head_dim=128, index_topk=512,
        num_nextn_predict_layers=0, vocab_size=2048, tie_word_embeddings=False, max_position_embeddings=8192),
        "DeepSeek-V4 layers (H 2048, E 64, k 6, I 1024, 1 shared expert, SwiGLU clamped at 10, compressed "
        "sparse attention, sqrt-softplus router), 4 layers, vocabulary 2048"),
    "tiny-deepseek-v4": ModelSpec("tiny-deepseek-v4", "deepseek_v4", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        q_lora_rank=32, o_lora_rank=32, o_groups=2, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, layer_types=["compressed_sparse_attention"] * 2,
        mlp_layer_types=["moe"] * 2, index_n_heads=4, index_head_dim=32, index_topk=16, num_nextn_predict_layers=0,
        qk_rope_head_dim=16, vocab_size=128, tie_word_embeddings=False, max_position_embeddings=256),
        "a tiny DeepSeek-V4 for the CPU (H 64, E 8, k 2, I 32, 2 layers)"),
    # transformers runs gpt-oss's attention (sinks, no SDPA) eagerly: [B, heads, L, L] scores per layer,
    # so sequences of 1024 (16 of them in 16384 tokens) keep the 4 layers' activations on one H100
    "gpt-oss-20b": ModelSpec("gpt-oss-20b", "gpt_oss", dict(
        hidden_size=2880, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2, vocab_size=2048, tie_word_embeddings=False,
        max_position_embeddings=8192),
        "gpt-oss-20b layers (H 2880, E 32, k 4, I 2880, 64 heads, sliding window 128 on every other layer, "
        "attention sinks; experts: transposed weights, interleaved gate/up, biases, its clamped gate), 4 "
        "layers, vocabulary 2048, sequences of 1024", seq_len=1024),
    "tiny-gpt-oss": ModelSpec("tiny-gpt-oss", "gpt_oss", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], vocab_size=128, tie_word_embeddings=False,
        max_position_embeddings=256),
        "a tiny gpt-oss for the CPU (H 64, E 8, k 2, I 32, 2 layers)"),
    "tiny-qwen3-moe": ModelSpec("tiny-qwen3-moe", "qwen3_moe", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=128, tie_word_embeddings=False,
        max_position_embeddings=256),
        "a tiny Qwen3-MoE for the CPU (H 64, E 8, k 2, I 32, 2 layers)"),
    "torchtitan-qwen3-moe": ModelSpec("torchtitan-qwen3-moe", "qwen3_moe", dict(
        dim=2048, n_layers=4, n_heads=32, n_kv_heads=4, head_dim=128, moe_hidden_dim=768, num_experts=128,
        top_k=8, vocab_size=2048, attention="flex"),
        "torchtitan's Qwen3 with Qwen3-30B-A3B layers (H 2048, E 128, k 8, I 768, 32 heads), 4 layers, "
        "vocabulary 2048, its default flex attention", framework="torchtitan"),
    "tiny-torchtitan-qwen3-moe": ModelSpec("tiny-torchtitan-qwen3-moe", "qwen3_moe", dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32, num_experts=8, top_k=2,
        vocab_size=128, attention="sdpa"),
        "a tiny torchtitan Qwen3-MoE for the CPU (H 64, E 8, k 2, I 32, 2 layers; causal SDPA: flex attention "
        "has no backward on the CPU)", framework="torchtitan"),
}
BACKENDS = ("grouped_mm", "tabby")
# Tabby's config for the CPU: the sync-free path with small tiles (the interpreter's time goes with
# the padded rows and the programs)
CPU_TABBY_CONFIG = "megakernel=0;tuning=tile_m=16,dispatch_rows=16,dispatch_cols=64,dispatch_programs=4"
MODES = ("eager", "compile", "graph")


@dataclass
class TrainConfig:
    models: list = field(default_factory=lambda: ["qwen3-moe"])
    backends: list = field(default_factory=lambda: list(BACKENDS))
    modes: list = field(default_factory=lambda: ["eager"])
    steps: int = 200
    mode_steps: int = 60  # steps of the compile and graph runs (speed and a working step, not curves)
    tokens: int = 16384  # per step (per GPU)
    seq_len: int = 4096
    lr: float = 1e-3
    warmup_steps: int = 10  # steps excluded from the tokens/s (compilation, allocator, clocks)
    log_every: int = 10
    repeat: bool = True  # Tabby eager twice (bitwise); the baseline again at seed 0 and at seed 1 (noise)
    attribute_steps: int = 5  # eager steps timed per MoE block after the run (its share of the step)
    out: str | None = None
    tag: str = ""
    profile_dir: str | None = None  # write each eager run's kernel table here
    tabby_config: str = ""  # a tabby.MoEConfig text (tabby.functional.moe.config_string), "" for the defaults


# ---------------------------------------------------------------------------------------------
# The corpus


def make_corpus(vocab: int, n_tokens: int, seq_len: int, seed: int = 1234, branching: int = 16,
                orders: int = 4) -> tuple:
    """``(tokens [n_seq, seq_len] int64, entropy)``: sequences of a fixed random language over
    ``vocab`` tokens. The next token is one of ``branching`` candidates of the last token (a random
    set per token) drawn with Zipf(1) weights; which candidate gets which weight is one of
    ``orders`` random orders chosen by the token before last. A model learns the candidates from
    the last token (a bigram table) and the weights from the last two (attention to the token
    before), down to ``entropy`` nats per token (the language's entropy rate, returned; far below
    log(vocab)). Same arguments, same tokens, on any machine."""
    g = torch.Generator().manual_seed(seed)
    n_seq = max(1, -(-n_tokens // seq_len))
    cand = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
    order = torch.stack([torch.randperm(branching, generator=g) for _ in range(orders)])
    p = 1.0 / torch.arange(1, branching + 1, dtype=torch.float64)
    p = p / p.sum()
    entropy = float(-(p * p.log()).sum())
    cdf = p.cumsum(0).float()
    cdf[-1] = 1.0
    toks = torch.empty(n_seq, seq_len, dtype=torch.int64)
    toks[:, :2] = torch.randint(0, vocab, (n_seq, 2), generator=g)
    u = torch.rand(n_seq, seq_len, generator=g)
    for t in range(2, seq_len):
        rank = torch.searchsorted(cdf, u[:, t].contiguous()).clamp_max(branching - 1)
        slot = order[toks[:, t - 2] % orders, rank]
        toks[:, t] = cand[toks[:, t - 1], slot]
    return toks, entropy


# ---------------------------------------------------------------------------------------------
# The model


def build_model(spec: ModelSpec, backend: str, seed: int, device: torch.device, tabby_config: str = ""):
    """The model in bf16 on ``device``, initialised from ``seed``, its experts run by ``backend``
    (``tabby_config``: Tabby's config string for a torchtitan model; a transformers model's comes
    from ``tabby.integrations.transformers.register``)."""
    if spec.framework == "torchtitan":
        return build_torchtitan_model(spec, backend, seed, device, tabby_config)
    import transformers

    cls = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
           "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}[spec.family]
    cfg = getattr(transformers, cls[0])(**spec.fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, cls[1])(cfg).to(torch.bfloat16)
    model.set_experts_implementation(backend)
    model.train()
    return model


def torchtitan_qwen3_config(dim, n_layers, n_heads, n_kv_heads, head_dim, moe_hidden_dim, num_experts, top_k,
                            vocab_size, attention):
    """torchtitan 0.3.0's Qwen3-MoE config (its 30B-A3B recipe: fused QKV, QK norm, softmax router
    with renormalised top-k, RoPE theta 1e6) at these sizes; ``attention`` "flex" (torchtitan's
    default) or "sdpa" (causal)."""
    import dataclasses

    import torchtitan.models.qwen3 as q3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE

    layers = q3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        moe_hidden_dim=moe_hidden_dim, num_experts=num_experts, top_k=top_k, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=8192, theta=1000000.0), moe_comm_backend="standard")
    if attention == "sdpa":
        layers = [dataclasses.replace(c, attention=dataclasses.replace(
            c.attention, inner_attention=ScaledDotProductAttention.Config())) for c in layers]
    return q3.Qwen3Model.Config(
        vocab_size=vocab_size, dim=dim, norm=q3._qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=q3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=q3._LINEAR_INIT))


def import_torchtitan():
    """The torchtitan package. torchtitan 0.2.x's model packages import its data loading
    (``datasets``), which ``tabby train`` does not use (its corpus is its own): for 0.2.x, where
    ``datasets`` is not installed, an empty stand-in module takes its place, in this process only."""
    import importlib.metadata
    import importlib.util
    import sys
    import types

    try:
        legacy = importlib.metadata.version("torchtitan").startswith("0.2")
    except importlib.metadata.PackageNotFoundError:
        legacy = False
    if legacy and "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset = stub.IterableDataset = object
        stub.load_dataset = dist.split_dataset_by_node = None
        stub.distributed = dist
        sys.modules.update({"datasets": stub, "datasets.distributed": dist})
    import torchtitan

    return torchtitan


def torchtitan_legacy() -> bool:
    """Whether the installed torchtitan is 0.2.x (no ``@override``; ``tabby.integrations.torchtitan02``)."""
    import importlib.metadata

    import_torchtitan()
    return importlib.metadata.version("torchtitan").startswith("0.2")


class TorchtitanLM(torch.nn.Module):
    """A torchtitan decoder behind transformers' causal-LM call, ``model(input_ids=, labels=).loss``:
    the next-token cross-entropy in fp32 (labels shifted by one, as transformers does); flex
    attention gets its causal block mask (one document per row)."""

    def __init__(self, decoder, flex: bool, legacy: bool = False):
        super().__init__()
        self.decoder, self.flex, self.legacy = decoder, flex, legacy

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        masks = None
        if self.flex and self.legacy:  # 0.2.x: causal masks from the tokens (no tokenizer for "causal")
            masks = self.decoder.get_attention_masks(input_ids, None)
        elif self.flex:
            B, L = input_ids.shape
            masks = self.decoder.get_attention_masks(torch.arange(L, device=input_ids.device).expand(B, L))
        logits = self.decoder(input_ids, attention_masks=masks)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss)


def build_torchtitan02_model(spec: ModelSpec, backend: str, seed: int, device: torch.device, tabby_config: str):
    """torchtitan 0.2.x's Qwen3-MoE (its 30B-A3B recipe: QK norm, softmax router with renormalised
    top-k, scores after the experts, RoPE theta 1e6) at the spec's sizes, in bf16: its own experts
    (``grouped_mm`` on the GPU; its for-loop on the CPU) or Tabby's (``torchtitan02.apply``)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    f = spec.fields
    args = Qwen3ModelArgs(
        dim=f["dim"], n_layers=f["n_layers"], n_heads=f["n_heads"], n_kv_heads=f["n_kv_heads"],
        vocab_size=f["vocab_size"], head_dim=f["head_dim"], qk_norm=True, rope_theta=1000000, max_seq_len=8192,
        attn_type=f["attention"], attn_mask_type="causal", moe_enabled=True, moe_inter_dim=f["moe_hidden_dim"],
        moe_args=MoEArgs(num_experts=f["num_experts"], num_shared_experts=0, top_k=f["top_k"], score_func="softmax",
                         route_norm=True, route_scale=1.0, score_before_experts=False,
                         use_grouped_mm=device.type == "cuda"))
    torch.manual_seed(seed)
    with torch.device(device):
        decoder = Qwen3Model(args)
    with torch.no_grad():
        decoder.init_weights(buffer_device=device)
    if backend == "tabby":
        import tabby.integrations.torchtitan02 as tabby_tt02

        tabby_tt02.apply(decoder, tabby_config)
    model = TorchtitanLM(decoder.to(torch.bfloat16), flex=f["attention"] == "flex", legacy=True)
    model.train()
    return model


def build_torchtitan_model(spec: ModelSpec, backend: str, seed: int, device: torch.device, tabby_config: str):
    """torchtitan's Qwen3-MoE in bf16: its own experts (``grouped_mm``: ``GroupedExperts``, which
    calls ``torch._grouped_mm``) or Tabby's through the override (``tabby``); torchtitan 0.2.x:
    ``build_torchtitan02_model``."""
    if torchtitan_legacy():
        return build_torchtitan02_model(spec, backend, seed, device, tabby_config)
    cfg = torchtitan_qwen3_config(**spec.fields)
    if backend == "tabby":
        import tabby.integrations.torchtitan as tabby_tt

        tabby_tt.apply(cfg, tabby_config)
    torch.manual_seed(seed)
    with torch.device(device):
        decoder = cfg.build()
        decoder.init_states(buffer_device=device)
    model = TorchtitanLM(decoder.to(torch.bfloat16), flex=spec.fields["attention"] == "flex")
    model.train()
    return model


def experts_of(model) -> list:
    """The routed experts' modules (their parameters are the routed weights)."""
    if isinstance(model, TorchtitanLM):
        if model.legacy:
            from torchtitan.models.moe.moe import GroupedExperts
        else:
            from torchtitan.models.common.moe import GroupedExperts

        return [m for m in model.modules() if isinstance(m, GroupedExperts)]
    from tabby.integrations.transformers import experts_modules

    return experts_modules(model)


def moe_blocks(model) -> list:
    """The sparse MoE blocks (router, experts and shared experts)."""
    if isinstance(model, TorchtitanLM):
        if model.legacy:
            from torchtitan.models.moe import MoE
        else:
            from torchtitan.models.common.moe import MoE

        return [m for m in model.modules() if isinstance(m, MoE)]
    from tabby.integrations.transformers import experts_modules

    experts = set(map(id, experts_modules(model)))
    return [m for m in model.modules() if any(id(c) in experts for c in m.children())]


def flops_per_token(model, spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the parameters one token uses (the embedding lookup aside;
    routed experts counted k / E) + the causal attention's 6 x layers x heads x head dim x seq_len
    (the score and value products, forward and backward, half the square; DeepSeek-V4's sparse
    attention: its top-k keys a query)."""
    routed = sum(p.numel() for m in experts_of(model) for p in m.parameters())
    if spec.framework == "torchtitan":
        f = spec.fields
        dense = sum(p.numel() for p in model.parameters()) - routed - model.decoder.tok_embeddings.weight.numel()
        active = dense + routed * f["top_k"] / f["num_experts"]
        return 6 * active + 6 * f["n_layers"] * f["n_heads"] * f["head_dim"] * seq_len
    cfg = model.config
    dense = sum(p.numel() for p in model.parameters()) - routed - model.get_input_embeddings().weight.numel()
    E = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts"}.get(spec.family, "n_routed_experts")
    active = dense + routed * cfg.num_experts_per_tok / getattr(cfg, E)
    if spec.family == "qwen3_moe":
        attn_dim = cfg.num_attention_heads * cfg.head_dim  # q.k and p.v both over head_dim
        attn = 6 * cfg.num_hidden_layers * attn_dim * seq_len
    elif spec.family == "gpt_oss":  # full layers causal (half the square); sliding ones their window of keys
        attn_dim = cfg.num_attention_heads * cfg.head_dim
        attn = sum(6 * attn_dim * seq_len if t == "full_attention" else 12 * attn_dim * min(cfg.sliding_window,
                                                                                              seq_len)
                   for t in cfg.layer_types)
    elif spec.family == "deepseek_v4":  # sparse: each query's index_topk keys at most (the indexer's own work aside)
        attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * min(cfg.index_topk, seq_len)
    else:  # MLA: q.k over nope + rope dims, p.v over v_head_dim
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn = 3 * cfg.num_hidden_layers * cfg.num_attention_heads * (qk + cfg.v_head_dim) * seq_len
    return 6 * active + attn


# ---------------------------------------------------------------------------------------------
# One run


@dataclass
class Run:
    model: str
    backend: str
    mode: str
    seed: int
    steps: int
    deterministic: bool = False
    loss: list = field(default_factory=list)
    grad_norm: list = field(default_factory=list)
    tokens_per_s: float | None = None
    step_ms: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_gb: float | None = None
    moe_ms: float | None = None  # the MoE blocks' forward + backward per step (eager attribution)
    moe_share: float | None = None
    setup_s: float | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.backend} {self.mode} seed {self.seed}" + (" deterministic" if self.deterministic else "")


class Stepper:
    """One training step of ``model`` on a batch, in the run's mode. ``step(ids)`` returns the
    step's (loss, grad norm) as device tensors (no host synchronization)."""

    def __init__(self, model, mode: str, lr: float, device: torch.device):
        self.model, self.mode = model, mode
        cuda = device.type == "cuda"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.1, fused=cuda,
                                     capturable=(mode == "graph"))
        self.forward = torch.compile(model) if mode == "compile" else model
        self.graph = None
        self.static_ids = None

    def _step(self, ids):
        loss = self.forward(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        gn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        torch.nn.utils.clip_grads_with_norm_(self.params, 1.0, gn, foreach=True)
        self.opt.step()
        return loss.detach(), gn.detach()

    def step(self, ids):
        if self.mode != "graph":
            out = self._step(ids)
            self.opt.zero_grad(set_to_none=True)
            return out
        if self.graph is None:
            self._capture(ids)
        self.static_ids.copy_(ids)
        self.graph.replay()
        return self.static_loss.clone(), self.static_gn.clone()

    def _capture(self, ids):
        """Capture the whole step. The first step is taken eagerly on a side stream (it makes the
        optimizer state, the gradients' first allocation and every lazy workspace), the captured
        step replaces it: the run's first recorded step is the first replay."""
        self.static_ids = ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        snapshot = [p.detach().clone() for p in self.params]
        with torch.cuda.stream(side):
            self._step(self.static_ids)
            self.opt.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():  # undo the warm-up step: the replays start from the initial weights
            for p, s in zip(self.params, snapshot):
                p.copy_(s)
            for st in self.opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        v.zero_()
        del snapshot
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss, self.static_gn = self._step(self.static_ids)


def attribute_moe(model, batches, steps: int) -> float | None:
    """Milliseconds per step in the MoE blocks (forward + backward), from CUDA events recorded by
    module hooks over ``steps`` eager steps (the backward interval: from the block's output
    gradient to its input gradient, which holds the router's and the experts' gradients)."""
    if not torch.cuda.is_available() or not steps:
        return None
    blocks = moe_blocks(model)
    pairs, handles = [], []

    def ev():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    for b in blocks:
        state = {}
        handles.append(b.register_forward_pre_hook(lambda m, a, s=state: s.__setitem__("f", ev())))
        handles.append(b.register_forward_hook(lambda m, a, o, s=state: pairs.append((s.pop("f"), ev()))))
        handles.append(b.register_full_backward_pre_hook(lambda m, g, s=state: s.__setitem__("b", ev())))
        handles.append(b.register_full_backward_hook(lambda m, gi, go, s=state: pairs.append((s.pop("b"), ev()))))
    eager = Stepper(model, "eager", 0.0, next(model.parameters()).device)  # lr 0: the weights stay
    try:
        for i in range(steps):
            eager.step(batches(i))
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    return sum(a.elapsed_time(b) for a, b in pairs) / steps


def train_one(spec: ModelSpec, backend: str, mode: str, seed: int, steps: int, deterministic: bool,
              cfg: TrainConfig, corpus, device: torch.device, flops_tok: list) -> Run:
    """Train one run; progress lines while it runs."""
    run = Run(spec.name, backend, mode, seed, steps, deterministic)
    torch.use_deterministic_algorithms(deterministic)
    try:
        return _train(run, spec, cfg, corpus, device, flops_tok)
    finally:
        torch.use_deterministic_algorithms(False)


def _train(run: Run, spec: ModelSpec, cfg: TrainConfig, corpus, device: torch.device, flops_tok: list) -> Run:
    backend, mode, seed, steps = run.backend, run.mode, run.seed, run.steps
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:  # (the previous run's memory was released after it: release_implementation)
        torch.cuda.reset_peak_memory_stats()
    model = build_model(spec, backend, seed, device, cfg.tabby_config)
    if not flops_tok:
        flops_tok.append(flops_per_token(model, spec, spec.seq(cfg)))
    seq = spec.seq(cfg)
    rows = max(1, cfg.tokens // seq)

    def batch(i):
        start = (i * rows) % max(1, corpus.shape[0] - rows + 1)
        return corpus[start:start + rows, :seq].to(device, non_blocking=True)

    stepper = Stepper(model, mode, cfg.lr, device)
    losses, norms = [], []
    warm = min(cfg.warmup_steps, max(0, steps - 1))
    t_start = None
    name = f"[{spec.name} {run.label}]"
    for i in range(steps):
        if i == warm:
            if cuda:
                torch.cuda.synchronize()
            t_start = time.perf_counter()
            run.setup_s = t_start - t0
        loss, gn = stepper.step(batch(i))
        losses.append(loss)
        norms.append(gn)
        if (i + 1) % cfg.log_every == 0 or i + 1 == steps:
            now = time.perf_counter()
            done = i + 1 - warm
            rate = (done * rows * seq / (now - t_start)) if t_start is not None and done > 0 else None
            eta = (steps - i - 1) * (now - t_start) / done if rate else None
            print(f"{name} step {i + 1}/{steps} loss {loss.item():.4f} grad norm {gn.item():.3f}"
                  + (f" | {rate:,.0f} tok/s | ETA {eta:.0f} s" if rate else ""), flush=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_start
    timed = steps - warm
    run.step_ms = elapsed / timed * 1e3
    run.tokens_per_s = timed * rows * seq / elapsed
    run.loss = torch.stack(losses).float().cpu().tolist()
    run.grad_norm = torch.stack(norms).float().cpu().tolist()
    run.tflops = flops_tok[0] * run.tokens_per_s / 1e12
    if cuda:
        run.peak_mem_gb = torch.cuda.max_memory_allocated() / 1e9
        peak = gpu_peak_tflops()
        run.mfu = run.tflops / peak if peak else None
        if mode == "eager" and cfg.attribute_steps:
            run.moe_ms = attribute_moe(model, batch, cfg.attribute_steps)
            run.moe_share = run.moe_ms / run.step_ms if run.moe_ms is not None else None
        if cfg.profile_dir:
            profile_kernels(stepper, batch, os.path.join(cfg.profile_dir, f"kernels-{spec.name}-{backend}-{mode}.txt"))
    del stepper, model
    return run


def profile_kernels(stepper: Stepper, batches, path: str, steps: int = 2) -> None:
    """GPU time of ``steps`` steps (torch.profiler) to ``path``: by operator, then by kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        for i in range(steps):
            stepper.step(batches(i))
        torch.cuda.synchronize()
    events = prof.key_averages()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{steps} {stepper.mode} steps: operators by their own GPU time\n")
        f.write(events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
        kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in kernels)
        f.write(f"\n{steps} {stepper.mode} steps: kernels, {total / 1e3 / steps:.1f} ms per step\n")
        for e in kernels[:40]:
            f.write(f"{e.self_device_time_total / 1e3 / steps:9.2f} ms/step {e.count // steps:6d}x  {e.key[:160]}\n")


def gpu_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    for key, v in PEAK_BF16_TFLOPS.items():
        if key in name.split() or f" {key} " in f" {name} ".replace("-", " "):
            return v
    return None


# ---------------------------------------------------------------------------------------------
# The suite and its report


def suite_runs(cfg: TrainConfig) -> list:
    """(backend, mode, seed, steps, deterministic) of one model, in the order they run."""
    runs = []
    for mode in cfg.modes:
        for backend in cfg.backends:
            runs.append((backend, mode, 0, cfg.steps if mode == "eager" else cfg.mode_steps, False))
    if cfg.repeat and "eager" in cfg.modes:
        if "tabby" in cfg.backends:
            runs += [("tabby", "eager", 0, cfg.steps, True)] * 2
        base = [b for b in cfg.backends if b != "tabby"]
        if base:
            runs += [(base[0], "eager", 0, cfg.steps, False), (base[0], "eager", 1, cfg.steps, False)]
    return runs


def smooth(xs: list, window: int = 10) -> list:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def compare(runs: list) -> dict:
    """Per model: Tabby's speedup over the baseline per mode, the loss agreement and the bitwise
    repeat. Loss agreement: the first step's losses, and the largest gap between the smoothed
    curves of Tabby and the baseline at seed 0 against the run-to-run noise: the gap between two
    baseline runs at seed 0 (its own noise), between the baseline's two seeds, and between two
    Tabby runs that differ only in rounding (attention's backward with and without deterministic
    algorithms)."""
    out = {}
    for model in dict.fromkeys(r.model for r in runs):
        rs = [r for r in runs if r.model == model and r.error is None]
        c = {}

        def find(backend, mode, seed=0, nth=0, det=False, rs=rs):
            m = [r for r in rs if r.backend == backend and r.mode == mode and r.seed == seed
                 and r.deterministic == det]
            return m[nth] if len(m) > nth else None

        base_name = next((r.backend for r in rs if r.backend != "tabby"), None)
        speed = {}
        for mode in MODES:
            t, b = find("tabby", mode), find(base_name, mode) if base_name else None
            if t and b:
                speed[mode] = t.tokens_per_s / b.tokens_per_s
        bests = {bk: max((r.tokens_per_s for r in rs if r.backend == bk), default=None) for bk in BACKENDS}
        if bests.get("tabby") and base_name and bests.get(base_name):
            speed["best"] = bests["tabby"] / bests[base_name]
        c["speedup"] = speed
        d0, d1 = find("tabby", "eager", det=True), find("tabby", "eager", nth=1, det=True)
        if d0 and d1:
            c["bitwise_repeat"] = d0.loss == d1.loss and d0.grad_norm == d1.grad_norm
        t0 = find("tabby", "eager")
        b0, b1 = (find(base_name, "eager"), find(base_name, "eager", seed=1)) if base_name else (None, None)
        if t0 and b0:
            n = min(len(t0.loss), len(b0.loss))
            c["first_loss"] = {"tabby": t0.loss[0], base_name: b0.loss[0],
                               "rel_diff": abs(t0.loss[0] - b0.loss[0]) / abs(b0.loss[0])}
            st, sb = smooth(t0.loss[:n]), smooth(b0.loss[:n])
            c["max_smoothed_diff_vs_baseline"] = max(abs(a - b) for a, b in zip(st, sb))
            c["final_loss"] = {"tabby": st[-1], base_name: sb[-1]}
            noise = []
            b0r = find(base_name, "eager", nth=1)
            if b0r:
                c["baseline_repeat_spread"] = max(abs(a - b) for a, b in zip(sb, smooth(b0r.loss[:n])))
                noise.append(c["baseline_repeat_spread"])
            if b1:
                c["baseline_seed_spread"] = max(abs(a - b) for a, b in zip(sb, smooth(b1.loss[:n])))
                noise.append(c["baseline_seed_spread"])
            if d0:
                c["rounding_spread"] = max(abs(a - b) for a, b in zip(st, smooth(d0.loss[:n])))
                noise.append(c["rounding_spread"])
            if noise:
                c["within_run_to_run_noise"] = c["max_smoothed_diff_vs_baseline"] <= max(noise)
        out[model] = c
    return out


def table(runs: list) -> str:
    head = ["model", "experts", "mode", "det", "seed", "steps", "tokens/s", "ms/step", "TFLOP/s", "MFU", "peak GB",
            "MoE ms", "MoE share", "first loss", "last loss (avg 10)"]
    rows = []
    for r in runs:
        if r.error:
            rows.append([r.model, r.backend, r.mode, "yes" if r.deterministic else "", str(r.seed), str(r.steps),
                         "error: " + r.error[:60]] + ["-"] * (len(head) - 7))
            continue

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        rows.append([r.model, r.backend, r.mode, "yes" if r.deterministic else "", str(r.seed), str(r.steps), f(r.tokens_per_s, ",.0f"),
                     f(r.step_ms, ".1f"), f(r.tflops, ".1f"), f(r.mfu and 100 * r.mfu, ".1f") + ("%" if r.mfu else ""),
                     f(r.peak_mem_gb, ".1f"), f(r.moe_ms, ".1f"),
                     f(r.moe_share and 100 * r.moe_share, ".0f") + ("%" if r.moe_share else ""),
                     f(r.loss[0] if r.loss else None, ".4f"), f(sum(r.loss[-10:]) / len(r.loss[-10:]), ".4f")])
    return markdown_table(head, rows, right=set(range(4, len(head))))


def plot(runs: list, entropy: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r.model for r in runs))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        seen = set()
        for r in runs:
            if r.model != model or r.error or not r.loss:
                continue
            label = r.label + (" (repeat)" if r.label in seen else "")
            seen.add(r.label)
            ax.plot(range(1, len(r.loss) + 1), r.loss, lw=1.0, alpha=0.85, label=label,
                    ls="--" if "(repeat)" in label else "-")
        if model in entropy:
            ax.axhline(entropy[model], color="gray", lw=0.8, ls=":", label="corpus entropy (best possible)")
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(cfg: TrainConfig) -> dict:
    """Train the suite of every model; write JSON, the table and the loss chart; return the result."""
    import tabby.integrations.transformers as tabby_hf
    from tabby.functional import moe as layer

    unknown = [m for m in cfg.models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    # cuBLAS is deterministic with a fixed workspace (needed by the deterministic runs; set for every
    # run so that all share one cuBLAS configuration; read when cuBLAS starts)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and any(m != "eager" for m in cfg.modes):
        raise ValueError("without a GPU only --modes eager runs (compile and graph need CUDA)")
    tabby_hf.register(layer.parse_config(cfg.tabby_config) if cfg.tabby_config else None)
    info = machine_info()
    info["peak_bf16_tflops"] = gpu_peak_tflops()
    print(f"tabby train: {info['machine']}; torch {info['torch']}, triton {info['triton']}, commit "
          f"{info['git_commit']}; {cfg.tokens} tokens/step, seq {cfg.seq_len}", flush=True)
    runs, entropy, flops = [], {}, {}
    for name in cfg.models:
        spec = MODELS[name]
        seq = spec.seq(cfg)
        rows = max(1, cfg.tokens // seq)
        corpus, entropy[name] = make_corpus(spec.fields["vocab_size"], max(cfg.steps, cfg.mode_steps) * rows * seq,
                                            seq)
        print(f"{name}: {spec.about}; corpus {corpus.numel():,} tokens, entropy {entropy[name]:.3f} nats/token",
              flush=True)
        flops_tok: list = []
        for backend, mode, seed, steps, det in suite_runs(cfg):
            try:
                r = train_one(spec, backend, mode, seed, steps, det, cfg, corpus, device, flops_tok)
            except Exception as e:  # noqa: BLE001 -- a failed run is reported in the table, the rest go on
                r = Run(name, backend, mode, seed, steps, det, error=f"{type(e).__name__}: {e}")
                print(f"[{name} {r.label}] FAILED: {r.error[:500]}", flush=True)
            runs.append(r)
            release_implementation()
        flops[name] = flops_tok[0] if flops_tok else None
    result = dict(format="tabby-train/1", **info, config=asdict(cfg), flops_per_token=flops, corpus_entropy=entropy,
                  seq_len={name: MODELS[name].seq(cfg) for name in cfg.models},  # (a model's own where it has one)
                  runs=[dict(asdict(r), label=r.label) for r in runs], comparison=compare(runs))
    text = table(runs)
    print("\n" + text, flush=True)
    for model, c in result["comparison"].items():
        print(f"{model}: {json.dumps(c)}", flush=True)
    out = cfg.out or default_out_dir()
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, file_stem(info, cfg.tag).replace("bench-", "train-", 1))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# tabby train: {info['machine']}, commit {info['git_commit']}, {info['date']}\n\n{text}\n")
    drawn = plot(runs, entropy, stem + "-loss.png")
    print(f"wrote {stem}.json, {stem}.md" + (f", {stem}-loss.png" if drawn else ""), flush=True)
    result["files"] = [stem + ".json", stem + ".md"] + ([stem + "-loss.png"] if drawn else [])
    result["failed"] = any(r.error for r in runs) or any(
        c.get("bitwise_repeat") is False for c in result["comparison"].values())
    if any(math.isnan(x) for r in runs for x in r.loss):
        result["failed"] = True
    return result
