"""The gated delta rule (Gated DeltaNet's token mixer) in plain torch, chunked, with per-sequence restarts.

Per head, with a state ``S ∈ R^{d_k × d_v}`` that starts at 0 for every sequence, unit-norm ``q_t, k_t``
(L2-normalised by the caller), ``q_t`` scaled by ``1/sqrt(d_k)``, decay ``γ_t = exp(g_t)`` (``g_t <= 0``) and
write strength ``β_t ∈ (0, 1)``::

    S_t = γ_t S_{t-1} + k_t u_tᵀ,   u_t = β_t (v_t − γ_t S_{t-1}ᵀ k_t)      (delta rule: replace k_t's memory)
    o_t = S_tᵀ q_t

Chunked form (a chunk of C tokens entered with state ``S_0``; ``G_i = g_1 + … + g_i`` inside the chunk,
``D_ij = exp(G_i − G_j)``): unrolling the recurrence,

    u_i = β_i v_i − β_i e^{G_i} S_0ᵀ k_i − Σ_{j<i} β_i D_ij (k_i·k_j) u_j
    ⇒ (I + A) U = diag(β) V − diag(β e^G) K S_0,    A_ij = β_i D_ij (k_i·k_j) for j < i (strictly lower)
    O = diag(e^G) Q S_0 + (D ⊙ Q Kᵀ)_{j<=i} U
    S_C = e^{G_C} S_0 + (K ⊙ e^{G_C − G})ᵀ U

so each chunk costs one unit-lower-triangular solve and a few GEMMs, and only the state crosses chunks
(C = 64: the same chunk size as the reference kernels). ``D`` is formed from differences of the cumulative
sums, masked before ``exp`` (above the diagonal they are positive and could overflow). Everything runs in
fp32, as the reference kernels do.

Packed rows: :func:`gated_delta_rule_varlen` gathers the sequences of a packed row (``cu_seqlens``) into
a zero-padded batch, one sequence per row, so the state and the causal conv1d window of Gated DeltaNet restart
at every sequence; trailing padding cannot reach earlier tokens of a causal recurrence. On CUDA with the
``fla`` package importable, its chunked kernel takes ``cu_seqlens`` directly (:func:`fla_available`).
"""
from __future__ import annotations

import functools

import torch

Tensor = torch.Tensor
CHUNK = 64


@functools.cache
def _fla_kernel():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - fla absent or unusable on this host (no CUDA/Triton): the torch path runs
        return None
    return chunk_gated_delta_rule


def fla_available() -> bool:
    """``fla``'s varlen chunked kernel can run here (CUDA and the package importable)."""
    return torch.cuda.is_available() and _fla_kernel() is not None


def kernel_name() -> str:
    """Which gated-delta-rule kernel a rank of this host runs (``mrl plan`` prints it)."""
    return "fla chunk_gated_delta_rule (varlen, CUDA)" if fla_available() else "torch chunked (per sequence)"


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim (the reference kernels' form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int = CHUNK) -> Tensor:
    """``o`` of the module docstring for a batch of sequences that each start from ``S = 0``.

    q, k: [B, L, H, d_k] (already L2-normalised, not yet scaled); v: [B, L, H, d_v]; g, beta: [B, L, H].
    Returns [B, L, H, d_v] in the dtype of ``v``."""
    out_dtype = v.dtype
    B, L, H, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, H, L, d]
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))  # [B, H, L]
    q = q * dk ** -0.5
    pad = (-L) % chunk
    if pad:  # zeros after the end: never seen by the tokens before them
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    G = g.reshape(B, H, n, chunk).cumsum(-1)
    beta = beta.reshape(B, H, n, chunk)
    idx = torch.arange(chunk, device=q.device)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    D_strict = torch.exp(diff.masked_fill(~strict, float("-inf")))
    D_incl = torch.exp(diff.masked_fill(~incl, float("-inf")))
    A = beta[..., :, None] * D_strict * (k @ k.transpose(-1, -2))
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)  # (I + A)^-1
    eG = G.exp()
    U_v = T @ (beta[..., None] * v)  # the part of U that does not depend on S_0
    W = T @ ((beta * eG)[..., None] * k)  # U = U_v − W S_0
    QK = (q @ k.transpose(-1, -2)) * D_incl
    q_decayed = q * eG[..., None]
    k_to_end = k * torch.exp(G[..., -1:] - G)[..., None]
    S = q.new_zeros(B, H, dk, dv)
    outs = []
    for c in range(n):
        U = U_v[:, :, c] - W[:, :, c] @ S
        outs.append(q_decayed[:, :, c] @ S + QK[:, :, c] @ U)
        S = eG[:, :, c, -1, None, None] * S + k_to_end[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, H, n * chunk, dv)[:, :, :L]
    return o.transpose(1, 2).to(out_dtype)


def sequence_index(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """(index [n, Lmax] into the packed row, valid [n, Lmax]) of the sequences ``cu_seqlens`` bounds: row i holds
    columns ``cu[i] … cu[i+1]−1`` then repeats the row's first column where it is shorter (masked)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    lmax = int(lens.max()) if lens.numel() else 0
    col = torch.arange(lmax, device=cu.device)
    valid = col[None, :] < lens[:, None]
    index = torch.where(valid, cu[:-1, None] + col[None, :], cu[:-1, None].clamp(max=max(int(cu[-1]) - 1, 0)))
    return index, valid
