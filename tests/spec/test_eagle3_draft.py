"""EAGLE-3 drafts in the published layout: loading (names, reduced vocabulary, shared embedding,
clear errors) and the cached, chained forward against a reference that recomputes every position
from scratch with its own attention loop."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from moeserve.models.eagle3 import DraftRows, DraftShard, Eagle3Config, Eagle3Draft

TARGET_LAYERS, TARGET_HIDDEN, VOCAB, DRAFT_VOCAB = 12, 24, 50, 32
CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": TARGET_HIDDEN,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def published_tensors(seed: int = 0, own_embedding: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, t, hd = 32, TARGET_HIDDEN, 8

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    out = {
        "fc.weight": w(h, 3 * t),
        "midlayer.self_attn.q_proj.weight": w(4 * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(2 * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(2 * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, 4 * hd),
        "midlayer.mlp.gate_proj.weight": w(48, h),
        "midlayer.mlp.up_proj.weight": w(48, h),
        "midlayer.mlp.down_proj.weight": w(h, 48),
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "lm_head.weight": w(DRAFT_VOCAB, h),
        # draft id i -> target id i + d2t[i]: a sorted subset of the target's vocabulary
        "d2t": torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }
    if own_embedding:
        out["embed_tokens.weight"] = torch.randn(VOCAB, h, generator=g)
    return out


@pytest.fixture
def draft_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(published_tensors(), str(tmp_path / "model.safetensors"))
    return tmp_path


TARGET_EMBED = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(9))


def load(path) -> Eagle3Draft:
    return Eagle3Draft.load(path, TARGET_LAYERS, TARGET_HIDDEN, TARGET_EMBED)


def reference_pass(t: dict, tokens: list[int], hidden: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from position 0, no cache: every query against every earlier key, head by head."""

    def norm(x, wt):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * wt

    def rope(x, pos):  # x: [heads, d]
        a = pos * inv_freq
        c, s = torch.cat([a.cos(), a.cos()]), torch.cat([a.sin(), a.sin()])
        rot = torch.cat([-x[:, 4:], x[:, :4]], dim=-1)
        return x * c + rot * s

    p = "midlayer."
    emb = TARGET_EMBED[tokens]
    x = torch.cat([norm(emb, t[p + "input_layernorm.weight"]), norm(hidden, t[p + "hidden_norm.weight"])], -1)
    n = len(tokens)
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(n, 4, 8)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(n, 2, 8)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, 2, 8)
    q = torch.stack([rope(q[i], i) for i in range(n)])
    k = torch.stack([rope(k[i], i) for i in range(n)])
    out = torch.zeros(n, 4, 8)
    for i in range(n):
        for head in range(4):
            kv = head // 2
            scores = torch.stack([q[i, head] @ k[j, kv] for j in range(i + 1)]) / math.sqrt(8)
            out[i, head] = scores.softmax(0) @ v[: i + 1, kv]
    r = hidden + out.reshape(n, 32) @ t[p + "self_attn.o_proj.weight"].T
    m = norm(r, t[p + "post_attention_layernorm.weight"])
    r = (
        r
        + (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T))
        @ t[p + "mlp.down_proj.weight"].T
    )
    return norm(r, t["norm.weight"]) @ t["lm_head.weight"].T, r


def reference_drafts(t, tokens, aux, k, inv_freq) -> list[int]:
    """Greedy chain by recomputing the whole sequence every step."""
    hidden = aux @ t["fc.weight"].T
    toks = list(tokens)
    out = []
    for _ in range(k):
        logits, r = reference_pass(t, toks, hidden, inv_freq)
        d = int(logits[-1].argmax())
        d_target = d + int(t["d2t"][d])
        out.append(d_target)
        toks.append(d_target)
        hidden = torch.cat([hidden, r[-1:]])  # the chained position reads the draft's own pre-norm state
    return out


def test_config_reads_the_published_fields():
    cfg = Eagle3Config.from_dict(CONFIG, TARGET_LAYERS)
    assert (cfg.head_dim, cfg.draft_vocab_size, cfg.target_hidden_size) == (8, DRAFT_VOCAB, TARGET_HIDDEN)
    assert cfg.aux_layer_ids == (2, 6, 9)  # 2, N // 2, N - 3
    named = Eagle3Config.from_dict({**CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 10]}}, TARGET_LAYERS)
    assert named.aux_layer_ids == (1, 5, 10)


