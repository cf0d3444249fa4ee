// A DGX H100 (8 H100 SXM5 GPUs, NVLink 4 through NVSwitch, a host, no CXL).  Figures:
// runtime/simulation/data/figures.json (gpu h100_sxm, links nvlink4 and pcie5_x16).
fabric dgx_h100 {
  gpu gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7 { model: "h100_sxm"; hbm: 80GiB; hbm_bw: 3.35TB/s; bf16: 989TFLOPs }
  host cpu0 { dram: 2TiB }

  // PCIe Gen5 x16 from each GPU to the host
  link gpu0 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu1 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu2 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu3 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu4 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu5 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu6 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link gpu7 <-> cpu0 { bw: 63GB/s; latency: 600ns; kind: pcie }

  // NVLink through NVSwitch: every pair of GPUs one hop apart, each direction at the GPU's NVLink
  // bandwidth (a ring all-reduce uses one neighbour per GPU)
  link gpu0 <-> gpu1 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu2 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu3 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu4 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu5 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu6 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu0 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu2 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu3 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu4 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu5 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu6 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu1 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu3 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu4 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu5 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu6 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu2 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu4 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu5 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu6 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu3 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu4 <-> gpu5 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu4 <-> gpu6 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu4 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu5 <-> gpu6 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu5 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
  link gpu6 <-> gpu7 { bw: 450GB/s; latency: 1us; kind: nvlink }
}
