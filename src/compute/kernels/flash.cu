
// Attention without the probabilities (compute/kernels/flash.rs plans them): the forward
// keeps each query row's log-sum-exp L of its scores instead of the [B, H, T, S]
// probabilities, and the backward computes them again a tile at a time, P = exp(S - L)
// (FlashAttention-2's scheme). A thread owns a row (a query, or in the keys' backward a
// key) and a block of threads shares tiles of the other side in shared memory. Every sum
// runs in one fixed order, so the same inputs give the same bits; no atomics (the
// queries' and the keys' gradients are separate kernels, each summing its own rows). The
// products accumulate with explicit fused multiply-adds (`fmaf`: one instruction on the
// GPU, whose NVRTC options otherwise keep products and sums apart; the C library's
// correctly rounded `fmaf` under the emulator, the same bits).
//
// Tensors are read and written where they lie: element (b, h, row, c) of a tensor at
// x + b xb + h xh + row xr + c xc (strides in values). The head size D is a template
// parameter (16, 32, 64, 128), so a thread's rows are registers.

#define FA_TILE 32

// Scores a query row sees: keys j < seen (causal: query i sees keys up to i + s - t).
__device__ __forceinline__ int fa_seen(int i, int t, int s, int causal) {
    return causal ? min(i + s - t + 1, s) : s;
}

// A query-row thread's place: its (batch entry, head) pair, its row, whether the row
// exists, the keys it sees and the keys any row of its block sees.
struct FaQuery {
    int bh, b, h, i, live, seen, block_seen;
};

__device__ __forceinline__ FaQuery fa_query(int heads, int t, int s, int causal) {
    FaQuery at;
    at.bh = blockIdx.y;
    at.b = at.bh / heads;
    at.h = at.bh % heads;
    int first = blockIdx.x * blockDim.x;
    at.i = first + threadIdx.x;
    at.live = at.i < t;
    at.seen = fa_seen(at.i, t, s, causal);
    at.block_seen = fa_seen(min(first + (int)blockDim.x, t) - 1, t, s, causal);
    return at;
}

// Score (i, j) from its dot product: scaled, plus the additive mask where there is one.
__device__ __forceinline__ float fa_score(float dot, float scale, const float* mask,
                                          long long mt, long long ms, int i, int j) {
    float x = dot * scale;
    return mask ? x + mask[i * mt + j * ms] : x;
}

// Rows first.. of a tile, FA_TILE x D values kept as float4s (read four at a time), from
// a tensor's (b, h) matrix: zeros past `rows`. Every thread of the block takes part.
template <int D>
__device__ __forceinline__ void fa_tile(float4 (*tile)[D / 4], const float* x, long long xr,
                                        long long xc, int first, int rows) {
    float* values = (float*)tile;
    for (int n = threadIdx.x; n < FA_TILE * D; n += blockDim.x) {
        int r = n / D, c = n % D, row = first + r;
        values[n] = row < rows ? x[row * xr + c * xc] : 0.0f;
    }
}

// acc + x . row, the products added in order of c.
template <int D>
__device__ __forceinline__ float fa_dot(const float* x, const float4* row, float acc) {
#pragma unroll
    for (int q = 0; q < D / 4; ++q) {
        float4 y = row[q];
        acc = fmaf(x[4 * q], y.x, acc);
        acc = fmaf(x[4 * q + 1], y.y, acc);
        acc = fmaf(x[4 * q + 2], y.z, acc);
        acc = fmaf(x[4 * q + 3], y.w, acc);
    }
    return acc;
}

// acc += a row, value by value.
template <int D>
__device__ __forceinline__ void fa_axpy(float* acc, float a, const float4* row) {
#pragma unroll
    for (int q = 0; q < D / 4; ++q) {
        float4 y = row[q];
        acc[4 * q] = fmaf(a, y.x, acc[4 * q]);
        acc[4 * q + 1] = fmaf(a, y.y, acc[4 * q + 1]);
        acc[4 * q + 2] = fmaf(a, y.z, acc[4 * q + 2]);
        acc[4 * q + 3] = fmaf(a, y.w, acc[4 * q + 3]);
    }
}

