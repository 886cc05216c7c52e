// The ops' Meta kernels: each op's host entry (csrc/host) over the launcher that runs nothing
// (csrc/host/meta.h). Meta tensors, FakeTensorMode and torch.compile run these: the argument
// checks of csrc/checks.h with the CPU and CUDA kernels' messages, and the outputs' allocation.
#include <torch/library.h>

#include "host/codecs.h"
#include "host/fusion.h"
#include "host/meta.h"

TORCH_LIBRARY_IMPL(pycomm, Meta, m) {
  pycomm::host::register_fusion<pycomm::host::Meta>(m);
  pycomm::host::register_codecs<pycomm::host::Meta>(m);
}
