// pipetrain's kernels over a stage's flat float32 buffers on the device (compiled at run
// time with NVRTC, `--fmad=false`: every product and sum rounded as the CPU's loops round
// them, so an update gives bitwise the CPU optimizer's values; see optim/elementwise.rs).
// Every loop is grid-strided over `n` values.

#define FOR_EACH(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// SGD: g = g*s + wd*p; p -= lr*g.
extern "C" __global__ void sgd(float* p, const float* g, long long n, float s, float lr,
                               float wd) {
    FOR_EACH(i, n) {
        float x = g[i] * s;
        x = x + wd * p[i];
        p[i] -= lr * x;
    }
}

// SGD with momentum: g = g*s + wd*p; b = keep*b + take*g; p -= lr*(gc*g + bc*b).
extern "C" __global__ void sgd_momentum(float* p, const float* g, float* b, long long n,
                                        float s, float lr, float wd, float keep,
                                        float take, float gc, float bc) {
    FOR_EACH(i, n) {
        float x = g[i] * s;
        x = x + wd * p[i];
        float m = keep * b[i] + take * x;
        b[i] = m;
        p[i] -= lr * (gc * x + bc * m);
    }
}

__device__ __forceinline__ float lerp_torch(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// Adam and AdamW: g = g*s + l2*p; m = lerp(m, g, w1); v = v*b2 + w2*g*g;
// p = p*shrink - step_size*(m / (sqrt(v)/bias2_sqrt + eps)).
extern "C" __global__ void adam(float* p, const float* g, float* m, float* v, long long n,
                                float s, float l2, float shrink, float w1, float b2,
                                float w2, float eps, float bias2_sqrt, float step_size) {
    FOR_EACH(i, n) {
        float x = g[i] * s;
        x = x + l2 * p[i];
        float mi = lerp_torch(m[i], x, w1);
        float vi = v[i] * b2 + w2 * x * x;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bias2_sqrt + eps;
        p[i] = p[i] * shrink - step_size * (mi / denom);
    }
}

// acc += x (a later micro-batch's gradients into the step's).
extern "C" __global__ void add_into(float* acc, const float* x, long long n) {
    FOR_EACH(i, n) { acc[i] += x[i]; }
}

// The data-parallel replicas' gradients summed in replica order, (g0 + g1) + g2 ..., as
// the host's in-process all-reduce sums them: `sources` holds the addresses of `count`
// runs of `n` values. `dst` may be one of them: every source's value is read before the
// sum is written over it.
extern "C" __global__ void sum_replicas(float* dst, const unsigned long long* sources,
                                        int count, long long n) {
    FOR_EACH(i, n) {
        float s = ((const float*)sources[0])[i];
        for (int k = 1; k < count; ++k) s += ((const float*)sources[k])[i];
        dst[i] = s;
    }
}

#define SUM_THREADS 256

// Sums of squares in float64, one per block, in a fixed order: each thread its
// grid-strided values, then the block's tree. The same grid gives the same bits.
extern "C" __global__ void sum_sq_blocks(const float* g, long long n, double* partial) {
    __shared__ double sh[SUM_THREADS];
    double acc = 0.0;
    FOR_EACH(i, n) {
        double x = (double)g[i];
        acc += x * x;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int w = SUM_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// The blocks' sums into one, by one block, in the same fixed order.
extern "C" __global__ void sum_blocks(const double* partial, int n, double* total) {
    __shared__ double sh[SUM_THREADS];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += SUM_THREADS) acc += partial[i];
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int w = SUM_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) total[0] = sh[0];
}
