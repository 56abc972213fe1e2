"""Plain PyTorch references of the routed experts (the transformers eager
loop, written out), differentiable by autograd."""
import torch


def gate_act(h, gate, interleaved, alpha=1.702, limit=7.0):
    g, u = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    if gate == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def experts(x, ids, w, gu, dn, gb=None, db=None, gate="silu", transposed=False, interleaved=False,
            lora=None, scale=1.0):
    """y = Σ_k w_tk · Expert_{ids_tk}(x_t); ids ≥ E are skipped (empty slots).
    lora: (a_gu (E, r, d), b_gu (E, 2f, r), a_dn (E, r, f), b_dn (E, d, r)), any pair None."""
    out = torch.zeros_like(x)
    E = gu.shape[0]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= E:
                continue
            h = x[t] @ (gu[e] if transposed else gu[e].T)
            if lora is not None and lora[0] is not None:
                nat = scale * ((x[t] @ lora[0][e].T) @ lora[1][e].T)  # natural [gate | up]
                if interleaved:
                    f = nat.shape[-1] // 2
                    nat = torch.stack([nat[:f], nat[f:]], dim=-1).reshape(-1)
                h = h + nat
            if gb is not None:
                h = h + gb[e]
            a = gate_act(h, gate, interleaved)
            o = a @ (dn[e] if transposed else dn[e].T)
            if lora is not None and lora[2] is not None:
                o = o + scale * ((a @ lora[2][e].T) @ lora[3][e].T)
            if db is not None:
                o = o + db[e]
            out[t] = out[t] + w[t, k] * o
    return out


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
