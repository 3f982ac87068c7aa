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
