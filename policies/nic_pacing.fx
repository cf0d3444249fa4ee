// DPU pacing and coalescing of KV export to a decode node.  KV leaves the GPUs
// in 64 KiB chunks; the DPU merges them into 256 KiB frames before the wire
// (one per-frame cost instead of four), spreads them over four transmit queues,
// and the pacing rate backs off when the queue at the NIC grows beyond 4 MiB.
import "fabrics/dgx_cxl.fx"

workload prefill { model: "llama3-8b"; prompt: 8192; tp: 4; weights: hbm; kv: hbm; kv_export: nic0 }

movement kv_export = kv : gpu* -> nic0 { chunk: 64KiB }

map tx_bytes : percpu_array<u32, size>[1]

policy nic_pacing {
  on kv_export.tx at nic0 {
    tx_bytes[0] += ev.bytes
    coalesce = 256KiB
    queue = ev.chunk % 4
    if ev.queue_bytes > 4MiB { rate = 20GB/s } else { rate = 36GB/s }
  }
  on kv_export.forward at sw0 { priority = 2 }
}