// The forward: grid (query blocks, B H), a thread a query. O = softmax(S) V in O's layout,
// L = max + log(sum) of each row's scores at lse[(b H + h) T + i].
template <int D>
__device__ void fa_forward(const float* q, long long qb, long long qh, long long qr,
                           long long qc, const float* k, long long kb, long long kh,
                           long long kr, long long kc, const float* v, long long vb,
                           long long vh, long long vr, long long vc, float* o, long long ob,
                           long long oh, long long orow, long long oc, float* lse,
                           const float* mask, long long mb, long long mh, long long mt,
                           long long ms, int heads, int t, int s, float scale, int causal) {
    __shared__ float4 ks[FA_TILE][D / 4];
    __shared__ float4 vs[FA_TILE][D / 4];
    FaQuery at = fa_query(heads, t, s, causal);
    int bh = at.bh, b = at.b, h = at.h, i = at.i, live = at.live, seen = at.seen;
    const float* mrow = mask ? mask + b * mb + h * mh : 0;
    float qv[D], acc[D];
    for (int c = 0; c < D; ++c) {
        qv[c] = live ? q[b * qb + h * qh + i * qr + c * qc] : 0.0f;
        acc[c] = 0.0f;
    }
    float m = -3.402823466e38f, l = 0.0f;
    for (int j0 = 0; j0 < at.block_seen; j0 += FA_TILE) {
        fa_tile<D>(ks, k + b * kb + h * kh, kr, kc, j0, s);
        fa_tile<D>(vs, v + b * vb + h * vh, vr, vc, j0, s);
        __syncthreads();
        if (live && j0 < seen) {
            float sc[FA_TILE];
            float top = m;
            // Unrolled, so that the tile's scores are registers, not local memory.
#pragma unroll
            for (int r = 0; r < FA_TILE; ++r) {
                sc[r] = 0.0f;
                if (j0 + r < seen) {
                    float dot = fa_dot<D>(qv, ks[r], 0.0f);
                    sc[r] = fa_score(dot, scale, mrow, mt, ms, i, j0 + r);
                    top = fmaxf(top, sc[r]);
                }
            }
            float keep = expf(m - top);
            l *= keep;
            for (int c = 0; c < D; ++c) acc[c] *= keep;
#pragma unroll
            for (int r = 0; r < FA_TILE; ++r) {
                if (j0 + r < seen) {
                    float p = expf(sc[r] - top);
                    l += p;
                    fa_axpy<D>(acc, p, vs[r]);
                }
            }
            m = top;
        }
        __syncthreads();
    }
    if (live) {
        float inv = 1.0f / l;
        for (int c = 0; c < D; ++c) o[b * ob + h * oh + i * orow + c * oc] = acc[c] * inv;
        lse[(long long)bh * t + i] = m + logf(l);
    }
}

// The keys' gradients: grid (key blocks, B H), a thread a key j, over the queries that see
// it, a tile at a time: with VALUES dV_j = sum_i P_ij dO_i, else
// dK_j = scale sum_i dS_ij q_i with dS_ij = P_ij (dO_i . v_j - delta_i). Two kernels, so
// that a thread holds two rows of D values (three for dK), not four.
template <int D, int VALUES>
__device__ void fa_keys(const float* q, long long qb, long long qh, long long qr, long long qc,
                        const float* k, long long kb, long long kh, long long kr, long long kc,
                        const float* v, long long vb, long long vh, long long vr, long long vc,
                        const float* d_o, long long ob, long long oh, long long orow,
                        long long oc, const float* lse, const float* delta, float* dk,
                        float* dv, const float* mask, long long mb, long long mh, long long mt,
                        long long ms, int heads, int t, int s, float scale, int causal) {
    __shared__ float4 qs[FA_TILE][D / 4];
    __shared__ float4 dos[FA_TILE][D / 4];
    __shared__ float ls[FA_TILE], ds[FA_TILE];
    int bh = blockIdx.y, b = bh / heads, h = bh % heads;
    int first = blockIdx.x * blockDim.x, j = first + threadIdx.x;
    int live = j < s;
    // Query i sees key j from i = j - (s - t) on.
    int from = causal ? max(j - (s - t), 0) : 0;
    int block_from = causal ? max(first - (s - t), 0) : 0;
    const float* mrow = mask ? mask + b * mb + h * mh : 0;
    float kv[D], vv[D], acc[D];
    for (int c = 0; c < D; ++c) {
        kv[c] = live ? k[b * kb + h * kh + j * kr + c * kc] : 0.0f;
        vv[c] = live && !VALUES ? v[b * vb + h * vh + j * vr + c * vc] : 0.0f;
        acc[c] = 0.0f;
    }
    for (int i0 = block_from; i0 < t; i0 += FA_TILE) {
        fa_tile<D>(qs, q + b * qb + h * qh, qr, qc, i0, t);
        fa_tile<D>(dos, d_o + b * ob + h * oh, orow, oc, i0, t);
        for (int r = threadIdx.x; r < FA_TILE; r += blockDim.x) {
            int i = i0 + r;
            ls[r] = i < t ? lse[(long long)bh * t + i] : 0.0f;
            ds[r] = i < t ? delta[(long long)bh * t + i] : 0.0f;
        }
        __syncthreads();
        for (int r = 0; live && r < FA_TILE; ++r) {
            int i = i0 + r;
            if (i >= t || i < from) continue;
            float dot = fa_dot<D>(kv, qs[r], 0.0f);
            float p = expf(fa_score(dot, scale, mrow, mt, ms, i, j) - ls[r]);
            if (VALUES) {
                fa_axpy<D>(acc, p, dos[r]);
            } else {
                float dp = fa_dot<D>(vv, dos[r], 0.0f);
                fa_axpy<D>(acc, p * (dp - ds[r]), qs[r]);
            }
        }
        __syncthreads();
    }
    if (live) {
        for (int c = 0; c < D; ++c) {
            if (VALUES) {
                dv[b * vb + h * vh + j * vr + c * vc] = acc[c];
            } else {
                dk[b * kb + h * kh + j * kr + c * kc] = scale * acc[c];
            }
        }
    }
}

