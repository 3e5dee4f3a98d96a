// How many threads `at::parallel_for` gives the kernels in this folder. ATen's parallel_for is a
// header template: compiled without OpenMP it runs every range on the calling thread, whatever
// torch.set_num_threads says, so the build's flags decide it (parallel/cpu_kernels.py checks it).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

int64_t parallel_threads() {
  const int64_t threads = at::get_num_threads();
  std::vector<char> ran(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { ran[at::get_thread_num()] = 1; });
  int64_t used = 0;
  for (char r : ran) used += r;
  return used;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylane_cpu, m) { m.def("parallel_threads() -> int", &parallel_threads); }
