"""ssmgrad.transformers on the fifteen conv families of transformers 5.24 against stock transformers.

These families call the module functions ``causal_conv1d_fn`` / ``causal_conv1d_update`` (ggml's SSM_CONV)
ahead of a short-conv block (LFM, Inkling) or a linear-attention mixer (gated delta rule, KDA); patch() replaces
those two, and in the nine delta-rule families the delta rule too (test_transformers_gdn.py tests that part). Oracle: the stock transformers CPU path of the same tiny random model,
same weights, same batch. As in test_transformers.py: float64 with the stock float32 casts neutralised,
loss and every gradient to 1e-10; greedy generate gives the same tokens; the cache (conv and recurrent
states) after a prefill and two one-token steps equals stock to 1e-10.

Each model is tiny (hidden 16, two or three layers, two experts where the family has MoE), so each case
takes a few seconds on a busy 2-core machine (the 45 cases about 3 minutes).
"""

import pytest
import torch

from test_transformers import VOCAB, batch, build_model, keep_float64, loss_and_grads, prefill_and_steps

import ssmgrad.transformers as sht

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

# shared tiny sizes: attention, gated-delta-rule linear attention, MoE, Kimi delta attention (+ MLA), Inkling
A2 = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
LIN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_conv_kernel_dim=4)
MOE = dict(moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2, num_experts_per_tok=1)
KDA = dict(linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4, kv_lora_rank=8, qk_rope_head_dim=4,
           v_head_dim=8, qk_nope_head_dim=8, num_experts=2, num_experts_per_token=1, moe_intermediate_size=8,
           num_attention_heads=2, num_key_value_heads=2, head_dim=8)
INK = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8, swa_num_attention_heads=2,
           swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=8, d_rel=4, rel_extent=16,
           moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, conv_kernel_size=4)
GDN_LAYERS = dict(layer_types=["linear_attention", "full_attention"])
H16 = dict(hidden_size=16, num_hidden_layers=2)

# family -> (config class, model class, tiny config): one conv (or linear-attention) layer and one attention layer
CONV_MODELS = {
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(H16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                  layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(H16, intermediate_size=24, moe_intermediate_size=8, num_attention_heads=2,
                      num_key_value_heads=1, num_dense_layers=1, num_experts=2, num_experts_per_tok=1,
                      layer_types=["conv", "full_attention"])),
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM",
             dict(H16, intermediate_size=24, layer_types=["conv", "full_attention"], sliding_window=8, **A2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(H16, intermediate_size=24, **GDN_LAYERS, **A2, **LIN, **MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(H16, intermediate_size=24, **GDN_LAYERS, **A2, **LIN)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(H16, **GDN_LAYERS, **A2, **LIN, **MOE)),
    "qwen4_exp": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM",
                  dict(H16, **GDN_LAYERS, hc_count=2, hc_lowrank=4, indexer_n_heads=2, indexer_kv_heads=1,
                       indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2, ple_embed_dim=8,
                       **A2, **LIN, **MOE)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(H16, intermediate_size=24, **GDN_LAYERS, mlp_layer_types=["dense", "sparse"], **KDA)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM",
                    dict(H16, intermediate_size=24, **GDN_LAYERS, num_attention_heads=2, num_key_value_heads=1, **LIN)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(H16, intermediate_size=24, **GDN_LAYERS, mlp_layer_types=["dense", "sparse"],
                            num_expert_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=2, **KDA)),
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration",       # text + a tiny vision tower
                  dict(vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                                          out_hidden_size=16, projection_intermediate_size=16, patch_size=2,
                                          image_size=4),
                       text_config=dict(H16, intermediate_size=24, moe_intermediate_size=8, num_attention_heads=2,
                                        num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1,
                                        kv_lora_rank=8, q_lora_rank=8, v_head_dim=8, qk_nope_head_dim=8,
                                        index_topk=4, index_kpool=2, index_head_dim=8, index_n_heads=2,
                                        linear_head_dim=8, linear_num_heads=2, hc_mult=1,
                                        layer_types=["linear_attention", "indexed_attention"],
                                        mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"]))),
    "inkling": ("InklingTextConfig", "InklingForCausalLM",
                dict(H16, intermediate_size=24, layer_types=["hybrid_sliding", "hybrid"],
                     mlp_layer_types=["dense", "sparse"], n_shared_experts=1, **INK)),
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM",
                 dict(H16, layer_types=["hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=1,
                      unpadded_vocab_size=VOCAB, **INK)),
    "inkling2_loop": ("Inkling2LoopTextConfig", "Inkling2LoopForCausalLM",
                      dict(hidden_size=16, num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid", "hybrid"],
                           n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                           loop_num_passes=2, loop_gate_rank=4, unpadded_vocab_size=VOCAB, **INK)),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM",
                  dict(H16, **GDN_LAYERS, sliding_window=8, **A2, **LIN, **MOE)),
}

