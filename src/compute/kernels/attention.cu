// Attention on ONNX Runtime's CUDA provider (compute/cuda_attention.rs): the products run
// on cuBLAS (compute/kernels/attention.rs plans them), these kernels do the rest, a block
// a row of the probabilities [B, H, T, S], every sum and maximum in a fixed order (each
// thread's strided values, then a tree over the threads).

#define ROW_THREADS 256

// The probabilities in place: each row of `s` scaled scores, plus the additive mask where
// there is one (`mask` null: none; element (b, h, i, j) at b mb + h mh + i mt + j, a
// stride 0 where it is broadcast; `heads` rows of t a batch entry), becomes its softmax.
// With `causal`, query i (the row's index within its head's t rows) sees keys up to
// i + s - t; the others get 0.
extern "C" __global__ void attn_softmax(float* p, long long rows, int s, int t, int causal,
                                        const float* mask, int heads, long long mb,
                                        long long mh, long long mt, long long ms) {
    __shared__ float red[ROW_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        float* x = p + r * s;
        int seen = causal ? (int)(r % t) + s - t + 1 : s;
        if (mask) {
            long long i = r % t, h = (r / t) % heads, b = r / ((long long)t * heads);
            const float* m = mask + b * mb + h * mh + i * mt;
            for (int j = threadIdx.x; j < seen; j += ROW_THREADS) x[j] += m[j * ms];
        }
        float m = -3.402823466e38f;
        for (int j = threadIdx.x; j < seen; j += ROW_THREADS) m = fmaxf(m, x[j]);
        red[threadIdx.x] = m;
        __syncthreads();
        for (int w = ROW_THREADS / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
            __syncthreads();
        }
        float top = red[0];
        __syncthreads();
        float sum = 0.0f;
        for (int j = threadIdx.x; j < seen; j += ROW_THREADS) {
            float e = expf(x[j] - top);
            x[j] = e;
            sum += e;
        }
        red[threadIdx.x] = sum;
        __syncthreads();
        for (int w = ROW_THREADS / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
            __syncthreads();
        }
        float inv = 1.0f / red[0];
        __syncthreads();
        for (int j = threadIdx.x; j < s; j += ROW_THREADS) x[j] = j < seen ? x[j] * inv : 0.0f;
    }
}

// The scores' gradient in place of the probabilities' (d): d = scale p (d - sum(d p)),
// over rows of s values.
extern "C" __global__ void attn_softmax_grad(const float* p, float* d, long long rows, int s,
                                             float scale) {
    __shared__ float red[ROW_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* y = p + r * s;
        float* g = d + r * s;
        float acc = 0.0f;
        for (int j = threadIdx.x; j < s; j += ROW_THREADS) acc += g[j] * y[j];
        red[threadIdx.x] = acc;
        __syncthreads();
        for (int w = ROW_THREADS / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
            __syncthreads();
        }
        float total = red[0];
        __syncthreads();
        for (int j = threadIdx.x; j < s; j += ROW_THREADS) g[j] = scale * (y[j] * (g[j] - total));
    }
}

// x = 0 over n values (a packed gradient's values no part covers), grid-strided.
extern "C" __global__ void attn_zero(float* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = 0.0f;
    }
}
