"""The Triton kernels of the `triton` backend (FlashAttention-2, block-sparse aware).

Imported only by `qkv.kernels.triton.backend` and only when `triton` is importable, so `import qkv`
never pulls Triton in. Whether the kernels run compiled (CUDA) or in Triton's interpreter (CPU
tensors) is decided by `TRITON_INTERPRET=1` *when this module is imported*: `triton.jit` reads it
at decoration time.

Three kernels, each one program per tile and (batch, head):

    _attn_fwd       grid (query tiles, B·H)     out, lse
    _attn_bwd_dkdv  grid (key tiles,   B·Hkv)   dK, dV  (loops over the G query heads of its group)
    _attn_bwd_dq    grid (query tiles, B·H)     dQ      (and the relative-bias table's gradient)

The forward of one query tile Q_i, over the key tiles K_j its row keeps::

    S   = Q_i K_jᵀ · scale                    (+ bias, score modifiers, mask)
    m'  = max(m, rowmax S);  P = exp(S − m');  l = l · exp(m − m') + rowsum P
    acc = acc · exp(m − m') + P V_j;           out = acc / l;  stores m and l

(each exp as `exp2((x − m)·log2 e)`: the unit conversion multiplies the small difference, not
S). The host turns m and l into lse = m + log l in float64; the backward recomputes
P = exp(S − lse) tile by tile (FlashAttention-2, Algorithm 2) with lse as a two-float::

    dV_j += Pᵀ dO_i,  dP = dO_i V_jᵀ,  dS = P ∘ (dP − Δ_i),  dQ_i += dS K_j,  dK_j += dSᵀ Q_i

with Δ_i = rowsum(dO_i ∘ O_i) − dlse_i computed by the host in float64 (one O(N·Dv)
reduction), also passed as a two-float (hi, lo).

Which key tiles a query tile visits comes from per-row tile lists (like FlexAttention's
BlockMask): FULL tiles run with no mask arithmetic at all; PARTIAL tiles apply the bounds check,
the causal rule (arithmetic) and, for a structured `qkv.masks.Mask` or a bool mask tensor, one
bit per pair read from a *bank*: the host evaluates the rule once on the partial tiles only and
stores them as int8 `(n_partial_tiles, BLOCK_M, BLOCK_N)`; a tile's code is its index in the
bank (−1: no bank tile, only arithmetic). EMPTY tiles are not in the lists, so never loaded.

NaN/±inf in a masked-out key or value never reaches a row (no `finite_inputs` promise needed).
A masked score is replaced by −inf (never added to), so K is harmless in the forward; keys past
Nk are never loaded. For V, `0 · NaN` in P V is the danger: the forward runs a guarded P V
(`_pv`) in every tile where a weight can be exactly 0 by structure — PARTIAL tiles, and all
tiles under a float mask (a −inf column) or dropout — when the host sets GUARD_PART/GUARD_FULL
(it does unless the caller promised finite k/v). The guard checks the loaded V tile; one that
is finite runs the plain product, otherwise the finite part goes through the product and each
NaN/±inf is added only where its weight is > 0: a row that attends to a non-finite value gets
NaN/±inf in that entry, as the reference has it (`qkv.numerics.weighted_values`). (FULL tiles
without a bias or dropout hold no structural zero: a kept weight that underflows to 0 there
still meets its value, and a ±inf added to acc meets later rescales as it is.) The backward
kernels need no guard: the host hands them k and v with NaN/±inf zeroed and dO zeroed where
the output is non-finite (`host.Call.backward`).

Every offset is computed in int64 (program ids and tile indices are cast before they multiply a
stride), so B·H·N·D beyond 2³¹ does not overflow.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """tanh in fp32 to ~1 ulp (libdevice's is unavailable in the interpreter): Taylor series to
    x¹⁵ for |x| < 0.55, `(1 − e)/(1 + e)` with e = exp(−2|x|) elsewhere."""
    ax = tl.abs(x)
    x2 = x * x
    p = -929569.0 / 638512875.0
    p = p * x2 + 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = x + x * x2 * p
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.55, small, big)


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """`tl.dot(a, b, acc)`. UPCAST (set only in the interpreter for bf16, whose numpy `dot`
    mishandles bf16) multiplies the same bf16 values in fp32: the products of two bf16 numbers
    are exact in fp32, as in the GPU's bf16 MMA with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _mix32(x):
    """`qkv.dropout._mix32` on uint32: wrapping products equal the reference's `& 0xFFFFFFFF`."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x6A09E667
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    return x ^ (x >> 15)


@triton.jit
def _keep(bh, rows, cols, DROP):
    """`qkv.dropout.keep_mask` for one tile: True where weight (bh, row, col) survives.
    DROP holds int64 [seed & 0xFFFFFFFF, seed >> 32, threshold]."""
    s0 = tl.load(DROP).to(tl.uint32)
    s1 = tl.load(DROP + 1).to(tl.uint32)
    thresh = tl.load(DROP + 2)
    golden = 0x61C88647
    head = _mix32(bh.to(tl.uint32) * golden + s0)
    row = _mix32(head ^ (rows.to(tl.uint32) * golden))
    col = _mix32((cols.to(tl.uint32) * golden) ^ s1)
    return _mix32(row[:, None] ^ col[None, :]).to(tl.int64) >= thresh


@triton.jit
def _pv(acc, p, v, PREC: tl.constexpr, UPCAST: tl.constexpr, GUARD: tl.constexpr):
    """`acc + P V` for one tile. With GUARD, a weight of exactly 0 (a masked pair, a −inf bias,
    a dropped weight) never lets a NaN or ±inf of V through, as `qkv.numerics.weighted_values`
    has it for the reference: a tile whose V holds none (checked here, on the loaded tile)
    runs the plain product; otherwise the finite part goes through the product and each
    non-finite entry is added where its weight is > 0 (any NaN, or +inf and −inf together:
    NaN; else ±inf; added to acc, so what earlier tiles left there stays)."""
    if GUARD:
        vf = v.to(tl.float32)
        bad = (vf.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000  # exponent all ones
        if tl.max(tl.max(bad.to(tl.int32), 1), 0) > 0:
            acc = _mma(p.to(v.dtype), tl.where(bad, tl.zeros_like(v), v), acc, PREC, UPCAST)
            seen = (p > 0).to(tl.float16)  # 0/1 counts: exact in fp16 products, fp32 sums
            n_nan = tl.dot(seen, (vf != vf).to(tl.float16))
            n_pos = tl.dot(seen, (vf == float("inf")).to(tl.float16))
            n_neg = tl.dot(seen, (vf == float("-inf")).to(tl.float16))
            acc += tl.where(n_pos > 0, float("inf"), 0.0)
            acc += tl.where(n_neg > 0, float("-inf"), 0.0)  # inf + −inf = NaN
            acc += tl.where(n_nan > 0, float("nan"), 0.0)
        else:
            acc = _mma(p.to(v.dtype), v, acc, PREC, UPCAST)
    else:
        acc = _mma(p.to(v.dtype), v, acc, PREC, UPCAST)
    return acc


@triton.jit
def _scores(
    qk,
    rows,
    cols,
    b,
    h,
    Nq,
    Nk,
    OFF,
    sm_scale,
    BIAS,
    sbb,
    sbh,
    sbm,
    sbn,
    SLOPES,
    REL,
    srh,
    REL_M,
    cap,
    HAS_BIAS: tl.constexpr,
    ALIBI: tl.constexpr,
    REL_POS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Raw Q Kᵀ → the scores the softmax sees (`Q Kᵀ · scale`, rounded as the reference rounds
    it, + bias, modifiers), and t = tanh(x / cap) (the softcap's derivative needs it; 0 without
    softcap). ALIBI / REL_POS: 0 absent, 1 before the softcap, 2 after it."""
    t = qk * 0.0
    s = qk * sm_scale
    if HAS_BIAS:
        bias_ptr = BIAS + b * sbb + h * sbh + rows[:, None] * sbm + cols[None, :] * sbn
        ok = (rows[:, None] < Nq) & (cols[None, :] < Nk)
        bias = tl.load(bias_ptr, mask=ok, other=0.0).to(tl.float32)
        s = tl.where(bias == float("-inf"), float("-inf"), s + bias)  # −inf excludes the pair
    dist = (rows[:, None] + OFF) - cols[None, :]  # query position − key position
    if ALIBI == 1:
        s -= tl.load(SLOPES + h) * tl.abs(dist).to(tl.float32)
    if REL_POS == 1:
        rel = tl.minimum(tl.maximum(-dist, -REL_M), REL_M) + REL_M
        s += tl.load(REL + h * srh + rel).to(tl.float32)
    if SOFTCAP:
        t = _tanh(s / cap)
        s = cap * t
    if ALIBI == 2:
        s -= tl.load(SLOPES + h) * tl.abs(dist).to(tl.float32)
    if REL_POS == 2:
        rel = tl.minimum(tl.maximum(-dist, -REL_M), REL_M) + REL_M
        s += tl.load(REL + h * srh + rel).to(tl.float32)
    return s, t


@triton.jit
def _allowed(rows, cols, code, Nk, OFF, BANK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_BANK: tl.constexpr):  # fmt: skip
    """Which pairs of a PARTIAL tile may attend: in bounds, causal, and the bank's bit."""
    ok = (cols[None, :] < Nk) & (rows[:, None] > -1)
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + OFF)
    if HAS_BANK:
        r = tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        has = (tl.zeros([BLOCK_M, BLOCK_N], tl.int32) + code) >= 0
        ptr = BANK + code.to(tl.int64) * (BLOCK_M * BLOCK_N) + r[:, None] * BLOCK_N + c[None, :]
        ok = ok & (tl.load(ptr, mask=has, other=1) != 0)
    return ok


