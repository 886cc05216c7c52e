// A CPU emulation of the parts of the CUDA execution model that pycomm's kernels use, so that
// the kernels' own source (csrc/cuda/*.cu, compiled as C++ with PYCOMM_CUDA_EMULATION) runs,
// and is tested against pycomm.reference, on machines without a GPU.
//
// Every thread of a block is a fiber on one OS thread; blocks run one after another, so a
// kernel's __shared__ arrays can be function statics. A fiber starts once through a ucontext
// and then serves every block of every launch; switches between fibers and the scheduler are
// __builtin_setjmp/__builtin_longjmp (registers and stack pointer, no system call), where
// swapcontext would save and restore the signal mask with one at every barrier.
// __syncthreads() and the warp shuffles are real barriers: a fiber waits there until every
// thread of its block (of its warp) arrives. What a GPU would hang on or leave undefined is an
// error here: a barrier that not every thread reaches, a shuffle some lanes skip, a grid of zero
// blocks, more than 32764 bytes of kernel parameters (CUDA 12.1's limit on Volta and later), a
// vector access that is not aligned to its size.
//
// What this cannot show: speed, races between blocks (blocks never overlap here), races within
// a block other than those the two thread orders expose (see run_block), the memory model, and
// out-of-bounds accesses (no memory checker). The GPU script covers what it can of those.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace pycomm::emu {

constexpr int kWarp = 32;

enum class State { kReady, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  ucontext_t ctx;       // its first entry
  void* resume_at[5];   // where it waits (__builtin_setjmp's buffer)
  bool started = false; // false: the next block enters it through ctx, afresh
  std::vector<char> stack;
  State state = State::kReady;
};

struct Machine {
  dim3 grid, block, block_idx, thread_idx;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  void* scheduler_at[5];  // where the scheduler waits for the running fiber
  int current = 0;
  std::function<void()> body;
  std::string error;
  std::vector<uint64_t> slots;  // one per thread: the values a shuffle exchanges
};

inline Machine& machine() {
  static Machine m;
  return m;
}

// __builtin_longjmp may not share a function with the __builtin_setjmp it returns to.
[[noreturn, gnu::noinline]] inline void jump(void** to) { __builtin_longjmp(to, 1); }

// In a fiber: back to the scheduler; returns when the scheduler resumes this fiber.
[[gnu::noinline]] inline void to_scheduler() {
  Machine& m = machine();
  if (__builtin_setjmp(m.fibers[m.current].resume_at) == 0) jump(m.scheduler_at);
}

// A failed check inside a kernel: the block stops, the launch throws.
[[noreturn]] inline void fail(const std::string& what) {
  Machine& m = machine();
  if (m.error.empty()) {
    m.error = what + " (block " + std::to_string(m.block_idx.x) + ", thread " +
              std::to_string(m.current) + ")";
  }
  m.fibers[m.current].state = State::kDone;
  jump(m.scheduler_at);  // never resumed: run_block restarts every fiber of a broken block
}

inline void wait(State why) {
  Machine& m = machine();
  m.fibers[m.current].state = why;
  to_scheduler();
}

inline void trampoline() {
  Machine& m = machine();
  for (;;) {  // one block's body per pass
    m.body();
    m.fibers[m.current].state = State::kDone;
    to_scheduler();
  }
}

// In the scheduler: runs fiber t until it waits, finishes its body or fails.
[[gnu::noinline]] inline void resume(int t) {
  Machine& m = machine();
  m.current = t;
  m.thread_idx = dim3(t);
  if (__builtin_setjmp(m.scheduler_at) == 0) {
    Fiber& f = m.fibers[t];
    if (f.started) jump(f.resume_at);
    f.started = true;
    swapcontext(&m.scheduler, &f.ctx);  // the first entry; it comes back through jump()
  }
}

// A block that broke a rule: its fibers' stacks are left mid-kernel, so each starts afresh.
inline bool broken() {
  for (Fiber& f : machine().fibers) f.started = false;
  return false;
}

