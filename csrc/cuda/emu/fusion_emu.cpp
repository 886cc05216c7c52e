// fusion.cu compiled as C++ for the CPU emulation (emu.h): registers pycomm_emu's CPU kernels.
#include "cuda/fusion.cu"
