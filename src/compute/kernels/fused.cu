// pipetrain's fused kernels on ONNX Runtime's CUDA provider (compute/cuda_fused.rs),
// float32, each one pass where the standard-op form is many: GPT-2's tanh GELU and its
// backward (graph::fusion::fuse_tanh_gelu), and softmax's backward over the last axis.
// The formulas are graph::tanh_gelu / graph::tanh_gelu_slope and the CPU SoftmaxGrad's,
// in the same order of operations (compiled without FMA contraction); CUDA's tanhf (its
// own FMAs) and the order of a row's sum differ from the CPU's, within float32 rounding.

#define ROW_THREADS 256

// y = 0.5 x (1 + tanh(scale (x + coef x^3))), grid-strided.
extern "C" __global__ void tanh_gelu(const float* x, float* y, long long n, float scale,
                                     float coef) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = x[i];
        float t = tanhf(scale * (v + coef * (v * v * v)));
        y[i] = 0.5f * v * (1.0f + t);
    }
}

// dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) scale (1 + 3 coef x^2)), grid-strided.
extern "C" __global__ void tanh_gelu_grad(const float* dy, const float* x, float* dx,
                                          long long n, float scale, float coef) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = x[i];
        float x2 = v * v;
        float t = tanhf(scale * (v + coef * (x2 * v)));
        float slope = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * scale * (1.0f + 3.0f * coef * x2);
        dx[i] = dy[i] * slope;
    }
}

// dx = y (dy - sum(dy y)) over rows of m values: a block of ROW_THREADS threads a row,
// its sum in a fixed order (each thread's strided values, then a tree over threads).
extern "C" __global__ void softmax_grad(const float* dy, const float* y, float* dx,
                                        long long rows, int m) {
    __shared__ float part[ROW_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* a = dy + r * m;
        const float* b = y + r * m;
        float s = 0.0f;
        for (int j = threadIdx.x; j < m; j += ROW_THREADS) s += a[j] * b[j];
        part[threadIdx.x] = s;
        __syncthreads();
        for (int w = ROW_THREADS / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
            __syncthreads();
        }
        float total = part[0];
        __syncthreads();
        float* out = dx + r * m;
        for (int j = threadIdx.x; j < m; j += ROW_THREADS) out[j] = b[j] * (a[j] - total);
    }
}

// LayerNormGrad over rows of `cols` values (the forward's statistics given):
// dx = inv (g - mean(g) - xhat mean(g xhat)), g = dy scale, xhat = (x - mean) inv,
// the row means summed in a fixed order as softmax_grad sums; a block a row.
extern "C" __global__ void ln_grad_rows(const float* dy, const float* x, const float* scale,
                                        const float* mean, const float* inv, float* dx,
                                        long long rows, int cols) {
    __shared__ float sg[ROW_THREADS];
    __shared__ float sgx[ROW_THREADS];
    float inv_cols = 1.0f / cols;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* a = dy + r * cols;
        const float* b = x + r * cols;
        float m = mean[r], iv = inv[r];
        float p = 0.0f, q = 0.0f;
        for (int j = threadIdx.x; j < cols; j += ROW_THREADS) {
            float g = a[j] * scale[j];
            p += g;
            q += g * ((b[j] - m) * iv);
        }
        sg[threadIdx.x] = p;
        sgx[threadIdx.x] = q;
        __syncthreads();
        for (int w = ROW_THREADS / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) {
                sg[threadIdx.x] += sg[threadIdx.x + w];
                sgx[threadIdx.x] += sgx[threadIdx.x + w];
            }
            __syncthreads();
        }
        float m1 = sg[0] * inv_cols, m2 = sgx[0] * inv_cols;
        __syncthreads();
        float* out = dx + r * cols;
        for (int j = threadIdx.x; j < cols; j += ROW_THREADS) {
            float g = a[j] * scale[j];
            float xh = (b[j] - m) * iv;
            out[j] = ((g - m1) - xh * m2) * iv;
        }
    }
}

// Column sums over a chunk of rows, in row order: part_s[p][c] of dy xhat (dscale's),
// part_b[p][c] of dy (dbias's); block (x, p) holds columns x * blockDim.x.. of chunk p.
extern "C" __global__ void ln_grad_cols(const float* dy, const float* x, const float* mean,
                                        const float* inv, float* part_s, float* part_b,
                                        long long rows, int cols, long long chunk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    long long p = blockIdx.y;
    if (c >= cols) return;
    long long lo = p * chunk, hi = min(rows, lo + chunk);
    float s = 0.0f, t = 0.0f;
    for (long long r = lo; r < hi; ++r) {
        float d = dy[r * cols + c];
        s += d * ((x[r * cols + c] - mean[r]) * inv[r]);
        t += d;
    }
    part_s[p * cols + c] = s;
    part_b[p * cols + c] = t;
}

// dscale[c] and dbias[c]: the chunks' sums added in chunk order.
extern "C" __global__ void ln_grad_finish(const float* part_s, const float* part_b,
                                          float* ds, float* db, int parts, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f, t = 0.0f;
    for (int p = 0; p < parts; ++p) {
        s += part_s[p * cols + c];
        t += part_b[p * cols + c];
    }
    ds[c] = s;
    db[c] = t;
}

// KeyedDropout (compute/fused/dropout.rs): element i kept where the top 24 bits of
// splitmix64(base + i * GOLDEN) reach ratio * 2^24 (rounded up), base the key's four values
// and the node's salt mixed in turn; kept values times 1 / (1 - ratio), in float32 as the
// CPU kernel computes them, so the same bits. `mask` may be null (no mask output).
#define GOLDEN 0x9e3779b97f4a7c15ULL

__device__ unsigned long long splitmix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void keyed_dropout(const float* x, const float* ratio,
                                         const long long* key, float* y, unsigned char* mask,
                                         long long n, long long salt) {
    unsigned long long base = splitmix((unsigned long long)salt + GOLDEN);
    for (int k = 0; k < 4; ++k) base = splitmix(base ^ ((unsigned long long)key[k] + GOLDEN));
    float r = ratio[0];
    unsigned int threshold = (unsigned int)ceil((double)r * 16777216.0);
    float scale = 1.0f / (1.0f - r);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned int draw = (unsigned int)(splitmix(base + (unsigned long long)i * GOLDEN) >> 40);
        bool keep = draw >= threshold;
        y[i] = keep ? x[i] * scale : 0.0f;
        if (mask) mask[i] = keep;
    }
}