// Runs one block to completion; false (with machine().error set) if it broke a rule.
inline bool run_block() {
  Machine& m = machine();
  const int n = static_cast<int>(m.block.x);
  constexpr size_t kStack = 256 * 1024;
  m.fibers.resize(n);
  m.slots.assign(n, 0);
  for (int t = 0; t < n; ++t) {
    Fiber& f = m.fibers[t];
    f.state = State::kReady;
    if (f.started) continue;  // waits in trampoline for its next block
    if (f.stack.size() < kStack) f.stack.resize(kStack);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &m.scheduler;  // never used: trampoline does not return
    makecontext(&f.ctx, trampoline, 0);
  }
  // Between barriers the threads run one after another, in ascending order in one round and
  // descending in the next: a read of shared memory that a missing barrier leaves racing with a
  // write shows in one of the two orders.
  for (int round = 0;; ++round) {
    for (int k = 0; k < n; ++k) {
      const int t = round % 2 == 0 ? k : n - 1 - k;
      if (m.fibers[t].state != State::kReady) continue;
      resume(t);
      if (!m.error.empty()) return broken();
    }
    bool released = false, all_done = true, any_done = false, all_at_block = true;
    for (int w = 0; w * kWarp < n; ++w) {
      int at_warp = 0, lanes = 0;
      for (int t = w * kWarp; t < std::min(n, (w + 1) * kWarp); ++t, ++lanes) {
        at_warp += m.fibers[t].state == State::kAtWarpBarrier;
      }
      if (at_warp == lanes) {
        for (int t = w * kWarp; t < std::min(n, (w + 1) * kWarp); ++t) {
          m.fibers[t].state = State::kReady;
        }
        released = true;
      } else if (at_warp > 0) {
        m.error = "a warp shuffle that not every lane of warp " + std::to_string(w) +
                  " reached (block " + std::to_string(m.block_idx.x) + ")";
        return broken();
      }
    }
    if (released) continue;
    for (const Fiber& f : m.fibers) {
      all_done &= f.state == State::kDone;
      any_done |= f.state == State::kDone;
      all_at_block &= f.state == State::kAtBlockBarrier;
    }
    if (all_done) return true;
    if (any_done || !all_at_block) {
      m.error = "__syncthreads() that not every thread of block " +
                std::to_string(m.block_idx.x) + " reached";
      return broken();
    }
    for (Fiber& f : m.fibers) f.state = State::kReady;
  }
}

inline void sync_threads() { wait(State::kAtBlockBarrier); }

// __shfl_xor_sync(0xffffffff, v, lane_mask, width) for a full warp.
template <typename T>
T shfl_xor(T v, int lane_mask, int width) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a type wider than 8 bytes");
  Machine& m = machine();
  if (width < 1 || width > kWarp || (width & (width - 1)) != 0 || lane_mask >= width) {
    fail("shfl_xor with lane_mask " + std::to_string(lane_mask) + " and width " +
         std::to_string(width));
  }
  const int t = m.current;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  m.slots[t] = bits;
  wait(State::kAtWarpBarrier);
  const int src = (t / kWarp) * kWarp + ((t % kWarp) ^ lane_mask);
  T out;
  bits = m.slots[src];
  std::memcpy(&out, &bits, sizeof(T));
  wait(State::kAtWarpBarrier);  // nobody overwrites a slot before every lane has read
  return out;
}

inline void check_aligned(const void* p, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    fail("a " + std::to_string(bytes) + "-byte vector access at a misaligned address");
  }
}

template <typename... P>
struct Launch {
  dim3 grid, block;
  void (*kernel)(P...);

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel called with the wrong argument count");
    constexpr size_t param_bytes = (size_t{0} + ... + sizeof(P));
    static_assert(param_bytes <= 32764, "more than 32764 bytes of kernel parameters");
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
        grid.x > 2147483647u) {
      throw std::runtime_error("emulated launch: invalid grid " + std::to_string(grid.x));
    }
    if (block.y != 1 || block.z != 1 || block.x == 0 || block.x > 1024) {
      throw std::runtime_error("emulated launch: invalid block " + std::to_string(block.x));
    }
    std::tuple<P...> params(std::forward<A>(args)...);  // by value, as a launch copies them
    Machine& m = machine();
    m.grid = grid;
    m.block = block;
    m.error.clear();
    m.body = [&] { std::apply(kernel, params); };
    for (unsigned b = 0; b < grid.x; ++b) {
      m.block_idx = dim3(b);
      if (!run_block()) throw std::runtime_error("emulated kernel: " + m.error);
    }
  }
};

template <typename... P>
Launch<P...> launch(dim3 grid, dim3 block, void (*kernel)(P...)) {
  return {grid, block, kernel};
}

}  // namespace pycomm::emu

#define threadIdx (::pycomm::emu::machine().thread_idx)
#define blockIdx (::pycomm::emu::machine().block_idx)
#define blockDim (::pycomm::emu::machine().block)
#define gridDim (::pycomm::emu::machine().grid)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)