def test_drafts_equal_full_recomputation(draft_dir):
    draft = load(draft_dir)
    t = published_tensors()
    g = torch.Generator().manual_seed(1)
    seqs = {7: [3, 14, 15, 9, 26], 8: [1, 2], 9: [40]}
    aux = {s: torch.randn(len(toks), 3 * TARGET_HIDDEN, generator=g) for s, toks in seqs.items()}
    rows = DraftRows(list(seqs), [0] * 3, [len(x) for x in seqs.values()])
    got = draft.propose(torch.tensor(sum(seqs.values(), [])), torch.cat(list(aux.values())), rows, k=3)
    want = [reference_drafts(t, seqs[s], aux[s], 3, draft.inv_freq) for s in seqs]
    assert got.tolist() == want
    assert all(0 <= i < VOCAB for row in want for i in row)


def test_writing_at_an_earlier_position_rolls_the_cache_back(draft_dir):
    """After a pass that proposed 3 drafts, the target accepted one: the next pass writes from
    there, and must give what a fresh draft gives on the accepted sequence."""
    draft = load(draft_dir)
    t = published_tensors()
    g = torch.Generator().manual_seed(2)
    prompt = [5, 6, 7, 8]
    aux = torch.randn(4, 3 * TARGET_HIDDEN, generator=g)
    first = draft.propose(torch.tensor(prompt), aux, DraftRows([1], [0], [4]), k=3)[0].tolist()
    accepted = [first[0], 11]  # d1 accepted, then the target's own token
    new_aux = torch.randn(2, 3 * TARGET_HIDDEN, generator=g)
    again = draft.propose(torch.tensor(accepted), new_aux, DraftRows([1], [4], [2]), k=2)[0].tolist()
    assert again == reference_drafts(t, prompt + accepted, torch.cat([aux, new_aux]), 2, draft.inv_freq)
    assert draft.cache.length(1) == 4 + 2 + 1  # the last chained draft's key is kept until overwritten
    draft.free(1)
    assert draft.cache.length(1) == 0


def test_own_embedding_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = published_tensors(own_embedding=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    draft = Eagle3Draft.load(tmp_path, TARGET_LAYERS, TARGET_HIDDEN)  # no target embedding needed
    assert torch.equal(draft.embed_tokens, tensors["embed_tokens.weight"])
    with pytest.raises(ValueError, match="fuses hidden states of size 24, the target's are 16"):
        Eagle3Draft.load(tmp_path, TARGET_LAYERS, 16)
    del tensors["midlayer.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor for up_proj.weight"):
        Eagle3Draft.load(tmp_path, TARGET_LAYERS, TARGET_HIDDEN)
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        Eagle3Config.from_dict({**CONFIG, "architectures": ["LlamaForCausalLM"]}, TARGET_LAYERS)
    with pytest.raises(ValueError, match="must be three of the target's 12 layers"):
        Eagle3Config.from_dict({**CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 20, 3]}}, TARGET_LAYERS)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Eagle3Draft.load(tmp_path / "nowhere", TARGET_LAYERS, TARGET_HIDDEN)