// The queries' gradients: grid (query blocks, B H), a thread a query i, over the keys it
// sees. dQ_i = scale sum_j dS_ij k_j.
template <int D>
__device__ void fa_queries(const float* q, long long qb, long long qh, long long qr,
                           long long qc, const float* k, long long kb, long long kh,
                           long long kr, long long kc, const float* v, long long vb,
                           long long vh, long long vr, long long vc, const float* d_o,
                           long long ob, long long oh, long long orow, long long oc,
                           const float* lse, const float* delta, float* dq, const float* mask,
                           long long mb, long long mh, long long mt, long long ms, int heads,
                           int t, int s, float scale, int causal) {
    __shared__ float4 ks[FA_TILE][D / 4];
    __shared__ float4 vs[FA_TILE][D / 4];
    FaQuery at = fa_query(heads, t, s, causal);
    int bh = at.bh, b = at.b, h = at.h, i = at.i, live = at.live, seen = at.seen;
    const float* mrow = mask ? mask + b * mb + h * mh : 0;
    float qv[D], dov[D], gq[D];
    for (int c = 0; c < D; ++c) {
        qv[c] = live ? q[b * qb + h * qh + i * qr + c * qc] : 0.0f;
        dov[c] = live ? d_o[b * ob + h * oh + i * orow + c * oc] : 0.0f;
        gq[c] = 0.0f;
    }
    float li = live ? lse[(long long)bh * t + i] : 0.0f;
    float di = live ? delta[(long long)bh * t + i] : 0.0f;
    for (int j0 = 0; j0 < at.block_seen; j0 += FA_TILE) {
        fa_tile<D>(ks, k + b * kb + h * kh, kr, kc, j0, s);
        fa_tile<D>(vs, v + b * vb + h * vh, vr, vc, j0, s);
        __syncthreads();
        for (int r = 0; live && r < FA_TILE; ++r) {
            int j = j0 + r;
            if (j >= seen) break;
            float dot = fa_dot<D>(qv, ks[r], 0.0f), dp = fa_dot<D>(dov, vs[r], 0.0f);
            float p = expf(fa_score(dot, scale, mrow, mt, ms, i, j) - li);
            float g = p * (dp - di);
            fa_axpy<D>(gq, g, ks[r]);
        }
        __syncthreads();
    }
    if (live) {
        for (int c = 0; c < D; ++c) dq[b * qb + h * qh + i * qr + c * qc] = scale * gq[c];
    }
}

// delta_i = dO_i . O_i for each of `rows` (b, h, i) rows (O and dO in one layout),
// grid-strided.
extern "C" __global__ void attn_flash_delta(const float* o, const float* d_o, long long ob,
                                            long long oh, long long orow, long long oc,
                                            float* delta, int heads, int t, int e,
                                            long long rows) {
    for (long long n = blockIdx.x * (long long)blockDim.x + threadIdx.x; n < rows;
         n += (long long)gridDim.x * blockDim.x) {
        long long i = n % t, bh = n / t, b = bh / heads, h = bh % heads;
        long long at = b * ob + h * oh + i * orow;
        float sum = 0.0f;
        for (int c = 0; c < e; ++c) sum = fmaf(d_o[at + c * oc], o[at + c * oc], sum);
        delta[n] = sum;
    }
}

