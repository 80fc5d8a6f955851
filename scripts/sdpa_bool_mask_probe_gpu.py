#!/usr/bin/env python
"""What one ``scaled_dot_product_attention`` call keeps for backward on this GPU, by the kind of mask it is given
(none, a bool or additive mask, contiguous or a broadcast view) and what mask a transformers Llama passes for a padded
batch: the bytes held after the forward beyond the output. ``python scripts/sdpa_bool_mask_probe_gpu.py``"""
import json

import torch
import torch.nn.functional as F

B, H, T, D = 8, 16, 2048, 64


def held(mask, causal=False):
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - o.numel() * o.element_size()
    del o, q, k, v
    return round(kept / 2**20, 2)


def main():
    pad = torch.ones(B, T, dtype=torch.bool, device="cuda")
    pad[1, 1000:] = False
    causal = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    view = pad[:, None, None, :] & causal[None, None]  # materialized (B,1,T,T)
    expanded = (pad[:, None, None, :] & causal[None, None]).expand(B, 1, T, T)
    broadcast_q = pad[:, None, None, :].expand(B, 1, T, T)  # stride 0 along the queries
    out = {"none_causal": held(None, causal=True), "bool_b1tt": held(view), "bool_b1tt_view_expand": held(expanded),
           "bool_broadcast_q": held(broadcast_q), "bf16_b1tt": held(torch.zeros(B, 1, T, T, dtype=torch.bfloat16,
                                                                                 device="cuda")),
           "bool_11tt": held(causal[None, None]), "mask_bf16_b1tt_MiB": B * T * T * 2 / 2**20}
    # the mask a transformers Llama hands SDPA for a padded batch
    import transformers

    seen = {}
    orig = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        if attn_mask is not None and "mask" not in seen:
            seen["mask"] = {"shape": list(attn_mask.shape), "stride": list(attn_mask.stride()),
                            "dtype": str(attn_mask.dtype), "contiguous": attn_mask.is_contiguous()}
            seen["held_MiB"] = held(attn_mask)
        return orig(q, k, v, attn_mask, *a, **kw)

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=T)
    model = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 1000, (B, T), device="cuda")
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        model(input_ids=ids, attention_mask=pad.long())
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig
    out["transformers_padded"] = seen
    print(json.dumps(out, indent=1))


main()
