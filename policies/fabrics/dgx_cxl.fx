// A DGX-class node (8 GPUs) with a CXL memory pool behind a CXL switch and a DPU
// that exports KV cache to a decode node.  Figures: runtime/simulation/data/figures.json.
fabric dgx_cxl {
  gpu gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7 { hbm: 80GiB; hbm_bw: 3.35TB/s; bf16: 989TFLOPs }
  cxl_switch sw0             { ports: 16; hop: 100ns }
  cxl_mem pool0 at sw0       { capacity: 1TiB; bw: 64GB/s; latency: 250ns }
  dpu nic0                   { line_rate: 400Gbps }
  host cpu0                  { dram: 512GiB }

  // PCIe Gen5 / CXL 2.0 x16 links into the switch
  link gpu0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu1 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu2 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu3 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu4 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu5 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu6 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link gpu7 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: cxl }
  link nic0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: pcie }
  link cpu0 <-> sw0 { bw: 63GB/s; latency: 600ns; kind: pcie }

  // NVLink 4 between GPUs (one hop through NVSwitch, modelled as a full mesh).
  // Latencies are one-way link traversal estimates; routing is by latency.
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
