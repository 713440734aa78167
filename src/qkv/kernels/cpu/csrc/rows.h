// A row at a time: conversions between the tensors' dtypes and float rows, row loads and stores,
// finiteness tests, and qkv.dropout's hashes. Part of kernel.h (compiled once per ISA).

// ------------------------------------------------------------------------- scalar conversions

static inline float f32_of_bits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
static inline float half_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-08f;  // m · 2^-24, exact
    return sign ? -f : f;
  }
  if (e == 31) return f32_of_bits(sign | 0x7F800000u | (m << 13));
  return f32_of_bits(sign | ((e + 112u) << 23) | (m << 13));
}
// float → IEEE half, round to nearest even
static inline uint16_t f32_to_half(float f) {
  const uint32_t x = bits_of_f32(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // ≥ 65520 rounds to inf
  if (ax < 0x38800000u) {                                    // below 2^-14: a subnormal half
    const float q = __builtin_nearbyintf(f32_of_bits(ax) * 16777216.0f);  // units of 2^-24
    return (uint16_t)(sign | (uint32_t)q);
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3FFu);
  const uint32_t rest = ax & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return (uint16_t)(sign | h);
}
// float → bfloat16, round to nearest even (NaN stays NaN)
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of_f32(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline int64_t elem_size(int32_t dt) { return dt == DT_F32 ? 4 : 2; }

static inline const void* row_of(const View& x, int32_t dt, int64_t b, int64_t h, int64_t n) {
  return (const char*)x.data + (b * x.sb + h * x.sh + n * x.sn) * elem_size(dt);
}

// n values of a row in dtype → float, zero-filled up to npad (n = 0: src may be null, the data
// pointer of an empty tensor, which memcpy must not be given even for no bytes)
static inline void load_row(const void* src, int32_t dt, int64_t n, int64_t npad, float* dst) {
  if (dt == DT_F32) {
    if (n > 0) __builtin_memcpy(dst, src, (size_t)n * 4);
  } else {
    const uint16_t* s = (const uint16_t*)src;
    if (dt == DT_BF16) {
      for (int64_t i = cvt_bf16(s, dst, n); i < n; ++i) dst[i] = f32_of_bits((uint32_t)s[i] << 16);
    } else {
      for (int64_t i = cvt_f16(s, dst, n); i < n; ++i) dst[i] = half_to_f32(s[i]);
    }
  }
  for (int64_t i = n; i < npad; ++i) dst[i] = 0.0f;
}

static inline void store_row(void* dst, int32_t dt, const float* x, int64_t n) {
  if (dt == DT_F32) {
    if (n > 0) __builtin_memcpy(dst, x, (size_t)n * 4);
  } else if (dt == DT_BF16) {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
  } else {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_half(x[i]);
  }
}

// non-finite entries → 0 (the backward reads masked-out garbage as 0, as the tiled backend does)
static inline void sanitize_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!(x[i] - x[i] == 0.0f)) x[i] = 0.0f;
}

// whether every x[r·ld + i], r < rows, i < n16 (a multiple of 16), is finite: x − x is +0 for a
// finite x and NaN otherwise, and NaN survives the sums (four, so the adds overlap); one test at
// the end, not one per vector (decoding checks each V tile it streams)
static inline bool rows_finite(const float* x, int64_t rows, int64_t ld, int64_t n16) {
  V16 z0 = v_set(0.0f), z1 = z0, z2 = z0, z3 = z0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    int64_t i = 0;
    for (; i + 64 <= n16; i += 64) {
      const V16 a = v_load(xr + i), b = v_load(xr + i + 16);
      const V16 c = v_load(xr + i + 32), d = v_load(xr + i + 48);
      z0 = v_add(z0, v_sub(a, a));
      z1 = v_add(z1, v_sub(b, b));
      z2 = v_add(z2, v_sub(c, c));
      z3 = v_add(z3, v_sub(d, d));
    }
    for (; i < n16; i += 16) {
      const V16 a = v_load(xr + i);
      z0 = v_add(z0, v_sub(a, a));
    }
  }
  return m_all(v_finite(v_add(v_add(z0, z1), v_add(z2, z3))));
}

// ------------------------------------------------------------------------- dropout (qkv.dropout)

static const uint32_t GOLDEN = 0x61C88647u;

static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x6A09E667u;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  return x ^ (x >> 15);
}
static inline uint32_t drop_row_hash(const Drop& d, int64_t bh, int64_t row) {
  const uint32_t head = mix32((uint32_t)((uint64_t)bh * GOLDEN + d.s0));
  return mix32(head ^ (uint32_t)((uint64_t)row * GOLDEN));
}
static inline void drop_col_hash(const Drop& d, int64_t c0, uint32_t* out) {
  for (int64_t c = 0; c < BK; ++c) out[c] = mix32((uint32_t)((uint64_t)(c0 + c) * GOLDEN) ^ d.s1);
}
// which of 16 consecutive keys survive dropout in a row
static inline M16 drop_keep(const Drop& d, uint32_t row_hash, const uint32_t* col_hash) {
  if (d.threshold > 0xFFFFFFFFull) return m_bits(0);
  return u_ge(u_mix(u_xor(u_load(col_hash), row_hash)), (uint32_t)d.threshold);
}
