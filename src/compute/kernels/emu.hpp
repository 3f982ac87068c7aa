// CUDA's execution model on the CPU, for running pipetrain's kernel sources in tests
// (compute/kernels/emu.rs). A launch runs its blocks one after another on the calling
// thread; a block's threads are user-level contexts (ucontext) switched at every
// __syncthreads, so a barrier is a phase: each live thread runs up to its next
// __syncthreads (or its end) before any runs on. `__shared__` is a function-local static,
// one block's shared memory at a time (launches are serialized by the caller). A thread
// that waits at a barrier another thread of its block does not reach (another
// `__syncthreads`, or none: it has ended) is reported, as CUDA allows a barrier in
// conditional code only where the condition is the same across the block. Within a
// phase the threads run in ascending order, or descending (`emu_set_descending`): a
// kernel whose results differ between the two reads what another thread of its block
// writes without a barrier between (a race on the GPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <ucontext.h>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

namespace emu {
static dim3 thread_idx, block_idx, grid_dim, block_dim;
static ucontext_t scheduler;
static std::vector<ucontext_t> contexts;
static std::vector<char> stacks;
static std::vector<int> done, lines;
static int current = 0;
static int descending = 0;
static const std::function<void()>* body = nullptr;
static char error[256] = "";
constexpr size_t STACK = 64 * 1024;

inline void sync(int line) {
    lines[current] = line;
    swapcontext(&contexts[current], &scheduler);
}

inline void trampoline() {
    (*body)();
    done[current] = 1;
}

// Runs `kernel` on a grid of `grid` blocks of `block` threads; returns 0, or 1 with
// `error` saying why (a barrier not all of a block's threads reached).
inline int launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {
    grid_dim = grid;
    block_dim = block;
    body = &kernel;
    int n = (int)(block.x * block.y * block.z);
    contexts.assign(n, ucontext_t{});
    stacks.assign((size_t)n * STACK, 0);
    error[0] = 0;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                block_idx = dim3{bx, by, bz};
                done.assign(n, 0);
                lines.assign(n, 0);
                for (int t = 0; t < n; ++t) {
                    getcontext(&contexts[t]);
                    contexts[t].uc_stack.ss_sp = &stacks[(size_t)t * STACK];
                    contexts[t].uc_stack.ss_size = STACK;
                    contexts[t].uc_link = &scheduler;
                    makecontext(&contexts[t], trampoline, 0);
                }
                for (;;) {
                    int live = 0, ended = -1, at = -1;
                    for (int k = 0; k < n; ++k) {
                        int t = descending ? n - 1 - k : k;
                        if (done[t]) continue;
                        current = t;
                        thread_idx = dim3{t % block.x, (t / block.x) % block.y,
                                          t / (block.x * block.y)};
                        swapcontext(&scheduler, &contexts[t]);
                        if (done[t]) {
                            ended = t;
                        } else if (live++ == 0) {
                            at = t;
                        } else if (lines[t] != lines[at]) {
                            snprintf(error, sizeof error,
                                     "block (%u, %u): thread %d waits at the barrier of line "
                                     "%d, thread %d at line %d",
                                     bx, by, t, lines[t], at, lines[at]);
                            return 1;
                        }
                    }
                    if (live == 0) break;
                    if (ended >= 0) {
                        snprintf(error, sizeof error,
                                 "block (%u, %u): thread %d ended while thread %d waits at "
                                 "the barrier of line %d",
                                 bx, by, ended, at, lines[at]);
                        return 1;
                    }
                }
            }
    return 0;
}

inline float f32(uint64_t bits) {
    uint32_t b = (uint32_t)bits;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}
}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __syncthreads() emu::sync(__LINE__)

template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
    return a < b ? a : b;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

extern "C" const char* emu_error() { return emu::error; }
extern "C" void emu_set_descending(int on) { emu::descending = on; }