def make(family, dtype=torch.float64, seed=0):
    return build_model(CONV_MODELS[family], dtype, seed)


@pytest.fixture(autouse=True)
def always_unpatched():
    sht.unpatch()
    yield
    sht.unpatch()


def test_table_is_the_conv_families():
    """Every family patch() covers with the conv and no Mamba scan (the conv alone, or the conv and the delta
    rule) has a model here, and no other."""
    conv = {f for f, names in sht.FAMILIES.items() if names in (sht.CONV_FUNCTIONS, sht.GDN_FUNCTIONS, sht.KDA_FUNCTIONS)}
    assert set(CONV_MODELS) == conv
    assert len(CONV_MODELS) == 15


@pytest.mark.parametrize("family", list(CONV_MODELS))
def test_conv_family_float64_exact(family):
    """Loss and every parameter gradient equal stock to 1e-10 (float64); the conv ran on ssmgrad, no
    call fell back, and the conv weights' gradients have nonzero entries."""
    model = make(family)
    ids = batch()
    fallbacks = dict(sht.fallback_counts)
    with keep_float64():
        loss0, g0 = loss_and_grads(model, ids)
        n0 = sht.call_counts["causal_conv1d_fn"]
        with sht.patched([family]):
            loss1, g1 = loss_and_grads(model, ids)
        ran = sht.call_counts["causal_conv1d_fn"] - n0
    assert ran >= 1 and dict(sht.fallback_counts) == fallbacks
    # every parameter stock trains gets a gradient (qwen4_exp's top-k indexer gets none, stock or patched),
    # the conv weights among them
    assert set(g0) == set(g1)
    assert any("conv" in n for n in g0)
    assert abs(float(loss1 - loss0)) <= 1e-10 * max(1.0, float(loss0.abs()))
    for name in g0:
        ref = g0[name]
        assert "conv" not in name or ref.abs().max() > 0, f"{name}: all-zero gradient"
        err = float((g1[name] - ref).abs().max()) / (1.0 + float(ref.abs().max()))
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"


def _generate(model, ids, n_new=5):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family", list(CONV_MODELS))
def test_conv_family_generate(family):
    """Greedy generate with the cache (float32 as shipped): the same tokens and scores as stock, and the
    one-token conv updates ran on ssmgrad."""
    model = make(family, torch.float32, seed=7).eval()
    ids = batch(n_seqs=2, n_t=5, seed=8)
    ref = _generate(model, ids)
    n0 = sht.call_counts["causal_conv1d_update"]
    with sht.patched([family]):
        got = _generate(model, ids)
    assert sht.call_counts["causal_conv1d_update"] > n0
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(CONV_MODELS))
def test_conv_family_cache_contents(family):
    """Prefill, then two single-token steps through the cache: logits and every cached conv / recurrent
    state equal stock (float64, casts neutralised, 1e-10)."""
    model = make(family, torch.float64, seed=9).eval()
    ids = batch(n_seqs=2, n_t=7, seed=10)
    with keep_float64():
        l0, c0, r0 = prefill_and_steps(model, ids)
        n0 = sht.call_counts["causal_conv1d_update"]
        with sht.patched([family]):
            l1, c1, r1 = prefill_and_steps(model, ids)
        ran = sht.call_counts["causal_conv1d_update"] - n0
    # the one-token path ran in both steps (inkling2 keeps several conv states per layer, not all updated)
    assert len(c0) > 0 and ran > 0 and ran % 2 == 0
    assert len(c1) == len(c0) and len(r1) == len(r0)
    for a, b in zip(l0 + c0 + r0, l1 + c1 + r1):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
