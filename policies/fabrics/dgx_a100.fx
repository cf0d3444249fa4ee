// A DGX A100 (8 A100 SXM4 80 GB GPUs, NVLink 3 through NVSwitch, a host, no CXL).  Figures:
// runtime/simulation/data/figures.json (gpu a100_sxm; NVLink 3: 600 GB/s bidirectional, PCIe Gen4 x16 ~32 GB/s).
fabric dgx_a100 {
  gpu gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7 { model: "a100_sxm"; hbm: 80GiB; hbm_bw: 2.039TB/s; bf16: 312TFLOPs }
  host cpu0 { dram: 2TiB }

  // PCIe Gen4 x16 from each GPU to the host
  link gpu0 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu1 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu2 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu3 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu4 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu5 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu6 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }
  link gpu7 <-> cpu0 { bw: 32GB/s; latency: 600ns; kind: pcie }

  // NVLink through NVSwitch: every pair of GPUs one hop apart, each direction at the GPU's NVLink
  // bandwidth (a ring all-reduce uses one neighbour per GPU)
  link gpu0 <-> gpu1 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu2 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu3 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu4 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu5 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu6 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu2 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu3 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu4 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu5 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu6 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu3 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu4 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu5 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu6 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu4 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu5 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu6 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu4 <-> gpu5 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu4 <-> gpu6 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu4 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu5 <-> gpu6 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu5 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
  link gpu6 <-> gpu7 { bw: 300GB/s; latency: 1us; kind: nvlink }
}
