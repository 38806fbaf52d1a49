"""Running a target on a CPU: its weight formats and kernels, its threads, and the format `--quant auto` picks.

- native.py builds and loads the project's C kernels (native/*.c: quantized matmuls, row-exact attention, whole
  decoder layers), once per CPU, in the fastest variant it runs (AVX2, AVX-VNNI or AVX-512 VNNI: the same bits);
  c_layers.py hands a decoder layer to them as one call.
- int8act.py: q4a8/q8a8 linears (4/8-bit weights times 8-bit activations, on those kernels); layout.py the
  order their weights are kept in.
- weightonly.py: q4/q8 linears on torch's weight-only kernels; quantized.py what the 4/8-bit formats share.
- packed.py: oneDNN-packed fp32/bf16 linears.
- threads.py: the thread count, from the cores other processes leave free.
- choice.py: q4a8 against q4, measured once where both run.
"""
