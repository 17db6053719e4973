"""transformers' experts backend "tabby": a tiny Qwen3-MoE (bf16) trains 3 steps with Tabby and
matches transformers' grouped_mm in loss and gradients; the expert-parallel helper on two
simulated ranks matches one process; sentinel ids; unsupported experts fall back.

Needs transformers 5.x (the "integrations" extra: pip install "tabby[integrations]"); skipped
without it."""
import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", minversion="5.0")

import tabby.integrations.transformers as tabby_hf  # noqa: E402
from tabby.functional.config import MoEConfig, Tuning  # noqa: E402
from tabby.functional.threads import run_ranks  # noqa: E402

# Small tiles and dispatch blocks: the interpreter's time goes with the padded rows and programs.
CFG = MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4))
TOL = 3e-2  # bf16 model, two implementations of the experts


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tiny_qwen3_moe(implementation, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.set_experts_implementation(implementation)
    return model


def batch(seed, rows=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (rows, seq), generator=g)
    return ids


@pytest.fixture(scope="module", autouse=True)
def registered():
    tabby_hf.register(CFG)
    yield


def test_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "tabby" in ALL_EXPERTS_FUNCTIONS
    model = tiny_qwen3_moe("tabby")
    assert model.config._experts_implementation == "tabby"
    assert len(list(tabby_hf.experts_modules(model))) == 2


def train(model, steps=3):
    """Loss and every parameter's gradient at each of ``steps`` AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def test_trains_like_grouped_mm():
    """Same init, same batches, AdamW: the losses of every step agree to bf16 rounding; the first
    step's gradients agree parameter by parameter; later steps start from weights that differ by
    rounding (a token's top-k can flip, which moves the router's gradient), so there the whole
    gradient is compared."""
    tabby_model = tiny_qwen3_moe("tabby")
    base = tiny_qwen3_moe("grouped_mm")
    for a, b in zip(tabby_model.parameters(), base.parameters()):
        assert torch.equal(a, b)
    losses_t, grads_t = train(tabby_model)
    losses_b, grads_b = train(base)
    for step, (lt, lb) in enumerate(zip(losses_t, losses_b)):
        assert abs(lt - lb) / abs(lb) < 1e-3, (step, lt, lb)
    for name in grads_b[0]:
        assert rel(grads_t[0][name], grads_b[0][name]) < TOL, (name, rel(grads_t[0][name], grads_b[0][name]))
    for step, (gt, gb) in enumerate(zip(grads_t, grads_b)):
        flat_t = torch.cat([gt[n].flatten().float() for n in gb])
        flat_b = torch.cat([gb[n].flatten().float() for n in gb])
        assert rel(flat_t, flat_b) < TOL, (step, rel(flat_t, flat_b))
    assert losses_t[-1] < losses_t[0]  # it learns


def test_sentinel_ids_and_fallback():
    """transformers' expert-parallel sentinel (id == num_experts) contributes nothing; experts that
    are not SwiGLU run transformers' grouped_mm."""
    model = tiny_qwen3_moe("tabby")
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g).bfloat16()
    idx = torch.randint(0, 8, (8, 2), generator=g)
    w = torch.rand(8, 2, generator=g).bfloat16()
    sentinel = idx.clone()
    sentinel[::2, 1] = 8
    with torch.no_grad():
        y = experts(x, sentinel, w)
        ref = transformers.integrations.moe.grouped_mm_experts_forward(experts, x, idx, w.masked_fill(sentinel == 8, 0))
        assert rel(y, ref) < TOL
        experts.act_fn = torch.nn.ReLU()  # relu(g) * u: none of Tabby's activations, falls back
        for cached in ("_tabby_gate", "_tabby_calls"):  # (the gate is found once per module: forget it)
            experts.__dict__.pop(cached)
        y2 = experts(x, idx, w)
        assert tabby_hf._supported(experts) is not None
        assert torch.equal(y2, transformers.integrations.moe.grouped_mm_experts_forward(experts, x, idx, w))


def test_expert_parallel_two_simulated_ranks():
    """shard_experts over 2 simulated ranks, each with its own half of the batch: every rank's loss
    equals one process's on that half, and the experts' gradients gathered from the ranks equal
    one process's on the whole batch (Tabby's backward brings every rank's tokens' share home)."""
    W = 2
    model = tiny_qwen3_moe("tabby", seed=3)
    ids = batch(7, rows=W, seq=8)
    tabby_hf.set_config(model, CFG)

    def rank_fn(r, group):
        m = tabby_hf.shard_experts(copy.deepcopy(model), group)
        loss = m(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss
        (loss / W).backward()
        ex = {n: p.grad for n, p in m.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
        shapes = {n: p.shape[0] for n, p in m.named_parameters() if n.endswith("gate_up_proj")}
        return loss.detach(), ex, shapes

    outs = run_ranks(W, rank_fn)
    assert all(n == 4 for n in outs[0][2].values())  # 8 experts over 2 ranks
    # one process, the whole batch: its loss is the mean of the rows' losses
    logits = model(input_ids=ids).logits.float()
    row_losses = [F.cross_entropy(logits[r, :-1], ids[r, 1:]) for r in range(W)]
    for r in range(W):
        assert abs(outs[r][0] - row_losses[r]) / row_losses[r] < 1e-2
    (sum(row_losses) / W).backward()
    for name, p in model.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")):
            gathered = torch.cat([outs[r][1][name] for r in range(W)], dim=0)
            assert rel(gathered, p.grad) < TOL, name