@triton.jit
def _fwd_step(
    acc, m_i, l_i, q, j, code, rows, b, h, bh, Kb, Vb, skn, skd, svn, svd,
    Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M, cap,
    BANK, DROP, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BANK: tl.constexpr, HAS_BIAS: tl.constexpr, ALIBI: tl.constexpr,
    REL_POS: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    """One key tile j of the online softmax for one query tile (GUARD: see `_pv`)."""
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    cols64 = cols.to(tl.int64)
    dk = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    kt = tl.load(  # Kᵀ tile (D_PAD, BLOCK_N)
        Kb + cols64[None, :] * skn + dk[:, None] * skd,
        mask=(cols[None, :] < Nk) & (dk[:, None] < D),
        other=0.0,
    )
    qk = _mma(q, kt, None, PREC, UPCAST)
    s, _t = _scores(qk, rows, cols, b, h, Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm,
                    sbn, SLOPES, REL, srh, REL_M, cap, HAS_BIAS, ALIBI, REL_POS,
                    SOFTCAP)  # fmt: skip
    if MASKED:
        ok = _allowed(rows, cols, code, Nk, OFF, BANK, BLOCK_M, BLOCK_N, CAUSAL, HAS_BANK)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: P = 0
    p = tl.exp2((s - m_use[:, None]) * LOG2E)
    alpha = tl.exp2((m_i - m_use) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(bh, rows, cols, DROP), p * keep_scale, 0.0)
    v = tl.load(
        Vb + cols64[:, None] * svn + dv[None, :] * svd,
        mask=(cols[:, None] < Nk) & (dv[None, :] < DV),
        other=0.0,
    )
    acc = _pv(acc * alpha[:, None], p, v, PREC, UPCAST, GUARD)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, M, L,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M, cap,
    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_CODE, BANK, lay_b, lay_h, Hl, NROW, NCOL,
    DROP, keep_scale,
    H, G, Nq, Nk, OFF, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_BANK: tl.constexpr,
    HAS_BIAS: tl.constexpr, ALIBI: tl.constexpr, REL_POS: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    GUARD_FULL: tl.constexpr, GUARD_PART: tl.constexpr,
):  # fmt: skip
    """out, m, l of one query tile. GUARD_FULL / GUARD_PART: whether FULL / PARTIAL tiles run
    the guarded P V (`_pv`); the host sets them."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    dq = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(
        Q + b * sqb + h * sqh + rows64[:, None] * sqm + dq[None, :] * sqd,
        mask=(rows[:, None] < Nq) & (dq[None, :] < D),
        other=0.0,
    )
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    lrow = ((b * lay_b) * Hl + h * lay_h) * NROW + pid_m
    n_full = tl.load(FULL_NUM + lrow)
    for t in range(n_full):
        j = tl.load(FULL_IDX + lrow * NCOL + t)
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, q, j, -1, rows, b, h, bh, Kb, Vb, skn, skd, svn, svd,
            Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M,
            cap, BANK, DROP, keep_scale, BLOCK_M, BLOCK_N, D, D_PAD, DV, DV_PAD, False, CAUSAL,
            HAS_BANK, HAS_BIAS, ALIBI, REL_POS, SOFTCAP, DROPOUT, PREC, UPCAST, GUARD_FULL,
        )  # fmt: skip
    n_part = tl.load(PART_NUM + lrow)
    for t in range(n_part):
        j = tl.load(PART_IDX + lrow * NCOL + t)
        code = tl.load(PART_CODE + lrow * NCOL + t)
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, q, j, code, rows, b, h, bh, Kb, Vb, skn, skd, svn, svd,
            Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M,
            cap, BANK, DROP, keep_scale, BLOCK_M, BLOCK_N, D, D_PAD, DV, DV_PAD, True, CAUSAL,
            HAS_BANK, HAS_BIAS, ALIBI, REL_POS, SOFTCAP, DROPOUT, PREC, UPCAST, GUARD_PART,
        )  # fmt: skip
    empty = l_i == 0.0  # nothing allowed in this row: out 0 (and lse −inf, from l = 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(
        O + b * sob + h * soh + rows64[:, None] * som + dv[None, :] * sod,
        out.to(O.dtype.element_ty),
        mask=(rows[:, None] < Nq) & (dv[None, :] < DV),
    )
    tl.store(M + bh * Nq + rows64, m_i, mask=rows < Nq)
    tl.store(L + bh * Nq + rows64, l_i, mask=rows < Nq)


@triton.jit
def _bwd_probs(
    q, do, lse_hi, lse_lo, d_hi, d_lo, kt, vt, rows, cols, code, b, h, bh,
    Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M, cap,
    BANK, DROP, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BANK: tl.constexpr, HAS_BIAS: tl.constexpr, ALIBI: tl.constexpr,
    REL_POS: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Recompute one tile's P from lse; return (P after dropout, dS at the modifiers' output,
    dS at Q Kᵀ · scale, t) — the two dS differ only through the softcap."""
    qk = _mma(q, kt, None, PREC, UPCAST)
    s, t = _scores(qk, rows, cols, b, h, Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm,
                   sbn, SLOPES, REL, srh, REL_M, cap, HAS_BIAS, ALIBI, REL_POS,
                   SOFTCAP)  # fmt: skip
    if MASKED:
        ok = _allowed(rows, cols, code, Nk, OFF, BANK, BLOCK_M, BLOCK_N, CAUSAL, HAS_BANK)
        s = tl.where(ok, s, float("-inf"))
    p = tl.exp2(((s - lse_hi[:, None]) - lse_lo[:, None]) * LOG2E)
    dp = _mma(do, vt, None, PREC, UPCAST)
    if DROPOUT:
        keep = _keep(bh, rows, cols, DROP)
        pd = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    else:
        pd = p
    ds = p * ((dp - d_hi[:, None]) - d_lo[:, None])
    ds_in = ds
    if SOFTCAP:
        ds_in = ds * (1.0 - t * t)
    return pd, ds, ds_in, t


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE_HI, LSE_LO, D_HI, D_LO, DK_OUT, DV_OUT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M, cap,
    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_CODE, BANK, lay_b, lay_h, Hl, NROW, NCOL,
    DROP, keep_scale,
    H, G, Hkv, Nq, Nk, OFF, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_BANK: tl.constexpr,
    HAS_BIAS: tl.constexpr, ALIBI: tl.constexpr, REL_POS: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile of kv head hk: loops over the G query heads that share it and,
    per head, the query tiles its (transposed) tile list keeps. Lists are by key tile here:
    NROW = key tiles, NCOL = query tiles."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // Hkv
    hk = bhk % Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols64 = cols.to(tl.int64)
    dq_ = tl.arange(0, D_PAD)
    dv_ = tl.arange(0, DV_PAD)
    kt = tl.load(
        K + b * skb + hk * skh + cols64[None, :] * skn + dq_[:, None] * skd,
        mask=(cols[None, :] < Nk) & (dq_[:, None] < D),
        other=0.0,
    )  # (D_PAD, BLOCK_N)
    vt = tl.load(
        V + b * svb + hk * svh + cols64[None, :] * svn + dv_[:, None] * svd,
        mask=(cols[None, :] < Nk) & (dv_[:, None] < DV),
        other=0.0,
    )  # (DV_PAD, BLOCK_N)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], tl.float32)
    for g in range(G):
        h = hk * G + g
        bh = b * H + h
        Qb = Q + b * sqb + h * sqh
        DOb = DO + b * sdb + h * sdh
        lcol = ((b * lay_b) * Hl + h * lay_h) * NROW + pid_n
        for part in tl.static_range(2):  # 0: FULL tiles (no mask arithmetic), 1: PARTIAL
            if part == 0:  # noqa: SIM108 (constexpr branch)
                n = tl.load(FULL_NUM + lcol)
            else:
                n = tl.load(PART_NUM + lcol)
            for t in range(n):
                if part == 0:
                    i = tl.load(FULL_IDX + lcol * NCOL + t)
                    code = -1
                else:
                    i = tl.load(PART_IDX + lcol * NCOL + t)
                    code = tl.load(PART_CODE + lcol * NCOL + t)
                rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
                rows64 = rows.to(tl.int64)
                in_rows = rows < Nq
                q = tl.load(
                    Qb + rows64[:, None] * sqm + dq_[None, :] * sqd,
                    mask=in_rows[:, None] & (dq_[None, :] < D),
                    other=0.0,
                )
                do = tl.load(
                    DOb + rows64[:, None] * sdm + dv_[None, :] * sdd,
                    mask=in_rows[:, None] & (dv_[None, :] < DV),
                    other=0.0,
                )
                lse_hi = tl.load(LSE_HI + bh * Nq + rows64, mask=in_rows, other=float("inf"))
                lse_lo = tl.load(LSE_LO + bh * Nq + rows64, mask=in_rows, other=0.0)
                d_hi = tl.load(D_HI + bh * Nq + rows64, mask=in_rows, other=0.0)
                d_lo = tl.load(D_LO + bh * Nq + rows64, mask=in_rows, other=0.0)
                pd, _ds, ds_in, _t = _bwd_probs(
                    q, do, lse_hi, lse_lo, d_hi, d_lo, kt, vt, rows, cols, code, b, h, bh,
                    Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh,
                    REL_M, cap, BANK, DROP, keep_scale, BLOCK_M, BLOCK_N, part == 1, CAUSAL,
                    HAS_BANK, HAS_BIAS, ALIBI, REL_POS, SOFTCAP, DROPOUT, PREC, UPCAST,
                )  # fmt: skip
                dv = _mma(tl.trans(pd).to(do.dtype), do, dv, PREC, UPCAST)
                dk = _mma(tl.trans(ds_in).to(q.dtype), q, dk, PREC, UPCAST)
    dk = dk * sm_scale
    tl.store(
        DK_OUT + b * sdkb + hk * sdkh + cols64[:, None] * sdkn + dq_[None, :] * sdkd,
        dk.to(DK_OUT.dtype.element_ty),
        mask=(cols[:, None] < Nk) & (dq_[None, :] < D),
    )
    tl.store(
        DV_OUT + b * sdvb + hk * sdvh + cols64[:, None] * sdvn + dv_[None, :] * sdvd,
        dv.to(DV_OUT.dtype.element_ty),
        mask=(cols[:, None] < Nk) & (dv_[None, :] < DV),
    )


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE_HI, LSE_LO, D_HI, D_LO, DQ, DREL,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
    sdqb, sdqh, sdqm, sdqd,
    BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh, REL_M, cap,
    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_CODE, BANK, lay_b, lay_h, Hl, NROW, NCOL,
    DROP, keep_scale,
    H, G, Nq, Nk, OFF, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_BANK: tl.constexpr,
    HAS_BIAS: tl.constexpr, ALIBI: tl.constexpr, REL_POS: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    REL_GRAD: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile; with REL_GRAD also the relative-bias table's gradient
    (atomic adds into DREL, fp32, same layout as the table)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    in_rows = rows < Nq
    dq_ = tl.arange(0, D_PAD)
    dv_ = tl.arange(0, DV_PAD)
    q = tl.load(
        Q + b * sqb + h * sqh + rows64[:, None] * sqm + dq_[None, :] * sqd,
        mask=in_rows[:, None] & (dq_[None, :] < D),
        other=0.0,
    )
    do = tl.load(
        DO + b * sdb + h * sdh + rows64[:, None] * sdm + dv_[None, :] * sdd,
        mask=in_rows[:, None] & (dv_[None, :] < DV),
        other=0.0,
    )
    lse_hi = tl.load(LSE_HI + bh * Nq + rows64, mask=in_rows, other=float("inf"))
    lse_lo = tl.load(LSE_LO + bh * Nq + rows64, mask=in_rows, other=0.0)
    d_hi = tl.load(D_HI + bh * Nq + rows64, mask=in_rows, other=0.0)
    d_lo = tl.load(D_LO + bh * Nq + rows64, mask=in_rows, other=0.0)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    lrow = ((b * lay_b) * Hl + h * lay_h) * NROW + pid_m
    for part in tl.static_range(2):  # 0: FULL tiles (no mask arithmetic), 1: PARTIAL
        if part == 0:  # noqa: SIM108 (constexpr branch)
            n = tl.load(FULL_NUM + lrow)
        else:
            n = tl.load(PART_NUM + lrow)
        for t in range(n):
            if part == 0:
                j = tl.load(FULL_IDX + lrow * NCOL + t)
                code = -1
            else:
                j = tl.load(PART_IDX + lrow * NCOL + t)
                code = tl.load(PART_CODE + lrow * NCOL + t)
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            cols64 = cols.to(tl.int64)
            in_cols = cols < Nk
            kt = tl.load(
                Kb + cols64[None, :] * skn + dq_[:, None] * skd,
                mask=in_cols[None, :] & (dq_[:, None] < D),
                other=0.0,
            )
            vt = tl.load(
                Vb + cols64[None, :] * svn + dv_[:, None] * svd,
                mask=in_cols[None, :] & (dv_[:, None] < DV),
                other=0.0,
            )
            _pd, ds, ds_in, _t = _bwd_probs(
                q, do, lse_hi, lse_lo, d_hi, d_lo, kt, vt, rows, cols, code, b, h, bh,
                Nq, Nk, OFF, sm_scale, BIAS, sbb, sbh, sbm, sbn, SLOPES, REL, srh,
                REL_M, cap, BANK, DROP, keep_scale, BLOCK_M, BLOCK_N, part == 1, CAUSAL, HAS_BANK,
                HAS_BIAS, ALIBI, REL_POS, SOFTCAP, DROPOUT, PREC, UPCAST,
            )  # fmt: skip
            if REL_GRAD:
                dist = (rows[:, None] + OFF) - cols[None, :]
                rel = tl.minimum(tl.maximum(-dist, -REL_M), REL_M) + REL_M
                g_rel = ds_in if REL_POS == 1 else ds
                tl.atomic_add(DREL + h * srh + rel, g_rel, mask=in_rows[:, None] & in_cols[None, :])
            dq = _mma(ds_in.to(kt.dtype), tl.trans(kt), dq, PREC, UPCAST)
    dq = dq * sm_scale
    tl.store(
        DQ + b * sdqb + h * sdqh + rows64[:, None] * sdqm + dq_[None, :] * sdqd,
        dq.to(DQ.dtype.element_ty),
        mask=in_rows[:, None] & (dq_[None, :] < D),
    )


# True when TRITON_INTERPRET=1 was set at import: the kernels then run on CPU tensors.
INTERPRETED = not isinstance(_attn_fwd, triton.runtime.JITFunction)

__all__ = ["INTERPRETED", "LN2", "LOG2E", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_fwd"]
