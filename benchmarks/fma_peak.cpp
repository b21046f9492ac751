// The CPU's fp32 FMA peak for benchmarks/roofline.py: 12 independent FMA chains per thread in the
// CPU's own vector width (enough to cover the FMA latency on every x86 core), on every thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>

#ifdef __AVX512F__
typedef float vf __attribute__((vector_size(64)));
#else
typedef float vf __attribute__((vector_size(32)));
#endif

// Flops done: 2 per lane per FMA, iters x 12 FMAs per thread, summed over the threads.
double fma_flops(int64_t iters) {
  std::atomic<int64_t> threads{0};
  std::atomic<int> sink{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      vf acc[12], b = vf{} + 0.9999f, c = vf{} + 1e-4f;
      for (int i = 0; i < 12; ++i) acc[i] = vf{} + 1e-3f * i;
      for (int64_t k = 0; k < iters; ++k)
        for (int i = 0; i < 12; ++i) acc[i] = acc[i] * b + c;
      float total = 0;
      for (int i = 0; i < 12; ++i) total += acc[i][0];
      sink += total == 12345.f;  // an atomic write of the result: the loop is kept
      ++threads;
    }
  });
  return 2.0 * 12 * (sizeof(vf) / 4) * iters * threads;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fma_flops", &fma_flops, "flops of iters FMA rounds on every thread"); }