// The kernels' parameters: Q, K, V (and dO) each a pointer and its four strides, then the
// outputs, the mask with its strides, and the sizes.
#define FA_QKV                                                                                 \
    const float *q, long long qb, long long qh, long long qr, long long qc, const float *k,    \
        long long kb, long long kh, long long kr, long long kc, const float *v, long long vb,  \
        long long vh, long long vr, long long vc
#define FA_MASK_SIZES                                                                          \
    const float *mask, long long mb, long long mh, long long mt, long long ms, int heads, int t, \
        int s, float scale, int causal
#define FA_FORWARD_PARAMS                                                                      \
    FA_QKV, float *o, long long ob, long long oh, long long orow, long long oc, float *lse,    \
        FA_MASK_SIZES
#define FA_KEYS_PARAMS                                                                         \
    FA_QKV, const float *d_o, long long ob, long long oh, long long orow, long long oc,        \
        const float *lse, const float *delta, float *dk, float *dv, FA_MASK_SIZES
#define FA_QUERIES_PARAMS                                                                      \
    FA_QKV, const float *d_o, long long ob, long long oh, long long orow, long long oc,        \
        const float *lse, const float *delta, float *dq, FA_MASK_SIZES
#define FA_FORWARD(D)                                                                          \
    fa_forward<D>(q, qb, qh, qr, qc, k, kb, kh, kr, kc, v, vb, vh, vr, vc, o, ob, oh, orow, oc, \
                  lse, mask, mb, mh, mt, ms, heads, t, s, scale, causal)
#define FA_KEYS(D, VALUES)                                                                     \
    fa_keys<D, VALUES>(q, qb, qh, qr, qc, k, kb, kh, kr, kc, v, vb, vh, vr, vc, d_o, ob, oh,    \
                       orow, oc, lse, delta, dk, dv, mask, mb, mh, mt, ms, heads, t, s, scale, \
                       causal)
#define FA_QUERIES(D)                                                                          \
    fa_queries<D>(q, qb, qh, qr, qc, k, kb, kh, kr, kc, v, vb, vh, vr, vc, d_o, ob, oh, orow,  \
                  oc, lse, delta, dq, mask, mb, mh, mt, ms, heads, t, s, scale, causal)

// One entry per kernel and head size (a kernel's registers are its own head size's).
extern "C" __global__ void attn_flash_forward_16(FA_FORWARD_PARAMS) { FA_FORWARD(16); }
extern "C" __global__ void attn_flash_forward_32(FA_FORWARD_PARAMS) { FA_FORWARD(32); }
extern "C" __global__ void attn_flash_forward_64(FA_FORWARD_PARAMS) { FA_FORWARD(64); }
extern "C" __global__ void attn_flash_forward_128(FA_FORWARD_PARAMS) { FA_FORWARD(128); }
extern "C" __global__ void attn_flash_keys_16(FA_KEYS_PARAMS) { FA_KEYS(16, 0); }
extern "C" __global__ void attn_flash_values_16(FA_KEYS_PARAMS) { FA_KEYS(16, 1); }
extern "C" __global__ void attn_flash_keys_32(FA_KEYS_PARAMS) { FA_KEYS(32, 0); }
extern "C" __global__ void attn_flash_values_32(FA_KEYS_PARAMS) { FA_KEYS(32, 1); }
extern "C" __global__ void attn_flash_keys_64(FA_KEYS_PARAMS) { FA_KEYS(64, 0); }
extern "C" __global__ void attn_flash_values_64(FA_KEYS_PARAMS) { FA_KEYS(64, 1); }
extern "C" __global__ void attn_flash_keys_128(FA_KEYS_PARAMS) { FA_KEYS(128, 0); }
extern "C" __global__ void attn_flash_values_128(FA_KEYS_PARAMS) { FA_KEYS(128, 1); }
extern "C" __global__ void attn_flash_queries_16(FA_QUERIES_PARAMS) { FA_QUERIES(16); }
extern "C" __global__ void attn_flash_queries_32(FA_QUERIES_PARAMS) { FA_QUERIES(32); }
extern "C" __global__ void attn_flash_queries_64(FA_QUERIES_PARAMS) { FA_QUERIES(64); }
extern "C" __global__ void attn_flash_queries_128(FA_QUERIES_PARAMS) { FA_QUERIES(128); }