@pytest.mark.parametrize("ranks", [2, 4])
def test_own_embedding_split_over_tp_ranks_sums_to_the_whole_lookup(tmp_path, ranks):
    """Under TP a draft's own table is cut into vocabulary rows (at 4 ranks the last holds 11 of
    its 13 rows: the rest are zeros); each rank looks up only the tokens it holds, and the ranks'
    parts sum to the whole table's lookup."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = published_tensors(own_embedding=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = torch.tensor([0, 12, 13, 25, 26, 38, 39, VOCAB - 1, 7, 7])
    parts = []
    for rank in range(ranks):
        draft = Eagle3Draft.load(tmp_path, TARGET_LAYERS, TARGET_HIDDEN, shard=DraftShard(ranks, rank))
        assert draft.embed_tokens.shape[0] == -(-VOCAB // ranks)
        parts.append(draft._local_embeds(ids))
        held = (ids >= draft.embed_start) & (ids < draft.embed_start + draft.embed_tokens.shape[0])
        assert torch.equal(parts[-1].abs().sum(-1) > 0, held)
    torch.testing.assert_close(sum(parts), tensors["embed_tokens.weight"][ids], rtol=0, atol=0)


def test_llama3_rope_scaling_matches_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    from moeserve.models.eagle3 import rope_inv_freq

    cfg = Eagle3Config.from_dict(CONFIG, TARGET_LAYERS)
    hf = LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        rope_theta=10000.0,
        rope_scaling=dict(CONFIG["rope_scaling"]),
        max_position_embeddings=128,
    )
    want, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.allclose(rope_inv_freq(cfg), want.float(), rtol=1e-6)


# An MLA draft (Kimi K2.x's published layout, ``Eagle3DeepseekV2ForCausalLM``) with YaRN rope.
MLA_CONFIG = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "vocab_size": VOCAB,
    "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": TARGET_HIDDEN,
}


def mla_tensors(q_lora_rank: int | None, seed: int = 3) -> dict[str, torch.Tensor]:
    t = published_tensors(seed)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        del t[f"midlayer.self_attn.{name}.weight"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    a = "midlayer.self_attn."
    if q_lora_rank:
        t[a + "q_a_proj.weight"] = w(q_lora_rank, 64)
        t[a + "q_a_layernorm.weight"] = 1 + 0.1 * torch.randn(q_lora_rank, generator=g)
        t[a + "q_b_proj.weight"] = w(4 * 12, q_lora_rank)
    else:
        t[a + "q_proj.weight"] = w(4 * 12, 64)
    t[a + "kv_a_proj_with_mqa.weight"] = w(16 + 4, 64)
    t[a + "kv_a_layernorm.weight"] = 1 + 0.1 * torch.randn(16, generator=g)
    t[a + "kv_b_proj.weight"] = w(4 * (8 + 6), 16)
    t[a + "o_proj.weight"] = w(32, 4 * 6)
    return t


def transformers_mla_pass(t: dict, config: dict, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_pass`` with transformers' DeepSeek-V3 attention (its q / kv projections widened
    to the draft's ``2 H`` input, its output projection the draft's) over the whole sequence."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    fields = ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps")
    hf = DeepseekV3Config(
        hidden_size=64,
        num_key_value_heads=4,
        q_lora_rank=config.get("q_lora_rank"),
        rope_theta=config["rope_theta"],
        rope_scaling=dict(config["rope_scaling"]),
        max_position_embeddings=64,
        rope_interleave=True,
        **{f: config[f] for f in fields},
    )
    hf._attn_implementation = "eager"
    attn = DeepseekV3Attention(hf, 0)
    attn.o_proj = torch.nn.Linear(4 * 6, 32, bias=False)
    attn.load_state_dict({k[len("midlayer.self_attn.") :]: v for k, v in t.items() if k.startswith("midlayer.self_attn.")})
    p = "midlayer."

    def norm(x, wt):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * wt

    n = len(tokens)
    x = torch.cat([norm(TARGET_EMBED[tokens], t[p + "input_layernorm.weight"]), norm(hidden, t[p + "hidden_norm.weight"])], -1)
    cos_sin = DeepseekV3RotaryEmbedding(hf)(x[None], torch.arange(n)[None])
    with torch.no_grad():
        out = attn(x[None], cos_sin, torch.full((n, n), float("-inf")).triu(1)[None, None])[0][0]
    r = hidden + out
    m = norm(r, t[p + "post_attention_layernorm.weight"])
    r = (
        r
        + (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T))
        @ t[p + "mlp.down_proj.weight"].T
    )
    return norm(r, t["norm.weight"]) @ t["lm_head.weight"].T, r


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_draft_equals_transformers_deepseek_attention(tmp_path, q_lora_rank):
    """An MLA draft (absorbed latent cache, YaRN rope on interleaved pairs, YaRN's softmax scale)
    against transformers' DeepSeek-V3 attention recomputing every position: the same layer
    outputs, and the same chained drafts after a rolled-back pass."""
    pytest.importorskip("transformers")
    config = {**MLA_CONFIG, **({"q_lora_rank": q_lora_rank} if q_lora_rank else {})}
    t = mla_tensors(q_lora_rank)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(t, str(tmp_path / "model.safetensors"))
    draft = load(tmp_path)
    assert draft.cfg.is_mla and draft.cache_heads == 1
    g = torch.Generator().manual_seed(4)
    tokens = [3, 14, 15, 9, 26, 5, 35]
    fused = torch.randn(len(tokens), 3 * TARGET_HIDDEN, generator=g) @ t["fc.weight"].T
    with torch.no_grad():
        got = draft.layer(torch.tensor(tokens), fused, DraftRows([1], [0], [len(tokens)]))
    _, want = transformers_mla_pass(t, config, tokens, fused)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def chain(toks, hidden, k):  # greedy drafts by recomputing the whole sequence each time
        toks, out = list(toks), []
        for _ in range(k):
            logits, r = transformers_mla_pass(t, config, toks, hidden)
            d = int(logits[-1].argmax())
            out.append(d + int(t["d2t"][d]))
            toks.append(out[-1])
            hidden = torch.cat([hidden, r[-1:]])
        return out

    draft.free(1)
    aux = torch.randn(5, 3 * TARGET_HIDDEN, generator=g)
    first = draft.propose(torch.tensor(tokens[:5]), aux, DraftRows([1], [0], [5]), k=3)[0].tolist()
    assert first == chain(tokens[:5], aux @ t["fc.weight"].T, 3)
    more = torch.randn(2, 3 * TARGET_HIDDEN, generator=g)  # one draft accepted, then the target's token
    again = draft.propose(torch.tensor([first[0], 11]), more, DraftRows([1], [5], [2]), k=2)[0].tolist()
    assert again == chain(tokens[:5] + [first[0], 11], torch.cat([aux, more]) @ t["fc.weight"].T, 2)


def test_mla_draft_through_emulated_graphs_proposes_the_same(tmp_path):
    """The draft's passes through its graphs' static buffers (cut at the attention; emulated on
    CPU): an MLA draft's absorbed queries and latent outputs fit them, the same drafts as eager."""
    from moeserve.engine.eagle3_graphs import DraftGraphs

    (tmp_path / "config.json").write_text(json.dumps({**MLA_CONFIG, "q_lora_rank": 24}))
    save_file(mla_tensors(24), str(tmp_path / "model.safetensors"))
    draft = load(tmp_path)
    g = torch.Generator().manual_seed(5)
    tokens = torch.tensor([3, 14, 15, 9, 26, 1, 2])
    aux = torch.randn(7, 3 * TARGET_HIDDEN, generator=g)
    rows = DraftRows([7, 8], [0, 0], [5, 2])
    eager = draft.propose(tokens, aux, rows, k=3)
    for seq in (7, 8):
        draft.free(seq)
    graphs = DraftGraphs(draft, [4, 8], max_rows=2, mempool=None, emulate=True)
    graphs.capture()
    assert torch.equal(draft.propose(tokens, aux, rows, k=3, passes=graphs), eager)


def test_packaged_demo_draft_proposes_the_demo_models_greedy_tokens():
    """The EAGLE-3 draft trained for the demo model (scripts/train_demo_eagle3.py), through the
    inference module: at random positions of held-out conversations' completions, a first pass
    over the prefix and one chained pass, against the demo model's own greedy tokens there (the
    second counted where the text took the first draft's token, as the chain then reads what it
    reads at inference)."""
    import random

    from tokenizers import Tokenizer

    from moeserve.config import load_model_config
    from moeserve.demo import EAGLE3_DIR, MODEL_DIR, tasks
    from moeserve.demo.quantize import dequantized_tensors
    from moeserve.demo.torch_model import DemoModel

    cfg = load_model_config(str(MODEL_DIR))
    target = DemoModel(cfg)
    target.load_hf_state_dict(dequantized_tensors(MODEL_DIR))
    target.eval()
    draft = Eagle3Draft.load(EAGLE3_DIR, cfg.num_hidden_layers, cfg.hidden_size, target.model.embed_tokens.weight.detach())
    layers = draft.cfg.aux_layer_ids
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    rng = random.Random(0)
    first = both = n = 0
    with torch.no_grad():
        for s in tasks.held_out_text(8):
            prompt = tok.encode(s.prompt(), add_special_tokens=False).ids
            ids = torch.tensor([prompt + tok.encode(s.completion(), add_special_tokens=False).ids])
            T = ids.shape[1]
            x = target.model.embed_tokens(ids)
            cos, sin = target._rope(T, ids.device, x.dtype)
            aux = []
            for i, layer in enumerate(target.model.layers[: cfg.num_hidden_layers]):
                if i in layers:
                    aux.append(x)
                x = layer(x, cos, sin, None)
            greedy = target.logits(target.model.norm(x)).argmax(-1)[0]
            aux = torch.cat(aux, -1)[0]
            # where the model writes: the proposals (tokens t + 2, t + 3) are completion tokens
            for t in rng.sample(range(len(prompt) - 2, T - 3), min(5, T - len(prompt) - 1)):
                draft.free(0)  # position t pairs hidden t with token t + 1
                d1, d2 = draft.propose(ids[0, 1 : t + 2], aux[: t + 1], DraftRows([0], [0], [t + 1]), k=2)[0].tolist()
                first += d1 == greedy[t + 1]
                both += d1 == greedy[t + 1] and ids[0, t + 2] == d1 and d2 == greedy[t + 2]
                n += 1
    print(f"draft: first {first}/{n}, both {both}/{n}")
    assert first / n >= 0.9 and both / n >= 0.65
