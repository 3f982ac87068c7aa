// RowsAdd: an embedding (Gather) gradient that sums in a fixed order on the GPU.
// table[v] = the sum, over positions i in ascending order with indices[i] == v, of
// updates[i] (a row of `row_len` values), starting from +0: the order ONNX Runtime's CPU
// ScatterElements(reduction = add) into zeros adds in, so the same bits. Rows nothing
// looks up stay 0. Indices below 0 count from the end; others out of range add nothing.
// Three launches: chain each position to the next one with its row (`rows_chain`, the
// first of each row marked), zero the table (`rows_zero`), then one thread per first
// position and column walks its chain (`rows_sum`).

__device__ __forceinline__ long long row_of(long long v, long long rows) {
    return v < 0 ? v + rows : v;
}

#define CHAIN_TILE 256

// next[i]: the next position j > i with i's row (-1: none); first[i]: 1 where no earlier
// position has i's row. O(n^2) compares, through shared-memory tiles of the indices.
extern "C" __global__ void rows_chain(const long long* idx, int n, long long rows,
                                      int* next, int* first) {
    __shared__ long long tile[CHAIN_TILE];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    long long v = i < n ? row_of(idx[i], rows) : -1;
    int nx = -1, fst = 1;
    for (int base = 0; base < n; base += CHAIN_TILE) {
        int k = base + threadIdx.x;
        tile[threadIdx.x] = k < n ? row_of(idx[k], rows) : -2;
        __syncthreads();
        int m = min(CHAIN_TILE, n - base);
        for (int t = 0; t < m; ++t) {
            int j = base + t;
            if (tile[t] == v) {
                if (j < i) fst = 0;
                if (j > i && nx < 0) nx = j;
            }
        }
        __syncthreads();
    }
    if (i < n) {
        next[i] = nx;
        first[i] = fst;
    }
}

extern "C" __global__ void rows_zero(float* table, long long len) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < len;
         k += (long long)gridDim.x * blockDim.x) {
        table[k] = 0.0f;
    }
}

// Block (x, i): columns x * blockDim.x .. of position i, if i is its row's first.
extern "C" __global__ void rows_sum(const long long* idx, const float* updates,
                                    const int* next, const int* first, int n, int row_len,
                                    long long rows, float* table) {
    int i = blockIdx.y;
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || d >= row_len || !first[i]) return;
    long long v = row_of(idx[i], rows);
    if (v < 0 || v >= rows) return;
    float sum = 0.0f;
    for (int j = i; j >= 0; j = next[j]) {
        sum += updates[(long long)j * row_len + d];
    }
    table[v * row_len + d] = sum;
}
